"""SUM all-reduce through shared memory, for a process group whose ranks share one host (TP on a CPU box).

gloo moves every all-reduce through TCP on the loopback interface, even between two processes of one machine:
a 4.5 MiB fp32 all-reduce of two ranks costs about 2.5-3.5 ms there, where copying the same bytes takes 0.15 ms.
Megatron's tensor parallelism all-reduces each layer's activations (forward) and input gradients (backward), so
on CPU those transfers are most of what TP adds to a pass (``bench/tp_scaling.py``). :class:`ShmAllReduce` does
the same reduction through one mapped file in ``/dev/shm``:

    round k:  slot[k % 2][rank] <- x           (each rank copies its tensor in)
              barrier                          (orders the copies before the reads)
              x <- slot[0] + slot[1] + ... + slot[world-1]   (every rank, in rank order)

The barrier is the native one of ``csrc/shm_barrier.cpp`` where the extension is built (each rank stores its round
in a counter of the same mapping and watches its peers': a few microseconds when they arrive together), else gloo's
``barrier`` on the group (about 0.6 ms on a 2-core machine, which made it most of a small model's all-reduce: 30%
of the quickstart's update). The native wait ends in a ``torch.distributed.DistError``, as a gloo collective's
would, when a peer's process exits or after the group's timeout (``trainer.collective_timeout_s``).

Every rank sums the slots in the same order, so all ranks get bitwise the same result (for two ranks also the
same bits as gloo's, since ``a + b == b + a`` in IEEE arithmetic). Two slot sets alternate between rounds: a
rank writes set ``k % 2`` only after the barrier of round ``k - 1``, which every peer reached after reading round
``k - 2`` from that set, so one barrier per round suffices. Tensors larger than a slot go in slot-sized pieces.
Each rank reads ``world`` slots per round: meant for the few ranks of one host, not for wide groups.

:func:`create` returns None (the caller keeps gloo) where it cannot work: ranks on different hosts, no
``/dev/shm``, or too little space in it (a container's default 64 MiB tmpfs is checked before any page is
touched: writing past a full tmpfs would kill the process with SIGBUS). The file is unlinked as soon as every
rank has mapped it, so nothing is left behind however the processes end.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
SLOT_BYTES = 8 << 20
"""Bytes of one rank's slot (per slot set): a tensor larger than this is reduced in pieces, one barrier each."""
COUNTER_STRIDE = 8
"""int64 values per rank in the barrier's counter block after the slots: one 64-byte cache line each."""
SPIN_US = 20.0
"""Microseconds the native barrier spins before yielding its core, where each rank of the host has a core."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
PROFILE_LABEL = "hybridrl::shm_all_reduce"
"""``torch.profiler`` label of each call (``bench/tp_scaling.py --profile`` counts it as communication)."""


@dataclass
class ShmStats:
    """What a :class:`ShmAllReduce` has done (read by ``bench/tp_scaling.py``): calls, the bytes of each call's whole
    tensor (the all-reduced one, an all-gather's output, a reduce-scatter's input), seconds inside the calls."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class ShmAllReduce:
    """In-place SUM all-reduce of CPU tensors over ``group`` through a shared mapping (module docs).

    Build it with :func:`create` (collective over ``group``), not directly.
    """

    def __init__(
        self, group: dist.ProcessGroup, storage: torch.Tensor, slot_bytes: int, pids: list[int], native: object = None
    ) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.slot_bytes = slot_bytes
        counters = _counters_offset(self.world, slot_bytes)
        self._slots = storage[: 2 * self.world * slot_bytes].view(2, self.world, slot_bytes)  # viewed per round
        self._counters = storage[counters:].view(torch.int64)  # the native barrier's: rank r's round at r * stride
        self._pids = pids
        self._native = native  # the extension module with ``shm_barrier``; None: gloo's barrier
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._spin_us = SPIN_US if self.world <= cores else 0.0  # more ranks than cores: yield at once
        self._failed: str | None = None
        self._round = 0
        self._barriers = 0
        self.stats = ShmStats()

    def accepts(self, tensor: torch.Tensor, op: object = dist.ReduceOp.SUM) -> bool:
        """Whether :meth:`__call__` can reduce ``tensor`` with ``op`` (else use the group's own all-reduce)."""
        return (
            op == dist.ReduceOp.SUM
            and tensor.device.type == "cpu"
            and tensor.dtype in DTYPES
            and tensor.is_contiguous()
        )

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (any shape, contiguous, a dtype of :data:`DTYPES`) over the group, in place."""
        flat = tensor.detach().view(-1)  # in place, as gloo's all-reduce: outside autograd
        with self._call(flat):
            per_slot = self.slot_bytes // flat.element_size()
            for begin in range(0, flat.numel(), per_slot):
                piece = flat[begin : begin + per_slot]
                slots = self._next_slots(flat.dtype, piece.numel())
                slots[self.rank].copy_(piece)
                self._barrier()
                torch.add(slots[0], slots[1], out=piece)
                for other in range(2, self.world):
                    piece.add_(slots[other])
        return tensor

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """``output`` (``world`` x ``tensor``'s elements, contiguous) <- every rank's ``tensor``, in rank order along
        the first dimension: ``torch.distributed.all_gather_into_tensor``, with the same slot rounds."""
        flat, out = tensor.detach().reshape(-1), output.detach().view(-1)
        n = flat.numel()
        if out.numel() != self.world * n:
            raise ValueError(f"all_gather: output has {out.numel()} elements, not {self.world} x {n}")
        with self._call(out):
            per_slot = self.slot_bytes // flat.element_size()
            for begin in range(0, n, per_slot):
                piece = flat[begin : begin + per_slot]
                slots = self._next_slots(flat.dtype, piece.numel())
                slots[self.rank].copy_(piece)
                self._barrier()
                for other in range(self.world):
                    out[other * n + begin : other * n + begin + piece.numel()].copy_(slots[other])
        return output

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """``output`` <- the sum over ranks of this rank's block of ``tensor`` (``world`` blocks along the first
        dimension): ``torch.distributed.reduce_scatter_tensor`` (SUM), added in rank order as :meth:`__call__`."""
        flat, out = tensor.detach().reshape(-1), output.detach().view(-1)
        n = out.numel()
        if flat.numel() != self.world * n:
            raise ValueError(f"reduce_scatter: input has {flat.numel()} elements, not {self.world} x {n}")
        with self._call(flat):
            blocks = flat.view(self.world, n)
            per_block = self.slot_bytes // flat.element_size() // self.world
            for begin in range(0, n, per_block):
                width = min(per_block, n - begin)
                slots = self._next_slots(flat.dtype, self.world * width).view(self.world, self.world, width)
                slots[self.rank].copy_(blocks[:, begin : begin + width])  # every block's piece: one per peer
                self._barrier()
                mine = slots[:, self.rank]  # (world, width): each rank's contribution to this rank's block
                piece = out[begin : begin + width]
                torch.add(mine[0], mine[1], out=piece)
                for other in range(2, self.world):
                    piece.add_(mine[other])
        return output

    def _barrier(self) -> None:
        """Every rank of the group has written its slots of this round (module docs)."""
        if self._native is None:
            dist.barrier(group=self.group)
            return
        self._barriers += 1
        timeout = _group_timeout_s(self.group)  # read each time: apply_collective_timeout may change it
        code, peer = self._native.shm_barrier(self._counters, COUNTER_STRIDE, self.rank, self._barriers, timeout,
                                              self._spin_us, self._pids)  # fmt: skip
        if code == 0:
            return
        pid = f"pid {self._pids[peer]}" if self._pids[peer] > 0 else "its pid unknown here"
        who = f"rank {dist.get_global_rank(self.group, peer)} ({pid})"
        if code == 2:  # "Connection closed by peer": the words hybridrl.errors knows a lost peer by, as gloo's
            self._failed = f"shared-memory all-reduce: Connection closed by peer: {who} has exited"
        else:
            self._failed = f"shared-memory all-reduce: Timed out waiting {timeout * 1000:.0f}ms for {who}"
        raise dist.DistError(self._failed)

    def _next_slots(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The next round's slot set as ``(world, numel)`` of ``dtype`` (sets alternate: module docs)."""
        self._round += 1
        return self._slots[self._round % 2].view(dtype)[:, :numel]

    @contextlib.contextmanager
    def _call(self, whole: torch.Tensor) -> Iterator[None]:
        """One collective: labelled for the profiler and counted in :attr:`stats` (``whole``: its whole tensor)."""
        if self._failed is not None:  # a peer may still read the slots this call would write first: never go on
            raise dist.DistError(self._failed)
        with torch.profiler.record_function(PROFILE_LABEL):
            start = time.perf_counter()
            yield
        self.stats.calls += 1
        self.stats.bytes += whole.numel() * whole.element_size()
        self.stats.seconds += time.perf_counter() - start

    def close(self) -> None:
        """Drop the mapping (the file is already unlinked)."""
        self._slots = self._counters = None


def _counters_offset(world: int, slot_bytes: int) -> int:
    """Byte offset of the barrier's counters in the mapping: after both slot sets, at a 64-byte boundary."""
    return -(-2 * world * slot_bytes // 64) * 64


def _group_timeout_s(group: dist.ProcessGroup) -> float:
    """The collective timeout of ``group``'s CPU backend (what a gloo collective on it would wait)."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def _pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not tell)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _same_host(group: dist.ProcessGroup) -> bool:
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    return len(set(hosts)) == 1


def _all_ok(ok: bool, group: dist.ProcessGroup) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _make_file(size: int) -> str | None:
    """A new ``/dev/shm`` file of ``size`` bytes with its pages reserved, or None where that is not possible."""
    if not os.path.isdir(SHM_DIR):
        return None
    stat = os.statvfs(SHM_DIR)
    if stat.f_bavail * stat.f_frsize < 2 * size:  # leave as much again for everything else using the tmpfs
        return None
    path = os.path.join(SHM_DIR, f"hybridrl_allreduce_{os.getpid()}_{uuid.uuid4().hex[:12]}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # ENOSPC here rather than SIGBUS at the first write
    except OSError:
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path


def create(group: dist.ProcessGroup, slot_bytes: int = SLOT_BYTES) -> ShmAllReduce | None:
    """A :class:`ShmAllReduce` for ``group`` (collective: every rank of ``group`` calls it), or None on every rank
    where shared memory cannot serve the group (module docs). A group of one rank gets None: nothing to reduce."""
    world = dist.get_world_size(group)
    if world < 2 or not _same_host(group):
        return None
    size = _counters_offset(world, slot_bytes) + world * COUNTER_STRIDE * 8
    root = dist.get_global_rank(group, 0)
    path = [_make_file(size) if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(path, src=root, group=group)
    if path[0] is None:
        return None
    try:
        storage = torch.from_file(path[0], shared=True, size=size, dtype=torch.uint8)
        ok = True
    except (OSError, RuntimeError):
        storage, ok = None, False
    ok = _all_ok(ok, group)  # every rank has mapped it (or failed): the name is no longer needed
    if dist.get_rank(group) == 0:
        os.unlink(path[0])
    if not ok:
        return None
    ids: list[tuple[int, int]] = [(0, 0)] * world
    dist.all_gather_object(ids, (os.getpid(), _pid_namespace()), group=group)
    # a peer's pid means something here only within one PID namespace (containers sharing a host's /dev/shm may
    # not share it): else the barrier cannot tell a gone peer and waits out the timeout, as gloo would
    pids = [pid for pid, _ in ids] if len({ns for _, ns in ids}) == 1 else [0] * world
    native = _native_barrier()
    try:
        _group_timeout_s(group)
    except Exception:  # torch's private accessor changed: keep gloo's barrier, which knows its own timeout
        native = None
    if not _all_ok(native is not None, group):  # one kind of barrier for all: else each would wait for the other
        native = None
    return ShmAllReduce(group, storage, slot_bytes, pids, native)


def _native_barrier() -> object | None:
    """The extension module when it has the shared-memory barrier (``HYBRIDRL_NATIVE``: built on first use unless
    0), else None (gloo's barrier)."""
    from hybridrl.ops import _native

    module = _native.native_module()
    return module if module is not None and hasattr(module, "shm_barrier") else None

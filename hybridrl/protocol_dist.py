"""Moving DataProto batches over a ``torch.distributed`` process group (gloo on CPU, NCCL on GPU).

Owns the two collectives the SPMD dispatch is built on: :func:`scatter` (one rank holds the batch, every
rank gets its contiguous chunk) and :func:`all_gather` (every rank gets the concatenation of all chunks).

Wire format. The tensor payload of a call travels in ONE tensor collective, whatever the number of fields:
every field is made contiguous, viewed as ``uint8`` and copied into one flat byte buffer per rank at an
offset aligned to 16 bytes (so the receiver can view each field back as its dtype without a copy). The
schema (key, dtype, per-row shape of every tensor field), the row counts, the non-tensor arrays and
``meta_info`` travel in ONE pickled object collective. So each call issues exactly two
``torch.distributed`` calls (one when the batch has no tensor bytes), independent of the number of fields.
(Inside torch, an object collective is itself two or three low-level collectives: sizes, then bytes.)

Received tensors live on the CPU for gloo and on the current CUDA device for NCCL, whatever device the
sender's tensors were on. Errors that only the sender can see (a batch that does not divide the group) are
sent through the object collective, so every rank raises the same ValueError instead of hanging.
"""

from __future__ import annotations

import math
import pickle
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from hybridrl.protocol import DataProto

_ALIGN = 16  # bytes; a multiple of every dtype's item size, so byte offsets can be viewed as any dtype
Schema = list[tuple[str, torch.dtype, tuple[int, ...]]]  # (key, dtype, shape without the batch dim)


def _schema(data: DataProto) -> Schema:
    return [(k, t.dtype, tuple(t.shape[1:])) for k, t in data.batch.items()]


def _field_bytes(schema: Schema, rows: int) -> list[int]:
    return [rows * math.prod(shape) * dtype.itemsize for _, dtype, shape in schema]


def _offsets(schema: Schema, rows: int) -> tuple[list[int], int]:
    """Aligned byte offset of each field in a buffer holding ``rows`` rows, and the buffer's total size."""
    offsets, end = [], 0
    for nbytes in _field_bytes(schema, rows):
        offsets.append(end)
        end += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, end


def _local(obj: Any) -> Any:
    """What an object collective over a group of one rank would hand back: a pickled copy of ``obj``.

    Collectives over a single rank are made locally, never through the backend. Gloo runs a collective on its
    own threads, and a large copy there starts an OpenMP thread team owned by that thread. Once a process has
    more OpenMP threads than CPUs, GNU OpenMP (torch's) stops spinning between parallel regions for good, so
    every later parallel op of the main thread wakes its workers from sleep: one process with two threads ran
    its steps 13% slower after the first such collective (docs/cpu_stack.md, "OpenMP threads").
    """
    return pickle.loads(pickle.dumps(obj))


def _comm_device(group: dist.ProcessGroup | None) -> torch.device:
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pack(data: DataProto, buffer: torch.Tensor, parts: int) -> None:
    """Copy ``data``'s tensors into ``buffer`` of shape ``(parts, bytes_per_part)``: part ``p`` gets rows
    ``[p * len / parts, (p + 1) * len / parts)`` of every field, laid out as :func:`_offsets` says."""
    schema = _schema(data)
    offsets, _ = _offsets(schema, len(data) // parts)
    for (key, _, _), offset, nbytes in zip(schema, offsets, _field_bytes(schema, len(data) // parts), strict=True):
        if nbytes:
            raw = data.batch[key].contiguous().reshape(-1).view(torch.uint8)
            buffer[:, offset : offset + nbytes] = raw.reshape(parts, nbytes)


def _unpack(buffer: torch.Tensor, schema: Schema, rows: int) -> dict[str, torch.Tensor]:
    """The tensors of one part from its flat ``uint8`` buffer (views into it, no copy)."""
    offsets, _ = _offsets(schema, rows)
    out = {}
    for (key, dtype, shape), offset, nbytes in zip(schema, offsets, _field_bytes(schema, rows), strict=True):
        if nbytes:
            out[key] = buffer[offset : offset + nbytes].view(dtype).reshape(rows, *shape)
        else:
            out[key] = torch.empty((rows, *shape), dtype=dtype, device=buffer.device)
    return out


def scatter(data: DataProto | None, group: dist.ProcessGroup | None = None, src: int = 0) -> DataProto:
    """Split the batch held by ``src`` into contiguous equal chunks, one per rank of ``group``, in rank order.

    Sent: one ``scatter_object_list`` from ``src`` carrying, per rank, ``(schema, rows per rank, that rank's
    non-tensor chunk, meta_info)`` (or an error message every rank raises), then, if there are tensor bytes,
    one ``scatter`` of a ``uint8`` buffer of ``rows * bytes_per_row`` (aligned) per rank.

    Args:
        data: the full batch ``(batch, ...)`` on ``src``; ignored (may be ``None``) on other ranks.
        group: the process group (default: the world).
        src: the global rank that holds the batch (torch.distributed's convention).

    Returns:
        This rank's chunk ``(batch // group_size, ...)``, with ``src``'s meta_info.

    Raises:
        ValueError: on every rank, when ``batch`` is not divisible by the group size.
    """
    from hybridrl.protocol import DataProto

    world, me = dist.get_world_size(group), dist.get_rank(group)
    is_src = dist.get_rank() == src
    if me < 0:
        raise ValueError(f"scatter: rank {dist.get_rank()} is not a member of the given group")
    objects: list[Any] | None = None
    if is_src:
        if data is None:
            raise TypeError(f"scatter: the source rank {src} must pass a DataProto, got None")
        n = len(data)
        if n % world:
            error = f"scatter: batch size {n} is not divisible by the group size {world}; pad_to_divisor({world}) first"
            objects = [error] * world
        else:
            header = (_schema(data), n // world)
            objects = [(header, c.non_tensor_batch, data.meta_info) for c in data.chunk(world)]
    received: list[Any] = [None]
    if world == 1:  # no collective (see _local): the same result as one, made here
        received = [_local(objects[0])]
    else:
        dist.scatter_object_list(received, objects, src=src, group=group)
    if isinstance(received[0], str):
        raise ValueError(received[0])
    (schema, rows), non_tensors, meta_info = received[0]

    device = _comm_device(group)
    _, nbytes = _offsets(schema, rows)
    mine = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes:
        chunks = None
        if is_src:
            packed = torch.empty(world, nbytes, dtype=torch.uint8, device=device)
            _pack(data, packed, world)
            chunks = list(packed.unbind(0))
        if world == 1:
            mine = chunks[0]
        else:
            dist.scatter(mine, chunks, src=src, group=group)
    return DataProto(_unpack(mine, schema, rows), non_tensors, meta_info)


def _describe(field: tuple[torch.dtype, tuple[int, ...]] | None) -> str:
    return "nothing" if field is None else f"{field[0]}{list(field[1])} per row"


def _check_schemas(headers: list[dict[str, Any]]) -> None:
    """Raise the same ValueError on every rank when ranks send different fields (all ranks see all headers)."""
    ref = {k: (d, s) for k, d, s in headers[0]["schema"]}
    ref_arrays = list(headers[0]["non_tensor_batch"])
    for r, h in enumerate(headers[1:], start=1):
        fields = {k: (d, s) for k, d, s in h["schema"]}
        for k in sorted(ref.keys() | fields.keys()):
            if ref.get(k) != fields.get(k):
                raise ValueError(
                    f"all_gather: rank {r} sends tensor {k!r} as {_describe(fields.get(k))}, but rank 0 as "
                    f"{_describe(ref.get(k))}; every rank must send the same fields"
                )
        if sorted(h["non_tensor_batch"]) != sorted(ref_arrays):  # any insertion order (concat reads by name)
            raise ValueError(
                f"all_gather: rank {r} sends non-tensor keys {list(h['non_tensor_batch'])}, but rank 0 sends "
                f"{ref_arrays}; every rank must send the same fields"
            )


def all_gather(data: DataProto, group: dist.ProcessGroup | None = None) -> DataProto:
    """Concatenate every rank's batch, in group rank order, on every rank of ``group``.

    Ranks may hold different batch sizes (including 0) but must hold the same fields with the same dtypes
    and per-row shapes. meta_info is merged as :meth:`DataProto.concat` does (a key sent by several ranks
    must hold equal values; "part i" in its error is group rank i).

    Sent: one ``all_gather_object`` of ``(schema, rows, byte size, non-tensor arrays, meta_info)`` per rank,
    then, if any rank has tensor bytes, one ``all_gather`` of each rank's ``uint8`` buffer zero-padded to the
    largest rank's byte size.

    Args:
        data: this rank's part ``(rows_r, ...)``.
        group: the process group (default: the world).

    Returns:
        The concatenation ``(sum_r rows_r, ...)``, identical on every rank.
    """
    from hybridrl.protocol import DataProto

    world = dist.get_world_size(group)
    schema = _schema(data)
    _, nbytes = _offsets(schema, len(data))
    header = {
        "schema": schema,
        "rows": len(data),
        "nbytes": nbytes,
        "non_tensor_batch": data.non_tensor_batch,
        "meta_info": data.meta_info,
    }
    headers: list[Any] = [None] * world
    if world == 1:  # no collective (see _local): the same result as one, made here
        headers = [_local(header)]
    else:
        dist.all_gather_object(headers, header, group=group)
    _check_schemas(headers)

    device = _comm_device(group)
    max_bytes = max(h["nbytes"] for h in headers)
    gathered = torch.empty(world, max_bytes, dtype=torch.uint8, device=device)
    if max_bytes:
        send = torch.zeros(1, max_bytes, dtype=torch.uint8, device=device)
        _pack(data, send[:, :nbytes], 1)
        if world == 1:
            gathered = send
        else:
            dist.all_gather(list(gathered.unbind(0)), send[0], group=group)
    parts = [  # each rank's bytes in that rank's own field order (ranks may have inserted fields differently)
        DataProto(_unpack(gathered[r], h["schema"], h["rows"]), h["non_tensor_batch"], h["meta_info"])
        for r, h in enumerate(headers)
    ]
    return DataProto.concat(parts)


__all__ = ["all_gather", "scatter"]

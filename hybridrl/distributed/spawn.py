"""Run a function on N local processes (gloo ranks) and collect each rank's result or traceback.

The multi-rank tests and the bench/ scripts use it; a notebook can too. Each launch costs seconds of
imports (torch, megatron), so group many checks into one body and return what the caller inspects. The
body is a module-level function ``fn(rank, world_size, *args)`` called after ``torch.distributed`` is
initialised on gloo through :func:`hybridrl.distributed.init_distributed`.

    results = run_ranks(_body, 2, "some-arg")      # list indexed by rank
"""

from __future__ import annotations

import io
import os
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from hybridrl.distributed.env import free_port


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: Any, timeout: float) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        from hybridrl.distributed import init_distributed

        init_distributed(timeout_s=timeout)
        out = fn(rank, world_size, *args)
        # By value: a tensor put on a torch.multiprocessing queue travels as shared memory that the parent
        # can only open while this process is alive, which it may no longer be.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including SystemExit from deep inside a library
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Returns:
        The per-rank return values, indexed by rank (values must be picklable).

    Raises:
        AssertionError: a rank raised (its traceback is included), died, or the launch exceeded ``timeout``.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, tuple[bool, Any]] = {}
    failures: list[str] = []
    try:
        while len(outputs) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outputs))
                failures.append(f"timeout after {timeout:.0f} s waiting for ranks {missing}")
                break
            outputs[rank] = (ok, value)
            if not ok:  # one rank failed: its peers are probably stuck in a collective; give them a moment
                timeout = min(timeout, 30.0)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    for rank in sorted(outputs):
        ok, value = outputs[rank]
        if not ok:
            failures.append(f"--- rank {rank} raised ---\n{value}")
    if failures:
        raise AssertionError(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(failures))
    import torch

    # Not a file: bytes that this call's own children (this program) made with torch.save. Whatever a child
    # puts on the queue, multiprocessing unpickles in full anyway, so a restricted load here would guard
    # nothing; full unpickling lets a body return any picklable value (numpy scalars, dataclasses).
    return [torch.load(io.BytesIO(outputs[r][1]), weights_only=False) for r in range(world_size)]

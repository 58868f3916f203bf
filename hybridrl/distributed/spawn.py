"""Run a function on N local processes (gloo ranks) and collect each rank's result or traceback.

The multi-rank tests and the bench/ scripts use it; a notebook can too. Each launch costs seconds of
imports (torch, megatron), so group many checks into one body and return what the caller inspects. The
body is a module-level function ``fn(rank, world_size, *args)`` called after ``torch.distributed`` is
initialised on gloo through :func:`hybridrl.distributed.init_distributed`.

    results = run_ranks(_body, 2, "some-arg")      # list indexed by rank

A caller that launches many times (a test suite) can call :func:`preload` once: the ranks of later launches then
start from a fork server that imported the named modules once, instead of importing them afresh per launch
(about 9 s of torch, megatron and vLLM imports per launch on a 2-core machine). Each rank is still a new process
with no process group, no parallel state and no engine; its environment is the caller's at the launch plus what
the preloaded imports set, as in a process that imported them itself; its exit hooks run when the body returns.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing.forkserver
import os
import queue
import traceback
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch.multiprocessing as mp

from hybridrl.distributed.env import free_port

_PRELOAD: list[str] = []
_SERVER_ENV: dict[str, str] | None = None
"""The caller's environment when the fork server started (None: not started)."""


def preload(modules: Sequence[str]) -> None:
    """Start the ranks of later :func:`run_ranks` calls from a fork server that has imported ``modules`` (module
    docs). Call it before the first launch; a module that fails to import is skipped by the server."""
    if _SERVER_ENV is not None:
        raise RuntimeError("spawn.preload() must be called before the first run_ranks()")
    _PRELOAD[:] = modules


def _context() -> tuple[Any, dict[str, str] | None]:
    """The multiprocessing context of a launch and the fork server's starting environment (None: spawn)."""
    global _SERVER_ENV
    if not _PRELOAD:
        return mp.get_context("spawn"), None
    ctx = mp.get_context("forkserver")
    if _SERVER_ENV is None:
        ctx.set_forkserver_preload(list(_PRELOAD))
        _SERVER_ENV = dict(os.environ)
        multiprocessing.forkserver.ensure_running()
    return ctx, _SERVER_ENV


def _fresh_environment(
    environ: MutableMapping[str, str], server_env: Mapping[str, str], caller_env: Mapping[str, str]
) -> None:
    """Make a forked rank's ``environ`` what a fresh process would have: the caller's environment at the launch,
    plus what the server's preloaded imports set or removed (vLLM, for one, sets variables at import)."""
    imported = {k: v for k, v in environ.items() if server_env.get(k) != v}
    removed = set(server_env) - set(environ)
    environ.clear()
    environ.update(caller_env)
    environ.update(imported)
    for key in removed:
        environ.pop(key, None)


def _child(
    fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: Any, timeout: float, envs: Any
) -> None:
    if envs is not None:
        _fresh_environment(os.environ, *envs)
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
        if envs is not None:  # a forked process ends in os._exit: run the exit hooks as a spawned one would
            atexit._run_exitfuncs()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo ranks.

    Returns:
        The per-rank return values, indexed by rank (values must be picklable).

    Raises:
        AssertionError: a rank raised (its traceback is included), died, or the launch exceeded ``timeout``.
    """
    ctx, server_env = _context()
    envs = None if server_env is None else (server_env, dict(os.environ))
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, timeout, envs), daemon=True)
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

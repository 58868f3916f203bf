"""A launched process's garbage collector and memory allocator.

The collector: paused through start-up, frozen when training starts, idle at exit.
Start-up (``hybridrl train`` / ``sft`` / ``dpo`` under torchrun) imports torch, Megatron, vLLM and transformers
and builds the models: millions of objects that live as long as the process and hardly any garbage. Python's
collector meanwhile runs about fourteen full passes over that growing heap, seconds of CPU per rank, and the
interpreter's exit runs more. So :func:`pause_collection` (the command line, before the imports) turns the
automatic collections off, :func:`start_training` (the trainers, before their first step) collects once, freezes
what start-up built, which the passes then skip, and turns them back on, and :func:`finish_quickly` (the command
line, after the command, ``export`` too) runs the exit hooks and leaves the heap frozen for the interpreter's
teardown. Explicit ``gc.collect()`` calls (vLLM's start-up makes five) still run throughout.

The allocator (CPU runs): :func:`keep_freed_memory`.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import sys
from collections.abc import Mapping

_paused = False


def pause_collection() -> None:
    """Turn the automatic collections off until :func:`start_training` (no-op if they are off already)."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def start_training() -> None:
    """Freeze the heap start-up built and turn the automatic collections back on, if :func:`pause_collection`
    turned them off (a trainer built in a notebook or a test is left alone)."""
    global _paused
    if _paused:
        gc.collect()  # one pass for start-up's cycles, so the frozen heap keeps no garbage for the whole run
        gc.freeze()
        gc.enable()
        _paused = False


def finish_quickly() -> None:
    """Run the exit hooks now, then freeze the heap: what is left of the interpreter's exit is cheap.

    At exit Python runs the libraries' exit hooks (vLLM's engine shutdown among them: it unfreezes the heap and
    collects it), then tears its modules down with more full collections, each a pass over every object that
    torch, Megatron, vLLM and the models hold: seconds of CPU per rank, every launch. Run here, the hooks do their
    work in full, once, except their collections, which would free nothing that the end of the process does not.
    With the heap frozen the teardown's collections skip it: objects kept alive only by reference cycles are
    left to the operating system (objects freed by reference counting are still freed), while the C-level exit
    handlers still run. Everything a run writes is closed by then (metrics, checkpoints, logs).
    """
    sys.stdout.flush()
    sys.stderr.flush()
    collect = gc.collect
    gc.collect = lambda generation=2: 0  # the hooks' own full collections, for the few moments they run
    try:
        atexit._run_exitfuncs()  # the registered hooks, once: CPython clears them after running them
    finally:
        gc.collect = collect
    gc.freeze()


KEEP_FREED_MEMORY_ENV = "HYBRIDRL_KEEP_FREED_MEMORY"
"""``0``: leave glibc's allocator at its defaults (:func:`keep_freed_memory`)."""
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt's parameter numbers, from glibc's <malloc.h>


def keep_freed_memory() -> bool:
    """On a CPU run, have glibc's ``malloc`` keep the memory that tensors free for the next ones; True if set.

    torch takes a CPU tensor's memory from ``malloc``. By default glibc serves a block above its mmap threshold
    (at most 32 MiB) with a fresh ``mmap`` and unmaps it when freed, and gives the heap's free top back to the
    kernel past its trim threshold; a training step frees and re-allocates its activations, logits and gradients
    every pass, so each pass touches that memory anew: a page fault and a zero-filled page per 4 KiB. With
    ``mmap`` off for blocks (``M_MMAP_MAX`` 0) and no trimming (``M_TRIM_THRESHOLD`` -1) the process reuses its
    heap. Measured on the 23.7M model of ``bench/step_vs_hf.py`` at 128 response tokens (one process, 2 threads,
    runs alternated): the update's page faults 8.1e5 -> 1.2e5, its time 11.8-14.2 s -> 8.0-8.5 s, the step
    19.8-21.7 s -> 13.4-14.9 s, peak PSS 4.41-4.56 -> 4.62-4.69 GiB (freed blocks that a larger one cannot reuse
    stay resident); at 32 tokens 7e4 -> 3e4 faults, the step within noise. The process's memory then stays at its
    peak until it exits, which a training process reaches every step anyway.

    Only the main heap: glibc still maps a block afresh that another thread asks for and that its thread heap
    (64 MiB) cannot hold. Left alone: GPU runs (their tensors are on the device; host memory that checkpoint
    staging frees is better returned), allocators other than glibc's, the user's own mmap or trim settings
    (``GLIBC_TUNABLES`` ``glibc.malloc.mmap_*`` / ``trim_threshold`` / ``top_pad``, or the older ``MALLOC_*_``
    variables), and :data:`KEEP_FREED_MEMORY_ENV` ``=0``. Call it early: blocks allocated before keep their kind.
    """
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1") == "0" or _user_mmap_settings(os.environ):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc only: musl's mallopt is a no-op, others differ
        return False
    import torch

    if torch.cuda.is_available():  # what init_distributed asks next anyway (it picks NCCL then)
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, -1))


_MMAP_TUNABLES = ("glibc.malloc.mmap_max", "glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold",
                  "glibc.malloc.top_pad")  # fmt: skip
_MMAP_VARIABLES = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def _user_mmap_settings(environ: Mapping[str, str]) -> bool:
    """True if ``environ`` sets glibc's mmap or trim behaviour itself (a tunable or an older variable)."""
    tunables = {item.split("=", 1)[0] for item in environ.get("GLIBC_TUNABLES", "").split(":")}
    return bool(tunables.intersection(_MMAP_TUNABLES)) or any(name in environ for name in _MMAP_VARIABLES)

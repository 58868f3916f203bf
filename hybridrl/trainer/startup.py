"""A launched process's garbage collector: paused through start-up, frozen when training starts, idle at exit.

Start-up (``hybridrl train`` / ``sft`` / ``dpo`` under torchrun) imports torch, Megatron, vLLM and transformers
and builds the models: millions of objects that live as long as the process and hardly any garbage. Python's
collector meanwhile runs about fourteen full passes over that growing heap, seconds of CPU per rank, and the
interpreter's exit runs more. So :func:`pause_collection` (the command line, before the imports) turns the
automatic collections off, :func:`start_training` (the trainers, before their first step) collects once, freezes
what start-up built, which the passes then skip, and turns them back on, and :func:`finish_quickly` (the command
line, after the command, ``export`` too) runs the exit hooks and leaves the heap frozen for the interpreter's
teardown. Explicit ``gc.collect()`` calls (vLLM's start-up makes five) still run throughout.
"""

from __future__ import annotations

import atexit
import gc
import sys

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

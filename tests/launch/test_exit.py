"""How a launched command ends (``hybridrl.trainer.startup.finish_quickly``): the libraries' exit hooks run once,
and the heap is frozen before the interpreter's own teardown, whose last full collections then skip it.

A real ``hybridrl train`` process holds torch, Megatron, vLLM and its models: each full collection of its heap is
a fraction of a second of CPU, and the interpreter's exit runs several after vLLM's exit hook has unfrozen the
heap. The check runs the command line in a fresh interpreter with an exit hook that unfreezes the heap as vLLM's
engine shutdown does, and looks at the heap when the command has returned, before the teardown.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import atexit, gc, sys

def engine_shutdown():  # what vLLM's engine shutdown does in its exit hook
    gc.unfreeze()
    print("exit hook ran", flush=True)

atexit.register(engine_shutdown)
from hybridrl.cli import main
sys.argv = ["hybridrl", COMMAND, "no_such_config.yaml"]  # as the console script and python -m hybridrl call it
code = CALL
print("returned, heap frozen:", gc.get_freeze_count() > 0, flush=True)
sys.exit(code)
"""


def _run(command: str, call: str = "main()") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYBRIDRL_VERBOSE": "0"}
    code = SCRIPT.replace("COMMAND", repr(command)).replace("CALL", call)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_launched_command_ends_with_a_frozen_heap():
    done = _run("train")  # a bad config: one line, exit status 2, through the same ending as a finished run
    assert done.returncode == 2, done.stdout + done.stderr
    assert "no_such_config.yaml" in done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if not line.startswith("[hybridrl]")]
    assert lines == ["exit hook ran", "returned, heap frozen: True"], lines  # hooks once, before the teardown


def test_other_commands_and_python_callers_end_as_usual():
    for command, code in (("validate-config", "main()"), ("train", "main(sys.argv[1:])")):
        # validate-config: one short process, nothing to gain; main(argv) from Python: not this process's own end
        done = _run(command, code)
        assert done.returncode == 2, done.stdout + done.stderr
        lines = [line for line in done.stdout.splitlines() if not line.startswith("[hybridrl]")]
        assert lines == ["returned, heap frozen: False", "exit hook ran"], (command, lines)


def test_collector_paused_through_start_up_only():
    code = (
        "import gc\nfrom hybridrl.trainer import startup\n"
        "startup.pause_collection(); print(gc.isenabled())\n"
        "startup.start_training(); print(gc.isenabled(), gc.get_freeze_count() > 0)\n"
        "gc.disable(); startup.start_training(); print(gc.isenabled())\n"  # not paused by startup: left alone
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.stdout.split("\n")[:3] == ["False", "True True", "False"], done.stdout + done.stderr

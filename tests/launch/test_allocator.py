"""A launched CPU command keeps the memory its tensors free for the next ones
(``hybridrl.trainer.startup.keep_freed_memory``): a training pass then re-allocates its activations, logits and
gradients from the process's heap instead of fresh pages, so after the first passes it page-faults hardly at all.

Each check runs the real command line (``hybridrl train`` with a config that does not exist: one line, exit 2,
after the same start-up as a real run) in a fresh interpreter, then, in that process, eight forward and backward
passes of a small MLP whose logits (64 MiB) lie above glibc's largest mmap threshold, and counts the process's
minor page faults per pass: the fewest of the last three (the heap settles in two or three passes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import ctypes, json, resource, sys
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, so a fault is a page wherever THP is on
from hybridrl.cli import main
sys.argv = ["hybridrl", "train", "no_such_config.yaml"]
code = CALL
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 16), torch.nn.GELU(), torch.nn.Linear(16, 8192))  # 64 MiB logits
x = torch.randn(2048, 256)
faults = []
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.log_softmax(model(x), -1).mean().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"code": code, "faults": faults}))
"""


def _faults(call: str = "main()", **env: str) -> int:
    """The fewest minor page faults of one of the last three passes after ``call`` (the command line) returned."""
    mine = ("GLIBC_TUNABLES", "HYBRIDRL_KEEP_FREED_MEMORY", "THP_MEM_ALLOC_ENABLE")
    environ = {k: v for k, v in os.environ.items() if k not in mine and not k.startswith("MALLOC_")}
    environ.update(PYTHONPATH=str(ROOT), HYBRIDRL_VERBOSE="0", OMP_NUM_THREADS="1", **env)
    done = subprocess.run([sys.executable, "-c", SCRIPT.replace("CALL", call)], capture_output=True, text=True,
                          cwd=ROOT, env=environ, timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["code"] == 2, out  # the bad config was reported as such
    return min(out["faults"][-3:])


def test_launched_cpu_command_reuses_freed_memory():
    kept = _faults()
    default = _faults(HYBRIDRL_KEEP_FREED_MEMORY="0")  # the opt-out: glibc's defaults
    # defaults: the 64 MiB logits and their gradient come from fresh pages every pass (16384 faults per 64 MiB)
    assert default > 2 * 16384, default
    assert kept < default / 20, (kept, default)


def test_left_alone_for_python_callers_and_the_users_own_settings():
    default = 2 * 16384
    assert _faults("main(sys.argv[1:])") > default  # main(argv) from Python: not this process's own launch
    # the user's own mmap settings win (here glibc's default threshold, pinned); an unrelated tunable does not count
    assert _faults(GLIBC_TUNABLES="glibc.malloc.mmap_threshold=131072") > default
    assert _faults(MALLOC_TRIM_THRESHOLD_="131072") > default
    assert _faults(GLIBC_TUNABLES="glibc.malloc.arena_max=2") < default / 20

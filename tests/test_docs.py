"""The docs' code examples run against the current code: every ```python block of docs/*.md.

All blocks run in ONE fresh interpreter (one import of torch, Megatron and transformers for all of them),
each in its own namespace and a scratch working directory, without any launch variables of the caller
(RANK, WORLD_SIZE, ...), as a reader who pastes them into a Python prompt would. A block that raises fails
the test with its page, its number and the traceback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

RUNNER = """
import json, sys, traceback
failures = []
for page, index, code in json.load(sys.stdin):
    try:
        exec(compile(code, f"{page} block {index}", "exec"), {"__name__": "__docs__"})
    except BaseException:
        failures.append(f"--- {page} block {index} ---\\n{traceback.format_exc()}")
print("\\n".join(failures), file=sys.stderr)
sys.exit(1 if failures else 0)
"""


def _blocks() -> list[tuple[str, int, str]]:
    return [
        (str(md.relative_to(ROOT)), i, code)
        for md in sorted((ROOT / "docs").glob("*.md"))
        for i, code in enumerate(BLOCK.findall(md.read_text()))
    ]


def test_pages_have_examples():
    pages = {page for page, _, _ in _blocks()}
    assert {"docs/architecture.md", "docs/contributing.md", "docs/cpu_stack.md"} <= pages, pages


def test_examples_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONWARNINGS", "ignore")
    result = subprocess.run(
        [sys.executable, "-c", RUNNER], input=json.dumps(_blocks()), capture_output=True, text=True,
        cwd=tmp_path, env=env, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-8000:]


def test_a_failing_example_fails(tmp_path):
    blocks = [("page.md", 0, "print('fine')"), ("page.md", 1, "raise ValueError('the docs are stale')")]
    result = subprocess.run(
        [sys.executable, "-c", RUNNER], input=json.dumps(blocks), capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 1 and "page.md block 1" in result.stderr and "stale" in result.stderr

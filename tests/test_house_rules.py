"""House rules (docs/contributing.md, "House style"), checked on the source tree.

- ``megatron`` is imported only inside ``hybridrl/mcore/``, ``vllm`` only inside ``hybridrl/rollout/``;
- torch and megatron are patched (attributes assigned, ``setattr``) only in ``hybridrl/mcore/cpu_compat.py``;
- the rollout replica mapping (which ranks form a vLLM engine, each rank's replica) is spelled only in
  ``hybridrl/distributed/layout.py``: no rank or world arithmetic with a rollout TP size anywhere else;
- ruff is clean; no source file passes 600 lines;
- the docs live in the repo: no file points at team notes outside it, and every repo path that docs/*.md
  (or the README) links to or names in backticks exists.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridrl"
SHIM_MODULE = PACKAGE / "mcore" / "cpu_compat.py"
PATCHABLE_ROOTS = {"torch", "megatron"}
BOUNDARIES = {"megatron": PACKAGE / "mcore", "vllm": PACKAGE / "rollout"}
"""Library -> the one package allowed to import it."""
# notes that lived outside the repo; spelled as a pattern so that this file does not match itself
OUTSIDE_NOTES = re.compile(rb"\b(?:DESIGN|STACK|STYLE)\.md\b")
REPO_DIRS = ("hybridrl", "tests", "launch", "configs", "csrc", "bench", "docs")
LAYOUT_MODULE = PACKAGE / "distributed" / "layout.py"
ROLLOUT_ARITHMETIC = re.compile(
    r"\b(?:\w*rank\w*(?:\(\))?|r|world\w*(?:\(\))?)\s*(?:%|//)\s*\(?[\w.]*(?:rollout_tp|tensor_parallel_size|tp_size|rtp)\b"
    r"|\brange\(\s*\w+\s*,\s*\w*world\w*(?:\(\))?\s*,"
)
"""``rank % rollout_tp``, ``dist.get_rank() // self.tensor_parallel_size``, ``world // rollout.tp_size``,
``range(t, world, rollout_tp)``: the rollout mapping, which only :data:`LAYOUT_MODULE` may spell."""


def _imports(tree: ast.AST, library: str) -> list[int]:
    """Lines that import ``library`` (``import x``, ``from x import``, ``importlib.import_module("x...")``)."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == library for a in node.names)) or (
            isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == library
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] == library:
                lines.append(node.lineno)
    return lines


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _patches(tree: ast.AST) -> list[int]:
    """Lines that assign attributes of torch/megatron (or of modules imported from them), or set `x.torch`."""
    aliases = set(PATCHABLE_ROOTS)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            module = getattr(node, "module", None) or ""
            for a in node.names:
                if (module or a.name).split(".")[0] in PATCHABLE_ROOTS:
                    aliases.add((a.asname or a.name).split(".")[0])
    lines = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for t in targets:
            if isinstance(t, ast.Attribute) and (_root_name(t) in aliases or t.attr == "torch"):
                lines.append(node.lineno)
    return sorted(lines)


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("library", sorted(BOUNDARIES))
def test_library_only_in_its_package(library):
    home = BOUNDARIES[library]
    bad = []
    for path in _sources():
        if home in path.parents:
            continue
        bad += [f"{path.relative_to(ROOT)}:{n}" for n in _imports(ast.parse(path.read_text()), library)]
    assert not bad, f"{library} imported outside {home.relative_to(ROOT)}/: {bad}"


def test_patches_only_in_cpu_compat():
    bad = []
    for path in _sources():
        if path == SHIM_MODULE:
            continue
        bad += [f"{path.relative_to(ROOT)}:{n}" for n in _patches(ast.parse(path.read_text()))]
    assert not bad, f"torch/megatron patched outside {SHIM_MODULE.relative_to(ROOT)}: {bad}"


def _rollout_arithmetic(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), start=1) if ROLLOUT_ARITHMETIC.search(line)]


def test_rollout_mapping_only_in_the_layout():
    bad = []
    for path in _sources():
        if path != LAYOUT_MODULE:
            bad += [f"{path.relative_to(ROOT)}:{n}" for n in _rollout_arithmetic(path.read_text())]
    assert not bad, f"rollout rank arithmetic outside {LAYOUT_MODULE.relative_to(ROOT)} (ask the layout): {bad}"
    assert _rollout_arithmetic(LAYOUT_MODULE.read_text()), "the layout module must be seen spelling the mapping"


def test_rollout_arithmetic_checker_can_fail():
    snippet = (
        "plan.for_rank(pp, tp, self.rank % rollout_tp)\n"
        "replica = dist.get_rank() // self.tensor_parallel_size if dist.is_initialized() else 0\n"
        "replicas = world // cfg.rollout.tp_size\n"
        "groups = [dist.new_group(list(range(t, world, rollout_tp))) for t in range(rollout_tp)]\n"
        "roles = {(c.pp, c.tp, r % self.rollout_tp) for r in range(n)}\n"
        "if heads % rtp: fail()\n"
        "kv_first = rank // (tp // kv)\n"
    )
    assert _rollout_arithmetic(snippet) == [1, 2, 3, 4, 5]


def test_checkers_can_fail():
    snippet = (
        "import torch\nfrom megatron.core import parallel_state as mpu\nimport importlib\n"
        "torch.cuda.current_device = lambda: 'cpu'\nmpu.foo = 1\nsetattr(torch.cuda, 'x', 1)\n"
        "importlib.import_module('megatron.core')\nmod.torch = None\nx = torch.zeros(1)\n"
    )
    tree = ast.parse(snippet)
    assert _imports(tree, "megatron") == [2, 7]
    assert _patches(tree) == [4, 5, 6, 8]
    assert _patches(ast.parse(SHIM_MODULE.read_text())), "the shim module must be seen as patching"
    vllm = (
        "import vllm\nfrom vllm.inputs import TokensPrompt\nimport importlib\nimportlib.import_module('vllm.v1')\n"
        "import vllm_extra\nfrom .vllm import x\nschema = 'vllm'\n"
    )
    assert _imports(ast.parse(vllm), "vllm") == [1, 2, 4]
    assert _imports(ast.parse((PACKAGE / "rollout" / "vllm_engine.py").read_text()), "vllm"), "the engine imports vllm"


def test_ruff_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_file_sizes():
    big = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > 600}
    assert not big, f"files over 600 lines (docs/contributing.md, House style): {big}"


def _repo_files() -> list[Path]:
    """Tracked and untracked-but-not-ignored files (git), else every file outside hidden and build folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout  # fmt: skip
        return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {"build", "runs", "__pycache__"}
        return [
            p for p in ROOT.rglob("*")
            if p.is_file() and not any(part.startswith(".") or part in skip for part in p.relative_to(ROOT).parts)
        ]  # fmt: skip


def test_no_pointers_to_notes_outside_the_repo():
    bad = []
    for path in _repo_files():
        for number, line in enumerate(path.read_bytes().splitlines(), start=1):
            if OUTSIDE_NOTES.search(line):
                bad.append(f"{path.relative_to(ROOT)}:{number}")
    assert not bad, f"pointers to notes a clone does not have (point at docs/ instead): {bad}"


def _doc_links(text: str, md: Path) -> list[tuple[str, Path]]:
    """(as written, path) of each repo path a markdown file links to or names in backticks."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        out.append((target, (md.parent / target.split("#")[0]).resolve()))
    for code in re.findall(r"`([^`\s]+)`", text):
        if re.fullmatch(rf"(?:{'|'.join(REPO_DIRS)})/[\w./-]*", code):
            out.append((code, ROOT / code))
    return out


def test_doc_links_point_at_files():
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages, "docs/ holds no pages"
    bad = []
    for md in [*pages, ROOT / "README.md"]:
        bad += [
            f"{md.relative_to(ROOT)}: {shown}" for shown, path in _doc_links(md.read_text(), md) if not path.exists()
        ]
    assert not bad, f"links to repo paths that do not exist: {bad}"


def test_doc_checks_can_fail(tmp_path):
    md = tmp_path / "page.md"
    text = "[a](missing.md) [b](https://x.org) [c](#here) `hybridrl/nope.py` `hybridrl/` `x.y`"
    assert [shown for shown, path in _doc_links(text, md) if not path.exists()] == ["missing.md", "hybridrl/nope.py"]
    assert OUTSIDE_NOTES.search(b"see " + b"STYLE" + b".md") and not OUTSIDE_NOTES.search(b"see docs/contributing.md")

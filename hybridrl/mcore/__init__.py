"""Everything that touches Megatron-Core: the ONLY package that imports ``megatron``.

- ``cpu_compat``: the CPU shims (the one module that patches torch/megatron, only when CUDA is absent)
- ``parallel_state``: Megatron process groups from a ``ParallelLayout``
- ``gpt``: Llama-style model chunks and the forward/backward driver over Megatron's pipeline schedules

Import the submodules directly; this package does not import megatron on its own.
"""

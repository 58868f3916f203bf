"""Everything that touches Megatron-Core: the ONLY package that imports ``megatron``.

- ``cpu_compat``: the CPU shims (the one module that patches torch/megatron, only when CUDA is absent)
- ``parallel_state``: Megatron process groups from a ``ParallelLayout``
- ``gpt``: Llama-style ``GPTShape``, ``TransformerConfig``, model chunks per (virtual) pipeline stage
- ``hf_config``: Hugging Face configs (Llama, Qwen2, Mistral, Qwen3) to ``GPTShape`` + ``TransformerConfig``
- ``bridge`` / ``bridge_layout`` / ``bridge_checkpoint``: HF safetensors <-> Megatron shards, each rank
  reading only its slices; export back to an HF folder
- ``roles``: actor, reference, critic and reward model on the same process groups
- ``vocab_parallel``: log-probs and entropy from vocab-parallel logits without gathering the vocabulary
- ``loss_scaling``: loss aggregation modes whose global denominators make a loss split-invariant
- ``compute``: forward/backward and forward-only log-probs / values through Megatron's pipeline schedules
- ``optimizer`` / ``lr_schedule``: Megatron DDP + DistributedOptimizer on GPU; AdamW + bucketed DP
  all-reduce + TP-aware clipping on CPU; warmup/decay schedules
- ``checkpoint``: a role's training checkpoint (model, optimizer, LR position, RNG states)
- ``checkpoint_safety`` / ``torch_file`` / ``safe_dcp`` / ``safe_load`` / ``pickle_records``: checkpoints read
  without an unpickler (``torch.save`` files, DCP folders, Megatron's ``dist_checkpointing.load``); the FSDP
  backend uses the torch-only ones

Import the submodules directly; this package does not import megatron on its own.
"""

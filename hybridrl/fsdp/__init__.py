"""The PyTorch FSDP2 backend of the critic and the reference: HF transformers models under ``fully_shard``.

The ONLY package that uses ``torch.distributed.fsdp``. A role on this backend (``critic.backend: fsdp``,
``ref.backend: fsdp``) holds an HF model sharded over a 1-D device mesh of every rank of the run (the same
processes as the Megatron actor, colocated): each rank keeps ``1 / world`` of the weights, gradients and
Adam moments, gathers a layer's full weights just before it runs and frees them after (ZeRO-3).

- ``model``: the HF model with its head (:class:`~hybridrl.fsdp.model.TokenModel`: values for the critic,
  log-probs for the reference), its sharding and its offload between phases;
- ``compute``: rollout batches through the model (rows rolled as the Megatron path rolls them), forward-only
  heads and the aggregated loss's backward (:mod:`hybridrl.algos.aggregation`);
- ``optimizer``: AdamW on the shards, the global grad-norm clip and the warmup/decay schedule;
- ``checkpoint``: model + optimizer through ``torch.distributed.checkpoint`` (resharded on load), read safely.

Import the submodules directly.
"""

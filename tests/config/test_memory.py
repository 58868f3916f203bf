"""The per-rank memory estimate of ``hybridrl validate-config``: the device is assumed only when the config or
``--device-gib`` says GPU, offload flags move parts off the device, the optimizer is divided over DP only by the
distributed optimizer, and the warning appears only when a known device size is exceeded."""

from __future__ import annotations

import pytest

from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.config.kv_cache import config_size
from hybridrl.config.memory import GIB, architecture, estimate, model_fields, per_rank_params


@pytest.fixture(autouse=True)
def _default_kv_cache(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)


def _memory(capsys, *argv: str) -> str:
    assert main(["validate-config", *argv, "--quiet"]) == 0
    out = capsys.readouterr().out
    return out[out.index("memory per rank") :]


def test_llama2_7b_parts():
    cfg = load_config("ppo_llama2_7b.yaml")
    arch = architecture(cfg)
    layers, embed = arch.params()
    assert round((layers + embed) / 1e9, 2) == 6.74  # Llama-2-7B's published parameter count
    n = per_rank_params(arch, 2, 1)
    est = estimate(cfg, 80)
    assert est.on_gpu and est.rollout_gib == 40.0  # 0.5 x 80
    assert est.parts["actor weights"].gib == pytest.approx(n * 2 / GIB)  # bf16
    assert est.parts["actor optimizer"].gib == pytest.approx(n * 12 / 4 / GIB)  # distributed optimizer over dp 4
    critic = per_rank_params(arch, 2, 1, lm_head=False)  # score head (1, hidden) instead of the output layer
    assert critic == n - (32000 * 4096 - 4096) // 2
    assert est.phases() == pytest.approx((est.roles(False) + 40.0, est.roles(False)))  # nothing offloaded


def test_cpu_config_is_host_ram_without_device(capsys):
    out = _memory(capsys, "tiny_cpu.yaml")
    assert out.startswith("memory per rank in GiB, CPU run, host RAM (rollout.enforce_eager true;")
    assert "GPU with" not in out and "warning" not in out and "gpu_memory_utilization" not in out
    kv = config_size(load_config("tiny_cpu.yaml"), model_fields(load_config("tiny_cpu.yaml")))
    assert kv.source == "auto" and f"auto KV cache {kv.bytes / 1024**2:.0f} MiB (4 sequences" in out
    assert "8 B/param, not sharded (torch backend)" in out  # fp32 AdamW: two moments, no master copy
    est = estimate(load_config("tiny_cpu.yaml"))
    arch = architecture(load_config("tiny_cpu.yaml"))
    vllm_weights = per_rank_params(arch, 1, 1) * 4 / GIB  # rollout tp 1, fp32
    assert est.rollout_gib == pytest.approx(vllm_weights + kv.gib)
    total = sum(p.gib for p in est.parts.values()) + est.rollout_gib
    (line,) = [line for line in out.splitlines() if line.startswith("  total ")]
    assert line.split() == ["total", f"{total:.2f}"]  # every part counted, nothing offloaded


def test_gpu_config_without_size_gives_the_smallest_device(capsys):
    out = _memory(capsys, "ppo_llama2_7b.yaml")
    assert "GPU of unknown size (CUDA graphs: rollout.enforce_eager false;" in out and "warning" not in out
    est = estimate(load_config("ppo_llama2_7b.yaml"))
    assert est.rollout_gib is None and est.phases() is None
    assert f"fits a GPU of {est.roles(True) / 0.5:.0f} GiB or more" in out  # roles fill the other half


def test_warning_only_when_a_known_device_is_exceeded(capsys):
    out = _memory(capsys, "ppo_llama2_7b.yaml", "--device-gib", "80")
    warnings = [line for line in out.splitlines() if "warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith("  warning: 102 GiB > the GPU's 80 GiB;")
    assert "warning" not in _memory(capsys, "ppo_llama2_7b.yaml", "--device-gib", "141")
    assert main(["validate-config", "tiny_cpu.yaml", "--device-gib", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "--device-gib (0) must be > 0: one GPU's memory in GiB; omit it for CPU"


def test_offload_flags_move_parts_off_the_device():
    base = estimate(load_config("ppo_llama2_7b.yaml"), 80)
    cfg = load_config("ppo_llama2_7b.yaml", ["actor.optimizer_offload=true", "ref.param_offload=true"])
    est = estimate(cfg, 80)
    p = est.parts
    assert p["actor optimizer"].away == "host RAM while vLLM generates" and p["actor grads"].away
    assert not p["actor weights"].away and p["reference weights"].away_in_training
    moved = p["actor optimizer"].gib + p["actor grads"].gib + p["reference weights"].gib
    assert est.phases()[0] == pytest.approx(base.phases()[0] - moved)  # generating
    assert est.phases()[1] == pytest.approx(base.phases()[1] - p["reference weights"].gib)  # training: actor back
    cfg = load_config("ppo_llama2_7b.yaml", ["actor.param_offload=true", "critic.param_offload=true"])
    est = estimate(cfg, 80)
    assert est.parts["critic weights"].away == "host RAM outside its passes"
    assert est.phases()[0] == pytest.approx(
        base.phases()[0] - est.parts["actor weights"].gib - est.parts["critic weights"].gib
    )
    cpu = estimate(load_config("tiny_cpu.yaml", ["actor.optimizer_offload=true", "ref.param_offload=true"]))
    assert all(not part.away for part in cpu.parts.values())  # on CPU "host" is home: nothing leaves


@pytest.mark.parametrize(
    "overrides, per_param",
    [
        ([], 12 / 4),  # GPU auto: Megatron + distributed optimizer, over dp 4
        (["actor.megatron.use_distributed_optimizer=false"], 12),
        (["actor.optim.backend=torch", "model.dtype=float32"], 8),  # torch AdamW: fp32 weights, two moments
        (["actor.optim.backend=megatron", "model.dtype=float32"], 8 / 4),  # no master copy of fp32 weights
    ],
)
def test_optimizer_divided_over_dp_only_by_the_distributed_optimizer(overrides, per_param):
    cfg = load_config("ppo_llama2_7b.yaml", overrides)
    n = per_rank_params(architecture(cfg), 2, 1)
    assert estimate(cfg, 80).parts["actor optimizer"].gib == pytest.approx(n * per_param / GIB)


def test_vllm_stays_awake_without_free_cache_engine():
    est = estimate(load_config("ppo_llama2_7b.yaml", ["rollout.free_cache_engine=false"]), 141)
    assert est.phases()[1] == pytest.approx(est.roles(False) + 70.5)

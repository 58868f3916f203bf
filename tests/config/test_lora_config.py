"""``actor.lora``: the packaged LoRA config loads through load_config (the trainer's path), every bad value or
unsupported combination is refused before any model is built with one line naming the key and the fix, and the
memory report counts the adapters only for gradients and Adam state, no reference copy, and prints the same run's
full fine-tuning total next to it."""

from __future__ import annotations

import pytest

from hybridrl.cli import main
from hybridrl.config import load_config
from hybridrl.config.memory import GIB, architecture, estimate, per_rank_params
from hybridrl.config.memory_lora import adapter_params
from hybridrl.config.schema import ConfigError

LORA = "tiny_cpu_lora.yaml"


def test_packaged_config_enables_lora_with_the_actor_as_reference():
    cfg = load_config(LORA)
    assert cfg.actor.lora.enable and cfg.actor.lora.rank == 8 and cfg.actor.lora.target_modules == ["all-linear"]
    assert cfg.ref.enable  # use_kl_loss: served by the actor with its adapters off


CASES = [
    (["actor.lora.rank=0"], "actor.lora.rank (0) must be >= 1; set e.g. actor.lora.rank=8"),
    (["actor.lora.alpha=-1"], "actor.lora.alpha (-1.0) must be > 0; e.g. twice the rank"),
    (["actor.lora.dropout=1.0"], "actor.lora.dropout (1.0) must be in [0, 1); e.g. 0.05"),
    (["actor.lora.target_modules=[qproj]"], "actor.lora.target_modules: 'qproj' matches no layer; did you mean "
     "'q_proj'? choose from ['q_proj', 'k_proj', 'v_proj', 'o_proj', 'gate_proj', 'up_proj', 'down_proj', "
     "'linear_qkv', 'linear_proj', 'linear_fc1', 'linear_fc2', 'all-linear']"),
    (["actor.lora.target_modules=[]"], "actor.lora.target_modules ([]) names no layer; e.g. [all-linear] or "
     "[q_proj, v_proj]"),
    (["actor.param_offload=true"], "actor.param_offload (true) cannot run with actor.lora.enable (true); set "
     "actor.param_offload=false"),
    (["ref.param_offload=true"], "ref.param_offload (true) cannot run with actor.lora.enable (true); set "
     "ref.param_offload=false (the reference has no weights of its own)"),
]  # fmt: skip


@pytest.mark.parametrize("overrides,message", CASES)
def test_bad_lora_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(LORA, overrides)
    assert str(err.value) == message


def test_sequence_parallel_is_refused_with_lora():
    with pytest.raises(ConfigError, match=r"^actor.megatron.sequence_parallel \(true\) cannot run with actor.lora"):
        load_config("ppo_llama2_7b.yaml", ["actor.lora.enable=true"])


def test_lora_off_ignores_its_fields():
    assert not load_config(LORA, ["actor.lora.enable=false", "actor.lora.rank=0"]).actor.lora.enable


def test_memory_counts_adapters_and_no_reference_copy(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cfg = load_config("ppo_llama2_7b.yaml", ["actor.lora.enable=true", "actor.lora.rank=16",
                                             "actor.megatron.sequence_parallel=false"])  # fmt: skip
    full = load_config("ppo_llama2_7b.yaml", ["actor.megatron.sequence_parallel=false"])
    lora, base = estimate(cfg, device_gib=80), estimate(full, device_gib=80)
    arch = architecture(cfg)
    n = adapter_params(arch, cfg.actor.lora, 2, 1)
    # Llama-2-7B, r=16 on every linear, TP 2: per layer A_qkv 16*4096 + B_qkv 12288*16/2, A_o 16*4096/2 + B_o
    # 4096*16, A_fc1 16*4096 + B_fc1 22016*16/2, A_fc2 16*11008/2 + B_fc2 4096*16
    assert n == 32 * (16 * 4096 + 12288 * 8 + 8 * 4096 + 4096 * 16 + 16 * 4096 + 22016 * 8 + 8 * 11008 + 4096 * 16)
    assert lora.parts["actor grads"].gib == pytest.approx(n * 4 / GIB)
    assert lora.parts["actor weights"].gib == pytest.approx((per_rank_params(arch, 2, 1) + n) * 2 / GIB)
    assert lora.parts["reference weights"].gib == 0.0 and base.parts["reference weights"].gib > 6
    assert max(lora.phases()) < max(base.phases()) - 25  # grads, Adam state and the reference copy are gone
    assert main(["validate-config", "ppo_llama2_7b.yaml", "actor.lora.enable=true", "actor.lora.rank=16",
                 "actor.megatron.sequence_parallel=false", "--device-gib", "80", "--quiet"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert f"  full fine-tuning     {max(base.phases()):6.2f}  peak of the same run with actor.lora.enable=false" in out
    assert "the actor with its LoRA adapters off (no copy)" in out

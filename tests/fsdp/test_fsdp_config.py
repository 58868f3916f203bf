"""The FSDP backend's config rules (one line naming the key, the value and the fix, before any model is built) and
its boundary (``torch.distributed.fsdp`` used only in hybridrl/fsdp/); no ranks, no models."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hybridrl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
SMALL_CRITIC = ["data.train_batch_size=2", "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=1",
                "critic.ppo_mini_batch_size=1", "critic.ppo_micro_batch_size_per_gpu=1"]  # fmt: skip


def _error(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu.yaml", list(overrides), world_size=2)
    assert "\n" not in str(info.value)
    return info.value


def test_fsdp_roles_load():
    cfg = load_config("tiny_cpu.yaml", ["critic.backend=fsdp", "ref.backend=fsdp"], world_size=2)
    assert (cfg.critic.backend, cfg.ref.backend, cfg.actor.backend) == ("fsdp", "fsdp", "megatron")


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["actor.backend=fsdp"], "actor.backend", "'fsdp'"),
        (["ref.backend=fsdp", "model.architecture.model_type=t5"], "ref.backend", "model_type 't5'"),
        (
            ["critic.backend=fsdp", "model.architecture.model_type=nonsense"],
            "critic.backend",
            "set critic.backend=megatron",
        ),
        (
            ["critic.backend=fsdp", "critic.optim.backend=megatron"],
            "critic.optim.backend",
            "set critic.optim.backend=auto",
        ),
        (["critic.backend=fsdp", *SMALL_CRITIC], "critic.ppo_mini_batch_size", "world_size (2)"),
        (["critic.backend=deepspeed"], "critic.backend", "'megatron', 'fsdp'"),
    ],
)
def test_what_fsdp_cannot_serve_is_one_line(overrides, key, words):
    err = _error(*overrides)
    assert err.key == key and words in str(err), str(err)


def test_the_batch_rule_is_fsdps_own():
    """The same small critic batches are fine on Megatron (tiny_cpu: TP 2, so dp 1): the rule is the backend's."""
    load_config("tiny_cpu.yaml", SMALL_CRITIC, world_size=2)


def _fsdp_imports(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        if any(n == "torch.distributed.fsdp" or n.startswith("torch.distributed.fsdp.") for n in names):
            lines.append(node.lineno)
    return lines


def test_fsdp_only_in_its_package():
    assert _fsdp_imports(ast.parse("from torch.distributed.fsdp import fully_shard\nimport torch.distributed.fsdp\n"
                                   "from torch.distributed import fsdp\nimport torch\n")) == [1, 2, 3]  # fmt: skip
    home = ROOT / "hybridrl" / "fsdp"
    assert _fsdp_imports(ast.parse((home / "model.py").read_text())), "the backend itself must be seen importing it"
    bad = [f"{p.relative_to(ROOT)}:{n}" for p in sorted((ROOT / "hybridrl").rglob("*.py")) if home not in p.parents
           for n in _fsdp_imports(ast.parse(p.read_text()))]  # fmt: skip
    assert not bad, f"torch.distributed.fsdp used outside hybridrl/fsdp/: {bad}"


def test_a_hub_model_not_downloaded_is_left_to_the_build():
    """A packaged config's Hub name: its model_type is unknown before download, so no refusal here."""
    cfg = load_config("ppo_llama2_7b.yaml", ["critic.backend=fsdp", "ref.backend=fsdp"])
    assert cfg.critic.backend == "fsdp"


def test_memory_estimate_shards_fsdp_roles_over_the_world():
    from hybridrl.config.memory import GIB, architecture, estimate, per_rank_params

    cfg = load_config("ppo_llama2_7b.yaml", ["critic.backend=fsdp", "ref.backend=fsdp"])
    world, arch = 8, architecture(cfg)
    parts = estimate(cfg, device_gib=80).parts
    critic = -(-per_rank_params(arch, 1, 1, lm_head=False) // world)
    assert parts["critic weights"].gib == pytest.approx(critic * 4 / GIB)  # fp32 master shards
    assert parts["critic optimizer"].gib == pytest.approx(critic * 8 / GIB)
    assert parts["reference weights"].gib == pytest.approx(-(-per_rank_params(arch, 1, 1) // world) * 2 / GIB)
    megatron = estimate(load_config("ppo_llama2_7b.yaml"), device_gib=80).parts
    assert megatron["critic optimizer"].gib > parts["critic optimizer"].gib

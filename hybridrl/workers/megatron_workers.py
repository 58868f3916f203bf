"""The role workers of a PPO/GRPO step on Megatron (training) and vLLM (generation).

Each worker takes its own config section(s), not the run config, and builds its model on the already-initialised
Megatron groups (all roles share them: the run's :class:`~hybridrl.distributed.ParallelLayout`); the trainer
computes what a section alone does not give (optimizer steps of the run, the rollout group size). Each exposes
registered methods; :class:`~hybridrl.workers.group.WorkerGroup` splits their DataProto over the
data-parallel ranks and gathers the results (see :mod:`hybridrl.workers.dispatch`).

- :class:`ActorRolloutWorker`: ``switch_to_rollout`` / ``switch_to_training`` (the hybrid engine's
  :class:`~hybridrl.hybrid_engine.switch.RolloutSwitch`), ``generate_sequences`` (vLLM), ``compute_log_prob``,
  ``update_actor`` (:class:`~hybridrl.algos.objectives.ActorLoss`: the registry's policy loss + entropy +
  optional KL loss, mini-batches x epochs);
- :class:`CriticWorker`: ``compute_values``, ``update_critic`` (:class:`~hybridrl.algos.objectives.CriticLoss`);
- :class:`ReferenceWorker`: ``compute_ref_log_prob``;
- :class:`RewardModelWorker`: ``compute_rm_score`` (score at the last response token).

The actor and the critic are also checkpoint parts (``save_checkpoint`` / ``check_checkpoint`` /
``load_checkpoint`` of their folder, ``state_dict`` / ``load_state_dict`` of their update count); the frozen
reference and reward model are rebuilt from their model paths instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hybridrl.algos.objectives import ActorLoss, CriticLoss
from hybridrl.config.checks_routing import records_routes
from hybridrl.config.schema import RewardModelConfig, RolloutCorrectionConfig
from hybridrl.config.schema_roles import ActorConfig, CriticConfig, RefConfig, RolloutConfig
from hybridrl.distributed.layout import ParallelLayout
from hybridrl.mcore import checkpoint as mckpt
from hybridrl.mcore import compute, lora, roles, routing
from hybridrl.mcore.optimizer import OptimConfig, build_optimizer, move_model_weights, move_optimizer_state
from hybridrl.mcore.parallel_state import data_parallel_info, rollout_replica_info
from hybridrl.protocol import DataProto
from hybridrl.workers.dispatch import Dispatch, register

COMPUTE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def model_options(megatron: Any, key: str) -> dict[str, Any]:
    """``TransformerConfig`` overrides from a role's ``megatron`` options: activation recompute, batched pipeline
    p2p (None: the backend's default) and sequence parallelism (the layout sizes come from the process groups)."""
    out: dict[str, Any] = {}
    for name in ("recompute_granularity", "recompute_method", "recompute_num_layers", "batch_p2p_comm"):
        if getattr(megatron, name) is not None:
            out[name] = getattr(megatron, name)
    if megatron.sequence_parallel:  # TransformerEngine's norms on a GPU with it, hybridrl.mcore.local_norm's otherwise
        out["sequence_parallel"] = True
    return out


def optim_config(section: Any, total_steps: int, megatron: Any = None) -> OptimConfig:
    """mcore's optimizer settings from a config ``optim`` section; ``total_steps`` counts optimizer updates;
    ``megatron`` (the role's section) chooses the DistributedOptimizer (None there = on with CUDA)."""
    warmup = section.lr_warmup_steps
    if warmup is None:
        warmup = int(section.lr_warmup_ratio * total_steps)
    return OptimConfig(
        lr=section.lr,
        min_lr=section.min_lr,
        warmup_steps=warmup,
        total_steps=total_steps,
        lr_decay_style=section.lr_decay_style,
        weight_decay=section.weight_decay,
        betas=tuple(section.betas),
        eps=section.eps,
        clip_grad=section.clip_grad,
        backend=section.backend,
        use_distributed_optimizer=(
            torch.cuda.is_available()
            if megatron is None or megatron.use_distributed_optimizer is None
            else megatron.use_distributed_optimizer
        ),
    )


def _tensors(data: DataProto, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {k: data.batch[k] for k in keys if k in data.batch}


def _mean_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in results for k in r}
    return {k: sum(r[k] for r in results if k in r) / sum(1 for r in results if k in r) for k in sorted(keys)}


class _TrainedRole:
    """Mini-batch x epoch loop shared by the actor and the critic, and their checkpoint part.

    As a part of a trainer checkpoint (:mod:`hybridrl.trainer.checkpoint`, through the worker group's declared
    methods) a trained role saves its own folder, collectively: model, optimizer and LR position
    (:func:`hybridrl.mcore.checkpoint.save_role`: Megatron's dist checkpointing writes each rank's shards, so
    the state is files, not a dict); its small state (``state_dict``) is its update count ``version``, which
    seeds each update's mini-batch shuffle.
    """

    model: Any
    optimizer: Any
    version: int

    def _setup_dp(self) -> None:
        self.dp_size, self.dp_rank, self.dp_group = data_parallel_info()

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Weights and optimizer state on the device for the block (a checkpoint save reads them)."""
        yield

    @register(Dispatch.LOCAL)
    def save_checkpoint(self, path: str) -> None:
        """Write model, optimizer and LR position to the new folder ``path``. Collective."""
        with self.resident():  # an offloaded critic is parked between its updates
            mckpt.save_role(self.model, self.optimizer, path)

    @register(Dispatch.LOCAL)
    def check_checkpoint(self, path: str) -> None:
        """Check the files of ``path`` this rank will load (:func:`~hybridrl.mcore.checkpoint.check_role`)."""
        mckpt.check_role(path)

    @register(Dispatch.LOCAL)
    def load_checkpoint(self, path: str) -> None:
        """Load model, optimizer and LR position from ``path`` (before the first update). Collective."""
        mckpt.load_role(self.model, self.optimizer, path)

    @register(Dispatch.LOCAL)
    def state_dict(self) -> dict[str, int]:
        return {"version": self.version}

    @register(Dispatch.LOCAL)
    def load_state_dict(self, state: dict[str, int]) -> None:
        self.version = int(state["version"])

    def _train(
        self,
        data: DataProto,
        mini_batch: int,
        epochs: int,
        seed: int,
        step_fn,
        shuffle: bool = True,
        whole_groups: bool = False,
    ) -> dict[str, float]:
        """``epochs`` passes over ``data`` in mini-batches of ``mini_batch`` responses (all DP ranks together).

        ``whole_groups``: shuffle whole prompt groups (runs of one ``uid``) instead of rows, so that a mini-batch
        holds a prompt's responses side by side and prompt sharing can pack them (:func:`group_order`).
        """
        local = mini_batch // self.dp_size
        results = []
        grouped = shuffle and whole_groups and "uid" in data.non_tensor_batch
        minis = (
            _group_minibatches(data, local, epochs, seed)
            if grouped
            else data.make_iterator(local, epochs=epochs, shuffle=shuffle, seed=seed)
        )
        for mini in minis:
            self.optimizer.zero_grad()
            out = step_fn(mini)
            res = self.optimizer.step()
            results.append({**out.metrics, "loss": out.loss, "grad_norm": res.grad_norm, "lr": res.lr,
                            "skipped": float(res.skipped)})  # fmt: skip
        return _mean_metrics(results)


def group_order(uids, generator: torch.Generator) -> torch.Tensor:
    """A permutation of the rows that shuffles whole groups (maximal runs of equal ``uids``), each group's rows
    kept adjacent and in order.

    Args:
        uids: ``(b,)`` group id of each row (the rollout lays a prompt's responses out adjacent).
        generator: the shuffle's generator (seeded alike on every rank).

    Returns:
        ``(b,)`` int64 row indices.
    """
    b = len(uids)
    starts = [0, *(i for i in range(1, b) if uids[i] != uids[i - 1])]
    spans = list(zip(starts, [*starts[1:], b], strict=True))
    picked = torch.randperm(len(spans), generator=generator).tolist()
    return torch.cat([torch.arange(*spans[g]) for g in picked]) if b else torch.zeros(0, dtype=torch.long)


def _group_minibatches(data: DataProto, size: int, epochs: int, seed: int) -> Iterator[DataProto]:
    """``data.make_iterator(size, epochs, shuffle=True, seed)`` with whole groups shuffled (:func:`group_order`)."""
    if len(data) % size:
        raise ValueError(f"batch size {len(data)} is not divisible by the mini-batch size {size}")
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = group_order(data.non_tensor_batch["uid"], generator)
        for start in range(0, len(data), size):
            yield data[order[start : start + size]]


class ActorRolloutWorker(_TrainedRole):
    """Policy training on Megatron and generation in a colocated vLLM engine.

    Args:
        actor / rollout: the run's ``actor`` and ``rollout`` sections.
        layout: the run's layout (the Megatron groups are built from it; its generation groups are vLLM's).
        model_path: HF folder of the policy.
        dtype: training dtype (``model.dtype``); generation uses ``rollout.dtype``.
        optimizer_steps: optimizer updates over the run (the LR schedule's length).
        tokenizer: the run's tokenizer (its EOS ends responses; an HF folder lets vLLM match ``rollout.stop``).
        rollout_correction: ``algorithm.rollout_correction`` (its TIS weights enter the policy loss), or None.
        ref_micro_batch_size: ``ref.log_prob_micro_batch_size_per_gpu`` where this worker serves the reference
            (``actor.lora``: the actor with its adapters off, :meth:`compute_ref_log_prob`).
    """

    def __init__(
        self,
        actor: ActorConfig,
        rollout: RolloutConfig,
        layout: ParallelLayout,
        model_path: str,
        dtype: str,
        optimizer_steps: int,
        tokenizer: Any = None,
        rollout_correction: RolloutCorrectionConfig | None = None,
        ref_micro_batch_size: int | None = None,
    ) -> None:
        from hybridrl.hybrid_engine import RolloutSwitch
        from hybridrl.rollout import VLLMRolloutEngine

        self.actor_cfg, self.rollout_cfg = actor, rollout
        self.tokenizer, self._reward_session = tokenizer, None  # the session generate_sequences opened
        self.objective = ActorLoss(actor, rollout_correction)  # a custom policy loss file is imported here
        m = actor.megatron
        self.model = roles.build_actor(model_path, dtype=getattr(torch, dtype), **model_options(m, "actor.megatron"))
        if actor.lora.enable:  # before the optimizer: only the adapters train
            lora.apply_config(self.model, actor.lora)
        record_routes = records_routes(actor, rollout, self.model.shape.moe is not None)
        if record_routes:  # MoE: compare with (or replay) the experts vLLM chose (hybridrl.mcore.routing)
            routing.install(self.model.chunks, replay=actor.moe.routing_replay)
        self.log_prob_micro_batch_size = actor.log_prob_micro_batch_size_per_gpu or actor.ppo_micro_batch_size_per_gpu
        self.ref_micro_batch_size = ref_micro_batch_size or self.log_prob_micro_batch_size
        self.optimizer = build_optimizer(self.model.chunks, optim_config(actor.optim, optimizer_steps, m))
        self._setup_dp()
        self.rollout_dp_size, self.rollout_dp_rank, self.rollout_dp_group = rollout_replica_info(layout)
        self.rollout_tp_rank = layout.rollout_coords(torch.distributed.get_rank()).tp
        # the tokenizer's and generation_config.json's EOS ids end responses too; an HF tokenizer's folder lets
        # vLLM match rollout.stop strings
        self.rollout = VLLMRolloutEngine.from_config(
            rollout, layout, self.model.hf_config, tokenizer, model_path, record_routes=record_routes
        )
        from hybridrl.rollout.agent.loop import AgentLoop

        self.agent = AgentLoop.from_config(rollout.agent, self.rollout, tokenizer, layout)  # None: single-turn
        self.switch = RolloutSwitch.build(
            self.model, self.optimizer, self.rollout, rollout, layout, getattr(torch, rollout.dtype or dtype),
            param_offload=actor.param_offload, optimizer_offload=actor.optimizer_offload,
        )  # fmt: skip
        self.version = 0

    @register(Dispatch.ONE_TO_ALL)
    def switch_to_rollout(self) -> dict[str, float]:
        """Training -> generation layout: this version of the actor's weights in vLLM (pushed unless vLLM holds
        it already), vLLM awake, what generation does not need parked; see
        :meth:`~hybridrl.hybrid_engine.switch.RolloutSwitch.to_rollout`. Rank 0's push metrics. With LoRA the
        push reads the merged weights ``W + scale * B @ A`` (:func:`hybridrl.mcore.lora.merged`)."""
        with lora.merged(self.model.chunks):
            return self.switch.to_rollout(self.version)

    @register(Dispatch.DP_COMPUTE, mesh="rollout")
    def generate_sequences(self, prompts: DataProto, reward_stream: Any = None, **sampling: Any) -> DataProto:
        """Responses for this replica's prompts: ``n`` samples per prompt, adjacent (interleaved); call between
        :meth:`switch_to_rollout` and :meth:`switch_to_training`. A ``seed`` in ``sampling`` is the whole batch's:
        this replica offsets it past the earlier replicas' prompts. With ``rollout.agent`` each response is a multi-turn
        trajectory (:class:`~hybridrl.rollout.agent.loop.AgentLoop`). ``reward_stream``: a
        :class:`~hybridrl.rewards.stream.StreamSession` that scores the responses as they finish."""
        if sampling.get("seed") is not None:
            n = sampling.get("n", self.rollout_cfg.n)
            sampling = {**sampling, "seed": sampling["seed"] + self.rollout_dp_rank * len(prompts) * n}
        if reward_stream is not None and reward_stream.scores_on(self.rollout_tp_rank):  # scored as each finishes
            n = int(sampling.get("n", self.rollout_cfg.n))
            sampling["on_step"] = self._reward_session = reward_stream.open(prompts, n, self.tokenizer)
        elif reward_stream is not None:  # a Ray replica's TP peer: its first rank scores; the same engine path
            sampling["on_step"] = lambda finished: None
        return (self.agent or self.rollout).generate(prompts, **sampling)

    @register(Dispatch.DP_COMPUTE, mesh="rollout")
    def streamed_rewards(self, prompts: DataProto, reward_stream: Any) -> DataProto:
        """The scores ``reward_stream`` computed while this replica generated ``prompts`` (the batch given to
        :meth:`generate_sequences`, split as it was), in its rows' order; waits for the last ones. The session is
        the one :meth:`generate_sequences` opened here (under Ray each call gets its own copy of ``reward_stream``)."""
        session, self._reward_session = self._reward_session, None
        if session is None and not reward_stream.scores_on(self.rollout_tp_rank):
            return DataProto.from_dict({})  # a Ray replica's TP peer: the driver keeps its first rank's scores
        if session is None:
            raise RuntimeError("streamed_rewards: no reward stream was opened here; call generate_sequences first")
        return session.collect()

    @register(Dispatch.ONE_TO_ALL)
    def switch_to_training(self) -> dict[str, float]:
        """Generation -> training layout: parked state home, vLLM's KV cache (and weights) freed where its sleep
        frees memory; see :meth:`~hybridrl.hybrid_engine.switch.RolloutSwitch.to_training`."""
        return self.switch.to_training()

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropy`` ``(b, r)`` of the responses under the current policy."""
        out = compute.compute_log_probs(
            self.model.chunks,
            _tensors(data, (*COMPUTE_KEYS, *routing.keys_in(data.batch, self.actor_cfg.moe.routing_replay))),
            self.log_prob_micro_batch_size,
            temperature=self.rollout_cfg.temperature or 1.0,
            with_entropy=True,
            vocab_size=self.model.shape.vocab_size,
            share_prefix=self.actor_cfg.share_prompt_prefix,
        )
        return DataProto.from_dict(tensors={"old_log_probs": out["log_probs"], "entropy": out["entropy"]})

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_probs`` ``(b, r)`` with ``actor.lora``: the reference policy is this model with its adapters
        off (no second copy of the weights); scored at the sampling temperature, as the reference worker does."""
        with lora.disabled(self.model.chunks):
            out = compute.compute_log_probs(
                self.model.chunks, _tensors(data, COMPUTE_KEYS), self.ref_micro_batch_size,
                temperature=self.rollout_cfg.temperature or 1.0, vocab_size=self.model.shape.vocab_size,
                share_prefix=self.actor_cfg.share_prompt_prefix,
            )  # fmt: skip
        return DataProto.from_dict(tensors={"ref_log_probs": out["log_probs"]})

    @register(Dispatch.DP_COMPUTE)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches; returns the mean metrics (``actor/...``) in ``meta_info``."""
        a = self.actor_cfg
        head = compute.LogProbHead(
            temperature=self.rollout_cfg.temperature or 1.0, with_entropy=True, vocab_size=self.model.shape.vocab_size
        )
        keys = (*COMPUTE_KEYS, *self.objective.inputs, *routing.keys_in(data.batch, a.moe.routing_replay))

        def step(mini: DataProto):
            # the optimizer's chunks: DDP-wrapped on the Megatron path (its grad sync, DP loss scaling)
            return compute.forward_backward(
                self.optimizer.chunks, _tensors(mini, keys), self.objective, a.ppo_micro_batch_size_per_gpu, head=head,
                loss_agg_mode=a.loss_agg_mode, loss_scale_factor=a.loss_scale_factor,
                share_prefix=a.share_prompt_prefix,
            )  # fmt: skip

        responses = a.ppo_mini_batch_size * self.rollout_cfg.n
        groups = a.share_prompt_prefix is not False and self.rollout_cfg.n > 1
        metrics = self._train(data.select(keys), responses, a.ppo_epochs, self.version, step, a.shuffle, groups)
        metrics["param_norm"] = _param_norm(self.model.parameters())
        self.version += 1
        return DataProto(meta_info={"metrics": {f"actor/{k}": v for k, v in metrics.items()}})


class CriticWorker(_TrainedRole):
    """The value model: per-token values and the clipped value-loss update.

    Args:
        critic: the run's ``critic`` section.
        model_path: HF folder to start from (``critic.model_path``, else the policy's).
        dtype: training dtype (``model.dtype``).
        optimizer_steps: optimizer updates over the run (the LR schedule's length).
        rollout_n: responses per prompt (``rollout.n``): a mini-batch of P prompts is P * rollout_n responses.
        shuffle: shuffle responses between mini-batches (``actor.shuffle``).
        share_prefix: compute each GRPO group's prompt once (``actor.share_prompt_prefix``).
    """

    def __init__(
        self,
        critic: CriticConfig,
        model_path: str,
        dtype: str,
        optimizer_steps: int,
        rollout_n: int,
        shuffle: bool,
        share_prefix: bool = False,
    ) -> None:
        self.critic_cfg, self.rollout_n, self.shuffle, self.share_prefix = critic, rollout_n, shuffle, share_prefix
        options = model_options(critic.megatron, "critic.megatron")
        self.model = roles.build_critic(model_path, dtype=getattr(torch, dtype), **options)
        self.optimizer = build_optimizer(
            self.model.chunks, optim_config(critic.optim, optimizer_steps, critic.megatron)
        )
        self.objective = CriticLoss(critic)
        self._setup_dp()
        self.version = 0

    def _bring_back(self) -> None:
        """critic.param_offload / optimizer_offload: the critic sleeps in host memory between its updates."""
        c = self.critic_cfg
        if c.param_offload:
            move_model_weights(self.optimizer, self.model, to_host=False)
        if c.optimizer_offload:
            move_optimizer_state(self.optimizer, next(iter(self.model.parameters())).device)

    def _park(self) -> None:
        c = self.critic_cfg
        if c.optimizer_offload:
            move_optimizer_state(self.optimizer, "cpu")
        if c.param_offload:
            move_model_weights(self.optimizer, self.model, to_host=True)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Weights and optimizer state home for the block (a checkpoint save reads them; parked Megatron DDP
        buffers are zero-size storage), parked again after."""
        self._bring_back()
        try:
            yield
        finally:
            self._park()

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, data: DataProto) -> DataProto:
        self._bring_back()
        mbs = self.critic_cfg.ppo_micro_batch_size_per_gpu
        values = compute.compute_values(
            self.model.chunks, _tensors(data, COMPUTE_KEYS), mbs, share_prefix=self.share_prefix
        )
        return DataProto.from_dict(tensors={"values": values})

    @register(Dispatch.DP_COMPUTE)
    def update_critic(self, data: DataProto) -> DataProto:
        """Value-loss epochs over mini-batches; returns the mean metrics (``critic/...``) in ``meta_info``."""
        c = self.critic_cfg
        keys = (*COMPUTE_KEYS, *self.objective.inputs)

        def step(mini: DataProto):
            # the optimizer's chunks: DDP-wrapped on the Megatron path (its grad sync, DP loss scaling)
            return compute.forward_backward(
                self.optimizer.chunks, _tensors(mini, keys), self.objective, c.ppo_micro_batch_size_per_gpu,
                head=compute.ValuesHead(), loss_agg_mode=c.loss_agg_mode, loss_scale_factor=c.loss_scale_factor,
                share_prefix=self.share_prefix,
            )  # fmt: skip

        self._bring_back()
        responses = c.ppo_mini_batch_size * self.rollout_n
        groups = self.share_prefix is not False and self.rollout_n > 1
        metrics = self._train(data.select(keys), responses, c.ppo_epochs, self.version, step, self.shuffle, groups)
        self.version += 1
        self._park()
        return DataProto(meta_info={"metrics": {f"critic/{k}": v for k, v in metrics.items()}})


class ReferenceWorker:
    """The frozen reference policy.

    Args:
        ref: the run's ``ref`` section.
        model_path: HF folder of the policy (the reference is the initial actor).
        dtype: ``model.dtype``.
        temperature: the sampling temperature (``rollout.temperature``; 0 = greedy, scored at 1) log-probs are of.
        share_prefix: compute each GRPO group's prompt once (``actor.share_prompt_prefix``).
    """

    def __init__(
        self, ref: RefConfig, model_path: str, dtype: str, temperature: float, share_prefix: bool = False
    ) -> None:
        self.ref_cfg, self.temperature, self.share_prefix = ref, temperature, share_prefix
        self.model = roles.build_reference(
            model_path, offload=ref.param_offload, dtype=getattr(torch, dtype),
            **model_options(ref.megatron, "ref.megatron"),
        )  # fmt: skip
        self.dp_size, self.dp_rank, self.dp_group = data_parallel_info()

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        offloaded = self.model.offloaded
        if offloaded:
            self.model.onload()
        mbs = self.ref_cfg.log_prob_micro_batch_size_per_gpu
        out = compute.compute_log_probs(
            self.model.chunks, _tensors(data, COMPUTE_KEYS), mbs, temperature=self.temperature or 1.0,
            vocab_size=self.model.shape.vocab_size, share_prefix=self.share_prefix,
        )  # fmt: skip
        if offloaded:
            self.model.offload()
        return DataProto.from_dict(tensors={"ref_log_probs": out["log_probs"]})


class RewardModelWorker:
    """A frozen scalar reward model: its score at each response's last valid token.

    Args:
        reward_model: the run's ``reward.model`` section.
        model_path: its checkpoint folder (resolved: a Hub name downloaded).
        dtype: ``model.dtype``.
    """

    def __init__(self, reward_model: RewardModelConfig, model_path: str, dtype: str) -> None:
        self.rm_cfg = reward_model
        self.model = roles.build_reward_model(model_path, dtype=getattr(torch, dtype))
        if reward_model.param_offload:
            self.model.offload()
        self.dp_size, self.dp_rank, self.dp_group = data_parallel_info()

    @register(Dispatch.DP_COMPUTE)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` ``(b,)``: the model's scalar at each response's last valid token."""
        offloaded = self.model.offloaded
        if offloaded:
            self.model.onload()
        mbs = self.rm_cfg.micro_batch_size_per_gpu
        # compute_values reads response token t's value where t is predicted (p + t - 1); the reward model's
        # score belongs to the last token itself, so the batch gets one more (padding) response column and
        # the score is read at index last + 1: the output at the response's last real token, as HF's sequence
        # classifier scores. "Last" follows the attention mask, not response_mask: tokens the policy did not write
        # (a tool's output) have response_mask 0 but are part of what the reward model judges, at the end too.
        # A row without response tokens reads index 0 (the prompt's last token).
        b = data.batch
        pad = torch.zeros(len(data), 1, dtype=b["input_ids"].dtype, device=b["input_ids"].device)
        mask = b["attention_mask"][:, -b["responses"].shape[1] :].bool()
        last = mask.shape[1] - 1 - mask.flip(-1).int().argmax(-1)
        lengths = torch.where(mask.any(-1), last + 1, 0).long()
        batch = {
            "input_ids": torch.cat([b["input_ids"], pad], 1),
            "attention_mask": torch.cat([b["attention_mask"], torch.zeros_like(pad)], 1),
            "responses": torch.cat([b["responses"], pad], 1),
            "response_mask": torch.cat([b["response_mask"], torch.zeros_like(pad)], 1),
        }
        values = compute.compute_values(self.model.chunks, batch, mbs)
        if offloaded:
            self.model.offload()
        return DataProto.from_dict(
            tensors={"rm_scores": values[torch.arange(len(data), device=values.device), lengths]}
        )


def _param_norm(params) -> float:
    """L2 norm of this rank's parameter shards (a cheap fingerprint that the weights changed)."""
    return float(torch.stack([p.detach().float().norm() for p in params]).norm())

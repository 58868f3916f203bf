"""The policy workers of the offline recipes: :class:`SFTWorker` and :class:`DPOWorker`, on Megatron.

Each is a role worker as the RL ones are (:mod:`hybridrl.workers.megatron_workers`): built from its own config
section on the run's already-initialised Megatron groups through the same builders (``roles.build_actor``,
``model_options``, ``build_optimizer(optim_config(...))``), so every TP / PP / VPP / DP layout the actor supports
works here; registered methods that a :class:`~hybridrl.workers.group.WorkerGroup` splits over the DP ranks; and a
checkpoint part (model, optimizer, LR position; the update count). The DPO reference is the RL trainer's
:class:`~hybridrl.workers.megatron_workers.ReferenceWorker`.

- :class:`SFTWorker`: ``compute_log_prob`` (forward only), ``update_sft``: one optimizer step on the batch, loss
  ``-log pi(y_t | ...)`` per trained token, aggregated by ``sft.loss_agg_mode`` over the whole batch.
- :class:`DPOWorker`: also ``update_preference``: one optimizer step whose loss is the per-token surrogate
  ``g * log pi(y_t | ...)`` summed over tokens, ``g`` each sequence's weight from
  :func:`hybridrl.algos.preference.sequence_weights` (its gradient is the preference loss's).
"""

from __future__ import annotations

from typing import Any

import torch

from hybridrl.config.schema_recipes import SFTConfig
from hybridrl.config.schema_roles import ActorConfig
from hybridrl.mcore import compute, roles
from hybridrl.mcore.optimizer import build_optimizer
from hybridrl.protocol import DataProto
from hybridrl.workers.dispatch import Dispatch, register
from hybridrl.workers.megatron_workers import (
    COMPUTE_KEYS,
    _param_norm,
    _tensors,
    _TrainedRole,
    model_options,
    optim_config,
)

Tensors = dict[str, torch.Tensor]


def nll_loss(outputs: Tensors, batch: Tensors) -> tuple[torch.Tensor, dict]:
    """SFT's per-token loss ``-log pi(y_t | x, y_<t)`` ``(b, r)``, zero where ``response_mask`` is 0."""
    return -outputs["log_probs"] * batch["response_mask"], {}


def weighted_log_prob_loss(outputs: Tensors, batch: Tensors) -> tuple[torch.Tensor, dict]:
    """The preference surrogate ``g_i * log pi(y_it | ...)`` per token ``(b, r)``; ``g`` is ``batch["seq_weights"]``
    ``(b,)`` (see :mod:`hybridrl.algos.preference`)."""
    weights = batch["seq_weights"].to(outputs["log_probs"].dtype).unsqueeze(-1)
    return weights * outputs["log_probs"] * batch["response_mask"], {}


class SFTWorker(_TrainedRole):
    """The policy under supervised fine-tuning.

    Args:
        actor: the run's ``actor`` section (layout, Megatron options, optimizer, micro-batch size).
        sft: the ``sft`` section (loss aggregation).
        model_path: HF folder to start from.
        dtype: ``model.dtype``.
        optimizer_steps: optimizer updates over the run (the LR schedule's length).
    """

    def __init__(self, actor: ActorConfig, sft: SFTConfig | None, model_path: str, dtype: str,
                 optimizer_steps: int) -> None:  # fmt: skip
        m = actor.megatron
        self.micro_batch_size = actor.ppo_micro_batch_size_per_gpu
        self.loss_agg_mode = sft.loss_agg_mode if sft is not None else "token-mean"
        self.model = roles.build_actor(model_path, dtype=getattr(torch, dtype), **model_options(m, "actor.megatron"))
        self.optimizer = build_optimizer(self.model.chunks, optim_config(actor.optim, optimizer_steps, m))
        self._setup_dp()
        self.version = 0

    @register(Dispatch.DP_COMPUTE)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``log_probs`` ``(b, r)`` of the responses under the current policy (temperature 1)."""
        out = compute.compute_log_probs(self.model.chunks, _tensors(data, COMPUTE_KEYS), self.micro_batch_size,
                                        vocab_size=self.model.shape.vocab_size)  # fmt: skip
        return DataProto.from_dict(tensors={"log_probs": out["log_probs"]})

    def backward(self, data: DataProto, loss_fn: Any, loss_agg_mode: str) -> compute.StepOutput:
        """Forward and backward of this rank's batch (gradients accumulate in the parameters); no step."""
        head = compute.LogProbHead(vocab_size=self.model.shape.vocab_size)
        return compute.forward_backward(self.optimizer.chunks, _tensors(data, (*COMPUTE_KEYS, "seq_weights")),
                                        loss_fn, self.micro_batch_size, head=head,
                                        loss_agg_mode=loss_agg_mode)  # fmt: skip

    def _step(self, data: DataProto, loss_fn: Any, loss_agg_mode: str) -> dict[str, float]:
        self.optimizer.zero_grad()
        out = self.backward(data, loss_fn, loss_agg_mode)
        res = self.optimizer.step()
        self.version += 1
        return {"loss": out.loss, "grad_norm": res.grad_norm, "lr": res.lr, "skipped": float(res.skipped),
                "param_norm": _param_norm(self.model.parameters())}  # fmt: skip

    @register(Dispatch.DP_COMPUTE)
    def update_sft(self, data: DataProto) -> DataProto:
        """One optimizer step on the batch's next-token loss; metrics ``sft/...`` in ``meta_info``."""
        metrics = self._step(data, nll_loss, self.loss_agg_mode)
        return DataProto(meta_info={"metrics": {f"sft/{k}": v for k, v in metrics.items()}})


class DPOWorker(SFTWorker):
    """The policy under preference optimisation (arguments as :class:`SFTWorker`, without the ``sft`` section)."""

    def __init__(self, actor: ActorConfig, model_path: str, dtype: str, optimizer_steps: int) -> None:
        super().__init__(actor, None, model_path, dtype, optimizer_steps)

    @register(Dispatch.DP_COMPUTE)
    def update_preference(self, data: DataProto) -> DataProto:
        """One optimizer step on ``sum_i seq_weights_i * log pi(y_i|x)`` (the batch carries ``seq_weights`` ``(b,)``);
        metrics ``dpo/...`` in ``meta_info`` (``surrogate`` is that sum, not the preference loss)."""
        metrics = self._step(data, weighted_log_prob_loss, "token-sum")
        metrics["surrogate"] = metrics.pop("loss")
        return DataProto(meta_info={"metrics": {f"dpo/{k}": v for k, v in metrics.items()}})

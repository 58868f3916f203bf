"""The critic and reference workers on the FSDP2 backend (``critic.backend: fsdp``, ``ref.backend: fsdp``).

Drop-in for :class:`~hybridrl.workers.megatron_workers.CriticWorker` and
:class:`~hybridrl.workers.megatron_workers.ReferenceWorker`: the same constructor arguments, the same registered
methods with the same dispatch modes and outputs, so the loop (:func:`hybridrl.trainer.rl_trainer.role_workers`)
picks the class by the role's ``backend`` and nothing else changes. The model is an HF transformers model sharded
over every rank (:mod:`hybridrl.fsdp`), so each rank is its own data-parallel rank here (``dp_size`` = world):
``DP_COMPUTE`` hands each rank ``1 / world`` of the batch, where the Megatron roles split over
``actor.megatron.dp_size``.

- :class:`FSDPCriticWorker`: ``compute_values``, ``update_critic`` (:class:`~hybridrl.algos.objectives.CriticLoss`
  aggregated with ``critic.loss_agg_mode`` over the whole mini-batch, ``critic.optim``'s AdamW, clip and
  schedule), ``critic.param_offload`` / ``optimizer_offload`` between updates, and the checkpoint part
  (``save_checkpoint`` / ``check_checkpoint`` / ``load_checkpoint`` of its folder, ``state_dict`` /
  ``load_state_dict`` of its update count), as the Megatron critic;
- :class:`FSDPReferenceWorker`: ``compute_ref_log_prob``, ``ref.param_offload`` between calls.

``share_prefix`` (``actor.share_prompt_prefix``) is accepted and not used: this backend runs row by row, which
gives the same values up to float rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hybridrl.algos.objectives import CriticLoss
from hybridrl.config.schema_roles import CriticConfig, RefConfig
from hybridrl.fsdp import checkpoint as fckpt
from hybridrl.fsdp import compute, model
from hybridrl.fsdp.optimizer import FSDPOptimizer
from hybridrl.protocol import DataProto
from hybridrl.workers.dispatch import Dispatch, register

COMPUTE_KEYS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def _tensors(data: DataProto, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {k: data.batch[k] for k in keys if k in data.batch}


def _world() -> tuple[int, int]:
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


class FSDPCriticWorker:
    """The value model on FSDP2: per-token values and the clipped value-loss update.

    Args: as :class:`~hybridrl.workers.megatron_workers.CriticWorker` (``critic`` section, HF folder, dtype,
        optimizer steps of the run, ``rollout.n``, ``actor.shuffle``, ``actor.share_prompt_prefix``).
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
        self.critic_cfg, self.rollout_n, self.shuffle = critic, rollout_n, shuffle
        self.model = model.build_critic(model_path, dtype=getattr(torch, dtype))
        self.optimizer = FSDPOptimizer(self.model, critic.optim, optimizer_steps)
        self.objective = CriticLoss(critic)
        self.dp_size, self.dp_rank = _world()
        self.dp_group = None  # the world: the FSDP mesh
        self.version = 0
        self._park()

    def _bring_back(self) -> None:
        c, home = self.critic_cfg, model.home_device()
        if c.param_offload:
            model.move_model(self.model, home)
        if c.optimizer_offload:
            self.optimizer.move_state(home)

    def _park(self) -> None:
        """critic.param_offload / optimizer_offload: the critic sleeps in host memory between its updates."""
        c = self.critic_cfg
        if c.optimizer_offload:
            self.optimizer.move_state("cpu")
        if c.param_offload:
            model.move_model(self.model, "cpu")

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Weights and optimizer state home for the block (a checkpoint save reads them), parked again after."""
        self._bring_back()
        try:
            yield
        finally:
            self._park()

    @register(Dispatch.DP_COMPUTE)
    def compute_values(self, data: DataProto) -> DataProto:
        """``values`` ``(b, r)``: the critic's value of each response token, read where it is predicted."""
        mbs = self.critic_cfg.ppo_micro_batch_size_per_gpu
        with self.resident():
            values = compute.forward(self.model, _tensors(data, COMPUTE_KEYS), mbs)
        return DataProto.from_dict(tensors={"values": values})

    @register(Dispatch.DP_COMPUTE)
    def update_critic(self, data: DataProto) -> DataProto:
        """Value-loss epochs over mini-batches; returns the mean metrics (``critic/...``) in ``meta_info``."""
        c = self.critic_cfg
        keys = (*COMPUTE_KEYS, *self.objective.inputs)
        local = c.ppo_mini_batch_size * self.rollout_n // self.dp_size
        results = []
        with self.resident():
            for mini in data.select(keys).make_iterator(local, epochs=c.ppo_epochs, shuffle=self.shuffle,
                                                        seed=self.version):  # fmt: skip
                self.optimizer.zero_grad()
                out = compute.forward_backward(
                    self.model, _tensors(mini, keys), self.objective, c.ppo_micro_batch_size_per_gpu,
                    loss_agg_mode=c.loss_agg_mode, loss_scale_factor=c.loss_scale_factor,
                )  # fmt: skip
                res = self.optimizer.step()
                results.append({**out.metrics, "loss": out.loss, "grad_norm": res.grad_norm, "lr": res.lr,
                                "skipped": float(res.skipped)})  # fmt: skip
            self.optimizer.zero_grad()
        self.version += 1
        metrics = {k: sum(r[k] for r in results) / len(results) for k in sorted(results[0])}
        return DataProto(meta_info={"metrics": {f"critic/{k}": v for k, v in metrics.items()}})

    @register(Dispatch.LOCAL)
    def save_checkpoint(self, path: str) -> None:
        """Write model, optimizer and update count to the new folder ``path``. Collective."""
        with self.resident():
            fckpt.save_role(self.model, self.optimizer, path, self.model.config)

    @register(Dispatch.LOCAL)
    def check_checkpoint(self, path: str) -> None:
        """Check the files of ``path`` through the safe readers (:func:`hybridrl.fsdp.checkpoint.check_role`)."""
        fckpt.check_role(path)

    @register(Dispatch.LOCAL)
    def load_checkpoint(self, path: str) -> None:
        """Load model, optimizer and LR position from ``path`` (before the first update). Collective."""
        with self.resident():
            fckpt.load_role(self.model, self.optimizer, path)

    @register(Dispatch.LOCAL)
    def state_dict(self) -> dict[str, int]:
        return {"version": self.version}

    @register(Dispatch.LOCAL)
    def load_state_dict(self, state: dict[str, int]) -> None:
        self.version = int(state["version"])


class FSDPReferenceWorker:
    """The frozen reference policy on FSDP2.

    Args: as :class:`~hybridrl.workers.megatron_workers.ReferenceWorker` (``ref`` section, HF folder, dtype, the
        rollout temperature the log-probs are of, ``actor.share_prompt_prefix``).
    """

    def __init__(self, ref: RefConfig, model_path: str, dtype: str, temperature: float, share_prefix: bool = False):
        self.ref_cfg, self.temperature = ref, temperature
        self.model = model.build_reference(model_path, dtype=getattr(torch, dtype))
        self.dp_size, self.dp_rank = _world()
        self.dp_group = None
        if ref.param_offload:
            model.move_model(self.model, "cpu")

    @register(Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_probs`` ``(b, r)`` of the responses under the reference, at the rollout's temperature."""
        if self.ref_cfg.param_offload:
            model.move_model(self.model, model.home_device())
        mbs = self.ref_cfg.log_prob_micro_batch_size_per_gpu
        log_probs = compute.forward(self.model, _tensors(data, COMPUTE_KEYS), mbs, self.temperature or 1.0)
        if self.ref_cfg.param_offload:
            model.move_model(self.model, "cpu")
        return DataProto.from_dict(tensors={"ref_log_probs": log_probs})

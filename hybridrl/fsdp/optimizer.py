"""The FSDP critic's optimizer: AdamW on this rank's shards, the global grad-norm clip and the LR schedule.

The same step as the Megatron roles' (:mod:`hybridrl.mcore.optimizer`), so that both backends train a critic
alike from one ``critic.optim`` section: set ``lr = LRSchedule(step)`` (:mod:`hybridrl.mcore.lr_schedule`, pure
Python), take the global gradient norm over every shard of every rank

    ||g|| = sqrt( sum over ranks of sum over params of ||g_p,local||^2 )

(each element of the model lives on exactly one rank, so nothing is counted twice), skip the update when it is
not finite (weights, moments and the schedule step unchanged), else scale the gradients by
``min(1, clip_grad / (||g|| + 1e-6))`` and step AdamW, with no weight decay on biases and 1-D parameters
(Megatron's rule). The moments live next to the shards: ``1 / world`` of them per rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.mcore.lr_schedule import LRSchedule, StepResult


def schedule_of(optim: Any, total_steps: int) -> LRSchedule:
    """The LR schedule of a config ``optim`` section over ``total_steps`` optimizer updates (warmup: its steps, or
    its ratio of the run)."""
    warmup = optim.lr_warmup_steps if optim.lr_warmup_steps is not None else int(optim.lr_warmup_ratio * total_steps)
    return LRSchedule(optim.lr, optim.min_lr, warmup, total_steps, optim.lr_decay_style)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class FSDPOptimizer:
    """AdamW + clipping + schedule over an FSDP model's sharded parameters (module docs).

    Args:
        model: the sharded model (its trainable parameters are DTensors).
        optim: the role's config ``optim`` section (lr, betas, eps, weight decay, clip_grad, schedule).
        total_steps: optimizer updates over the run (the schedule's length).
    """

    def __init__(self, model: torch.nn.Module, optim: Any, total_steps: int) -> None:
        self.clip_grad = optim.clip_grad
        self.schedule = schedule_of(optim, total_steps)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        decay = [p for n, p in named if not (p.dim() <= 1 or n.endswith(".bias"))]
        no_decay = [p for n, p in named if p.dim() <= 1 or n.endswith(".bias")]
        groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.schedule(0),
                                           betas=tuple(optim.betas), eps=optim.eps)  # fmt: skip
        self.num_steps = 0

    def zero_grad(self) -> None:
        """Drop the accumulated gradients."""
        for p in self.params:
            p.grad = None

    def grad_norm(self) -> float:
        """The global gradient norm over all shards (NaN when any gradient is not finite). Collective."""
        grads = [_local(p.grad) for p in self.params if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        norms = torch.stack(torch._foreach_norm(grads)).double() if grads else torch.zeros(0, dtype=torch.float64)
        stats = torch.stack([norms.pow(2).sum(), (~torch.isfinite(norms)).sum().double()]).to(device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)
        return math.sqrt(stats[0].item()) if stats[1].item() == 0 else float("nan")

    @torch.no_grad()
    def step(self) -> StepResult:
        """Measure, clip and apply the gradients (module docs)."""
        norm = self.grad_norm()
        lr = self.schedule(self.num_steps)
        if not math.isfinite(norm):
            return StepResult(grad_norm=norm, lr=lr, skipped=True, num_steps=self.num_steps)
        if self.clip_grad > 0:
            coef = self.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_([_local(p.grad) for p in self.params if p.grad is not None], coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.num_steps += 1
        return StepResult(grad_norm=norm, lr=lr, skipped=False, num_steps=self.num_steps)

    def move_state(self, device: torch.device | str) -> int:
        """Move the Adam moments to ``device`` (offload between updates, or back); returns the bytes moved."""
        target, moved = torch.device(device), 0
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device.type != target.type and key != "step":
                    state[key] = value.to(target, non_blocking=True)
                    moved += _local(value).numel() * value.element_size()
        return moved

    def state_tensors(self) -> list[torch.Tensor]:
        """The optimizer's own tensors (moments and step counters) on this rank."""
        return [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]

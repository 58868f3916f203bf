"""The training optimizer of a Megatron model: one interface, a GPU path and a CPU path.

- GPU (:class:`MegatronOptimizer`): Megatron's ``DistributedDataParallel`` (grads in fp32 buckets,
  reduce-scattered) + ``DistributedOptimizer`` (bf16 params, fp32 master weights and Adam states sharded
  over DP) from ``get_megatron_optimizer``.
- CPU (:class:`TorchOptimizer`): what works on gloo (docs/cpu_stack.md): ``torch.optim.AdamW`` (fused) on the
  model's own fp32 params, gradients SUMMED over data-parallel ranks through a few flat buckets (one all-reduce per
  bucket of ``bucket_numel`` elements, not one per parameter), and a TP/PP-aware global grad norm.

Both apply the same step: set ``lr = LRSchedule(step)``, compute the global gradient norm

    ||g|| = sqrt( sum over model-parallel ranks of sum over counted params of ||g_p||^2 )

where a tensor-parallel shard (``tensor_model_parallel=True``; ``hybridrl.mcore.gpt.build_model_chunks`` sets
the attributes on every parameter and :func:`build_optimizer` refuses chunks without them) counts on its own
rank and a TP-replicated param (norms, the value head) counts on TP rank 0 only; data-parallel copies are not
counted again (the gradients were reduced). A non-finite norm skips the update (weights, Adam states and the
schedule step are unchanged) and is reported; otherwise gradients are scaled by
``min(1, clip_grad / (||g|| + 1e-6))`` and AdamW steps, with no weight decay on biases and 1-D params
(Megatron's rule).

:func:`build_optimizer` picks the path (``backend="auto"``: Megatron when CUDA is available).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from hybridrl.mcore import moe_optim
from hybridrl.mcore.gpt import check_tensor_parallel_attributes
from hybridrl.mcore.lr_schedule import LRSchedule, StepResult

BACKENDS = ("auto", "torch", "megatron")


@dataclass
class OptimConfig:
    """Optimizer, clipping and learning-rate settings of one role's training."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning-rate floor of linear/cosine decay."""
    warmup_steps: int = 0
    """Updates of linear warmup."""
    total_steps: int | None = None
    """Updates in the whole run (needed by linear/cosine decay)."""
    lr_decay_style: str = "constant"
    """``constant``, ``linear`` or ``cosine``."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay; never applied to biases and 1-D params."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's beta1, beta2."""
    eps: float = 1e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    bucket_numel: int = 40_000_000
    """Elements per data-parallel gradient bucket (both paths)."""
    use_distributed_optimizer: bool = True
    """GPU path: shard fp32 master weights and Adam states over DP (Megatron's DistributedOptimizer)."""
    grad_reduce_in_fp32: bool = True
    """GPU path: accumulate and reduce gradients in fp32 even for bf16 params."""
    backend: str = "auto"
    """``auto`` (Megatron with CUDA, else torch), ``torch`` or ``megatron``."""

    def schedule(self) -> LRSchedule:
        return LRSchedule(self.lr, self.min_lr, self.warmup_steps, self.total_steps, self.lr_decay_style)


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    return param.dim() <= 1 or name.endswith(".bias")


def _counts_in_norm(param: torch.nn.Parameter, tp_rank: int) -> bool:
    if getattr(param, "shared", False):  # the last stage's copy of a tied embedding
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def plan_buckets(params: list[torch.nn.Parameter], bucket_numel: int) -> list[list[int]]:
    """Indices of ``params`` per flat bucket: same dtype, consecutive, at most ``bucket_numel`` elements
    (a larger param gets a bucket of its own)."""
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel ({bucket_numel}) must be >= 1")
    buckets: list[list[int]] = []
    open_bucket: dict[torch.dtype, tuple[list[int], int]] = {}
    for i, p in enumerate(params):
        idx, size = open_bucket.get(p.dtype, ([], 0))
        if idx and size + p.numel() > bucket_numel:
            buckets.append(idx)
            idx, size = [], 0
        open_bucket[p.dtype] = ([*idx, i], size + p.numel())
    buckets += [idx for idx, _ in open_bucket.values() if idx]
    return buckets


FUSED_DEVICES = ("cpu", "cuda")
"""Device types whose params get torch's fused AdamW (``fused=True``) on the torch path."""


def fused_adamw(params: list[torch.nn.Parameter]) -> bool | None:
    """``fused=True`` for ``torch.optim.AdamW`` when every param is on a :data:`FUSED_DEVICES` device, else None
    (torch's default). On CPU torch's default is its per-param loop, about seven elementwise passes over each
    param, whose temporaries (``sqrt(v)``, the denominator) are as large as the param; the fused kernel reads and
    writes param, grad and both moments once. Same update, in a different float order: weights differ from the
    loop's by at most an ulp per step (tests/mcore/test_update_path.py)."""
    return True if params and all(p.device.type in FUSED_DEVICES for p in params) else None


class _Checkpointable:
    """``state_dict`` / ``load_state_dict`` of a wrapper holding ``self.optimizer`` and ``self.num_steps``."""

    optimizer: Any
    num_steps: int

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "num_steps": self.num_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.num_steps = int(state["num_steps"])


class TorchOptimizer(_Checkpointable):
    """CPU path: ``torch.optim.AdamW`` + bucketed DP all-reduce (sum) + TP/PP-aware clipping.

    Collectives per :meth:`step`: one all-reduce per bucket over DP (none when dp == 1), one over the
    embedding group for tied embeddings under PP, one over TP for replicated params whose gradient is split
    between TP ranks (q/k layernorms), and one all-reduce of ``[sum of squares, non-finite count]`` over the
    model-parallel group (none when tp * pp == 1).
    """

    def __init__(self, chunks: list[torch.nn.Module], config: OptimConfig) -> None:
        self.chunks = list(chunks)
        self.config = config
        self.schedule = config.schedule()
        named = [(n, p) for chunk in self.chunks for n, p in chunk.named_parameters() if p.requires_grad]
        for name, p in named:
            if p.dtype != torch.float32:
                raise ValueError(f"param {name} is {p.dtype}; the torch optimizer path needs fp32 params (dtype=fp32)")
        self.params = [p for _, p in named]
        groups = [
            {"params": [p for n, p in named if not _no_weight_decay(n, p)], "wd_mult": 1.0},
            {"params": [p for n, p in named if _no_weight_decay(n, p)], "wd_mult": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        for g in groups:
            g["weight_decay"] = config.weight_decay * g["wd_mult"]
        self.optimizer = torch.optim.AdamW(groups, lr=self.schedule(0), betas=config.betas, eps=config.eps,
                                           fused=fused_adamw(self.params))  # fmt: skip
        # Expert params (MoE) are summed over the expert-data-parallel group and their norm over the expert
        # model-parallel group (EP x expert-TP x PP): see hybridrl.mcore.moe_optim.
        self._expert = [moe_optim.is_expert(p) for p in self.params]
        self.buckets = moe_optim.plan_grouped_buckets(self.params, self._expert, config.bucket_numel, plan_buckets)
        tp_rank = mpu.get_tensor_model_parallel_rank()
        self._counted = [_counts_in_norm(p, tp_rank) for p in self.params]
        moe_optim.scale_aux_loss_for_summed_grads(self.chunks)
        # Tied embeddings under PP: the first stage's embedding and the last stage's copy (``shared``).
        self._tied = [i for i, p in enumerate(self.params) if getattr(p, "shared_embedding", False)]
        # TP-replicated params whose gradient each TP rank only has a part of (Megatron's finalize_model_grads
        # sums them over TP): q/k layernorm weights (Qwen3's qk_norm: each rank normalises its own heads) and,
        # under sequence parallelism, the layernorms; averaged over TP, as Megatron does, when marked so.
        self._tp_sum, self._tp_avg = [], []
        for i, (name, p) in enumerate(named):
            if getattr(p, "average_gradients_across_tp_domain", False):
                self._tp_avg.append(i)
            elif getattr(p, "sequence_parallel", False) or "q_layernorm" in name or "k_layernorm" in name:
                self._tp_sum.append(i)
        self.num_steps = 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        fused = fused_adamw(self.params)  # the loaded groups carry the saving run's choice: keep this run's
        for group in self.optimizer.param_groups:
            group["fused"], group["foreach"] = fused, None
            for p in group["params"] if fused else ():  # torch placed "step" by the saved flag: fused reads it
                step = self.optimizer.state.get(p, {}).get("step")  # on the param's device, as float32
                if isinstance(step, torch.Tensor):
                    self.optimizer.state[p]["step"] = step.to(device=p.device, dtype=torch.float32)

    def zero_grad(self) -> None:
        """Drop the accumulated gradients (before the next :func:`~hybridrl.mcore.compute.forward_backward`)."""
        for p in self.params:
            p.grad = None

    def _grads(self) -> list[torch.Tensor]:
        for p in self.params:
            if p.grad is None:  # unused on this rank: its DP peers may still have a gradient
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]

    def _reduce_over_dp(self, grads: list[torch.Tensor]) -> None:
        for bucket in self.buckets:
            group = moe_optim.grad_group(self._expert[bucket[0]])
            if dist.get_world_size(group) == 1:
                continue
            flat = torch.cat([grads[i].reshape(-1) for i in bucket])
            dist.all_reduce(flat, group=group)
            for i, piece in zip(bucket, flat.split([grads[i].numel() for i in bucket]), strict=True):
                grads[i].copy_(piece.view_as(grads[i]))

    def _sync_tied_embeddings(self, grads: list[torch.Tensor]) -> None:
        """Sum the grads of a tied embedding and its last-stage copy (Megatron's embedding group)."""
        if not self._tied:
            return
        group = mpu.get_embedding_group()
        if dist.get_world_size(group) == 1:
            return
        flat = torch.cat([grads[i].reshape(-1) for i in self._tied])
        dist.all_reduce(flat, group=group)
        for i, piece in zip(self._tied, flat.split([grads[i].numel() for i in self._tied]), strict=True):
            grads[i].copy_(piece.view_as(grads[i]))

    def _reduce_partial_over_tp(self, grads: list[torch.Tensor]) -> None:
        group = mpu.get_tensor_model_parallel_group()
        if dist.get_world_size(group) == 1:
            return
        for indices, op in ((self._tp_sum, dist.ReduceOp.SUM), (self._tp_avg, dist.ReduceOp.AVG)):
            if not indices:
                continue
            flat = torch.cat([grads[i].reshape(-1) for i in indices])
            if op == dist.ReduceOp.AVG:  # gloo has no AVG
                dist.all_reduce(flat, group=group)
                flat /= dist.get_world_size(group)
            else:
                dist.all_reduce(flat, op=op, group=group)
            for i, piece in zip(indices, flat.split([grads[i].numel() for i in indices]), strict=True):
                grads[i].copy_(piece.view_as(grads[i]))

    def _global_norm(self, grads: list[torch.Tensor]) -> float:
        device = self.params[0].device if self.params else torch.device("cpu")  # NCCL reduces device tensors only
        norms = torch.stack(torch._foreach_norm(grads)).double() if grads else torch.zeros(0, dtype=torch.float64)
        norms = norms.to(device)
        counted = torch.tensor(self._counted, dtype=torch.bool, device=device)
        expert = torch.tensor(self._expert, dtype=torch.bool, device=device)
        stats = torch.stack([norms[counted & ~expert].pow(2).sum(), (~torch.isfinite(norms[~expert])).sum().double()])
        group = mpu.get_model_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(stats, group=group)
        if any(self._expert):
            stats = stats + moe_optim.expert_norm_stats(norms, expert, self.params)
        return math.sqrt(stats[0].item()) if stats[1].item() == 0 else float("nan")

    @torch.no_grad()
    def step(self) -> StepResult:
        """Reduce, measure, clip and apply the accumulated gradients (see the module docs)."""
        grads = self._grads()
        self._reduce_over_dp(grads)
        self._sync_tied_embeddings(grads)
        self._reduce_partial_over_tp(grads)
        norm = self._global_norm(grads)
        lr = self.schedule(self.num_steps)
        if not math.isfinite(norm):
            return StepResult(grad_norm=norm, lr=lr, skipped=True, num_steps=self.num_steps)
        if self.config.clip_grad > 0:
            coef = self.config.clip_grad / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.num_steps += 1
        return StepResult(grad_norm=norm, lr=lr, skipped=False, num_steps=self.num_steps)


class MegatronOptimizer(_Checkpointable):
    """GPU path: Megatron DDP + ``get_megatron_optimizer`` (DistributedOptimizer, fp32 master weights).

    Wraps the chunks in ``DistributedDataParallel``: use :attr:`chunks` (not the originals) for
    :func:`~hybridrl.mcore.compute.forward_backward`, which then compensates DDP's DP averaging.
    """

    def __init__(self, chunks: list[torch.nn.Module], config: OptimConfig) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.utils import get_model_config

        self.config = config
        self.schedule = config.schedule()
        model_config = get_model_config(chunks[0])
        self.ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=config.grad_reduce_in_fp32,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=config.use_distributed_optimizer,
            bucket_size=config.bucket_numel,
        )
        self.chunks = [
            DistributedDataParallel(
                config=model_config, ddp_config=self.ddp_config, module=chunk, disable_bucketing=i > 0
            )
            for i, chunk in enumerate(chunks)
        ]
        self.megatron_config = OptimizerConfig(
            optimizer="adam",
            lr=config.lr,
            min_lr=config.min_lr,
            weight_decay=config.weight_decay,
            adam_beta1=config.betas[0],
            adam_beta2=config.betas[1],
            adam_eps=config.eps,
            clip_grad=config.clip_grad,
            bf16=model_config.bf16,
            fp16=model_config.fp16,
            params_dtype=model_config.params_dtype,
            use_distributed_optimizer=config.use_distributed_optimizer,
        )
        self.optimizer = get_megatron_optimizer(self.megatron_config, self.chunks)
        # What Megatron's training loop wires up: grad sync at the end of the schedule.
        no_sync = [c.no_sync for c in self.chunks]
        model_config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        model_config.finalize_model_grads_func = finalize_model_grads
        model_config.grad_scale_func = self.optimizer.scale_loss
        self.num_steps = 0

    def zero_grad(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
            group["weight_decay"] = self.config.weight_decay * group.get("wd_mult", 1.0)

    @torch.no_grad()
    def step(self) -> StepResult:
        lr = self.schedule(self.num_steps)
        self._set_lr(lr)
        found_inf = self.optimizer.prepare_grads()
        norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(norm):
            return StepResult(
                grad_norm=norm if not found_inf else float("inf"), lr=lr, skipped=True, num_steps=self.num_steps
            )
        coef = self.config.clip_grad / (norm + 1e-6)
        if self.config.clip_grad > 0 and coef < 1.0:
            # Megatron's clip_grad_by_total_norm_fp32 does this multiply but asserts CUDA tensors.
            for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                if getattr(opt, "is_stub_optimizer", False):
                    continue
                attr = "decoupled_grad" if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 else "grad"
                grads = [g for p in opt.get_parameters() if (g := getattr(p, attr, None)) is not None]
                if grads:
                    torch._foreach_mul_(grads, coef)
        self.optimizer.step_with_ready_grads()
        self.num_steps += 1
        return StepResult(grad_norm=norm, lr=lr, skipped=False, num_steps=self.num_steps)


TrainOptimizer = TorchOptimizer | MegatronOptimizer


def build_optimizer(chunks: list[torch.nn.Module], config: OptimConfig) -> TrainOptimizer:
    """The optimizer for ``chunks``; train with ``optimizer.chunks`` (wrapped in DDP on the Megatron path)."""
    if config.backend not in BACKENDS:
        raise ValueError(f"optimizer backend ({config.backend!r}) must be one of {BACKENDS}")
    check_tensor_parallel_attributes(chunks)  # the grad norm counts a TP shard on every rank, a replica once
    backend = config.backend
    if backend == "auto":
        backend = "megatron" if torch.cuda.is_available() else "torch"
    if backend == "megatron" and config.use_distributed_optimizer and not torch.cuda.is_available():
        raise ValueError(
            "use_distributed_optimizer=True needs CUDA (Megatron's DistributedOptimizer); "
            "set backend='torch' or use_distributed_optimizer=False on CPU"
        )
    return MegatronOptimizer(chunks, config) if backend == "megatron" else TorchOptimizer(chunks, config)


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` objects inside a TorchOptimizer / MegatronOptimizer (chained ones too)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    found: list[torch.optim.Optimizer] = []
    for candidate in getattr(inner, "chained_optimizers", None) or [inner]:
        while candidate is not None and not isinstance(candidate, torch.optim.Optimizer):
            candidate = getattr(candidate, "optimizer", None)
        if candidate is not None:
            found.append(candidate)
    return found


def move_optimizer_state(optimizer: Any, device: torch.device | str) -> int:
    """Move the optimizer's own tensors to ``device``: Adam moments and fp32 master weights (the inner
    optimizers' parameters that are not the model's parameters or views of them); away from the model's
    device also drop the gradients, back on it restore them (zeroed). Returns the bytes moved or freed.

    Used around generation (``actor.optimizer_offload``): the KV cache gets the memory the optimizer holds
    between updates. Gradients: plain ``.grad`` is dropped; Megatron DDP's contiguous grad buffers are freed
    and reallocated at the same tensors (``offload_grad_buffers`` / ``restore_grad_buffers``, which keep every
    ``main_grad`` view valid). Moving to the device the state is already on costs nothing (the CPU path).
    """
    target = torch.device(device)
    chunks = list(getattr(optimizer, "chunks", []))
    params = [p for chunk in chunks for p in chunk.parameters()]
    model = {p.untyped_storage().data_ptr() for p in params}
    home = params[0].device if params else target
    away = target.type != home.type or (None not in (target.index, home.index) and target.index != home.index)
    offload = away  # away from the model's device (on a CPU model "cpu" is home: nothing leaves)
    ddp = [c for c in chunks if hasattr(c, "offload_grad_buffers")]
    moved = 0
    if offload:
        for chunk in ddp:
            moved += sum(_grad_bytes(b) for b in chunk.buffers + chunk.expert_parallel_buffers)
            chunk.offload_grad_buffers(synchronize=True, empty_cache=False)
    for opt in _torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:  # fp32 masters of 16-bit models; a model parameter (or a view) stays
                if p.device != target and p.untyped_storage().data_ptr() not in model:
                    p.data = p.data.to(target, non_blocking=True)
                    moved += p.numel() * p.element_size()
        for state in opt.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device != target:
                    state[key] = value.to(target, non_blocking=True)
                    moved += value.numel() * value.element_size()
    if offload:
        for p in params:
            p.grad = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    else:
        for chunk in ddp:
            chunk.restore_grad_buffers(synchronize=False)
            moved += sum(_grad_bytes(b) for b in chunk.buffers + chunk.expert_parallel_buffers)
    return moved


def _grad_bytes(buffer: Any) -> int:
    grad = getattr(buffer, "grad_data", None)
    return 0 if grad is None else grad.untyped_storage().nbytes()


def move_model_weights(optimizer: Any, model: Any, to_host: bool) -> None:
    """Park a trainable role's weights in host memory (``to_host``) or bring them back.

    Under Megatron DDP with the DistributedOptimizer the weights are views of DDP's contiguous param buffers
    (it gathers into them): those buffers are copied out and their storage freed / re-grown in place
    (``offload_to_cpu`` / ``reload_from_cpu``), so every view stays valid. Otherwise the
    :class:`~hybridrl.mcore.roles.RoleModel` moves its parameters itself. Weights on the CPU stay put.
    """
    if not to_host and getattr(model, "offloaded", False):
        model.onload()  # parked by RoleModel.offload (weights not in DDP buffers): its parameters sit on the CPU now
        return
    if all(p.device.type == "cpu" for p in model.parameters()):
        return  # host memory already (and DDP's CPU "copy" would share the storage it then frees)
    ddp = [c for c in getattr(optimizer, "chunks", []) if hasattr(c, "buffers") and hasattr(c, "offload_grad_buffers")]
    buffers = [b for chunk in ddp for b in chunk.buffers + chunk.expert_parallel_buffers]
    if not buffers or any(b.param_data is None for b in buffers):  # weights are not views of DDP buffers
        model.offload() if to_host else model.onload()
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for buffer in buffers:
        if to_host:
            buffer.offload_to_cpu(move_params=True, move_grads=False)
        else:
            buffer.reload_from_cpu(move_params=True, move_grads=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        if to_host:
            torch.cuda.empty_cache()

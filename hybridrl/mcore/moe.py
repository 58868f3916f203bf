"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral) as Megatron-Core MoE layers: shape, spec, config, metrics.

Owns what a Hugging Face MoE config means for Megatron (:class:`MoEShape`, filled by
``hybridrl.mcore.hf_config``), the MoE layer spec (:func:`layer_spec`), the ``TransformerConfig`` fields
(:func:`config_overrides`) and the load-balancing loss metric read back after a step (:func:`aux_loss_metrics`).

Routing, as each HF model defines it, in Megatron's terms (``megatron/core/transformer/moe/router.py``),
with logits ``z = W_router h`` over the E experts and k experts per token:

- Mixtral, and Qwen3-MoE with ``norm_topk_prob=True``: ``p = softmax(z)``, keep the top-k and renormalise
  them, which equals a softmax over the top-k logits: Megatron's default (``moe_router_pre_softmax=False``).
- Qwen3-MoE with ``norm_topk_prob=False``: the top-k of ``softmax(z)`` over all experts, not renormalised:
  ``moe_router_pre_softmax=True``.

Load balancing (Switch Transformer, Fedus et al. 2021, https://arxiv.org/abs/2101.03961; Megatron's
``switch_load_balancing_loss_func``): per MoE layer l and micro-batch of T tokens,

    L_aux,l = E * sum_i f_i * P_i,   f_i = (1 / (T k)) * #tokens routed to i,   P_i = (1 / T) * sum_t p_t,i

and ``coef * sum_l L_aux,l`` (``coef`` = HF ``router_aux_loss_coef``) is added to the training loss, averaged
over micro-batches and data-parallel ranks. HF transformers computes one such term over all layers'
tokens concatenated, with f_i not divided by k (so its value is about k times one layer's); the coefficient
is taken as it stands, as Megatron-Bridge does.

Experts run as Megatron's ``SequentialMLP`` (one local MLP per expert; every CPU run) or, with
TransformerEngine, ``TEGroupedMLP`` (``linear_fc1.weight{e}``); tokens travel with the ``alltoall``
dispatcher, which runs on gloo (docs/moe.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.mcore import cpu_compat

DISPATCHER = "allgather"
"""Megatron token dispatcher: ``all_to_all_single`` between EP peers (gloo implements it)."""
AUX_LOSS_METRIC = "moe/load_balancing_loss"
"""Metric key: the mean over MoE layers of ``L_aux,l`` (without the coefficient), averaged over micro-batches."""


@dataclass(frozen=True)
class MoEShape:
    """The MoE part of a decoder: every layer's MLP is a routed mixture of ``num_experts`` SwiGLU experts."""

    num_experts: int
    """Routed experts per layer (HF ``num_experts`` / ``num_local_experts``)."""
    ffn_hidden_size: int
    """Width of one expert (HF ``moe_intermediate_size``; Mixtral's ``intermediate_size``)."""
    topk: int
    """Experts per token (HF ``num_experts_per_tok``)."""
    pre_softmax: bool = False
    """Softmax over all experts before the top-k, weights not renormalised (Qwen3-MoE ``norm_topk_prob=False``);
    False: softmax over the top-k logits (Mixtral, ``norm_topk_prob=True``)."""
    aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss (HF ``router_aux_loss_coef``); 0 disables it."""
    hf_prefix: str = "mlp"
    """The HF module of a layer's MoE block: ``mlp`` (Qwen3-MoE) or ``block_sparse_moe`` (Mixtral)."""
    hf_expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """HF names of an expert's gate, up and down projections (Mixtral: ``w1``, ``w3``, ``w2``)."""


def layer_spec(shape: Any, transformer_engine: bool) -> Any:
    """Megatron's GPT layer spec with an MoE MLP: local ``SequentialMLP`` experts, TE's grouped GEMM with TE."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    cpu_compat.define_missing_te_names()

    if transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=shape.moe.num_experts, moe_grouped_gemm=True, qk_layernorm=shape.qk_norm
        )
    return get_gpt_layer_local_spec(
        num_experts=shape.moe.num_experts, moe_grouped_gemm=False, qk_layernorm=shape.qk_norm, normalization="RMSNorm"
    )


def config_overrides(moe: MoEShape) -> dict[str, Any]:
    """``TransformerConfig`` fields of the MoE layers (dropless routing, as HF's models route), with the expert
    parallel sizes of the initialised process groups."""
    from megatron.core import parallel_state as mpu

    return dict(
        expert_model_parallel_size=mpu.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=mpu.get_expert_tensor_parallel_world_size(),
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.topk,
        moe_router_pre_softmax=moe.pre_softmax,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_token_dispatcher_type=DISPATCHER,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        moe_expert_capacity_factor=None,
    )


def expert_parallel(chunks: list[torch.nn.Module]) -> bool:
    """True for an MoE model on more than one expert-parallel rank (chunks may be wrapped in DDP)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    return getattr(config, "num_moe_experts", None) is not None and mpu.get_expert_model_parallel_world_size() > 1


def check_equal_width(width: int) -> None:
    """Raise unless every expert-parallel peer runs micro-batches of ``width`` tokens per row.

    The allgather dispatcher gathers equal-sized token blocks from the EP peers in every MoE layer; a peer
    with other widths would fail deep inside gloo/NCCL (or hang). One all-reduce over the EP group.
    """
    from megatron.core import parallel_state as mpu

    group = mpu.get_expert_model_parallel_group()
    widths = torch.tensor([width, -width], dtype=torch.long)
    dist.all_reduce(widths, op=dist.ReduceOp.MAX, group=group)
    if widths[0].item() != -widths[1].item():
        raise ValueError(
            f"expert-parallel peers hold batches of different widths ({-widths[1].item()}..{widths[0].item()} "
            "tokens); pad every data-parallel shard to the same width (data.max_prompt_length + "
            "data.max_response_length) under actor.megatron.ep_size > 1"
        )


def aux_loss_metrics(config: Any, num_micro_batches: int) -> dict[str, float]:
    """Read and clear Megatron's aux-loss tracker after a step: ``{AUX_LOSS_METRIC: value}`` on every rank.

    The tracker holds, per layer, the sum over this step's ``num_micro_batches`` of ``L_aux,l``; the value is
    the mean over MoE layers and micro-batches (summed over pipeline stages and over the router's reduce group
    (the TP ranks' sequence slices under sequence parallelism), averaged over data-parallel ranks). Empty for a
    dense model and when nothing was tracked (no gradient, or coefficient 0).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    if getattr(config, "num_moe_experts", None) is None:
        return {}
    entry = get_moe_layer_wise_logging_tracker().get("load_balancing_loss") or {}
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None  # NCCL: CUDA
    total = torch.zeros(1, dtype=torch.float64, device=device)
    if "values" in entry:
        total[0] = entry["values"].detach().double().sum().to(total.device)
    clear_aux_losses_tracker()
    # as Megatron reduces its tracker: the router computed its loss over a slice of the tokens (this TP rank's
    # sequence slice under sequence parallelism) and names the group the slices' parts add over
    dp_group = mpu.get_data_parallel_group()
    for group in (mpu.get_pipeline_model_parallel_group(), entry.get("reduce_group"), dp_group):
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    if total[0].item() == 0:
        return {}
    dp = dist.get_world_size(dp_group)
    return {AUX_LOSS_METRIC: total[0].item() / (dp * config.num_layers * max(num_micro_batches, 1))}

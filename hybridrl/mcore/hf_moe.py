"""Hugging Face MoE configs (Qwen3-MoE, Mixtral) -> :class:`~hybridrl.mcore.moe.MoEShape`, with one-line refusals.

Everything a Megatron MoE layer cannot reproduce exactly is refused here, before any weight is read: dense
layers between MoE layers (Qwen3-MoE ``mlp_only_layers`` / ``decoder_sparse_step``), Mixtral's training-time
router jitter, and a top-k larger than the number of experts.

    moe = moe_shape(hf_config, "qwen3_moe")   # None for a dense model_type
"""

from __future__ import annotations

from typing import Any

from hybridrl.errors import InputError
from hybridrl.mcore.moe import MoEShape

MOE_TYPES = ("qwen3_moe", "mixtral")


class HFMoEConfigError(InputError, ValueError):
    """An MoE config field hybridrl cannot build exactly; the message names the field and the fix."""


def _experts(hf: Any, model_type: str) -> tuple[int, int]:
    if model_type == "mixtral":
        return int(hf.num_local_experts), int(hf.intermediate_size)
    return int(hf.num_experts), int(hf.moe_intermediate_size)


def _check_all_layers_moe(hf: Any) -> None:
    only = list(getattr(hf, "mlp_only_layers", None) or [])
    if only:
        raise HFMoEConfigError(
            f"mlp_only_layers ({only}) is not supported: every layer must be an MoE layer; set mlp_only_layers=[]"
        )
    step = int(getattr(hf, "decoder_sparse_step", 1) or 1)
    if step != 1:
        raise HFMoEConfigError(f"decoder_sparse_step ({step}) is not supported: every layer must be MoE; set it to 1")


def moe_shape(hf: Any, model_type: str) -> MoEShape | None:
    """The MoE layers of ``hf`` (a transformers config), or None for a dense ``model_type``.

    Raises:
        HFMoEConfigError: a field the Megatron MoE layer cannot reproduce (message names it and the fix).
    """
    if model_type not in MOE_TYPES:
        return None
    experts, width = _experts(hf, model_type)
    topk = int(hf.num_experts_per_tok)
    if not 1 <= topk <= experts:
        raise HFMoEConfigError(
            f"num_experts_per_tok ({topk}) must be between 1 and the number of experts ({experts}); lower it"
        )
    coef = float(getattr(hf, "router_aux_loss_coef", 0.0) or 0.0)
    if model_type == "mixtral":
        jitter = float(getattr(hf, "router_jitter_noise", 0.0) or 0.0)
        if jitter:
            raise HFMoEConfigError(
                f"router_jitter_noise ({jitter}) is not supported (Megatron's router has no input jitter); set it to 0"
            )
        return MoEShape(experts, width, topk, pre_softmax=False, aux_loss_coeff=coef, hf_prefix="block_sparse_moe",
                        hf_expert_names=("w1", "w3", "w2"))  # fmt: skip
    _check_all_layers_moe(hf)
    pre_softmax = not bool(getattr(hf, "norm_topk_prob", False))
    return MoEShape(experts, width, topk, pre_softmax=pre_softmax, aux_loss_coeff=coef)

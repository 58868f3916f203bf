"""Hugging Face configs -> Megatron model architecture: which transformers models hybridrl can train.

Owns the mapping from a transformers ``PretrainedConfig`` (Llama, Qwen2, Mistral, Qwen3, and the MoE families
Qwen3-MoE and Mixtral, whose router and experts ``hf_moe`` maps) to a
:class:`~hybridrl.mcore.gpt.GPTShape` (RMSNorm eps, RoPE theta and llama3 scaling, GQA, head dim, qkv bias,
QK-norm, sliding window, tied embeddings, vocab padded by :func:`~hybridrl.mcore.gpt.padded_vocab_size`),
and from there to a ``TransformerConfig`` (:func:`from_hf`). Everything a Megatron model cannot
reproduce exactly (other activations, MLP or o_proj biases, other RoPE scalings, Qwen's per-layer sliding
windows) is refused here with a one-line error, before any weight is read.

    hf = load_hf_config("/ckpt/Qwen2.5-0.5B")          # a local folder with config.json
    shape = shape_from_hf(hf, tp=2)                    # vocab padded to a multiple of 2 * 64
    shape, config = from_hf(hf)                        # the same, on the initialised parallel state
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hybridrl.errors import InputError
from hybridrl.mcore import gpt, hf_moe

# model_type -> the architectures (HF class names) whose weights the bridge maps.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM", "LlamaForSequenceClassification"),
    "mistral": ("MistralForCausalLM", "MistralForSequenceClassification"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForSequenceClassification"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification"),
    "mixtral": ("MixtralForCausalLM", "MixtralForSequenceClassification"),
}
# Megatron's llama3 RoPE scaling fixes these (RotaryEmbedding._apply_scaling); only `factor` is free.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class HFConfigError(InputError, ValueError):
    """A Hugging Face config hybridrl cannot build exactly; the message names the field and the fix."""


def load_hf_config(path: str | os.PathLike) -> Any:
    """Read ``config.json`` of a local Hugging Face model folder (no network)."""
    from transformers import AutoConfig

    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise HFConfigError(f"no config.json in {path!r}; pass a local Hugging Face model folder (save_pretrained)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as err:  # transformers raises many types for unreadable or unknown configs
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise HFConfigError(
            f"cannot read {path}/config.json ({type(err).__name__}: {first}); fix or re-save it"
        ) from err


def supported_architectures() -> list[str]:
    """Every HF architecture name the bridge can load."""
    return [a for archs in SUPPORTED.values() for a in archs]


def _check_architecture(hf: Any) -> str:
    model_type = getattr(hf, "model_type", None)
    archs = getattr(hf, "architectures", None) or []
    known = supported_architectures()
    if model_type not in SUPPORTED or any(a not in known for a in archs):
        raise HFConfigError(
            f"unsupported architecture {archs or None} (model_type {model_type!r}); supported: {', '.join(known)}"
        )
    return model_type


def _rope(hf: Any) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor or None) from transformers 5 ``rope_parameters`` or 4.x fields."""
    params = dict(getattr(hf, "rope_parameters", None) or {})
    if not params:  # transformers 4.x
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", getattr(hf, "rope_theta", None) or 10000.0))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise HFConfigError(
            f"rope_parameters.rope_type ({rope_type!r}) is not supported; supported: 'default', 'llama3' "
            f"(Megatron's RotaryEmbedding); use a checkpoint without this RoPE scaling"
        )
    for key, value in _LLAMA3_FIXED.items():
        if float(params.get(key, value)) != float(value):
            raise HFConfigError(
                f"rope_parameters.{key} ({params[key]}) must be {value}: Megatron's llama3 RoPE scaling fixes "
                f"{_LLAMA3_FIXED}; only 'factor' may vary"
            )
    return theta, float(params["factor"])


def _sliding_window(hf: Any, model_type: str) -> int | None:
    if model_type in ("mistral", "mixtral"):
        window = getattr(hf, "sliding_window", None)
        return int(window) if window else None
    layer_types = getattr(hf, "layer_types", None) or []
    if getattr(hf, "use_sliding_window", False) and "sliding_attention" in layer_types:
        raise HFConfigError(
            f"use_sliding_window (True) with per-layer windows (layer_types) is not supported for {model_type}; "
            f"set use_sliding_window=false in config.json"
        )
    return None


def _check_unsupported(hf: Any, model_type: str) -> None:
    act = getattr(hf, "hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"hidden_act ({act!r}) is not supported; only 'silu' (SwiGLU) maps onto Megatron")
    if getattr(hf, "mlp_bias", False):
        raise HFConfigError("mlp_bias (True) is not supported; only bias-free MLPs map onto Megatron")
    if model_type != "qwen2" and getattr(hf, "attention_bias", False):
        raise HFConfigError(
            f"attention_bias (True) is not supported for {model_type} (o_proj bias); only Qwen2's q/k/v biases are"
        )
    if float(getattr(hf, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise HFConfigError(f"partial_rotary_factor ({hf.partial_rotary_factor}) is not supported; it must be 1.0")


def shape_from_hf(
    hf: Any, tp: int = 1, vocab_divisor: int = gpt.VOCAB_DIVISOR, max_seq_len: int | None = None
) -> gpt.GPTShape:
    """The :class:`GPTShape` of a Hugging Face config, with the vocab padded for ``tp`` ranks.

    Args:
        hf: a transformers ``PretrainedConfig`` (Llama, Mistral, Qwen2, Qwen3).
        tp: tensor-parallel size (vocab padding and divisibility checks).
        vocab_divisor: the vocab is padded to a multiple of ``vocab_divisor * tp``.
        max_seq_len: overrides ``max_position_embeddings``.

    Raises:
        HFConfigError: an unsupported architecture or option, or sizes that ``tp`` does not divide.
    """
    model_type = _check_architecture(hf)
    _check_unsupported(hf, model_type)
    theta, rope_factor = _rope(hf)
    heads = hf.num_attention_heads
    groups = getattr(hf, "num_key_value_heads", None) or heads
    shape = gpt.GPTShape(
        num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size,
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=getattr(hf, "intermediate_size", None) or hf.moe_intermediate_size,
        vocab_size=hf.vocab_size,
        max_seq_len=max_seq_len or hf.max_position_embeddings,
        rope_theta=theta,
        norm_eps=hf.rms_norm_eps,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        padded_vocab_size=gpt.padded_vocab_size(hf.vocab_size, tp, vocab_divisor),
        rope_scaling_factor=rope_factor,
        sliding_window=_sliding_window(hf, model_type),
        moe=hf_moe.moe_shape(hf, model_type),
    )
    check_tp(shape, tp)
    return shape


def check_tp(shape: gpt.GPTShape, tp: int) -> None:
    """Raise :class:`HFConfigError` if ``tp`` does not divide the heads, KV heads or MLP width."""
    for key, value in (
        ("num_key_value_heads", shape.num_query_groups),
        ("num_attention_heads", shape.num_attention_heads),
        ("intermediate_size", shape.ffn_hidden_size),
    ):
        if value % tp:
            raise HFConfigError(f"{key} ({value}) is not divisible by tp ({tp}); choose a tp that divides {value}")
    if shape.moe is not None and shape.moe.ffn_hidden_size % tp:
        raise HFConfigError(
            f"moe_intermediate_size ({shape.moe.ffn_hidden_size}) is not divisible by the expert tensor-parallel "
            f"size ({tp}); choose a tp that divides it"
        )
    if shape.padded_vocab % tp:
        raise HFConfigError(f"padded vocab ({shape.padded_vocab}) is not divisible by tp ({tp}); pad with tp")


def from_hf(hf: Any, dtype: torch.dtype = torch.float32, vocab_divisor: int = gpt.VOCAB_DIVISOR, **overrides: Any):
    """The ``(GPTShape, TransformerConfig)`` of ``hf`` on the initialised Megatron parallel state.

    The vocab is padded for the current TP size; ``overrides`` go to ``TransformerConfig`` (see
    :func:`gpt.make_config`). Build the chunks with ``gpt.build_model_chunks(shape, config)``.
    """
    from megatron.core import parallel_state as mpu

    shape = shape_from_hf(hf, tp=mpu.get_tensor_model_parallel_world_size(), vocab_divisor=vocab_divisor)
    return shape, gpt.make_config(shape, dtype, **overrides)


def architecture_name(hf: Any, head: str) -> str:
    """The HF class name for an exported ``config.json``: ``...ForCausalLM`` or ``...ForSequenceClassification``."""
    causal, seq_cls = SUPPORTED[_check_architecture(hf)]
    return causal if head == "lm" else seq_cls

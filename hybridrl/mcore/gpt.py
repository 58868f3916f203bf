"""Llama-style Megatron GPT models on the active parallel layout, and a forward/backward driver.

This is the substrate the actor, critic and reference roles are built on: :class:`GPTShape` (the
architecture, filled from a Hugging Face config by ``hybridrl.mcore.hf_config``), a ``TransformerConfig``
with the Llama-family options (RMSNorm, SwiGLU, RoPE incl. llama3 scaling, GQA, qkv bias, QK-norm, sliding
window, tied or untied embeddings), the vocab padding rule (:func:`padded_vocab_size`), the layer spec
(TransformerEngine when it imports, Megatron's local modules otherwise), the model chunks of this pipeline
rank (one per virtual stage), and :func:`forward_backward`, which runs micro-batches through Megatron's
pipeline schedules with a caller-supplied loss.

Every chunk built here carries what the rest of the stack reads from the model rather than from a config:

- Megatron's tensor-parallel attributes on EVERY parameter (``tensor_model_parallel``, ``partition_dim``,
  ``partition_stride``; :func:`set_tensor_parallel_attributes`). Megatron-Core sets them on linear and
  embedding weights only inside its random-init code, so a model built with ``perform_initialization=False``
  (every role, then loaded from a checkpoint) would lack them, and the grad norm and clipping of both
  optimizer paths would count each TP shard as a replica. :func:`check_tensor_parallel_attributes` is the
  invariant the optimizer and the roles check.
- the tokenizer's vocabulary size (:data:`VOCAB_ATTR`, read by :func:`vocab_size_of`): the embedding and
  output layer have ``padded_vocab`` rows, and the per-token heads must leave the padding out of the softmax.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer import ModuleSpec, TransformerConfig
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from hybridrl.mcore import cpu_compat, moe, vocab_parallel
from hybridrl.mcore.local_norm import LocalNorm, with_local_norms
from hybridrl.mcore.parallel_state import p2p_settings
from hybridrl.mcore.swiglu import swiglu

VOCAB_DIVISOR = 64  # Megatron's make_vocab_size_divisible_by default
VOCAB_ATTR = "hybridrl_vocab_size"
"""Attribute of every chunk built by :func:`build_model_chunks`: the true (unpadded) vocabulary size."""
TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def padded_vocab_size(vocab_size: int, tp: int, divisor: int = VOCAB_DIVISOR) -> int:
    """The vocab size the embedding and output layer are built with: a multiple of ``divisor * tp``.

    The ONE place of the padding rule (Megatron's ``make_vocab_size_divisible_by`` x TP): every rank gets
    the same number of rows, and padded rows are zero (their logits are 0, so log-softmax over the padded
    vocab must mask them; see :meth:`GPTShape.padded_vocab`).
    """
    if vocab_size < 1 or tp < 1 or divisor < 1:
        raise ValueError(f"vocab_size ({vocab_size}), tp ({tp}) and divisor ({divisor}) must be positive")
    multiple = divisor * tp
    return math.ceil(vocab_size / multiple) * multiple


@dataclass(frozen=True)
class GPTShape:
    """Architecture of a Llama-style decoder (the HF config fields that shape the weights)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    vocab_size: int
    """The tokenizer's (HF ``vocab_size``); the model may hold more rows, see ``padded_vocab_size``."""
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    head_dim: int | None = None
    """Per-head size (HF ``head_dim``); None means ``hidden_size // num_attention_heads``."""
    qkv_bias: bool = False
    """Biases on q/k/v only (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """The output layer reuses the input embedding (HF ``tie_word_embeddings``)."""
    padded_vocab_size: int | None = None
    """Rows of the embedding / output layer (from :func:`padded_vocab_size`); None means ``vocab_size``."""
    rope_scaling_factor: float | None = None
    """llama3-style RoPE scaling factor (low/high frequency factors 1 and 4, original context 8192)."""
    sliding_window: int | None = None
    """Each token attends to itself and the ``sliding_window - 1`` previous tokens (Mistral). Megatron's
    attention then builds its own banded causal mask and IGNORES the ``attention_mask`` passed to forward
    (key padding must not be needed: keep padding to the right of valid tokens)."""
    moe: Any = None
    """Mixture-of-experts layers (a :class:`hybridrl.mcore.moe.MoEShape`); None for a dense model."""

    @property
    def kv_channels(self) -> int:
        """Per-head size."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and output layer; logits ``[..., vocab_size:]`` are padding."""
        return self.padded_vocab_size or self.vocab_size


def use_transformer_engine() -> bool:
    """True when TransformerEngine imports and a GPU is present: its layer spec is then used."""
    if not torch.cuda.is_available():
        return False
    try:
        importlib.import_module("transformer_engine")
    except ImportError:
        return False
    return True


def layer_spec(shape: GPTShape, transformer_engine: bool | None = None) -> ModuleSpec:
    """The decoder layer spec: TransformerEngine's if available (``None`` = auto), else Megatron's local one.

    The two name the pre-attention / pre-MLP norms differently (TE fuses them into ``linear_qkv`` /
    ``linear_fc1`` as ``layer_norm_weight``); the weight bridge accepts both. The local spec's norms are
    :class:`~hybridrl.mcore.local_norm.LocalNorm` (torch's, also under sequence parallelism).
    """
    if transformer_engine is None:
        transformer_engine = use_transformer_engine()
    if shape.moe is not None:
        spec = moe.layer_spec(shape, transformer_engine)
        return spec if transformer_engine else with_local_norms(spec)
    if transformer_engine:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=shape.qk_norm)
    return with_local_norms(get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_norm))


def swiglu_module(shape: GPTShape, transformer_engine: bool, settings: dict[str, Any]) -> bool:
    """Whether the MLP computes its gated unit with :func:`hybridrl.mcore.swiglu.swiglu`: a dense model on
    Megatron's local spec with a plain SwiGLU (no linear offset, no clamp, no jit-fused kernel)."""
    return (
        not transformer_engine
        and shape.moe is None
        and settings.get("activation_func", F.silu) is F.silu
        and settings.get("gated_linear_unit", True)
        and not settings.get("bias_activation_fusion", False)
        and settings.get("glu_linear_offset", 0.0) == 0.0
        and settings.get("activation_func_clamp_value") is None
        and settings.get("use_te_activation_func", True) is not False
    )


def make_config(shape: GPTShape, dtype: torch.dtype = torch.float32, **overrides: Any) -> TransformerConfig:
    """A ``TransformerConfig`` for ``shape`` on the current Megatron parallel state.

    The TP/PP/VPP sizes come from the initialised process groups; on CPU the shim settings are added and
    on gloo ``batch_p2p_comm`` is forced off (see :func:`hybridrl.mcore.parallel_state.p2p_settings`).
    """
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    kwargs: dict[str, Any] = dict(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.num_query_groups,
        ffn_hidden_size=shape.ffn_hidden_size,
        kv_channels=shape.kv_channels,
        add_qkv_bias=shape.qkv_bias,
        qk_layernorm=shape.qk_norm,
        window_size=None if shape.sliding_window is None else (shape.sliding_window - 1, 0),
        normalization="RMSNorm",
        layernorm_epsilon=shape.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=mpu.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=mpu.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp if vpp and vpp > 1 else None,
        **p2p_settings(),
    )
    if cpu_compat.is_applied():
        kwargs.update(cpu_compat.cpu_config_overrides())
    if shape.moe is not None:
        kwargs.update(moe.config_overrides(shape.moe))
    if swiglu_module(shape, use_transformer_engine(), {**kwargs, **overrides}):
        kwargs["use_te_activation_func"] = True  # Megatron's switch for an activation submodule: the spec's swiglu
    if overrides.get("batch_p2p_comm") and not p2p_settings()["batch_p2p_comm"]:
        raise ValueError(
            "actor.megatron.batch_p2p_comm (True) gives silently wrong pipeline activations on gloo "
            "(docs/cpu_stack.md); set it to null (auto) or false"
        )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_model_chunks(shape: GPTShape, config: TransformerConfig) -> list[GPTModel]:
    """The model chunks this rank holds: one per virtual pipeline stage (one without VPP).

    The embedding and output layer have ``shape.padded_vocab`` rows (split over TP); the output layer of
    a tied model reuses the embedding (PP = 1) or holds a copy kept equal by Megatron (PP > 1).
    """
    te = use_transformer_engine()
    spec = layer_spec(shape, te)
    if config.use_te_activation_func and not te:
        if shape.moe is not None:  # Megatron's experts would apply F.silu to the whole [gate | up]
            raise ValueError("use_te_activation_func (True) needs TransformerEngine for a mixture-of-experts model")
        mlp = spec.submodules.mlp
        spec = dataclasses.replace(
            spec,
            submodules=dataclasses.replace(
                spec.submodules,
                mlp=dataclasses.replace(mlp, submodules=dataclasses.replace(mlp.submodules, activation_func=swiglu)),
            ),
        )
    rotary_base = int(shape.rope_theta) if float(shape.rope_theta).is_integer() else shape.rope_theta
    vpp = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vpp):
        block: Any = spec
        if not te:
            # the decoder's final norm: given a layer spec, Megatron takes apex's FusedLayerNorm when apex is
            # installed (a GPU without TransformerEngine), which refuses RMSNorm; torch's norm is what the local
            # spec's own norms use
            n = get_num_layers_to_build(config, vp_stage=vp_stage if vpp > 1 else None)
            block = TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=LocalNorm)
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=block,
                vocab_size=shape.padded_vocab,
                max_sequence_length=shape.max_seq_len,
                pre_process=mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=shape.tie_embeddings,
                position_embedding_type="rope",
                rotary_base=rotary_base,
                rope_scaling=shape.rope_scaling_factor is not None,
                rope_scaling_factor=shape.rope_scaling_factor or 8.0,
                vp_stage=vp_stage if vpp > 1 else None,
            )
        )
    for chunk in chunks:
        setattr(chunk, VOCAB_ATTR, shape.vocab_size)
    set_tensor_parallel_attributes(chunks, config)
    return chunks


def _fc1_stride(config: TransformerConfig) -> int:
    """The ``stride`` Megatron's MLP gives ``linear_fc1``: 2 for a gated unit (each TP rank holds
    ``[gate_r; up_r]``), 1 otherwise and under Kitchen linears (megatron/core/transformer/mlp.py)."""
    return 2 if config.gated_linear_unit and not getattr(config, "use_kitchen", False) else 1


def _megatron_split(module: torch.nn.Module, name: str, fc1: set[int], fc1_stride: int) -> tuple | None:
    """``(tensor_model_parallel, partition_dim, partition_stride)`` that Megatron's init gives parameter
    ``name`` of ``module``, for its own parallel layers; None for every other parameter (replicated)."""
    stride = fc1_stride if id(module) in fc1 else 1
    if isinstance(module, VocabParallelEmbedding) and name == "weight":
        return (True, 0, 1)
    if isinstance(module, ColumnParallelLinear) and name in ("weight", "bias"):
        return (True, 0, stride)
    if isinstance(module, RowParallelLinear) and name == "weight":
        return (True, 1, 1)
    return None


def _known_splits(chunk: torch.nn.Module, config: TransformerConfig | None) -> dict[int, tuple]:
    """id(parameter) -> the split of :func:`_megatron_split`, over one chunk."""
    fc1 = {id(m.linear_fc1) for m in chunk.modules() if isinstance(m, MLP)}
    fc1_stride = _fc1_stride(config) if config is not None else 1
    splits = {}
    for module in chunk.modules():
        for name, param in module.named_parameters(recurse=False):
            split = _megatron_split(module, name, fc1, fc1_stride)
            if split is not None:
                splits[id(param)] = split
    return splits


def set_tensor_parallel_attributes(chunks: list[torch.nn.Module], config: TransformerConfig) -> None:
    """Give every parameter Megatron's tensor-parallel attributes, as its init would have (any TP size).

    Megatron's column-parallel linears and vocab-parallel embeddings are split on dim 0, row-parallel
    linears on dim 1 (``linear_fc1`` with stride 2 for SwiGLU, see :func:`_fc1_stride`); attributes a layer
    set itself (Megatron's biases, TransformerEngine's layers) are kept, and every other parameter gets
    Megatron's replicated defaults. Idempotent.

    Raises:
        RuntimeError: Megatron set a split on one of its own layers that differs from the rule here.
    """
    for chunk in chunks:
        splits = _known_splits(chunk, config)
        for name, param in chunk.named_parameters():
            split = splits.get(id(param))
            have = tuple(getattr(param, a, None) for a in TP_ATTRIBUTES)
            if split is None or have == split:
                set_defaults_if_not_set_tensor_model_parallel_attributes(param)
            elif have == (None, None, None):
                set_tensor_model_parallel_attributes(param, *split)
            else:
                raise RuntimeError(
                    f"{name}: Megatron set tensor-parallel attributes {have}, the rule here gives {split}; "
                    "update hybridrl.mcore.gpt._megatron_split to this Megatron version"
                )


def check_tensor_parallel_attributes(chunks: Iterable[torch.nn.Module]) -> None:
    """Raise unless every parameter carries Megatron's tensor-parallel attributes and each weight of a
    Megatron parallel layer is marked split on its dim (the invariant the grad norm and clipping rely on).

    Chunks may be wrapped (Megatron DDP's ``.module``).

    Raises:
        RuntimeError: naming the first parameter that lacks them.
    """
    for chunk in chunks:
        chunk = _unwrap(chunk)
        splits = _known_splits(chunk, None)
        for name, param in chunk.named_parameters():
            missing = [a for a in TP_ATTRIBUTES if not hasattr(param, a)]
            split = splits.get(id(param))
            wrong = not missing and split is not None
            wrong = wrong and (not param.tensor_model_parallel or param.partition_dim != split[1])
            if missing or wrong:
                what = f"lacks {missing}" if missing else f"is not marked split on dim {split[1]}"
                raise RuntimeError(
                    f"parameter {name} {what}: the grad norm would count TP shards as replicas; build the model "
                    "with hybridrl.mcore.gpt.build_model_chunks (or call gpt.set_tensor_parallel_attributes)"
                )


def _unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    while not hasattr(chunk, "decoder") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def vocab_size_of(chunks: Iterable[torch.nn.Module], required: bool = True) -> int | None:
    """The true vocabulary size of a model built by :func:`build_model_chunks` (chunks may be wrapped).

    Raises:
        ValueError: ``required`` and the chunks were built elsewhere (pass the vocabulary size explicitly);
            not ``required``: None then.
    """
    for chunk in chunks:
        size = getattr(_unwrap(chunk), VOCAB_ATTR, None)
        if size is not None:
            return int(size)
    if not required:
        return None
    raise ValueError(
        "the model chunks carry no vocabulary size (not built by hybridrl.mcore.gpt.build_model_chunks); "
        "pass vocab_size= (the tokenizer's, e.g. RoleModel.shape.vocab_size)"
    )


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked) of shape ``(1, 1, seq, seq)``.

    Always passed explicitly: a ``None`` mask makes Megatron build one on device "cuda" (docs/cpu_stack.md).
    """
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def forward_backward(
    chunks: list[GPTModel],
    micro_batches: Iterable[dict[str, torch.Tensor]],
    loss_fn: LossFn,
    forward_only: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """Run ``micro_batches`` through Megatron's pipeline schedule for the current layout.

    Args:
        chunks: this rank's model chunks (from :func:`build_model_chunks`).
        micro_batches: dicts with ``input_ids`` and ``position_ids`` ``(mb, seq)``, optional ``labels``
            ``(mb, seq)`` (then ``output`` is the per-token cross entropy ``(mb, seq)`` over the TRUE vocabulary:
            Megatron's own would put the padding rows into the softmax), and whatever the loss needs. Every
            pipeline rank passes the same micro-batches.
        loss_fn: ``(output, micro_batch) -> (loss, metrics)``; ``output`` is per-token loss with labels,
            else vocab-parallel logits ``(mb, seq, vocab / tp)``. The schedule divides the returned loss by
            the number of micro-batches before backward.
        forward_only: skip backward.

    Returns:
        On the last pipeline stage, the ``metrics`` dict of each micro-batch; elsewhere an empty list.
    """
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise ValueError("forward_backward got no micro-batches")
    mb, seq = micro_batches[0]["input_ids"].shape
    mask = causal_mask(seq, device=micro_batches[0]["input_ids"].device)
    vocab = vocab_size_of(chunks) if "labels" in micro_batches[0] else None

    def step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["input_ids"], batch["position_ids"], mask)

        def loss_func(output_tensor):
            if vocab is not None:
                group = mpu.get_tensor_model_parallel_group()
                output_tensor = -vocab_parallel.log_probs(output_tensor, batch["labels"], group, vocab_size=vocab)
            return loss_fn(output_tensor, batch)

        return output, loss_func

    return run_schedule(chunks, micro_batches, step, forward_only, seq=seq, micro_batch_size=mb)


def run_schedule(
    chunks: list[GPTModel],
    micro_batches: list[dict[str, torch.Tensor]],
    step: Callable,
    forward_only: bool,
    seq: int,
    micro_batch_size: int,
) -> list[Any]:
    """Megatron's schedule for the current layout over ``micro_batches`` with a forward ``step`` function.

    ``step(data_iterator, model) -> (output, loss_func)`` as Megatron expects; every chunk (virtual stage)
    reads the micro-batches from its own iterator.
    """
    iterators = [iter(micro_batches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=seq,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )

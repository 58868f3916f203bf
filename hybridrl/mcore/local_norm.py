"""The norms of Megatron's local layer spec (CPU, or a GPU without TransformerEngine), also under sequence parallelism.

Megatron's local spec builds its norms with ``WrappedTorchNorm`` (torch's ``RMSNorm`` / ``LayerNorm``), which
refuses ``sequence_parallel``. Nothing in the norm itself depends on it: with sequence parallelism each
tensor-parallel rank normalises its own slice of the sequence, so the norm's weight sees only part of the tokens and
its gradient has to be summed over the TP group. Megatron finds such parameters by their ``sequence_parallel``
attribute (its ``finalize_model_grads``, and the ``torch`` optimizer path of :mod:`hybridrl.mcore.optimizer`);
:class:`LocalNorm` is ``WrappedTorchNorm`` that sets it. :func:`with_local_norms` puts it in a layer spec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer import ModuleSpec, TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm


class LocalNorm:
    """torch's ``RMSNorm`` or ``LayerNorm`` (``config.normalization``), its parameters marked ``sequence_parallel``
    when the config is; the signature of Megatron's norm builders."""

    def __new__(
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        if not config.sequence_parallel:
            return WrappedTorchNorm(config, hidden_size, eps=eps)
        # WrappedTorchNorm's choice, without its refusal of sequence parallelism
        norm_cls = {"RMSNorm": torch.nn.RMSNorm, "LayerNorm": torch.nn.LayerNorm}.get(config.normalization)
        if norm_cls is None or config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm:
            raise ValueError(
                f"normalization {config.normalization!r} (zero-centered gamma {config.layernorm_zero_centered_gamma}, "
                f"memory-efficient {config.memory_efficient_layer_norm}) has no local norm under sequence "
                "parallelism; use RMSNorm or LayerNorm, or set sequence_parallel=false"
            )
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm


def with_local_norms(spec: Any) -> Any:
    """``spec`` (a ``ModuleSpec`` tree, or a submodules dataclass) with every ``WrappedTorchNorm`` replaced by
    :class:`LocalNorm`: the pre-attention / pre-MLP norms and the q/k norms of the local layer spec."""
    if spec is WrappedTorchNorm:
        return LocalNorm
    if isinstance(spec, ModuleSpec):
        if spec.module is WrappedTorchNorm:
            return dataclasses.replace(spec, module=LocalNorm)
        return dataclasses.replace(spec, submodules=with_local_norms(spec.submodules))
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        changes = {}
        for f in dataclasses.fields(spec):
            value = getattr(spec, f.name)
            new = with_local_norms(value)
            if new is not value:
                changes[f.name] = new
        return dataclasses.replace(spec, **changes) if changes else spec
    return spec

"""The output layer on the response positions only: what the per-token heads read, and nothing else.

The log-prob and value heads (:mod:`hybridrl.mcore.heads`) read the model output at one position per response
token (``response_positions``, or ``packed_index`` for prompt-shared rows). Megatron's GPTModel runs its output
layer (``h -> V/tp``, the largest GEMM of a small model) and returns logits for every position: the prompt, the
padding, the position after the last response token, all computed, copied (its ``[s, b] -> [b, s]`` transpose)
and dropped. While :func:`installed` is active, a forward pre-hook on each last-stage output layer replaces its
input hidden states ``[s, b, h]`` by the rows at the current micro-batch's response positions, row-major
``[1, rows * r, h]``, so the model returns ``(rows * r, 1, V/tp)`` and :func:`as_responses` views it as
``(rows, r, V/tp)`` for the heads (:data:`KEY` set in the micro-batch). With a sequence dim of 1, GPTModel's
``[s, b] -> [b, s]`` transpose of the logits is a view, not a copy, in forward and in backward (the output
layer's weight-gradient GEMM then reads its input gradient as is instead of copying a transposed one).

The output layer is a per-position map, so the logits at the kept positions are the same (GEMM blocking may
change float summation order); the gradient reaching the final norm is the same too, since the dropped
positions received none. With a prompt-shared pass this also replaces :func:`hybridrl.mcore.prefix_share.unpack`:
the same rows are picked before the output layer instead of after it.

Under sequence parallelism each TP rank's decoder output holds its slice of the sequence, which the output layer
would all-gather itself: the pre-hook gathers it instead (``gather_from_sequence_parallel_region``), picks the rows
and runs the layer with its own gather off for that call. The gather's backward hands each rank its slice of the
input gradient, as it arrives: Megatron's vocab-split output layer, its gather off, all-reduces its input gradient
over TP itself (each rank's is a partial sum over its vocabulary shard), and a replicated head (a critic's value
head) computes the whole one on every rank.

Not used (the full output is kept) where the selection would be wrong: multi-token prediction (which reads every
position), and heads that do not declare ``reads_responses_only`` (a user head may read any position).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.utils import get_model_config

KEY = "output_at_responses"
"""Micro-batch key: True when the model output is already ``(rows, r, ...)`` at the response positions."""


def flat_index(micro_batch: dict[str, torch.Tensor], s: int, b: int) -> torch.Tensor:
    """``(rows, r)`` indices into the model's sequence-first hidden states flattened to ``(s * b, h)``.

    Args:
        micro_batch: a prepared micro-batch: ``response_positions`` ``(rows, r)`` into a ``(b, s)`` output, or a
            packed one whose ``packed_index`` ``(rows, r)`` indexes the packed output flattened to ``(b * s)``.
        s, b: the hidden states' sequence length and batch size (``[s, b, h]``).
    """
    if "packed_index" in micro_batch:
        index = micro_batch["packed_index"]
        row, pos = index // s, index % s
    else:
        pos = micro_batch["response_positions"]
        row = torch.arange(pos.shape[0], device=pos.device).unsqueeze(1).expand_as(pos)
    return pos * b + row


def usable(chunks: list[torch.nn.Module], head) -> bool:
    """Whether the pass may run the output layer on the response positions only (module docs)."""
    if not getattr(head, "reads_responses_only", False):
        return False
    return not getattr(get_model_config(chunks[0]), "mtp_num_layers", None)


class Selector:
    """Holds the current micro-batch's index for the installed pre-hooks."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None
        self.gathered: list[torch.nn.Module] = []  # layers whose own sequence gather is off for the current call

    def set(self, micro_batch: dict[str, torch.Tensor]) -> None:
        """Select ``micro_batch``'s response positions in the next output-layer call."""
        b, s = micro_batch["model_input_ids"].shape
        self.index = flat_index(micro_batch, s, b)

    def hook(self, module, args, kwargs):
        hidden = args[0]
        if self.index is None:
            return None
        index = self.index
        self.index = None  # one output-layer call per model call
        if getattr(module, "sequence_parallel", False):  # this rank's slice of the sequence: gather it (module docs)
            from megatron.core import tensor_parallel

            hidden = tensor_parallel.gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=getattr(module, "tp_group", None)
            )
            module.sequence_parallel = False
            self.gathered.append(module)
        s, b, h = hidden.shape
        picked = hidden.reshape(s * b, h)[index.reshape(-1)].unsqueeze(0)  # [1, rows * r, h]: see the module docs
        return (picked, *args[1:]), kwargs

    def after(self, module, args, output):
        """Forward hook: the layer's own sequence gather back on after a call the pre-hook gathered for."""
        if module in self.gathered:
            self.gathered.remove(module)
            module.sequence_parallel = True
        return None


def as_responses(output: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model output of a selected pass, ``(rows * r, 1, *rest)``, as ``(rows, r, *rest)`` (a view).

    Args:
        output: what the model returned while the selection was active: one row per response position.
        micro_batch: the micro-batch it ran, whose ``responses`` ``(rows, r)`` give the shape.
    """
    rows, r = micro_batch["responses"].shape
    return output.view(rows, r, *output.shape[2:])


@contextlib.contextmanager
def installed(chunks: list[torch.nn.Module], enabled: bool) -> Iterator[Selector | None]:
    """While active, each last-stage output layer of ``chunks`` runs on the selector's positions (None: disabled)."""
    if not enabled:
        yield None
        return
    selector = Selector()
    handles = []
    for chunk in chunks:
        for model in chunk.modules():
            if isinstance(model, GPTModel) and model.post_process and getattr(model, "output_layer", None) is not None:
                handles.append(model.output_layer.register_forward_pre_hook(selector.hook, with_kwargs=True))
                # always_call: the gather back on even when the layer's forward raises
                handles.append(model.output_layer.register_forward_hook(selector.after, always_call=True))
    try:
        yield selector if handles else None
    finally:
        for handle in handles:
            handle.remove()
        for module in selector.gathered:  # a call the pre-hook saw but the layer never made
            module.sequence_parallel = True
        selector.gathered.clear()

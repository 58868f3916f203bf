"""Per-token heads: what the compute functions (:mod:`hybridrl.mcore.compute`) read from a model chunk's output
on the last pipeline stage, as per-response tensors ``(mb, r)``: log-probs and entropy of the responses from
vocab-parallel logits (:class:`LogProbHead`) and critic values (:class:`ValuesHead`). The output of response token
``t`` is read where it is predicted (``micro_batch["response_positions"]``, see ``compute.prepare_batch``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
from megatron.core import parallel_state as mpu

from hybridrl.mcore import response_logits, vocab_parallel
from hybridrl.mcore.gpt import vocab_size_of


def gather_response(output: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of ``output`` ``(mb, s, *rest)`` at ``positions`` ``(mb, r)``: ``(mb, r, *rest)``."""
    mb, r = positions.shape
    rest = output.shape[2:]
    index = positions.reshape(mb, r, *([1] * len(rest))).expand(mb, r, *rest)
    return output.gather(1, index)


def _at_responses(output: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``output`` at the response positions ``(mb, r, *rest)``: as is when the pass ran the output layer there only
    (:mod:`hybridrl.mcore.response_logits`), else gathered from the full ``(mb, s, *rest)``."""
    if micro_batch.get(response_logits.KEY):
        return output
    return gather_response(output, micro_batch["response_positions"])


class TokenHead(Protocol):
    """Turns a model chunk's output on the last stage into per-response-token tensors ``(mb, r)``.

    A head that needs facts of the model (the vocabulary) may define ``bind(chunks) -> head``: the forward
    functions call it before the first micro-batch. A head that reads the output at the response positions only
    may set ``reads_responses_only = True``: the output layer then runs there only, and the head gets
    ``(mb, r, ...)`` with ``micro_batch[response_logits.KEY]`` set (:mod:`hybridrl.mcore.response_logits`).
    """

    keys: tuple[str, ...]

    def __call__(self, output: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class LogProbHead:
    """Log-probs of ``responses`` (and the entropy) from vocab-parallel logits ``(mb, s, V/tp)``."""

    temperature: float = 1.0
    """Logits are divided by it (the rollout's sampling temperature for PPO ratios; 1.0: the model's own)."""
    with_entropy: bool = False
    """Also return the entropy of the (tempered) softmax."""
    vocab_size: int | None = None
    """The true vocabulary: logits past it are the model's padding rows and stay out of the softmax. None: the
    model's own, filled in by :meth:`bind` (which the forward functions call) from the chunks' builder."""

    reads_responses_only = True  # not a field: the output layer may run on the response positions only

    @property
    def keys(self) -> tuple[str, ...]:
        return ("log_probs", "entropy") if self.with_entropy else ("log_probs",)

    def bind(self, chunks: list[torch.nn.Module]) -> LogProbHead:
        """This head with ``vocab_size`` from the model (:func:`hybridrl.mcore.gpt.vocab_size_of`).

        Raises:
            ValueError: an explicit ``vocab_size`` differs from the model's, or neither is known.
        """
        model = vocab_size_of(chunks, required=self.vocab_size is None)
        if self.vocab_size is None:
            return dataclasses.replace(self, vocab_size=model)
        if model is not None and model != self.vocab_size:
            raise ValueError(
                f"LogProbHead.vocab_size ({self.vocab_size}) differs from the model's vocabulary ({model}); "
                "leave it unset (None) to use the model's"
            )
        return self

    def __call__(self, output: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.vocab_size is None:
            raise ValueError(
                "LogProbHead.vocab_size is None: call head.bind(chunks) (compute.forward_outputs / forward_backward "
                "do) or pass the tokenizer's vocabulary, or the model's padding rows enter the softmax"
            )
        logits = _at_responses(output, micro_batch)
        group = mpu.get_tensor_model_parallel_group()
        # the model output is read here only: its backward may overwrite it with its gradient (one fewer rows x V)
        logp, ent = vocab_parallel.log_probs_and_entropy(
            logits, micro_batch["responses"], group, self.temperature, self.vocab_size, True, self.with_entropy
        )  # grad_into_logits, with_entropy
        return {"log_probs": logp, "entropy": ent} if self.with_entropy else {"log_probs": logp}


@dataclass(frozen=True)
class ValuesHead:
    """Critic values from a model whose output is ``(mb, s, 1)`` or ``(mb, s)``: ``values (mb, r)``.

    The value of response token ``t`` is read at the position that predicts it (``p + t - 1``), as the
    log-probs are. This reads the critic's output; the parameterised ``Linear(h, 1)`` that produces it is
    the critic model's own (``hybridrl.mcore.roles``).
    """

    keys: tuple[str, ...] = ("values",)
    reads_responses_only = True  # not a field: the output layer may run on the response positions only

    def __call__(self, output: torch.Tensor, micro_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if output.dim() == 3:
            if output.shape[-1] != 1:
                raise ValueError(f"ValuesHead expects a (mb, s, 1) critic output, got {tuple(output.shape)}")
            output = output.squeeze(-1)
        return {"values": _at_responses(output, micro_batch).float()}

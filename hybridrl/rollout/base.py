"""The rollout-engine interface and the engine-agnostic packing of generations into a DataProto.

This module owns :class:`RolloutEngine` (what the trainer and the hybrid engine call on any inference
engine) and the two conversions every engine shares: left-padded prompt tensors -> token-id lists
(:func:`unpad_prompts`) and token-id lists -> the rollout batch (:func:`pack_rollout`), laid out like
verl's: each prompt's ``n`` samples adjacent, prompts left-padded, responses right-padded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from hybridrl.protocol import DataProto

# DataProto keys the rollout writes; input fields with these names are replaced, not carried over.
ROLLOUT_KEYS = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rollout_log_probs",
)


# Tags of what an engine frees in sleep() and re-allocates in wake_up(tags=...), in this order on waking: the
# weights first (a push needs them), the KV cache last (it takes the memory training gave back).
WEIGHTS, KV_CACHE = "weights", "kv_cache"


class RolloutEngine(ABC):
    """An inference engine that generates from token ids and takes pushed weights.

    Implementations keep the engine in the current process; weights arrive from the trainer (never from
    disk): full HF-layout tensors through :meth:`update_weights`, or this rank's shards in the engine's own
    per-rank layout through :meth:`load_shards` (written straight into :meth:`writable_parameters`). The
    hybrid engine's :class:`~hybridrl.hybrid_engine.switch.RolloutSwitch` drives these, :meth:`sleep` and
    :meth:`wake_up` between the training and the generation phases; nothing else needs to know them.
    """

    sleep_mode: bool = False
    """:meth:`sleep` frees device memory (vLLM's sleep mode on GPU); False: it is bookkeeping only, and the
    switch leaves the engine awake between generations."""
    can_alias: bool = False
    """Parameters may become views of other tensors (``load_shards(alias=...)``, no copy): the engine reads
    them afresh at every forward (no captured graphs, no engine-owned weight memory)."""
    weights_lost: bool = False
    """``sleep(level=2)`` dropped the weights' contents: every parameter must be pushed before generating."""

    @abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load ``(name, full tensor)`` pairs through the engine's checkpoint loader (HF names or the
        engine's fused names); the loader cuts each rank's part itself.

        Returns:
            Metrics of the push, at least ``{"push_s": seconds, "tensors": count, "bytes": total}``.
        """

    @abstractmethod
    def load_shards(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], alias: Iterable[str] = ()
    ) -> dict[str, float]:
        """Write ``(engine parameter name, this rank's shard)`` pairs into the parameters, without the
        engine's loader; a tensor that already is a parameter's storage (from :meth:`writable_parameters`)
        is only counted.

        Args:
            named_tensors: engine names and per-rank tensors of the parameters' shapes; any subset (all of
                them after :attr:`weights_lost`).
            alias: names whose tensors may become the parameters' storage where :attr:`can_alias`; pass only
                tensors that outlive the engine's use of them (training parameters).

        Returns:
            Metrics of the push, at least ``{"push_s", "tensors", "bytes"}``.
        """

    @abstractmethod
    def writable_parameters(self) -> dict[str, torch.Tensor]:
        """Engine name -> this rank's parameter storage that a switch may write into in place (valid across
        the engine's graphs and sleep / wake); the weights must be awake."""

    @abstractmethod
    def generate(self, prompts: DataProto, **sampling_overrides: Any) -> DataProto:
        """Sample responses.

        Args:
            prompts: ``input_ids`` ``(b, p)`` left-padded and ``attention_mask`` ``(b, p)``; other fields
                are repeated along with the prompts.
            **sampling_overrides: per-call sampling settings (temperature, top_p, top_k, max_tokens, n,
                seed, stop, stop_token_ids, ...).

        Returns:
            ``b * n`` rows (see :func:`pack_rollout` for the fields).
        """

    @abstractmethod
    def prompt_log_probs(self, sequences: DataProto) -> torch.Tensor:
        """Teacher-forced ``log p(x_t | x_<t)`` of every token, ``(b, s)`` float32, 0 at each sequence's
        first token and at padding (for parity checks against the trainer)."""

    @abstractmethod
    def sleep(self, level: int = 1) -> None:
        """Free what generation holds until :meth:`wake_up`: the KV cache, and the weights (level 1: kept in
        host memory; level 2: dropped, so :attr:`weights_lost` until a full push)."""

    @abstractmethod
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Re-allocate what :meth:`sleep` freed: the parts named by ``tags`` (:data:`WEIGHTS`,
        :data:`KV_CACHE`; None = all); waking what is awake is a no-op."""


def unpad_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Token ids of each row where ``attention_mask`` is 1 (left, right or no padding).

    Args:
        input_ids: ``(b, p)`` token ids.
        attention_mask: ``(b, p)`` 1 for tokens, 0 for padding.
    """
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"prompts input_ids {list(input_ids.shape)} and attention_mask {list(attention_mask.shape)} "
            "differ in shape; give one mask entry per token"
        )
    ids, mask = input_ids.cpu(), attention_mask.cpu().bool()
    rows = [ids[i][mask[i]].tolist() for i in range(ids.shape[0])]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise ValueError(f"prompt row {empty[0]} has no tokens (attention_mask all 0); drop empty prompts")
    return rows


def pack_rollout(
    prompts: DataProto,
    n: int,
    responses: Sequence[Sequence[int]],
    log_probs: Sequence[Sequence[float]],
    finish_reasons: Sequence[str],
    response_length: int,
    pad_token_id: int,
    response_masks: Sequence[Sequence[int]] | None = None,
) -> DataProto:
    """The rollout batch: ``prompts`` repeated ``n`` times (interleaved) with the responses appended.

    Args:
        prompts: ``b`` rows with ``input_ids`` / ``attention_mask`` ``(b, p)``, left-padded.
        n: samples per prompt; ``responses[i * n + j]`` is sample ``j`` of prompt ``i``.
        responses: ``b * n`` token-id lists, each at most ``response_length`` long.
        log_probs: the engine's log-prob of each response token, same lengths as ``responses``.
        finish_reasons: ``b * n`` strings ("stop", "length", ...).
        response_length: width ``r`` of the response tensors (right-padded to it).
        pad_token_id: id written into response padding.
        response_masks: per row, 1 on the tokens the policy generated and 0 on tokens it did not (a multi-turn
            trajectory's observations, whose log-probs are 0); None = every response token is the policy's.

    Returns:
        Tensors ``prompts`` ``(B, p)``, ``responses`` ``(B, r)``, ``input_ids`` ``(B, p + r)``,
        ``attention_mask`` ``(B, p + r)`` (1 on every response token), ``position_ids`` ``(B, p + r)``
        (cumsum(mask) - 1, clipped at 0), ``response_mask`` ``(B, r)`` (``response_masks``),
        ``rollout_log_probs`` ``(B, r)`` float32 (0 on padding), and non-tensor ``finish_reasons``; ``B = b * n``.
        Other fields of ``prompts`` are repeated alongside.
    """
    total = len(prompts) * n
    if not len(responses) == len(log_probs) == len(finish_reasons) == total:
        raise ValueError(
            f"pack_rollout: {len(responses)} responses, {len(log_probs)} log-prob rows and "
            f"{len(finish_reasons)} finish reasons for {len(prompts)} prompts x n ({n}) = {total} rows"
        )
    prompt_ids = prompts.batch["input_ids"].repeat_interleave(n, dim=0)
    prompt_mask = prompts.batch["attention_mask"].repeat_interleave(n, dim=0).to(torch.int64)
    resp = torch.full((total, response_length), pad_token_id, dtype=prompt_ids.dtype)
    resp_mask = torch.zeros((total, response_length), dtype=torch.int64)
    resp_attn = torch.zeros((total, response_length), dtype=torch.int64)
    resp_lp = torch.zeros((total, response_length), dtype=torch.float32)
    for i, (tokens, lps) in enumerate(zip(responses, log_probs, strict=True)):
        k = len(tokens)
        masks = None if response_masks is None else list(response_masks[i])
        if k > response_length or len(lps) != k or (masks is not None and len(masks) != k):
            raise ValueError(
                f"response row {i} has {k} tokens, {len(lps)} log-probs and {k if masks is None else len(masks)} "
                f"mask entries; all must be equal and <= response_length ({response_length})"
            )
        resp[i, :k] = torch.as_tensor(list(tokens), dtype=prompt_ids.dtype)
        resp_attn[i, :k] = 1
        resp_mask[i, :k] = 1 if masks is None else torch.as_tensor(masks, dtype=torch.int64)
        resp_lp[i, :k] = torch.as_tensor(list(lps), dtype=torch.float32)
    # rows are filled on the host (one device copy per tensor, not per row), then join the prompts' device
    resp, resp_mask, resp_attn, resp_lp = (t.to(prompt_ids.device) for t in (resp, resp_mask, resp_attn, resp_lp))
    attention_mask = torch.cat([prompt_mask, resp_attn], dim=1)
    rest = prompts.select([k for k in prompts.batch if k not in ROLLOUT_KEYS]).repeat(n, interleave=True)
    reasons = np.empty(total, dtype=object)
    reasons[:] = list(finish_reasons)
    return DataProto(
        {
            **rest.batch,
            "prompts": prompt_ids,
            "responses": resp,
            "input_ids": torch.cat([prompt_ids, resp], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": resp_mask,
            "rollout_log_probs": resp_lp,
        },
        {**rest.non_tensor_batch, "finish_reasons": reasons},
        prompts.meta_info,
    )

"""RewardManager: scores a batch of responses with rule-based / custom scorers, safely.

This module owns calling scorers and turning their results into rewards. Each sample is scored by a
:data:`~hybridrl.rewards.registry.ScoreFn`; a scorer that raises, returns something that is not a finite
number (NaN, inf, or past float32's range), or runs past ``timeout_s`` gives reward 0 and is counted
(``reward/errors``, ``reward/timeouts``) and logged, never a crash. A scorer that calls ``os._exit`` (or
``sys.exit``) while it runs is one of these errors too: during a call, ``os._exit`` raises in the scorer's
thread instead of ending the rank, and the warning names the scorer (a crash inside C code still ends the
process). The sequence score goes on the last valid response token: token-level scores
``(batch, response_len)``. A scorer the config names but that cannot be loaded, or that does not take
``(data_source, solution_str, ground_truth, extra_info)``, is a :class:`ScorerError` before training starts.

The calls run on a few reused threads with a timeout each (:mod:`hybridrl.rewards.pool`: how timeouts work
without signals, and what a call that never returns costs); ``timeout_s=None`` runs scorers inline (errors still
caught, no timeouts). :mod:`hybridrl.rewards.stream` scores the same way while responses are still generated:
each row settles with :func:`settle` and a batch's rows are summed up by :meth:`RewardManager.summarize`.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from hybridrl.errors import InputError
from hybridrl.protocol import DataProto
from hybridrl.rewards.pool import (  # noqa: F401  (re-exported: the rest of hybridrl imports them from here)
    ERROR,
    OK,
    TIMEOUT,
    ScorerExited,
    _guarded_exit,
    _real_exit,
    guard_exit,
    run_with_timeouts,
)
from hybridrl.rewards.registry import (
    ScoreFn,
    compares_ground_truth,
    default_compute_score,
    fixed_scorer,
    get_scorer,
    load_custom_scorer,
)

logger = logging.getLogger(__name__)

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class ScorerError(InputError, ValueError):
    """The configured scorer cannot be loaded or called; the message names reward.* and the fix."""


def _as_score(value: Any) -> float:
    """A scorer's result as a finite float32 value (dicts give their "score"); raises ValueError otherwise."""
    if isinstance(value, dict):
        value = value.get("score")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real):  # also numpy scalars and bools
        number = float(value)
        if math.isfinite(number) and abs(number) <= FLOAT32_MAX:
            return number
        if math.isfinite(number):
            raise ValueError(f"scorer returned {value!r}, beyond float32's range (+-{FLOAT32_MAX:.3g}); scale it")
    raise ValueError(f"scorer returned {value!r}; it must return a finite number (or a dict with 'score')")


def last_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence score on its last valid response token.

    Args:
        scores: ``(batch,)`` sequence-level scores.
        response_mask: ``(batch, response_len)``, 1 on response tokens (a row of zeros gets no reward).

    Returns:
        ``(batch, response_len)`` float32, zero except at each row's last valid token.
    """
    mask = response_mask.bool()
    b, r = mask.shape
    last = r - 1 - mask.flip(-1).int().argmax(-1)
    out = torch.zeros(b, r, dtype=torch.float32, device=response_mask.device)
    rows = mask.any(-1).nonzero().squeeze(-1)
    out[rows, last[rows]] = scores.to(out)[rows]
    return out


@dataclass
class RewardResult:
    """Rewards of one batch."""

    scores: torch.Tensor
    """``(batch,)`` float32 sequence-level scores (0 where the scorer failed or timed out)."""
    token_level_scores: torch.Tensor | None
    """``(batch, response_len)`` float32, the score on the last valid response token; None without a mask."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``reward/errors``, ``reward/timeouts`` (counts in this batch), ``reward/score_mean``."""
    failures: list[tuple[int, str, str]] = field(default_factory=list)
    """``(row, status, message)`` of each failed sample."""


class RewardManager:
    """Scores batches with one :data:`ScoreFn`, guarding each call.

    Args:
        score_fn: ``fn(data_source, solution_str, ground_truth, extra_info)``; default: the registry by
            each sample's data_source.
        timeout_s: seconds one call may take (None = inline, no timeouts).
        max_workers: scorer calls in flight at once.

    Attributes:
        totals: running counts over all batches: ``samples``, ``errors``, ``timeouts``.
    """

    def __init__(self, score_fn: ScoreFn | None = None, timeout_s: float | None = 30.0, max_workers: int = 8):
        self.score_fn = score_fn or default_compute_score
        self.timeout_s, self.max_workers = timeout_s, max_workers
        self.totals = {"samples": 0, "errors": 0, "timeouts": 0}
        self.fixed_scorer_name: str | None = None
        """The registered scorer that scores every row (``reward.scorer`` set to a name), else None."""
        self.scorer_name = getattr(self.score_fn, "__qualname__", repr(self.score_fn))
        """How the warnings name the scorer (from_config: the reward.* keys that chose it)."""
        self.config: Any = None
        """The ``reward`` section :meth:`from_config` built this manager from (None: built by hand); another
        process (a Ray host) rebuilds the same manager from it."""

    @classmethod
    def from_config(cls, cfg: Any, max_workers: int = 8) -> RewardManager | None:
        """From a :class:`~hybridrl.config.schema.RewardConfig`; None when ``reward.scorer`` is None.

        ``scorer="auto"``: the custom function when ``custom.path`` is set, else the registry by data_source;
        a scorer name: that scorer for every sample.

        Raises:
            ScorerError: the custom file is missing, fails to import, lacks the function, or the function does
                not take ``(data_source, solution_str, ground_truth, extra_info)``; an unknown scorer name.
        """
        if cfg.scorer is None:
            return None
        if cfg.scorer != "auto" and cfg.custom.path:
            raise ScorerError(
                f"reward.scorer ({cfg.scorer!r}) and reward.custom.path ({cfg.custom.path!r}) are both set; "
                "set reward.scorer=auto to use the custom function, or unset custom.path"
            )
        guard_exit()  # before the custom file runs: its `from os import _exit` binds the guarded one
        try:
            if cfg.scorer != "auto":
                fn, name = fixed_scorer(cfg.scorer), f"reward.scorer {cfg.scorer!r}"
            elif cfg.custom.path:
                fn = load_custom_scorer(cfg.custom.path, cfg.custom.name)
                name = f"reward.custom {cfg.custom.name!r} of {cfg.custom.path!r}"
            else:
                fn, name = default_compute_score, "the scorer registered for each data_source"
        except (ValueError, OSError) as err:  # the registry's messages name the key and the fix
            raise ScorerError(str(err)) from err
        _check_signature(fn, name)
        manager = cls(fn, timeout_s=cfg.timeout_s, max_workers=max_workers)
        manager.scorer_name, manager.config = name, cfg
        if cfg.scorer != "auto":  # one scorer for every row
            manager.fixed_scorer_name = cfg.scorer
        return manager

    def check_data_sources(
        self, data_sources: Iterable[str], without_ground_truth: Mapping[str, tuple[int, str]] | None = None
    ) -> None:
        """Before training: every data_source has a registered scorer (only for the registry dispatch), and a
        built-in scorer gets a ground truth in every row it scores.

        Args:
            data_sources: the data's ``data_source`` values.
            without_ground_truth: data_source -> (rows, first row's ``"<file>: row <r> (reward_model keys
                [...])"``) of the rows whose ``reward_model.ground_truth`` is missing or null
                (:attr:`RLHFDataset.without_ground_truth`).

        Raises:
            DataError: the first data_source without a scorer (the message lists the known ones), or a row
                without a ground truth that a built-in scorer would score 0 whatever the response.
        """
        from hybridrl.data.files import DataError

        if self.score_fn is default_compute_score:
            for source in data_sources:
                try:
                    get_scorer(source)
                except ValueError as err:
                    raise DataError(str(err)) from None
        for source, (count, first) in (without_ground_truth or {}).items():
            name = self.fixed_scorer_name or (source if self.score_fn is default_compute_score else None)
            if name is not None and compares_ground_truth(name):
                more = f" and {count - 1} more rows" if count > 1 else ""
                raise DataError(
                    f"{first}{more}: reward_model.ground_truth is missing or null, so the built-in scorer {name!r} "
                    "would give 0 to every response; add it to each row, or score with reward.custom.path (or a "
                    "reward model with reward.scorer=null)"
                )

    def __call__(
        self,
        data: DataProto,
        responses_text: Sequence[str],
        response_mask: torch.Tensor | None = None,
    ) -> RewardResult:
        """Score each row of ``data`` (non-tensors ``data_source``, ``ground_truth``, optional ``extra_info``).

        Args:
            data: the batch, ``batch`` rows.
            responses_text: the decoded response of each row.
            response_mask: ``(batch, response_len)``; default ``data.batch["response_mask"]``, else
                ``attention_mask[:, -responses.shape[1]:]``, else no token-level scores.
        """
        n = len(data)
        if len(responses_text) != n:
            raise ValueError(f"score_batch: {len(responses_text)} responses for a batch of {n} rows; pass one per row")
        nt = check_inputs(data.non_tensor_batch)
        calls = [self.row_call(nt, i, responses_text[i]) for i in range(n)]
        rows = [settle(o, self.timeout_s) for o in run_with_timeouts(calls, self.timeout_s, self.max_workers)]
        return self.summarize(data, rows, response_mask)

    def row_call(self, nt: Mapping[str, Any], row: int, text: str) -> Callable[[], Any]:
        """The call that scores row ``row`` of the non-tensors ``nt`` (:func:`check_inputs`) with response ``text``."""
        extra = nt["extra_info"][row] if "extra_info" in nt else None
        return partial(self.score_fn, nt["data_source"][row], text, nt["ground_truth"][row], extra)

    def summarize(
        self, data: DataProto, rows: Sequence[tuple[float, str, str]], response_mask: torch.Tensor | None = None
    ) -> RewardResult:
        """The batch's result from each row's :func:`settle`: scores, metrics, one warning, running totals.

        Args:
            data: the batch the rows belong to (``data_source`` names a failure's row in the warning).
            rows: ``(score, status, message)`` per row of ``data``.
            response_mask: see :meth:`__call__`.
        """
        n, nt = len(data), data.non_tensor_batch
        scores = torch.tensor([score for score, _, _ in rows], dtype=torch.float32)
        failures = [(i, status, message) for i, (_, status, message) in enumerate(rows) if status != OK]
        errors = sum(s == ERROR for _, s, _ in failures)
        timeouts = len(failures) - errors
        if failures and _rank() == 0:  # every rank scores the same batch: one warning per job
            row, _, message = failures[0]
            logger.warning(
                "reward: %d errors, %d timeouts in %d samples (each scores 0); first: row %d (data_source %r, "
                "scorer %s) %s", errors, timeouts, n, row, nt["data_source"][row], self.scorer_name, message,
            )  # fmt: skip
        self.totals["samples"] += n
        self.totals["errors"] += errors
        self.totals["timeouts"] += timeouts
        metrics = {
            "reward/errors": float(errors),
            "reward/timeouts": float(timeouts),
            "reward/score_mean": float(scores.mean()) if n else 0.0,
        }
        mask = _response_mask(data, response_mask)
        token_level = last_token_rewards(scores, mask) if mask is not None else None
        return RewardResult(scores, token_level, metrics, failures)


def check_inputs(nt: Mapping[str, Any]) -> Mapping[str, Any]:
    """``nt`` (a batch's non-tensors) if it holds what a scorer is called with, else a KeyError naming the key."""
    for key in ("data_source", "ground_truth"):
        if key not in nt:
            raise KeyError(f"score_batch: the batch has no non-tensor {key!r}; batches from RLHFDataset have it")
    return nt


def settle(outcome: tuple[str, Any], timeout_s: float | None) -> tuple[float, str, str]:
    """One call's ``(status, value)`` (:func:`~hybridrl.rewards.pool.run_with_timeouts`) as ``(score, status,
    message)``: the finite float32 score, or 0 with "error" (also a result that is not a finite number) or
    "timeout" and a one-line message; the message is "" when the call succeeded."""
    status, value = outcome
    if status == OK:
        try:
            return _as_score(value), OK, ""
        except ValueError as err:
            status, value = ERROR, err
    message = f"{type(value).__name__}: {value}" if status == ERROR else f"ran past {timeout_s}s"
    return 0.0, status, message


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _check_signature(fn: Callable[..., Any], name: str) -> None:
    """``fn`` can be called as ``fn(data_source, solution_str, ground_truth, extra_info)``, else a ScorerError
    (a scorer that takes two arguments would fail on every sample, scoring 0 all run)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check
        return
    try:
        signature.bind("data_source", "solution_str", "ground_truth", None)
    except TypeError:
        raise ScorerError(
            f"{name} has the signature {signature}; a scorer is called as fn(data_source, solution_str, "
            "ground_truth, extra_info): add the missing parameters (extra_info=None)"
        ) from None


def _response_mask(data: DataProto, response_mask: torch.Tensor | None) -> torch.Tensor | None:
    if response_mask is not None:
        return response_mask
    if "response_mask" in data.batch:
        return data.batch["response_mask"]
    if "responses" in data.batch and "attention_mask" in data.batch:
        return data.batch["attention_mask"][:, -data.batch["responses"].shape[1] :]
    return None


def score_batch(
    data: DataProto,
    responses_text: Sequence[str],
    timeout_s: float | None = 30.0,
    score_fn: ScoreFn | None = None,
    response_mask: torch.Tensor | None = None,
    max_workers: int = 8,
) -> RewardResult:
    """One-shot :class:`RewardManager` call (see there)."""
    return RewardManager(score_fn, timeout_s, max_workers)(data, responses_text, response_mask)

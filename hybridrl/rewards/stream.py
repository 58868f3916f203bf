"""Rewards computed while the batch still generates (``reward.overlap_generation``): :class:`RewardStream`.

Scoring a batch after generation waits for the slowest response first, then for every score; with a slow scorer
(a sandbox running code, a remote judge) the reward stage is pure waiting. Here each response vLLM finishes goes
to the :class:`~hybridrl.rewards.manager.RewardManager`'s scorer at once, on its threads
(:class:`~hybridrl.rewards.pool.ScorerPool`: the same timeouts, errors and exit guard as a batch), while the rest
of the batch keeps generating (:func:`hybridrl.rollout.streaming.generate_streaming`); after generation only the
scores still running are waited for, and that wait overlaps the switch back to the training layout.

The data flow follows generation's. The trainer opens a :class:`StreamSession` per rollout and passes it to the
actor's ``generate_sequences``; each rollout replica's ranks score the responses they generated (their share of
the prompts, split as ``generate_sequences`` splits them), and the actor's ``streamed_rewards`` (the same split)
gathers every replica's scores, so that every rank ends with the whole batch's, as when each rank scores it all.
The rows are then summed up as a batch is (:meth:`~hybridrl.rewards.manager.RewardManager.summarize`): the same
scores, ``reward/errors`` / ``reward/timeouts``, warning and running totals. A response's text is decoded from
exactly the tokens the batch holds, so the scores are the batch path's. Extra metric:
``perf/reward_scored_during_generation``, the fraction of responses whose score was done before generation ended.

Under Ray (``trainer.launcher=ray``) the session travels to each host actor with the ``generate_sequences`` call:
it pickles as plain data (the stream's key, the manager's class by name, the reward config and the manager's
settings), never as the scorer itself or the tokenizer (the host decodes with its worker's, a copy of the
driver's). The host rebuilds the manager in :meth:`StreamSession.open`, inside that call, once per run (a custom
scorer's file is loaded again there, as the driver loaded it): a scorer that cannot load on a host stops the run
with a one-line :class:`~hybridrl.rewards.manager.ScorerError` on the driver. Only the first rank of each rollout
replica scores (:meth:`StreamSession.scores_on`: the rank whose output the driver keeps; its TP peers generate
the same responses). The host's worker keeps the session it opened for ``streamed_rewards``. A manager built by
hand (not by ``RewardManager.from_config``) cannot be rebuilt there: under Ray it scores after generation, on the
driver (``reward.overlap_generation=true`` with one is an error).

Applies to rule-based and custom scorers called row by row (:func:`~hybridrl.config.checks_overlap.overlap_enabled`);
a reward model, or a ``RewardManager`` subclass with its own ``__call__`` (it may need the whole batch), keeps
scoring after generation.
"""

from __future__ import annotations

import functools
import importlib
import time
import uuid
from typing import Any

import numpy as np
import torch

from hybridrl.protocol import DataProto
from hybridrl.rewards.manager import ERROR, OK, TIMEOUT, RewardManager, RewardResult, ScorerError, check_inputs, settle
from hybridrl.rewards.pool import ScorerPool

_STATUS = (OK, ERROR, TIMEOUT)
KEYS = ("stream_score", "stream_status", "stream_early", "stream_length")
"""The tensors :meth:`StreamSession.collect` returns per row (and the non-tensor ``stream_message``)."""


class RewardStream:
    """The run's streaming scorer: opens one :class:`StreamSession` per rollout.

    Args:
        manager: the run's reward manager (its scorer, ``timeout_s``, ``max_workers``, totals).
        tokenizer: decodes responses as the trainer does (``tokenizer.decode(token_ids)``); None: the one given to
            :meth:`StreamSession.open` (a Ray host's copy decodes with its worker's).
    """

    def __init__(self, manager: RewardManager | None, tokenizer: Any) -> None:
        self.manager, self.tokenizer = manager, tokenizer
        self.key = uuid.uuid4().hex  # a host rebuilds each run's manager once
        self.spec: tuple[str, Any, float | None, int] | None = None
        """In a copy sent to another process: the manager's class (``module:qualname``), reward config,
        ``timeout_s`` and ``max_workers``, which :meth:`built` rebuilds it from; None: this process's own stream."""

    def __getstate__(self) -> dict[str, Any]:
        # plain data: the copy rebuilds its manager in built() (inside the call), never while it is unpickled
        m = self.manager
        if self.spec is not None:  # a copy sent on
            return {**self.__dict__, "manager": None}
        if m is None or m.config is None:
            raise TypeError("a RewardStream over a RewardManager built by hand cannot be sent to another process; "
                            "build the manager with RewardManager.from_config")  # fmt: skip
        cls = type(m)
        spec = (f"{cls.__module__}:{cls.__qualname__}", m.config, m.timeout_s, m.max_workers)
        return {"manager": None, "tokenizer": None, "key": self.key, "spec": spec}

    def built(self) -> RewardManager:
        """This process's manager: the stream's own, or in a copy (a Ray host's) the one rebuilt from :attr:`spec`
        as the driver built its own (once per run and process), with the driver's current ``timeout_s``.

        Raises:
            ScorerError: the manager cannot be rebuilt here (its class or the custom scorer file fails to load).
        """
        if self.manager is None:
            assert self.spec is not None, "RewardStream: no manager and nothing to rebuild it from"
            self.manager = _host_manager(self.key, *self.spec)
        return self.manager

    @classmethod
    def from_config(cls, cfg: Any, manager: Any, tokenizer: Any) -> RewardStream | None:
        """The stream of a run config (:func:`~hybridrl.config.checks_overlap.overlap_enabled`), or None: no
        rule-based manager, one whose ``__call__`` is its own (it scores whole batches), or, under Ray, one built
        by hand (not from a config the hosts can rebuild it from; ``reward.overlap_generation=true`` then raises
        a :class:`~hybridrl.config.ConfigError`)."""
        from hybridrl.config.checks_overlap import overlap_enabled
        from hybridrl.config.schema import ConfigError

        if manager is None or type(manager).__call__ is not RewardManager.__call__ or not overlap_enabled(cfg):
            return None
        if cfg.trainer.launcher == "ray" and manager.config is None:
            if cfg.reward.overlap_generation:
                raise ConfigError(
                    "reward.overlap_generation (true): under trainer.launcher=ray the rollout hosts rebuild the reward "
                    "manager from the config, but this one was built by hand; build it with RewardManager.from_config, "
                    "or set reward.overlap_generation to null or false (score on the driver)",
                    key="reward.overlap_generation",
                )
            return None
        return cls(manager, tokenizer)

    def session(self, prompts: DataProto) -> StreamSession:
        """A session for one rollout of ``prompts`` (the batch the trainer passes to ``generate_sequences``)."""
        check_inputs(prompts.non_tensor_batch)
        return StreamSession(self, prompts)


class StreamSession:
    """One rollout's scores: this rank's side (:meth:`open`, the engine's ``on_step``, :meth:`collect`) and the
    trainer's (:meth:`result`)."""

    def __init__(self, stream: RewardStream, prompts: DataProto) -> None:
        self.stream, self.prompts = stream, prompts
        self.pool: ScorerPool | None = None
        self.non_tensors: dict[str, Any] = {}
        self.n = self.rows = 0
        self.lengths: dict[int, int] = {}
        self.generation_end = 0.0
        self.decode: Any = None

    def __getstate__(self) -> dict[str, Any]:
        # sent to a Ray host before open(): the prompts are the driver's (the host gets its share as the call's data)
        return {**self.__dict__, "prompts": None, "pool": None, "decode": None}

    # ---- on the rank that generates ----------------------------------------------------------------------

    def scores_on(self, rollout_tp_rank: int) -> bool:
        """Whether the rank of rollout TP rank ``rollout_tp_rank`` opens this session. In the trainer's process
        (SPMD) every rank does: each gathers the batch's scores over its replica group. A copy (a Ray host's) opens
        only on a replica's first rank, the one whose output the driver keeps
        (:class:`~hybridrl.workers.ray_group.RayWorkerGroup`): its TP peers generate the same responses."""
        return self.stream.spec is None or rollout_tp_rank == 0

    def open(self, prompts: DataProto, n: int, tokenizer: Any = None) -> StreamSession:
        """Start scoring this rank's share ``prompts`` (``b`` rows, ``n`` samples each); returns the engine's
        ``on_step`` callback (this session). ``tokenizer``: decodes where the stream has none (a Ray host's copy).

        Raises:
            ScorerError: a copy's manager cannot be rebuilt here (:meth:`RewardStream.built`).
        """
        m = self.stream.built()
        tokenizer = self.stream.tokenizer if self.stream.tokenizer is not None else tokenizer
        if tokenizer is None:
            raise ValueError("reward stream: no tokenizer to decode responses; pass the worker's to open()")
        self.decode = tokenizer.decode
        self.pool = ScorerPool(m.timeout_s, m.max_workers)
        self.non_tensors, self.n, self.rows = check_inputs(prompts.non_tensor_batch), n, len(prompts) * n
        self.lengths = {}
        return self

    def __call__(self, finished: list[tuple[int, list[int]]]) -> None:
        """The engine's ``on_step``: queue the scoring of the responses one step finished."""
        assert self.pool is not None, "StreamSession: open() before generating"
        m, decode = self.stream.manager, self.decode
        for row, tokens in finished:
            self.lengths[row] = len(tokens)
            self.pool.submit(row, m.row_call(self.non_tensors, row // self.n, decode(tokens)))
        self.pool.poll()
        self.generation_end = time.monotonic()  # the last call follows the last step

    def collect(self) -> DataProto:
        """Wait for this rank's scores; per row (``b * n``, as generated): ``stream_score`` float32,
        ``stream_status`` (index into ok/error/timeout), ``stream_early`` (1: done before generation ended),
        ``stream_length`` (response tokens) and the non-tensor ``stream_message`` ("" when ok)."""
        assert self.pool is not None, "StreamSession: open() before collect()"
        if sorted(self.lengths) != list(range(self.rows)):
            raise RuntimeError(f"reward stream: {len(self.lengths)} of {self.rows} responses reached the scorer")
        outcomes, at = self.pool.wait(), self.pool.settled_at
        rows = [settle(outcomes[r], self.stream.manager.timeout_s) for r in range(self.rows)]
        messages = np.empty(self.rows, dtype=object)
        messages[:] = [message for _, _, message in rows]
        tensors = {
            "stream_score": torch.tensor([score for score, _, _ in rows], dtype=torch.float32),
            "stream_status": torch.tensor([_STATUS.index(status) for _, status, _ in rows], dtype=torch.int64),
            "stream_early": torch.tensor([at[r] <= self.generation_end for r in range(self.rows)], dtype=torch.int64),
            "stream_length": torch.tensor([self.lengths[r] for r in range(self.rows)], dtype=torch.int64),
        }
        self.pool = None
        return DataProto.from_dict(tensors, {"stream_message": messages})

    # ---- on every rank, after generation -----------------------------------------------------------------

    def result(self, actor: Any, batch: DataProto, response_mask: torch.Tensor) -> RewardResult:
        """The batch's :class:`~hybridrl.rewards.manager.RewardResult`: every replica's scores, gathered by the
        actor group's ``streamed_rewards`` (blocks until the last scores are done).

        Args:
            actor: the actor's worker group (the one that ran ``generate_sequences``).
            batch: the rollout batch ``generate_sequences`` returned for :attr:`prompts`.
            response_mask: ``(B, r)``.
        """
        # the split over replicas depends on the row count alone: row indices stand in for the prompts, which
        # generate_sequences already sent (under Ray they would travel again)
        got = actor.streamed_rewards(DataProto.from_dict({"row": torch.arange(len(self.prompts))}), self)
        written = batch.batch["attention_mask"][:, -batch.batch["responses"].shape[1] :].sum(-1)
        if len(got) != len(batch):
            raise RuntimeError(f"reward stream: {len(got)} scored rows for the batch's {len(batch)} responses")
        lengths = got.batch["stream_length"].cpu()
        if not torch.equal(lengths, written.cpu()):
            row = int((lengths != written.cpu()).nonzero()[0])
            raise RuntimeError(f"reward stream: row {row} was scored at {int(lengths[row])} response tokens but the "
                               f"batch holds {int(written[row])}")  # fmt: skip
        b = got.batch
        rows = [
            (float(s), _STATUS[int(k)], str(msg))
            for s, k, msg in zip(
                b["stream_score"], b["stream_status"], got.non_tensor_batch["stream_message"], strict=True
            )
        ]
        result = self.stream.manager.summarize(batch, rows, response_mask)
        result.metrics["perf/reward_scored_during_generation"] = float(b["stream_early"].float().mean())
        return result


_ON_DRIVER = ("with trainer.launcher=ray and reward.overlap_generation on, the scorer runs on the hosts that generate; "
              "set reward.overlap_generation=false to score on the driver")  # fmt: skip
"""How a host's scorer error says where the scorer runs and the fix."""
_HOST_MANAGERS: dict[str, RewardManager] = {}
"""The managers this process rebuilt from a driver's stream (a Ray host's), by the driver stream's key."""


def _host_manager(key: str, cls_name: str, reward_cfg: Any, timeout_s: float | None, max_workers: int) -> RewardManager:
    """A driver's manager in this process: built from ``reward_cfg`` by its class ``cls_name`` (``module:qualname``)
    as the driver built its own (``from_config``) on first use, with the driver's current ``timeout_s``."""
    manager = _HOST_MANAGERS.get(key)
    if manager is None:
        module, _, qualname = cls_name.partition(":")
        try:
            cls = functools.reduce(getattr, qualname.split("."), importlib.import_module(module))
        except (ImportError, AttributeError) as err:
            raise ScorerError(f"reward manager class {cls_name} cannot be imported on this rollout host ({err}); "
                              f"{_ON_DRIVER}") from None  # fmt: skip
        try:
            manager = cls.from_config(reward_cfg, max_workers=max_workers)
        except ScorerError as err:
            raise ScorerError(f"on a rollout host: {err}; {_ON_DRIVER}") from None
        _HOST_MANAGERS[key] = manager
    manager.timeout_s = timeout_s
    return manager

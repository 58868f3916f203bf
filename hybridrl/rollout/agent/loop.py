"""The agent loop: many multi-turn trajectories in flight on one vLLM engine, token-in-token-out.

:meth:`AgentLoop.generate` takes the same prompts and sampling settings as
:meth:`~hybridrl.rollout.vllm_engine.VLLMRolloutEngine.generate` and returns the same batch layout
(:func:`~hybridrl.rollout.base.pack_rollout`), where a response is a whole trajectory: the policy's turns (mask 1,
vLLM's log-probs) with the observations between them (mask 0). It drives vLLM request by request
(:class:`~hybridrl.rollout.vllm_requests.VLLMRequests`): every trajectory's first turn is queued, then each
engine step's finished turns go to a thread pool where the environment answers them
(:func:`~hybridrl.rollout.agent.episode.environment_turn`: tool calls, ``env.step``, observation tokens), and a
trajectory whose answer is back is queued again at once, with its prompt, its turns and the observation, while
the other trajectories keep generating. The loop blocks only when vLLM has nothing to run. ``turn_sync=True``
runs the same work the simple way (every turn waits for the slowest environment answer of that turn): the
baseline of ``bench/agent_loop.py``.
With ``on_step`` (``reward.overlap_generation``: :mod:`hybridrl.rewards.stream`) each trajectory is handed over
the iteration it ends, so that the rule-based scorer works on it while the others still generate or wait for tools.

The trained sequence is exactly what vLLM generated plus the observation tokens: nothing is re-tokenized.
Each turn of each trajectory samples with its own seed: turn 0 of trajectory ``k`` (``k = prompt * n + sample``)
with ``seed + k``, as single-turn generation does, later turns with a hash of (that seed, turn), so a resumed
run samples what the uninterrupted one did. Limits: ``rollout.agent.max_turns``, the response length as the
token budget of the whole trajectory (policy and observation tokens), ``max_tokens_per_turn``,
``tool_timeout_s``; every trajectory ends with one of :data:`~hybridrl.rollout.agent.episode.END_REASONS`.

At rollout TP > 1 the ranks of one engine must queue the same requests between the same steps: the engine's
first rank runs the environments and broadcasts, every iteration, what to queue and what ended (a gloo group
per engine); the other ranks apply it and take the final trajectory data from it, so all agree.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.protocol import DataProto
from hybridrl.rollout.agent.chat import as_messages
from hybridrl.rollout.agent.episode import BUDGET, COUNTS, DONE, END_ERROR, MAX_TURNS, Trajectory, environment_turn
from hybridrl.rollout.agent.interface import AgentError, Turn
from hybridrl.rollout.base import ROLLOUT_KEYS, pack_rollout, unpad_prompts
from hybridrl.rollout.streaming import Finished

logger = logging.getLogger(__name__)
_MASK62 = (1 << 62) - 1


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of a trajectory's ``turn``: its own seed at turn 0, a splitmix64 hash of (seed, turn) after."""
    if seed is None or turn == 0:
        return seed
    z = (seed * 0x9E3779B97F4A7C15 + turn * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK62


class AgentLoop:
    """Multi-turn generation on one :class:`~hybridrl.rollout.vllm_engine.VLLMRolloutEngine`.

    Args:
        engine: the rollout engine (its sampling defaults, end tokens and response width are used).
        spec: the checked environment (:func:`~hybridrl.rollout.agent.registry.load_agent`).
        chat: the tokenizer's :class:`~hybridrl.rollout.agent.chat.ChatFormat` with the environment's tools.
        cfg: the ``rollout.agent`` section.
        group: the gloo group of this engine's ranks at rollout TP > 1 (None: this rank is the engine).
        leader: the global rank that runs the environments (the engine's first rank).
        turn_sync: release the environment's answers only when the whole turn is done (the baseline).
    """

    def __init__(self, engine: Any, spec: Any, chat: Any, cfg: Any, group: Any = None, leader: int = 0,
                 turn_sync: bool = False) -> None:  # fmt: skip
        self.engine, self.spec, self.chat, self.cfg = engine, spec, chat, cfg
        self.tokenizer = chat.tokenizer
        self.group, self.leader, self.turn_sync = group, leader, turn_sync
        self.is_leader = group is None or dist.get_rank() == leader
        self.calls = 0
        self._pool: cf.ThreadPoolExecutor | None = None

    @classmethod
    def from_config(cls, cfg: Any, engine: Any, tokenizer: Any, layout: Any = None) -> AgentLoop | None:
        """The loop of a ``rollout.agent`` section on ``engine``; None for single-turn runs. Collective at rollout
        TP > 1 (every rank creates every engine's group, in order: ``layout.groups("rollout_tp")``).

        Raises:
            AgentError: see :func:`~hybridrl.rollout.agent.registry.load_agent` and ``check_chat``.
        """
        from hybridrl.rollout.agent.registry import check_chat, load_agent

        spec = load_agent(cfg)
        if spec is None:
            return None
        if tokenizer is None:
            raise AgentError(f"{spec.label}: multi-turn rollouts need the run's tokenizer (to read turns and render "
                             "observations); pass it to the actor-rollout worker")  # fmt: skip
        chat = check_chat(spec, tokenizer)
        tp, group, leader = engine.tensor_parallel_size, None, 0
        if tp > 1 and dist.is_initialized():
            if layout is None:
                raise ValueError(f"rollout TP {tp}: the agent loop needs the run's layout (its engines' ranks)")
            rank = dist.get_rank()
            for ranks in layout.groups("rollout_tp"):
                g = dist.new_group(ranks, backend="gloo")
                if rank in ranks:
                    group, leader = g, ranks[0]
        return cls(engine, spec, chat, cfg, group=group, leader=leader)

    # ---- prompts and seeds -----------------------------------------------------------------------------------
    def _prompt_rows(self, prompts: DataProto) -> list[list[int]]:
        """Prompt ids: the rows' messages rendered with the tools (``raw_prompt``), or the given ids."""
        raw = prompts.non_tensor_batch.get("raw_prompt")
        if self.chat.tools and raw is not None:
            rows = [self.chat.prompt_ids(as_messages(p)) for p in raw]
        else:
            rows = unpad_prompts(prompts.batch["input_ids"], prompts.batch["attention_mask"])
        width = prompts.batch["input_ids"].shape[1]
        longest = max(len(r) for r in rows)
        if longest > width:
            raise AgentError(
                f"a prompt rendered with the environment's tools has {longest} tokens > data.max_prompt_length "
                f"({width}); raise data.max_prompt_length (the tools' schemas are part of every prompt)"
            )
        return rows

    def _base_seed(self, seed: int | None) -> int | None:
        if seed is not None or self.engine.tensor_parallel_size == 1:
            return seed
        # the ranks of an engine all sample: unseeded requests would draw from each rank's own RNG
        return turn_seed((self.engine.seed << 24) + self.engine.replica, self.calls)

    # ---- the loop ----------------------------------------------------------------------------------------------
    def generate(self, prompts: DataProto, on_step: Callable[[Finished], None] | None = None,
                 **sampling: Any) -> DataProto:  # fmt: skip
        """Multi-turn trajectories for ``prompts``: ``n`` per prompt, adjacent; see the module docstring.

        ``on_step``: called after every iteration of the loop with the trajectories that ended in it (their row and
        final response tokens, as :func:`~hybridrl.rollout.streaming.generate_streaming` reports finished
        responses), on every rank of the engine; the last call comes when the last trajectory ended.

        Returns:
            The :func:`~hybridrl.rollout.base.pack_rollout` fields (``responses`` holds whole trajectories,
            ``response_mask`` 0 on observation tokens), ``finish_reasons`` ("length" where the budget ended it),
            and per row ``agent_turns``, ``agent_reward`` (the environment's, summed), the counts of
            :data:`~hybridrl.rollout.agent.episode.COUNTS` as ``agent_<count>`` and non-tensor
            ``agent_end_reasons``; ``meta_info["agent_timing"]`` holds this rank's loop timings.
        """
        from hybridrl.rollout.vllm_requests import VLLMRequests

        self.calls += 1
        settings = {**self.engine.sampling, **self.engine._check_sampling(sampling)}
        n = int(settings.pop("n", 1))
        if n > 1 and not settings.get("temperature"):
            raise ValueError(f"sampling n ({n}) > 1 needs temperature > 0 (greedy samples would be identical)")
        seed = self._base_seed(settings.pop("seed", None))
        budget = int(settings.pop("max_tokens"))
        rows = self._prompt_rows(prompts)
        extras = prompts.non_tensor_batch.get("extra_info", [None] * len(rows))
        trajs = [
            Trajectory(i * n + j, rows[i], dict(extras[i] or {}), None if seed is None else seed + i * n + j)
            for i in range(len(rows))
            for j in range(n)
        ]
        requests = VLLMRequests(self.engine)
        timing = self._run(trajs, requests, settings, budget, on_step)
        return self._pack(prompts, rows, n, trajs, budget, timing)

    def _run(self, trajs: list[Trajectory], requests: Any, settings: dict, budget: int,
             on_step: Callable[[Finished], None] | None) -> dict[str, float]:  # fmt: skip
        start, stats = time.perf_counter(), {"engine_s": 0.0, "wait_s": 0.0, "engine_steps": 0.0}
        jobs: dict[cf.Future, Trajectory] = {}
        ready: list[tuple] = []
        events: list[tuple] = [("gen", t.index, []) for t in trajs]  # every trajectory's first turn
        left = len(trajs)
        while left:
            if self.is_leader:
                ready += self._collect(jobs, budget, wait=False)
                while jobs and not requests.has_unfinished() and not self._releasable(ready, jobs, requests):
                    t0 = time.perf_counter()
                    ready += self._collect(jobs, budget, wait=True)
                    stats["wait_s"] += time.perf_counter() - t0
                if ready and self._releasable(ready, jobs, requests):
                    events, ready = events + ready, []
                if not (events or jobs or ready or requests.has_unfinished()):
                    raise RuntimeError(f"agent loop: {left} trajectories have no request and no environment turn")
            events = self._share(events)
            for event in events:
                left -= self._apply(event, trajs[event[1]], requests, settings, budget)
            if on_step is not None:  # ended trajectories are final: their scoring needs nothing else of the loop
                on_step([(e[1], list(trajs[e[1]].response)) for e in events if e[0] == "end"])
            events = []
            if not requests.has_unfinished():
                continue
            t0 = time.perf_counter()
            finished = requests.step()
            stats["engine_s"] += time.perf_counter() - t0
            stats["engine_steps"] += 1
            for fin in finished:
                traj = trajs[int(fin.request_id.split("-")[1])]
                traj.add(fin.token_ids, fin.log_probs)
                traj.turns += 1
                traj.finish_reason = fin.finish_reason
                if self.is_leader:
                    last = traj.turns >= self.cfg.max_turns or len(traj.response) >= budget
                    turn = Turn(traj.turns - 1, "", list(fin.token_ids), fin.finish_reason, last=last)
                    jobs[self._submit(traj, turn)] = traj
        stats["loop_s"] = time.perf_counter() - start
        return stats

    def _releasable(self, ready: list, jobs: dict, requests: Any) -> bool:
        if not self.turn_sync:
            return bool(ready)
        return bool(ready) and not jobs and not requests.has_unfinished()  # the whole turn is answered

    def _submit(self, traj: Trajectory, turn: Turn) -> cf.Future:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.cfg.max_workers, thread_name_prefix="hybridrl-agent")

        def work():
            turn.text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
            return environment_turn(traj, turn, self.spec, self.chat, self.cfg)

        return self._pool.submit(work)

    def _collect(self, jobs: dict, budget: int, wait: bool) -> list[tuple]:
        """Events of the finished environment turns (waiting for one when ``wait``)."""
        done = cf.wait(list(jobs), return_when=cf.FIRST_COMPLETED)[0] if wait else [f for f in jobs if f.done()]
        events = []
        for future in sorted(done, key=lambda f: jobs[f].index):  # a fixed order within one iteration
            traj = jobs.pop(future)
            events.append(self._decide(traj, future.result(), budget))
        return events

    def _decide(self, traj: Trajectory, outcome: Any, budget: int) -> tuple:
        """The leader's decision after an environment turn: queue the next turn, or end (and why)."""
        traj.reward += outcome.reward
        for key, value in outcome.counts.items():
            traj.counts[key] += value
        obs = outcome.observation_ids
        if outcome.end == END_ERROR:
            if traj.counts["env_errors"] == 1:
                logger.warning("agent: %s failed on trajectory %d (%s); it ends with reason 'error'",
                               self.spec.label, traj.index, outcome.message)  # fmt: skip
            reason = END_ERROR
        elif obs is None:
            reason = DONE if outcome.done else MAX_TURNS if traj.turns >= self.cfg.max_turns else BUDGET
        elif len(traj.response) + len(obs) >= budget:  # no room left for a policy token after the observation
            reason = BUDGET
        else:
            return ("gen", traj.index, obs)
        return ("end", traj.index, reason, traj.reward, dict(traj.counts))

    def _share(self, events: list[tuple]) -> list[tuple]:
        if self.group is None:
            return events
        box = [events if self.is_leader else None]
        dist.broadcast_object_list(box, src=self.leader, group=self.group)
        return box[0]

    def _apply(self, event: tuple, traj: Trajectory, requests: Any, settings: dict, budget: int) -> int:
        """Queue a trajectory's next turn (after its observation) or end it; 1 when it ended."""
        if event[0] == "end":
            traj.end, traj.reward, traj.counts = event[2], float(event[3]), dict(event[4])
            return 1
        obs = event[2]
        traj.add(obs, None)
        traj.counts["observation_tokens"] += len(obs)
        room = budget - len(traj.response)
        limit = self.cfg.max_tokens_per_turn
        turn = {**settings, "max_tokens": min(room, limit or room), "seed": turn_seed(traj.seed, traj.turns)}
        requests.add(f"a{self.calls}-{traj.index}-{traj.turns}", traj.prompt_ids + traj.response, turn)
        return 0

    # ---- the batch ---------------------------------------------------------------------------------------------
    def _pack(self, prompts: DataProto, rows: list[list[int]], n: int, trajs: list[Trajectory], budget: int,
              timing: dict[str, float]) -> DataProto:  # fmt: skip
        width = prompts.batch["input_ids"].shape[1]
        pad = self.engine.pad_token_id
        ids = torch.full((len(rows), width), pad, dtype=prompts.batch["input_ids"].dtype)
        mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for i, r in enumerate(rows):  # left-padded, as the dataset's prompts
            ids[i, width - len(r) :] = torch.tensor(r, dtype=ids.dtype)
            mask[i, width - len(r) :] = 1
        rest = prompts.select([k for k in prompts.batch if k not in ROLLOUT_KEYS])
        source = DataProto({**rest.batch, "input_ids": ids, "attention_mask": mask}, rest.non_tensor_batch)
        reasons = ["length" if t.end == BUDGET else "stop" for t in trajs]
        batch = pack_rollout(source, n, [t.response for t in trajs], [t.log_probs for t in trajs], reasons, budget,
                             pad, response_masks=[t.mask for t in trajs])  # fmt: skip
        batch.batch["agent_turns"] = torch.tensor([t.turns for t in trajs], dtype=torch.int64)
        batch.batch["agent_reward"] = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        for key in COUNTS:
            batch.batch[f"agent_{key}"] = torch.tensor([t.counts[key] for t in trajs], dtype=torch.int64)
        ends = np.empty(len(trajs), dtype=object)
        ends[:] = [t.end for t in trajs]
        batch.non_tensor_batch["agent_end_reasons"] = ends
        batch.meta_info.update(prompts.meta_info)
        batch.meta_info["agent_timing"] = timing
        return batch.to(prompts.batch["input_ids"].device)

    def close(self) -> None:
        """Stop the environment threads (waiting for none of them)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

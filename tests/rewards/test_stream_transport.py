"""A :class:`~hybridrl.rewards.stream.StreamSession` sent to another process (what Ray does with the
``generate_sequences`` arguments): pickled through the same ``pickle`` protocol, it arrives as plain data (the
reward config and the manager's settings), never as the scorer or the driver's prompts, and unpickling runs none
of the scorer's code; the copy rebuilds the manager when it is opened (inside ``generate_sequences``: a scorer that
fails there is a one-line ScorerError), once per run, and, opened with the worker's tokenizer, scores exactly as
the driver's manager (errors and timeouts included). Only a replica's first rank opens a copy. A manager built by
hand cannot travel, and a Ray run with one scores after generation instead (asking for overlap is an error)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridrl.config import ConfigError, load_config
from hybridrl.protocol import DataProto
from hybridrl.rewards import RewardManager
from hybridrl.rewards.manager import ScorerError
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
    assert copy.prompts is None and copy.stream.tokenizer is None and copy.stream.manager is None  # built on open
    responses = [[ord(c) for c in text] for text in ("3", "x", "5", "six 6")]
    on_step = copy.open(prompts, 1, Chars())
    again = pickle.loads(pickle.dumps(session))
    again.open(prompts, 1, Chars())
    assert again.stream.manager is copy.stream.manager and copy.stream.manager is not manager  # once per run
    assert [copy.scores_on(r) for r in (0, 1)] == [True, False]  # a Ray replica's first rank only
    assert [session.scores_on(r) for r in (0, 1)] == [True, True]  # SPMD: every rank gathers over its replicas
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
    with pytest.raises(
        ConfigError, match=r"^reward.overlap_generation \(true\): under trainer.launcher=ray .* by hand"
    ):
        RewardStream.from_config(_cfg("trainer.launcher=ray", "reward.overlap_generation=true"), manager, Chars())


def test_a_scorer_that_fails_on_the_host_fails_in_open_in_one_line(tmp_path, monkeypatch):
    scorer = tmp_path / "driver_only.py"
    scorer.write_text(
        "import os\n"
        "if os.environ.get('HOST_SIDE'):\n"
        "    raise RuntimeError('no API key here')\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1.0\n"
    )
    cfg = _cfg()
    cfg.reward.custom.path = str(scorer)
    manager = RewardManager.from_config(cfg.reward)
    session = RewardStream.from_config(cfg, manager, Chars()).session(_prompts(["3"]))
    monkeypatch.setenv("HOST_SIDE", "1")  # what the host lacks, the driver had
    copy = pickle.loads(pickle.dumps(session))  # unpickling runs none of the scorer's code
    with pytest.raises(ScorerError) as err:
        copy.open(_prompts(["3"]), 1, Chars())
    line = str(err.value)
    assert "\n" not in line and line.startswith("on a rollout host: reward.custom.path") and "no API key here" in line
    assert line.endswith("set reward.overlap_generation=false to score on the driver")


class Unsized(Chars):
    """A tokenizer that is falsy (``len()`` 0), as an empty vocabulary wrapper may be."""

    def __len__(self) -> int:
        return 0


def test_the_streams_own_tokenizer_decodes_even_when_falsy():
    cfg = _cfg()
    session = RewardStream.from_config(cfg, RewardManager.from_config(cfg.reward), Unsized()).session(_prompts(["3"]))
    session.open(_prompts(["3"]), 1)([(0, [ord("3")])])
    assert session.collect().batch["stream_score"].tolist() == [1.0]


def test_the_scores_are_gathered_without_sending_the_prompts_again():
    cfg = _cfg()
    manager = RewardManager.from_config(cfg.reward)
    prompts = _prompts(["3", "6"])
    session = RewardStream.from_config(cfg, manager, Chars()).session(prompts)
    session.open(prompts, 1)([(0, [ord("3")]), (1, [ord("6")])])
    sent = []

    class Actor:  # one rollout replica: what the worker group's streamed_rewards returns
        def streamed_rewards(self, rows, stream):
            sent.append(rows)
            return stream.collect()

    responses = torch.tensor([[51], [54]])
    batch = DataProto({"responses": responses, "attention_mask": torch.ones(2, 3, dtype=torch.int64)},
                      dict(prompts.non_tensor_batch))  # fmt: skip
    result = session.result(Actor(), batch, torch.ones(2, 1))
    assert result.scores.tolist() == manager(prompts, ["3", "6"]).scores.tolist()
    assert len(sent[0]) == 2 and set(sent[0].batch.keys()) == {"row"} and not sent[0].non_tensor_batch

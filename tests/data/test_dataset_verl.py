"""The founding document's dataset example, as written, on a parquet that has only ``prompt`` and ``chosen``
columns (written by pyarrow, read with a real tokenizer): it loads, and what a reward needs is stated at
train time by the trainer's own start-up check (``check_reward_sources``), in one line per case."""

from __future__ import annotations

import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridrl.config.schema import RewardConfig
from hybridrl.data.files import DataError
from hybridrl.protocol import DataProto
from hybridrl.rewards import RewardManager
from hybridrl.trainer.main import check_reward_sources

QUESTIONS = ["What is 12 + 30?", "Copy: 482", "Repeat the word hello world"]


def preference_parquet(path, chat: bool = False):
    """A DPO-style file: ``prompt`` (text or chat messages) and ``chosen``; no data_source, no reward_model."""
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS] if chat else QUESTIONS
    table = pa.table({"prompt": prompts, "chosen": ["42", "482", "hello world"]})
    pq.write_table(table, path)
    return path


@pytest.fixture
def tok(hf_tok):
    return hf_tok


def test_founding_example_loads_a_prompt_and_chosen_parquet(tok, tmp_path):
    from hybridrl import RLHFDataset as TopLevel
    from hybridrl.data import RLHFDataset

    assert TopLevel is RLHFDataset
    text = preference_parquet(tmp_path / "train.parquet")
    chat = preference_parquet(tmp_path / "chat.parquet", chat=True)
    assert pq.read_schema(text).names == ["prompt", "chosen"]
    ds = RLHFDataset(
        data_files=[str(text)], tokenizer=tok, config={"max_prompt_length": 512, "max_response_length": 256}
    )
    chat_ds = RLHFDataset(
        data_files=[str(chat)], tokenizer=tok, config={"max_prompt_length": 512, "max_response_length": 256}
    )
    assert len(ds) == len(chat_ds) == 3 and ds.max_response_length == 256
    for i, question in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": question}]
        expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        item, chat_item = ds[i], chat_ds[i]
        n = len(expected)
        assert item["input_ids"].shape == (512,) and item["input_ids"][-n:].tolist() == expected
        assert (item["input_ids"][:-n] == tok.pad_token_id).all() and item["attention_mask"].sum() == n
        assert torch.equal(item["input_ids"], chat_item["input_ids"])
        assert item["raw_prompt"] == question and chat_item["raw_prompt"] == messages
        assert item["data_source"] is None and item["ground_truth"] is None and item["extra_info"] == {}
    assert ds.data_sources == [None]
    assert ds.without_ground_truth == {None: (3, f"{text}: row 0 (no 'reward_model' column)")}


def check(tmp_path, tok, reward: RewardConfig, *files):
    from hybridrl.data import RLHFDataset

    train = RLHFDataset([str(f) for f in files], tok, {"max_prompt_length": 512, "max_response_length": 256})
    check_reward_sources(RewardManager.from_config(reward), train, None)
    return train


def test_train_time_statement_of_what_the_reward_needs(tok, tmp_path):
    path = preference_parquet(tmp_path / "train.parquet")
    with pytest.raises(DataError) as err:
        check(tmp_path, tok, RewardConfig(), path)  # scorer "auto": by data_source
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "rows without a data_source (their data file has no 'data_source' column) have no reward scorer: "
        "reward.scorer='auto' picks one by data_source; add a 'data_source' column naming one of ["
    )
    assert message.endswith(
        "], or set reward.scorer to one of them, reward.custom.path to your function, or reward.scorer=null to "
        "score with a reward model alone"
    )
    assert "'gsm8k'" in message
    expected = (
        f"{path}: row 0 (no 'reward_model' column) and 2 more rows: reward_model.ground_truth is missing or null, "
        "so the built-in scorer 'gsm8k' would give 0 to every response"
    )
    with pytest.raises(DataError, match=re.escape(expected)):
        check(tmp_path, tok, RewardConfig(scorer="gsm8k"), path)
    check(tmp_path, tok, RewardConfig(scorer=None), path)  # a reward model alone: nothing to state


def test_files_with_and_without_data_source_mix(tok, tmp_path):
    scored = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.table({"prompt": ["What is 12 + 30?"], "data_source": ["gsm8k"],
                             "reward_model": [{"ground_truth": "42"}]}), scored)  # fmt: skip
    with pytest.raises(DataError, match=re.escape("rows without a data_source (their data file has no 'data_source'")):
        check(tmp_path, tok, RewardConfig(), scored, preference_parquet(tmp_path / "pref.parquet"))
    train = check(tmp_path, tok, RewardConfig(), scored)
    assert train.data_sources == ["gsm8k"] and train.without_ground_truth == {}


def test_a_custom_scorer_scores_rows_without_data_source(tok, tmp_path):
    """With reward.custom.path the rows train: the function gets data_source None, the response and no truth."""
    from hybridrl.data import collate

    scorer = tmp_path / "my_reward.py"
    scorer.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source is None and ground_truth is None\n"
        "    return float(len(solution_str))\n"
    )
    cfg = RewardConfig()
    cfg.custom.path = str(scorer)
    train = check(tmp_path, tok, cfg, preference_parquet(tmp_path / "train.parquet"))
    batch: DataProto = collate([train[i] for i in range(3)])
    result = RewardManager.from_config(cfg)(batch, ["a", "bb", "ccc"])
    assert result.scores.tolist() == [1.0, 2.0, 3.0] and result.metrics["reward/errors"] == 0.0

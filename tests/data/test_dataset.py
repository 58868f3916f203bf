"""Tests of hybridrl.data.dataset and loader: schema checks and one-line errors, left padding, truncation
and filtering (counted), collate, seeded shuffling and resuming mid-epoch."""

from __future__ import annotations

import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hybridrl.config.schema import DataConfig
from hybridrl.data import PromptLoader, RLHFDataset, collate, load_tokenizer, write_rows


def row(content, source="gsm8k", truth="42", extra=None):
    prompt = content if isinstance(content, str) else [{"role": "user", "content": c} for c in content]
    return {"prompt": prompt, "data_source": source, "reward_model": {"ground_truth": truth}, "extra_info": extra}


def rows(n, start=0):
    return [row([f"Copy: {i}"], truth=str(i), extra={"index": i}) for i in range(start, start + n)]


@pytest.fixture(params=["hf", "sp"])
def tok(request, hf_tok, sp_tok):
    return hf_tok if request.param == "hf" else sp_tok


def test_rows_are_left_padded_with_all_fields(tok, tmp_path):
    path = write_rows([*rows(3), row(["Copy: 7"], truth="7")], tmp_path / "train.parquet")
    ds = RLHFDataset(data_files=[path], tokenizer=tok, config={"max_prompt_length": 32, "max_response_length": 8})
    chat = load_tokenizer(tok)
    assert len(ds) == 4 and ds.data_sources == ["gsm8k"]
    batch = collate([ds[i] for i in range(4)])
    ids, mask, pos = batch.batch["input_ids"], batch.batch["attention_mask"], batch.batch["position_ids"]
    assert ids.shape == mask.shape == pos.shape == (4, 32)
    expected = chat.apply_chat_template([{"role": "user", "content": "Copy: 1"}])
    n = len(expected)
    assert ids[1, -n:].tolist() == expected and (ids[1, :-n] == chat.pad_token_id).all()
    assert mask[1].tolist() == [0] * (32 - n) + [1] * n
    assert pos[1].tolist() == [0] * (32 - n) + list(range(n))
    nt = batch.non_tensor_batch
    assert list(nt["ground_truth"]) == ["0", "1", "2", "7"]
    assert nt["extra_info"][2] == {"index": 2} and nt["extra_info"][3] == {}
    assert (
        nt["raw_prompt"][0] == [{"role": "user", "content": "Copy: 0"}]
        and nt["raw_prompt"][3][0]["content"] == "Copy: 7"
    )
    assert len(set(nt["uid"])) == 4 and list(nt["data_source"]) == ["gsm8k"] * 4


def test_string_prompt_is_one_user_turn(hf_tok, tmp_path):
    text = write_rows([row("Copy: 7")], tmp_path / "text.parquet")
    chat = write_rows([row(["Copy: 7"])], tmp_path / "chat.parquet")
    ds = RLHFDataset([text, chat], hf_tok, {"max_prompt_length": 32})
    assert torch.equal(ds[0]["input_ids"], ds[1]["input_ids"]) and ds[0]["raw_prompt"] == "Copy: 7"


def test_truncation_modes_and_filtering(hf_tok, tmp_path, caplog):
    long = "the quick brown fox jumps over the lazy dog " * 3
    path = write_rows([*rows(2), row([long]), *rows(1, start=5)], tmp_path / "t.parquet")
    n_long = len(load_tokenizer(hf_tok).apply_chat_template([{"role": "user", "content": long}]))
    limit = 40
    with pytest.raises(ValueError) as err:
        RLHFDataset([path], hf_tok, {"max_prompt_length": limit})
    assert str(err.value) == (
        f"{path}: row 2: prompt has {n_long} tokens > data.max_prompt_length ({limit}); raise it, "
        "set data.truncation to left/right, or set data.filter_overlong_prompts=true"
    )
    left = RLHFDataset([path], hf_tok, {"max_prompt_length": limit, "truncation": "left"})
    right = RLHFDataset([path], hf_tok, {"max_prompt_length": limit, "truncation": "right"})
    full = load_tokenizer(hf_tok).apply_chat_template([{"role": "user", "content": long}])
    assert left[2]["input_ids"].tolist() == full[-limit:] and right[2]["input_ids"].tolist() == full[:limit]
    assert left[2]["attention_mask"].all() and left.stats["rows_truncated"] == 1 and len(left) == 4
    with caplog.at_level(logging.WARNING, logger="hybridrl.data.dataset"):
        kept = RLHFDataset([path], hf_tok, {"max_prompt_length": limit, "filter_overlong_prompts": True})
    assert len(kept) == 3 and kept.stats["rows_filtered_overlong"] == 1 and kept.stats["rows_read"] == 4
    assert "1 dropped as longer than max_prompt_length=40" in caplog.text
    assert [kept[i]["ground_truth"] for i in range(3)] == ["0", "1", "5"]


def test_overlong_error_counts_all_rows(hf_tok, tmp_path):
    long = row(["the quick brown fox jumps over the lazy dog " * 3])
    path = write_rows([long, *rows(1), long, long], tmp_path / "t.parquet")
    with pytest.raises(ValueError, match=r"row 0 \(and 2 more rows\): prompt has"):
        RLHFDataset([path], hf_tok, {"max_prompt_length": 40})


def _bad_file(tmp_path, name, table):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(table), path)
    return path


def test_bad_input_errors_name_file_row_and_fix(hf_tok, tmp_path):
    cfg = {"max_prompt_length": 32}
    missing = _bad_file(tmp_path, "noprompt.parquet", [{"question": "hi", "data_source": "gsm8k"}])
    with pytest.raises(ValueError, match=rf"{missing}: missing column 'prompt' \(has \['data_source', 'question'\]\)"):
        RLHFDataset([missing], hf_tok, cfg)
    renamed = write_rows(rows(2), tmp_path / "ok.parquet")
    with pytest.raises(ValueError, match="missing column 'question'"):
        RLHFDataset([renamed], hf_tok, {**cfg, "prompt_key": "question"})
    empty = write_rows([*rows(2), row(["  "])], tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=rf"{empty}: row 2: column 'prompt' has no message with content"):
        RLHFDataset([empty], hf_tok, cfg)
    empty_str = write_rows([row("x"), row("")], tmp_path / "empty_str.parquet")
    with pytest.raises(ValueError, match=r"row 1: column 'prompt' is an empty string"):
        RLHFDataset([empty_str], hf_tok, cfg)
    no_role = _bad_file(tmp_path, "role.parquet", [{**row(["x"]), "prompt": [{"content": "x"}]}])
    with pytest.raises(ValueError, match=r"row 0: message 0 of column 'prompt' is .*needs str role and content"):
        RLHFDataset([no_role], hf_tok, cfg)
    null_src = write_rows([row("x", source=None)], tmp_path / "src.parquet")
    with pytest.raises(ValueError, match=r"row 0: column 'data_source' is None; it must be a non-empty string"):
        RLHFDataset([null_src], hf_tok, cfg)
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"not a parquet file at all")
    with pytest.raises(ValueError, match=rf"cannot read {garbage} as parquet \(.*\); check the file"):
        RLHFDataset([renamed, garbage], hf_tok, cfg)
    with pytest.raises(ValueError, match=r"data file '.*nope\.parquet' does not exist; check data\.train_files"):
        RLHFDataset([tmp_path / "nope.parquet"], hf_tok, cfg)
    with pytest.raises(ValueError, match=r"data config key 'max_prompt_len' is unknown; known keys: \["):
        RLHFDataset([renamed], hf_tok, {"max_prompt_len": 32})
    with pytest.raises(ValueError, match=r"data.truncation \('middle'\) must be one of \['error', 'left', 'right'\]"):
        RLHFDataset([renamed], hf_tok, {"truncation": "middle"})
    with pytest.raises(ValueError, match=r"data.max_prompt_length \(0\) must be an integer >= 1"):
        RLHFDataset([renamed], hf_tok, {"max_prompt_length": 0})


def test_several_files_jsonl_optional_extra_info_and_dataconfig(hf_tok, tmp_path):
    a = write_rows(rows(2), tmp_path / "a.parquet")
    b = write_rows([{k: v for k, v in r.items() if k != "extra_info"} for r in rows(3, start=10)], tmp_path / "b.jsonl")
    ds = RLHFDataset([a, b], hf_tok, DataConfig(train_files=["ignored"], max_prompt_length=32))
    assert len(ds) == 5 and ds.max_prompt_length == 32 and ds.stats["files"] == 2
    assert [ds[i]["uid"] for i in (0, 2)] == ["0/0", "1/0"] and ds[4]["extra_info"] == {}
    assert "5 prompts from 2 file(s): 5 read, 0 dropped" in ds.summary()


def test_upper_case_suffix_reads_as_jsonl(hf_tok, tmp_path):
    upper = write_rows(rows(2), tmp_path / "A.JSONL")
    assert upper.read_text().startswith("{")  # written as JSON lines, not parquet
    ds = RLHFDataset([upper], hf_tok, {"max_prompt_length": 32})
    assert [ds[i]["ground_truth"] for i in range(2)] == ["0", "1"]


def test_json_array_file_reads_like_jsonl(hf_tok, tmp_path):
    """A .json file may hold JSON Lines or one JSON array of rows: both give the same dataset."""
    import json

    lines = write_rows(rows(3), tmp_path / "a.jsonl")
    (tmp_path / "b.json").write_text(json.dumps(rows(3), indent=2))
    a, b = (RLHFDataset([p], hf_tok, {"max_prompt_length": 32}) for p in (lines, tmp_path / "b.json"))
    assert len(a) == len(b) == 3
    for i in range(3):
        assert torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and a[i]["ground_truth"] == b[i]["ground_truth"]
    (tmp_path / "c.json").write_text(json.dumps([rows(1)[0], 5]))
    with pytest.raises(ValueError, match=r"c.json: element 1 of the JSON array is not an object"):
        RLHFDataset([tmp_path / "c.json"], hf_tok, {"max_prompt_length": 32})


def _truths(batches):
    return [list(b.non_tensor_batch["ground_truth"]) for b in batches]


def test_loader_seeded_shuffle_epochs_and_drop_last(hf_tok, tmp_path):
    ds = RLHFDataset([write_rows(rows(10), tmp_path / "t.parquet")], hf_tok, {"max_prompt_length": 32})
    loader = PromptLoader(ds, batch_size=3, seed=1)
    assert len(loader) == 3 and loader.dropped_per_epoch == 1
    epoch0, epoch1 = _truths(loader), _truths(loader)
    assert loader.epoch == 2 and len(epoch0) == 3 and all(len(b) == 3 for b in epoch0)
    assert len({t for b in epoch0 for t in b}) == 9 and epoch0 != epoch1
    assert _truths(PromptLoader(ds, 3, seed=1)) == epoch0 and _truths(PromptLoader(ds, 3, seed=2)) != epoch0
    assert _truths(PromptLoader(ds, 3, shuffle=False, drop_last=False)) == [
        ["0", "1", "2"], ["3", "4", "5"], ["6", "7", "8"], ["9"],
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"data.train_batch_size \(11\) is larger than the dataset \(10 prompts\)"):
        PromptLoader(ds, 11)


def test_startup_line_reports_left_out_prompts_and_validation(hf_tok, tmp_path):
    """What drop_last leaves out each epoch (never trained on without shuffle) and the validation set's own
    truncation are on the run's start-up line."""
    from types import SimpleNamespace

    from hybridrl.trainer.main import data_summary

    train = RLHFDataset([write_rows(rows(10), tmp_path / "t.parquet")], hf_tok, {"max_prompt_length": 32})
    long = [row(["Copy: " + "7 " * 40])]
    val = RLHFDataset(
        [write_rows(long, tmp_path / "v.parquet")], hf_tok, {"max_prompt_length": 16, "truncation": "left"}
    )
    line = data_summary(SimpleNamespace(data=SimpleNamespace(train_batch_size=3, shuffle=False)), train, val)
    assert "; 1 left out per epoch (the same last rows every epoch: never trained on; data.train_batch_size=3" in line
    assert line.endswith("; validation: 1 prompts from 1 file(s): 1 read, 0 dropped as longer than "
                         "max_prompt_length=16, 1 truncated (left)")  # fmt: skip
    assert "left out" not in data_summary(SimpleNamespace(data=SimpleNamespace(train_batch_size=5, shuffle=True)),
                                          train, None)  # fmt: skip


def test_loader_resumes_mid_epoch_and_at_epoch_end(hf_tok, tmp_path):
    ds = RLHFDataset([write_rows(rows(8), tmp_path / "t.parquet")], hf_tok, {"max_prompt_length": 32})
    reference = PromptLoader(ds, 2, seed=7)
    expected = _truths(reference) + _truths(reference)  # two uninterrupted epochs, 4 batches each
    for stop in (1, 3, 4, 6):
        loader, seen = PromptLoader(ds, 2, seed=7), []
        while len(seen) < stop:  # stop mid-iteration, like a trainer that checkpoints and dies
            for batch in loader:
                seen.append(list(batch.non_tensor_batch["ground_truth"]))
                if len(seen) == stop:
                    break
        state = loader.state_dict()
        restored = PromptLoader(ds, 2, seed=7)
        restored.load_state_dict(state)
        rest = []
        while len(seen) + len(rest) < len(expected):
            rest += _truths(restored)
        assert seen + rest == expected, stop
    with pytest.raises(ValueError, match="data loader state: seed was 7 at save time but is 8 now"):
        PromptLoader(ds, 2, seed=8).load_state_dict(state)

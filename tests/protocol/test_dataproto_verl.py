"""DataProto as code ported from verl calls it: the behaviour verl's own DataProto test suite
(tests/test_protocol_on_cpu.py) asserts, run against hybridrl's DataProto. The expected values are the
ones verl's tests state (our code, their behaviour); where hybridrl differs on purpose the test pins the
error that says so."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hybridrl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto


def labelled(meta: dict | None = None) -> DataProto:
    """verl's fixture: obs rows [1, 2] [3, 4] [5, 6], labels a b c."""
    return DataProto.from_dict(
        tensors={"obs": torch.tensor([[1, 2], [3, 4], [5, 6]])},
        non_tensors={"labels": ["a", "b", "c"]},
        meta_info={"info": "test_info"} if meta is None else meta,
    )


def obs(d: DataProto) -> list:
    return d.batch["obs"].tolist()


def labels(d: DataProto) -> list:
    return d.non_tensor_batch["labels"].tolist()


# ---- select / pop with verl's keyword names ------------------------------------------------------------


def test_pop_with_verl_keywords():
    data = DataProto.from_dict({"obs": torch.randn(100, 10), "act": torch.randn(100, 3)}, meta_info={"2": 2, "1": 1})
    popped = data.pop(batch_keys=["obs"], meta_info_keys=["2"])
    assert popped.batch.keys() == {"obs"} and popped.meta_info.keys() == {"2"}
    assert data.batch.keys() == {"act"} and data.meta_info.keys() == {"1"}


def test_select_and_pop_without_tensors():
    data = DataProto.from_dict(non_tensors={"labels": ["a", "b", "c"]}, meta_info={"info": "test_info"})
    assert labels(data.select(non_tensor_batch_keys=["labels"])) == ["a", "b", "c"]
    assert labels(data.pop(non_tensor_batch_keys=["labels"])) == ["a", "b", "c"]
    assert data.non_tensor_batch == {}
    positional = labelled().select(["obs"], ["labels"], ["info"])  # verl's positional order works too
    assert list(positional.batch) == ["obs"] and positional.meta_info == {"info": "test_info"}


def test_len_without_tensors():
    arr = np.array(["a", "b", "c"], dtype=object)
    assert len(DataProto(batch=None, non_tensor_batch={"labels": arr}, meta_info={"info": "x"})) == 3
    assert len(DataProto(batch=None, non_tensor_batch={}, meta_info={"info": "x"})) == 0
    assert len(DataProto(batch=None, non_tensor_batch=None, meta_info={"info": "x"})) == 0
    metrics_only = DataProto.from_single_dict(data={}, meta_info={"metrics": {"actor/loss": 0.5}})
    assert len(metrics_only) == 0 and metrics_only.meta_info == {"metrics": {"actor/loss": 0.5}}


# ---- concat merges meta_info["metrics"] of worker outputs -------------------------------------------------


def worker(rows: list[int], **meta) -> DataProto:
    return DataProto.from_dict(tensors={"obs": torch.tensor(rows)}, meta_info=meta)


def test_concat_merges_metrics_of_several_workers_into_lists():
    parts = [
        worker([1, 2], metrics=[{"loss": 0.5, "accuracy": 0.9}], config_flag=True),
        worker([3, 4], metrics=[{"loss": 0.6, "accuracy": 0.85}], config_flag=True),
        worker([5, 6], metrics=[{"loss": 0.55, "accuracy": 0.88}], config_flag=True),
    ]
    out = DataProto.concat(parts)
    assert out.batch["obs"].tolist() == [1, 2, 3, 4, 5, 6]
    assert out.meta_info["metrics"] == {"loss": [0.5, 0.6, 0.55], "accuracy": [0.9, 0.85, 0.88]}
    assert out.meta_info["config_flag"] is True
    assert parts[0].meta_info["metrics"] == [{"loss": 0.5, "accuracy": 0.9}]  # the parts are left alone


def test_concat_metrics_as_dicts_missing_in_some_parts_or_none():
    assert DataProto.concat(
        [worker([1], metrics={"loss": 0.5, "acc": 0.9}), worker([2], metrics={"loss": 0.6, "acc": 0.85})]
    ).meta_info == {"metrics": {"loss": [0.5, 0.6], "acc": [0.9, 0.85]}}
    first_missing = DataProto.concat(
        [
            worker([1], config_flag=True),
            worker([2], metrics={"loss": 0.6}, config_flag=True),
            worker([3], metrics={"loss": 0.55}, config_flag=True),
        ]
    )
    assert first_missing.meta_info == {"config_flag": True, "metrics": {"loss": [0.6, 0.55]}}
    assert DataProto.concat([worker([1], metrics=[{"loss": 0.5}], flag=True), worker([2], flag=True)]).meta_info == {
        "metrics": {"loss": [0.5]},
        "flag": True,
    }
    assert DataProto.concat([worker([1], metrics=None), worker([2], single_value=42)]).meta_info == {"single_value": 42}
    uneven = DataProto.concat([worker([1], metrics={"loss": 1.0}), worker([2], metrics={"loss": 2.0, "kl": 0.1})])
    assert uneven.meta_info["metrics"] == {"loss": [1.0, 2.0], "kl": [0.1]}  # a value per part that reports it


def test_concat_merges_other_meta_keys_and_rejects_conflicts():
    merged = DataProto.concat(
        [
            worker([1], config="A", shared_key="X"),
            worker([2], extra_key="B", shared_key="X"),
            worker([3], another_key="C", shared_key="X"),
        ]
    )
    assert merged.meta_info == {"config": "A", "shared_key": "X", "extra_key": "B", "another_key": "C"}
    with pytest.raises(ValueError, match=re.escape("concat: meta_info 'config' differs between part 0 and part 1")):
        DataProto.concat([worker([1], config="A"), worker([2], config="B")])
    with pytest.raises(
        ValueError, match=re.escape("concat: meta_info 'metrics' of part 1 holds a float; it must be a dict")
    ):
        DataProto.concat([worker([1], metrics={"loss": 1.0}), worker([2], metrics=0.5)])


def test_padding_keeps_metrics_as_they_are():
    padded, pad = worker([1, 2, 3], metrics={"loss": 0.5}).pad_to_divisor(2)
    assert pad == 1 and padded.meta_info == {"metrics": {"loss": 0.5}}


# ---- make_iterator: rows in order unless asked to shuffle ----------------------------------------------


def test_make_iterator_keeps_order_by_default_as_verl():
    d = DataProto.from_dict(tensors={"obs": torch.arange(12)}, non_tensors={"labels": [str(i) for i in range(12)]},
                            meta_info={"step": 3})  # fmt: skip
    batches = list(d.make_iterator(mini_batch_size=4, epochs=2))
    assert [b.batch["obs"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] * 2
    assert batches[1].non_tensor_batch["labels"].tolist() == ["4", "5", "6", "7"]
    assert all(b.meta_info == {"step": 3} for b in batches)
    assert [b.batch["obs"].tolist() for b in d.make_iterator(6, 1, 123)] == [list(range(6)), list(range(6, 12))]


def test_make_iterator_shuffles_through_dataloader_kwargs_reproducibly():
    d = DataProto.from_dict(tensors={"obs": torch.randn(100, 10)}, non_tensors={"labels": [str(i) for i in range(100)]})

    def run(**kwargs) -> list[list[str]]:
        return [b.non_tensor_batch["labels"].tolist() for b in d.make_iterator(10, 2, **kwargs)]

    first = run(seed=1, dataloader_kwargs={"shuffle": True})
    assert first == run(seed=1, dataloader_kwargs={"shuffle": True}) == run(seed=1, shuffle=True)
    assert first != run(seed=2, dataloader_kwargs={"shuffle": True})
    every = sorted(str(i) for i in range(100))
    assert first[:10] != first[10:] and sorted(x for b in first[:10] for x in b) == every
    unseeded = run(seed=None, dataloader_kwargs={"shuffle": True})  # verl's default seed: torch's global RNG
    assert sorted(x for b in unseeded[:10] for x in b) == every
    assert run(dataloader_kwargs={"shuffle": False}) == run()


def test_make_iterator_rejects_what_it_cannot_honour():
    d = DataProto.from_dict(tensors={"obs": torch.arange(4)})
    with pytest.raises(ValueError, match=re.escape("dataloader_kwargs key 'num_workers' is not supported (verl hands")):
        d.make_iterator(2, 1, dataloader_kwargs={"shuffle": True, "num_workers": 2})
    with pytest.raises(ValueError, match=re.escape("shuffle=False but dataloader_kwargs['shuffle']=True; pass one")):
        d.make_iterator(2, 1, dataloader_kwargs={"shuffle": True}, shuffle=False)


# ---- rows: reorder, chunk, repeat, padding, sample_level_repeat, slice, select_idxs ----------------------


def test_reorder_chunk_concat():
    data = DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2, 3, 4, 5, 6])},
        non_tensors={"labels": list("abcdef")},
        meta_info={"name": "abdce"},
    )
    parts = data.chunk(2)
    assert [p.batch["obs"].tolist() for p in parts] == [[1, 2, 3], [4, 5, 6]]
    assert [labels(p) for p in parts] == [["a", "b", "c"], ["d", "e", "f"]]
    assert all(p.meta_info == {"name": "abdce"} for p in parts)
    back = DataProto.concat(parts)
    assert back.batch["obs"].tolist() == [1, 2, 3, 4, 5, 6] and back.meta_info == {"name": "abdce"}
    with pytest.raises(ValueError, match="batch size 6 is not divisible by 5 chunks"):  # verl: AssertionError
        data.chunk(5)
    data.reorder(torch.tensor([3, 4, 2, 0, 1, 5]))
    assert data.batch["obs"].tolist() == [4, 5, 3, 1, 2, 6] and labels(data) == list("decabf")
    assert data.meta_info == {"name": "abdce"}


def test_repeat_interleaved_and_not():
    inter, tiled = (
        labelled().repeat(repeat_times=2, interleave=True),
        labelled().repeat(repeat_times=2, interleave=False),
    )
    assert obs(inter) == [[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]] and labels(inter) == list("aabbcc")
    assert obs(tiled) == [[1, 2], [3, 4], [5, 6], [1, 2], [3, 4], [5, 6]] and labels(tiled) == list("abcabc")
    assert inter.meta_info == tiled.meta_info == {"info": "test_info"}


@pytest.mark.parametrize(
    ("divisor", "pad", "rows"), [(2, 1, [1, 3, 5, 1]), (3, 0, [1, 3, 5]), (7, 4, [1, 3, 5, 1, 3, 5, 1])]
)
def test_pad_and_unpad_functions(divisor, pad, rows):
    padded, pad_size = pad_dataproto_to_divisor(labelled(), size_divisor=divisor)
    assert pad_size == pad and [r[0] for r in obs(padded)] == rows
    assert labels(padded) == [{1: "a", 3: "b", 5: "c"}[r] for r in rows] and padded.meta_info == {"info": "test_info"}
    unpadded = unpad_dataproto(padded, pad_size=pad_size)
    assert obs(unpadded) == [[1, 2], [3, 4], [5, 6]] and labels(unpadded) == ["a", "b", "c"]
    assert unpadded.meta_info == {"info": "test_info"}


def test_sample_level_repeat():
    data = labelled()
    listed = data.sample_level_repeat(repeat_times=[3, 1, 2])
    assert obs(listed) == [[1, 2], [1, 2], [1, 2], [3, 4], [5, 6], [5, 6]] and labels(listed) == list("aaabcc")
    assert listed.meta_info == {"info": "test_info"}
    tensor = data.sample_level_repeat(repeat_times=torch.tensor([1, 2, 3]))
    assert obs(tensor) == [[1, 2], [3, 4], [3, 4], [5, 6], [5, 6], [5, 6]] and labels(tensor) == list("abbccc")
    assert labels(data.sample_level_repeat((0, 2, np.int64(1)))) == ["b", "b", "c"]  # 0 drops the row
    with pytest.raises(
        ValueError, match=re.escape("repeat_times must hold one integer >= 0 per row (3), got int64[2]")
    ):
        data.sample_level_repeat([1, 2])
    with pytest.raises(ValueError, match=re.escape("one integer >= 0 per row (3), got int64[3]")):
        data.sample_level_repeat([1, -1, 2])


def test_slice_and_select_idxs():
    d = DataProto.from_dict(tensors={"obs": torch.arange(10)}, non_tensors={"labels": [str(i) for i in range(10)]})
    assert d.slice(0, None).batch["obs"].tolist() == list(range(10))
    assert d.slice(2, 8, 3).batch["obs"].tolist() == [2, 5] and d.slice(7).batch["obs"].tolist() == [7, 8, 9]
    idx = np.array([9, 0, 9])
    for index in (idx, torch.from_numpy(idx), idx.tolist()):
        assert d.select_idxs(index).batch["obs"].tolist() == [9, 0, 9]
    mask = np.arange(10) % 3 == 0
    for index in (mask, torch.from_numpy(mask), mask.tolist()):
        picked = d.select_idxs(index)
        assert picked.batch["obs"].tolist() == [0, 3, 6, 9] and picked.non_tensor_batch["labels"].tolist() == [
            "0",
            "3",
            "6",
            "9",
        ]

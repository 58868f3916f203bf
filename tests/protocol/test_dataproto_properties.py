"""Property-based tests of DataProto (hypothesis): algebraic relations between its operations."""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrl.protocol import DataProto
from tests.protocol.test_dataproto import assert_same

SETTINGS = settings(max_examples=40, deadline=None)
DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
OBJECTS = st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=3), st.lists(st.integers(0, 3), max_size=2))


@st.composite
def dataprotos(draw, max_size: int = 12) -> DataProto:
    """Random batches: a ``row`` id column, up to three more tensors of mixed dtypes/shapes, object arrays."""
    n = draw(st.integers(0, max_size))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    tensors = {"row": torch.arange(n)}
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = (n, *draw(st.lists(st.integers(0, 3), max_size=2)))
        floats = dtype.is_floating_point
        values = torch.randn(shape, generator=g) if floats else torch.randint(-9, 9, shape, generator=g)
        tensors[f"t{i}"] = values.to(dtype) if dtype != torch.bool else values > 0
    arrays = {f"o{i}": draw(st.lists(OBJECTS, min_size=n, max_size=n)) for i in range(draw(st.integers(0, 2)))}
    return DataProto.from_dict(tensors, arrays, {"step": draw(st.integers(0, 3))})


def rows(d: DataProto) -> list[int]:
    return d.batch["row"].tolist()


@SETTINGS
@given(dataprotos(), st.integers(1, 6))
def test_concat_of_chunks_is_identity(x, k):
    k = k if len(x) % k == 0 else 1
    parts = x.chunk(k)
    assert len(parts) == k and len({len(p) for p in parts}) == 1
    assert_same(DataProto.concat(parts), x)


@SETTINGS
@given(dataprotos(), st.integers(1, 5))
def test_concat_of_splits_is_identity(x, size):
    parts = x.split(size)
    assert all(len(p) == size for p in parts[:-1]) and (0 < len(parts[-1]) <= size or len(x) == 0)
    assert_same(DataProto.concat(parts), x)


@SETTINGS
@given(dataprotos(max_size=8), st.integers(1, 4))
def test_repeat_interleaved_is_a_permutation_of_blocked(x, r):
    n = len(x)
    inter, blocked = x.repeat(r, interleave=True), x.repeat(r, interleave=False)
    assert len(inter) == len(blocked) == n * r
    # blocked row b * n + i is copy b of row i; in the interleaved batch that copy sits at i * r + b.
    to_interleaved = [i * r + b for b in range(r) for i in range(n)]
    assert_same(inter[to_interleaved], blocked)
    assert rows(inter) == [i for i in range(n) for _ in range(r)]


@SETTINGS
@given(dataprotos(), st.integers(1, 7))
def test_pad_then_unpad_is_identity(x, divisor):
    padded, pad = x.pad_to_divisor(divisor)
    assert len(padded) % divisor == 0 and 0 <= pad < divisor and len(padded) == len(x) + pad
    if len(x):
        assert rows(padded)[len(x) :] == [j % len(x) for j in range(pad)]
    assert_same(padded.unpad(pad), x)


@SETTINGS
@given(dataprotos(), st.randoms(use_true_random=False))
def test_reorder_then_inverse_permutation_is_identity(x, rnd):
    perm = list(range(len(x)))
    rnd.shuffle(perm)
    inverse = np.argsort(perm)
    y = x.select().reorder(perm)
    assert rows(y) == perm
    assert_same(y, x[perm])
    assert_same(y.reorder(inverse), x)


@SETTINGS
@given(dataprotos(), st.integers(1, 4), st.integers(1, 3), st.booleans(), st.integers(0, 100))
def test_iterator_covers_every_row_once_per_epoch(x, mbs, epochs, shuffle, seed):
    x, _ = x.pad_to_divisor(mbs)
    x.batch["row"] = torch.arange(len(x))
    batches = list(x.make_iterator(mbs, epochs=epochs, shuffle=shuffle, seed=seed))
    assert len(batches) == epochs * len(x) // mbs and all(len(b) == mbs for b in batches)
    per_epoch = len(x) // mbs
    for e in range(epochs):
        seen = [r for b in batches[e * per_epoch : (e + 1) * per_epoch] for r in rows(b)]
        assert sorted(seen) == list(range(len(x)))
    again = list(x.make_iterator(mbs, epochs=epochs, shuffle=shuffle, seed=seed))
    assert [rows(b) for b in batches] == [rows(b) for b in again]


@SETTINGS
@given(dataprotos())
def test_save_load_and_pickle_roundtrip(x):
    with tempfile.TemporaryDirectory() as tmp:
        x.save_to_disk(Path(tmp) / "x.dp")
        assert_same(DataProto.load_from_disk(Path(tmp) / "x.dp"), x)
    assert_same(pickle.loads(pickle.dumps(x)), x)
    assert_same(pickle.loads(pickle.dumps(x[1:])), x[1:])


@SETTINGS
@given(dataprotos(), st.data())
def test_mask_index_equals_row_list_index_and_single_rows(x, data):
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=len(x), max_size=len(x))), dtype=bool)
    picked = x[mask]
    ids = np.flatnonzero(mask).tolist()
    assert_same(picked, x[ids])
    assert_same(picked, x[torch.from_numpy(mask)])
    for j, i in enumerate(ids):
        for k in x.batch:
            assert torch.equal(picked.batch[k][j], x[i].batch[k])


@SETTINGS
@given(dataprotos(), st.data())
def test_select_and_pop_then_union_restores_the_fields(x, data):
    keys = data.draw(st.lists(st.sampled_from(list(x.batch)), unique=True))
    arrays = data.draw(st.lists(st.sampled_from(list(x.non_tensor_batch) or ["-"]), unique=True))
    arrays = [a for a in arrays if a in x.non_tensor_batch]
    rest = x.select()
    taken = rest.pop(batch_keys=keys, non_tensor_batch_keys=arrays)
    assert set(taken.batch) == set(keys) and not set(keys) & set(rest.batch)
    merged = taken.union(rest)
    assert_same(merged.select(batch_keys=list(x.batch), non_tensor_batch_keys=list(x.non_tensor_batch)), x)

"""scatter / all_gather of DataProto on real gloo groups of 1, 2 and 3 ranks.

One launch per world size runs every check (launches cost seconds) and returns the results, pickled, to the
parent, which compares them with the single-process reference: ``chunk`` for scatter, ``concat`` for
all_gather.
"""

from __future__ import annotations

import itertools
import pickle
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch

from hybridrl.protocol import DataProto, all_gather, scatter
from tests.multirank import run_ranks
from tests.protocol.test_dataproto import assert_same

pytestmark = pytest.mark.multirank

VAR_SIZES = {1: [3], 2: [3, 0], 3: [2, 0, 5]}  # rows each rank contributes to the variable-size all_gather
COLLECTIVES = [
    "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "gather", "scatter",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv",
    "barrier", "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "batch_isend_irecv",
]  # fmt: skip


def _full(n: int) -> DataProto:
    """A deterministic batch with float32, bfloat16, int64 and bool fields, a non-contiguous view, a field with
    no elements per row, and object arrays of strings, dicts and 2-D rows."""
    g = torch.Generator().manual_seed(n)
    grid = np.empty((n, 2), dtype=object)
    grid[:] = [[i, f"g{i}"] for i in range(n)]
    return DataProto.from_dict(
        tensors={
            "f32": torch.randn(n, 3, generator=g),
            "bf16": torch.randn(n, generator=g).to(torch.bfloat16),
            "i64": torch.randint(-(2**40), 2**40, (n, 2, 2), generator=g),
            "mask": torch.rand(n, 5, generator=g) > 0.5,
            "transposed": torch.randn(3, n, generator=g).t(),
            "empty_rows": torch.zeros(n, 0, dtype=torch.int32),
        },
        non_tensors={"uid": [f"u{i}" for i in range(n)], "gt": [{"answer": i, "tags": ["x"] * i} for i in range(n)]}
        | {"grid": grid},
        meta_info={"temperature": 0.7, "n": n},
    )


def _fields(n: int, count: int) -> DataProto:
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
    return DataProto.from_dict(
        {f"f{i}": torch.ones(n, i + 1).to(dtypes[i % 4]) for i in range(count)}, {"uid": [str(i) for i in range(n)]}
    )


def _count_calls(fn: Callable[[], object]) -> tuple[dict[str, int], dict[str, int]]:
    """Run ``fn`` with every torch.distributed collective wrapped in a counter.

    Returns:
        ``(top, all)``: calls made by hybridrl (through ``torch.distributed``), and those plus the calls torch's
        object collectives make internally (through ``distributed_c10d``'s globals).
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    top, inner, saved = Counter(), Counter(), []
    for name in COLLECTIVES:
        for module, counter in ((dist, top), (c10d, inner)):
            original = getattr(module, name)
            saved.append((module, name, original))

            def counted(*args, _original=original, _name=name, _counter=counter, **kwargs):
                _counter[_name] += 1
                return _original(*args, **kwargs)

            setattr(module, name, counted)
    try:
        fn()
    finally:
        for module, name, original in saved:
            setattr(module, name, original)
    return dict(top), dict(top + inner)


def _capture(fn: Callable[[], object]) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _threads_started_by_single_rank_calls() -> int:
    """Threads a scatter and an all_gather of a large batch start in a one-rank world with two torch threads.

    Through gloo, a collective's copies run on gloo's own thread, and a large one there starts an OpenMP team of
    that thread's: a new thread, and a process with more OpenMP threads than CPUs (protocol_dist._local).
    """
    import os

    torch.set_num_threads(2)
    try:
        torch.zeros(1 << 20).add_(1)  # this thread's own team first: its worker is not what is counted
        before = len(os.listdir("/proc/self/task"))
        big = DataProto.from_dict({"x": torch.ones(64, 4096), "y": torch.arange(64 * 512).view(64, 512)})
        gathered, chunk = all_gather(big), scatter(big)
        assert_same(gathered, big)
        assert_same(chunk, big)
        return len(os.listdir("/proc/self/task")) - before
    finally:
        torch.set_num_threads(1)


def _body(rank: int, world: int) -> bytes:
    import torch.distributed as dist

    out: dict[str, object] = {}
    full = _full(4 * world)
    out["scatter_first"] = scatter(full if rank == 0 else None)
    out["scatter_last"] = scatter(full if rank == world - 1 else None, src=world - 1)
    out["gather_equal"] = all_gather(full.chunk(world)[rank])
    start = sum(VAR_SIZES[world][:rank])
    out["gather_var"] = all_gather(full[start : start + VAR_SIZES[world][rank]])
    out["gather_no_tensors"] = all_gather(full.select(batch_keys=[])[start : start + VAR_SIZES[world][rank]])
    # the same fields inserted in another order on odd ranks: each part must be read in its own order
    mine = full.chunk(world)[rank]
    keys = list(mine.batch.keys())
    order = keys[::-1] if rank % 2 else keys
    arrays = list(mine.non_tensor_batch)
    arrays = arrays[::-1] if rank % 2 else arrays
    out["gather_reordered"] = all_gather(
        DataProto({k: mine.batch[k] for k in order}, {k: mine.non_tensor_batch[k] for k in arrays})
    )

    odd = full[: 2 * world + 1]
    out["scatter_error"] = _capture(lambda: scatter(odd if rank == 0 else None))
    wrong = full.chunk(world)[rank].select()
    if rank == world - 1:
        wrong.batch["bf16"] = wrong.batch["bf16"].float()
    out["gather_dtype_error"] = _capture(lambda: all_gather(wrong))
    local_meta = DataProto(full.chunk(world)[rank].batch, meta_info={"rank": rank})
    out["gather_meta_error"] = _capture(lambda: all_gather(local_meta))

    for count in (2, 10):
        data = _fields(2 * world, count)
        out[f"scatter_calls_{count}"] = _count_calls(lambda data=data: scatter(data if rank == 0 else None))
        out[f"gather_calls_{count}"] = _count_calls(lambda data=data: all_gather(data.chunk(world)[rank]))

    if world == 1:
        out["threads_started"] = _threads_started_by_single_rank_calls()
    if world == 3:  # a subgroup without rank 1; src is a global rank
        group = dist.new_group([0, 2])
        if rank != 1:
            out["sub_scatter"] = scatter(full if rank == 2 else None, group=group, src=2)
            out["sub_gather"] = all_gather(full[rank : rank + 1], group=group)
    return pickle.dumps(out)  # plain bytes: tensors through the result queue would go through shared memory


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"{w}ranks")
def ranks(request) -> tuple[int, list[dict]]:
    world = request.param
    return world, [pickle.loads(b) for b in run_ranks(_body, world, timeout=120)]


def test_scatter_gives_each_rank_its_chunk(ranks):
    world, results = ranks
    chunks = _full(4 * world).chunk(world)
    for rank, res in enumerate(results):
        assert_same(res["scatter_first"], chunks[rank])
        assert_same(res["scatter_last"], chunks[rank])
        assert res["scatter_first"].batch["transposed"].is_contiguous()


def test_all_gather_equal_chunks_returns_the_full_batch_everywhere(ranks):
    world, results = ranks
    for res in results:
        assert_same(res["gather_equal"], _full(4 * world))


def test_all_gather_with_different_sizes_per_rank(ranks):
    world, results = ranks
    full, bounds = _full(4 * world), np.cumsum([0, *VAR_SIZES[world]])
    parts = [full[int(a) : int(b)] for a, b in itertools.pairwise(bounds)]
    for res in results:
        assert len(res["gather_var"]) == sum(VAR_SIZES[world])
        assert_same(res["gather_var"], DataProto.concat(parts))
        assert_same(res["gather_no_tensors"], DataProto.concat([p.select(batch_keys=[]) for p in parts]))


def test_all_gather_reads_each_rank_in_its_own_field_order(ranks):
    world, results = ranks
    full = _full(4 * world)
    for res in results:
        for key in full.batch:
            assert torch.equal(res["gather_reordered"].batch[key], full.batch[key]), key
        for key in full.non_tensor_batch:
            got, want = res["gather_reordered"].non_tensor_batch[key], full.non_tensor_batch[key]
            assert repr(got.tolist()) == repr(want.tolist()), key


def test_errors_are_raised_on_every_rank(ranks):
    world, results = ranks
    for res in results:
        if world > 1:
            expected = f"scatter: batch size {2 * world + 1} is not divisible by the group size {world}"
            assert res["scatter_error"].startswith(expected)
            assert res["gather_dtype_error"] == (
                f"all_gather: rank {world - 1} sends tensor 'bf16' as torch.float32[] per row, but rank 0 as "
                "torch.bfloat16[] per row; every rank must send the same fields"
            )
            assert res["gather_meta_error"].startswith("concat: meta_info 'rank' differs between part 0 and part 1")
        else:  # one rank: every batch divides, there is nobody to disagree with
            assert res["scatter_error"] == res["gather_dtype_error"] == res["gather_meta_error"] == "no error"


def test_number_of_collectives_does_not_depend_on_the_number_of_fields(ranks):
    world, results = ranks
    for res in results:
        assert res["scatter_calls_2"] == res["scatter_calls_10"]
        assert res["gather_calls_2"] == res["gather_calls_10"]
        if world == 1:  # nothing to exchange: made locally, no collective at all
            assert res["scatter_calls_10"] == res["gather_calls_10"] == ({}, {})
            continue
        assert res["scatter_calls_10"][0] == {"scatter_object_list": 1, "scatter": 1}
        assert res["gather_calls_10"][0] == {"all_gather_object": 1, "all_gather": 1}
        assert sum(res["scatter_calls_10"][1].values()) <= 5 and sum(res["gather_calls_10"][1].values()) <= 4


def test_one_rank_starts_no_thread(ranks):
    world, results = ranks
    if world != 1:
        pytest.skip("a one-rank world's calls; with more ranks the backend's threads do move the bytes")
    assert results[0]["threads_started"] == 0


def test_subgroup_with_a_global_src_rank(ranks):
    world, results = ranks
    if world != 3:
        pytest.skip("subgroups are checked on 3 ranks")
    chunks, full = _full(12).chunk(2), _full(12)
    assert_same(results[0]["sub_scatter"], chunks[0])
    assert_same(results[2]["sub_scatter"], chunks[1])
    assert "sub_scatter" not in results[1]
    for r in (0, 2):
        assert_same(results[r]["sub_gather"], DataProto.concat([full[0:1], full[2:3]]))

"""Mini-batches of whole prompt groups: the trained roles' shuffle when prompt sharing is on.

With ``actor.share_prompt_prefix`` a micro-batch packs the responses of one prompt into one row only where they
sit side by side; a row-level shuffle scatters a group over mini-batches. The checks: the order is a permutation,
every group stays contiguous and in order, epochs differ, the seed fixes it, and every mini-batch of a batch of
groups of n (mini-batch a multiple of n) holds whole groups, where the row shuffle does not.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridrl.protocol import DataProto
from hybridrl.workers.megatron_workers import _group_minibatches, group_order


def _batch(groups: int, n: int) -> DataProto:
    uids = np.array([f"p{g}" for g in range(groups) for _ in range(n)], dtype=object)
    return DataProto.from_dict(tensors={"row": torch.arange(groups * n)}, non_tensors={"uid": uids})


def test_group_order_is_a_permutation_of_whole_groups_in_order():
    uids = np.array(["a", "a", "a", "b", "c", "c", "d", "d", "d", "d"], dtype=object)
    order = group_order(uids, torch.Generator().manual_seed(3)).tolist()
    assert sorted(order) == list(range(len(uids)))
    runs = [[order[0]]]
    for i in order[1:]:
        if uids[i] == uids[runs[-1][0]]:
            runs[-1].append(i)
        else:
            runs.append([i])
    assert len(runs) == 4  # each group appears once, contiguous
    assert all(run == list(range(run[0], run[0] + len(run))) for run in runs)  # and in its original order
    again = group_order(uids, torch.Generator().manual_seed(3)).tolist()
    assert again == order


def test_every_mini_batch_holds_whole_groups_and_epochs_differ():
    data, n = _batch(groups=8, n=4), 4
    minis = list(_group_minibatches(data, size=8, epochs=2, seed=5))
    assert len(minis) == 8
    for mini in minis:
        uids = list(mini.non_tensor_batch["uid"])
        assert all(uids.count(u) == n for u in set(uids)), uids
    first = torch.cat([m.batch["row"] for m in minis[:4]]).tolist()
    second = torch.cat([m.batch["row"] for m in minis[4:]]).tolist()
    assert sorted(first) == sorted(second) == list(range(32)) and first != second
    rows = [list(m.non_tensor_batch["uid"]) for m in data.make_iterator(8, shuffle=True, seed=5)]
    assert any(any(r.count(u) != n for u in set(r)) for r in rows), "the row shuffle splits groups"

"""Dispatch modes and worker groups on real gloo ranks, against the single-process result."""

from __future__ import annotations

import pytest
import torch

from hybridrl.protocol import DataProto
from hybridrl.workers import ClassWithInitArgs, Dispatch, ResourceError, ResourcePool, WorkerGroup, register
from tests.multirank import run_ranks


class SquareWorker:
    """A toy role whose DP layout is (tp=2 when 4 ranks): DP peers are ranks with the same tp rank."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.dp_size, self.dp_rank = world // tp, rank // tp
        groups = [dist.new_group([r for r in range(world) if r % tp == t]) for t in range(tp)]
        self.dp_group = groups[rank % tp]
        self.seen: list[int] = []

    @register(Dispatch.DP_COMPUTE)
    def square(self, data: DataProto) -> DataProto:
        self.seen.append(len(data))
        x = data.batch["x"]
        return DataProto.from_dict(tensors={"y": x * x, "x": x}, non_tensors={"tag": data.non_tensor_batch["tag"]})

    @register(Dispatch.DP_COMPUTE)
    def samples(self, data: DataProto, n: int) -> DataProto:
        """n rows per input row, adjacent: the layout of generate_sequences."""
        return data.repeat(n, interleave=True)

    @register(Dispatch.ONE_TO_ALL)
    def rank_sum(self, data: DataProto) -> float:
        import torch.distributed as dist

        return float(data.batch["x"].sum()) + dist.get_rank()  # rank 0's value wins

    @register(Dispatch.ONE_TO_ALL)
    def rank_metrics(self) -> dict[str, float]:
        """No batch in, metrics out: the shape of the actor's weight switch (every rank runs it, rank 0 reports)."""
        import torch.distributed as dist

        return {"rank": float(dist.get_rank())}

    def helper(self) -> int:
        return 1


def _body(rank: int, world: int, tp: int, n: int) -> dict:
    import numpy as np

    pool = ResourcePool(process_on_nodes=[world], max_colocate_count=1)
    group = WorkerGroup(pool, ClassWithInitArgs(SquareWorker, tp))
    x = torch.arange(n, dtype=torch.float32)
    data = DataProto.from_dict(tensors={"x": x}, non_tensors={"tag": np.array([f"t{i}" for i in range(n)], object)})
    out = group.square(data)
    try:
        group.helper()
        not_registered = ""
    except AttributeError as err:
        not_registered = str(err)
    return {
        "y": out.batch["y"].tolist(),
        "x": out.batch["x"].tolist(),
        "tag": list(out.non_tensor_batch["tag"]),
        "seen": group.worker.seen,
        "one_to_all": group.rank_sum(data),
        "one_to_all_metrics": group.rank_metrics(),
        "samples": group.samples(data, 3).batch["x"].tolist(),
        "not_registered": not_registered,
    }


@pytest.mark.multirank
def test_dp_compute_splits_and_gathers():
    # 4 ranks, tp=2 -> dp=2; 7 rows (not divisible: padded to 8, then unpadded)
    results = run_ranks(_body, 4, 2, 7, timeout=300)
    expected_x = [float(i) for i in range(7)]
    for rank, r in enumerate(results):
        assert r["x"] == expected_x, rank
        assert r["y"] == [v * v for v in expected_x], rank
        assert r["tag"] == [f"t{i}" for i in range(7)], rank
        assert r["seen"] == [4], rank  # each DP rank computed half of the padded batch
        assert r["one_to_all"] == sum(expected_x), rank
        assert r["one_to_all_metrics"] == {"rank": 0.0}, rank
        # 3 rows per input: the padding row's 3 outputs are dropped, not 1 of them
        assert r["samples"] == [v for v in expected_x for _ in range(3)], rank
        assert "not a registered worker method" in r["not_registered"]


def test_resource_pool_validation():
    with pytest.raises(ResourceError, match=r"sums to 16 but the launch has world_size 2"):
        ResourcePool(process_on_nodes=[8, 8]).validate(world_size=2)
    with pytest.raises(ResourceError, match=r"this node launched 2; match torchrun --nproc-per-node"):
        ResourcePool(process_on_nodes=[4]).validate(world_size=4, local_world_size=2)
    with pytest.raises(ResourceError, match=r"use_gpu \(True\) but CUDA is not available"):
        if torch.cuda.is_available():
            raise ResourceError("use_gpu (True) but CUDA is not available (skipped on GPU)")
        ResourcePool(process_on_nodes=[1], use_gpu=True).validate(world_size=1)
    with pytest.raises(ResourceError, match=r"resources.max_colocate_count \(2\): the SPMD backend runs every role"):
        ResourcePool(process_on_nodes=[1], max_colocate_count=2).validate(world_size=1)


def test_register_rejects_unknown_mode():
    with pytest.raises(ValueError, match="is not a Dispatch"):
        register("dp")


class DeviceWorker:
    """Records the device of the chunk it gets and answers from another device than the caller's."""

    dp_size, dp_rank, dp_group = 1, 0, None

    @register(Dispatch.DP_COMPUTE)
    def where(self, data: DataProto) -> DataProto:
        self.got = data.batch["x"].device
        return DataProto.from_dict(tensors={"y": torch.zeros(len(data), device="meta")})


def test_dp_compute_runs_on_the_compute_device_and_returns_cpu(monkeypatch):
    """Chunks go to the rank's compute device (CUDA on GPU), results come back on the CPU (the trainer's side;
    an NCCL gather returns CUDA tensors). Single process: "meta" stands in for the CUDA device."""
    from hybridrl.workers import dispatch

    monkeypatch.setattr(dispatch, "compute_device", lambda: torch.device("meta"))
    monkeypatch.setattr(DataProto, "to", _to_with_meta_as_cpu_source)
    group = WorkerGroup(ResourcePool(process_on_nodes=[1]), ClassWithInitArgs(DeviceWorker))
    out = group.where(DataProto.from_dict(tensors={"x": torch.arange(4.0)}))
    assert group.worker.got == torch.device("meta")
    assert out.batch["y"].device == torch.device("cpu") and out.batch["y"].shape == (4,)


_original_to = DataProto.to


def _to_with_meta_as_cpu_source(self, device, non_blocking=False):
    """DataProto.to, except that meta tensors "move" to the CPU as zeros (meta holds no data to copy)."""
    if torch.device(device).type == "cpu":
        self.batch = {k: torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t for k, t in self.batch.items()}
        return self
    return _original_to(self, device, non_blocking)

"""A small custom worker for the Ray group tests (importable by the host actors: they get the driver's PYTHONPATH).

No data-parallel attributes: the whole world is its DP group, as :class:`~hybridrl.workers.WorkerGroup` assumes.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from hybridrl.protocol import DataProto
from hybridrl.workers import Dispatch, register


class RankWorker:
    """Tags rows with the rank that computed them; one collective method for the dead-peer test."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale

    @register(Dispatch.DP_COMPUTE)
    def tag(self, data: DataProto) -> DataProto:
        """``y = x * scale`` and ``rank`` (the computing rank) per row."""
        x = data.batch["x"]
        rank = torch.full((len(x),), dist.get_rank(), dtype=torch.long)
        return DataProto.from_dict(tensors={"y": x * self.scale, "rank": rank}, meta_info={"rank": dist.get_rank()})

    @register(Dispatch.DP_COMPUTE)
    def plus_one(self, data: DataProto) -> DataProto:
        return DataProto.from_dict(tensors={"y": data.batch["y"] + 1})

    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def slow_all_reduce(self, seconds: float) -> float:
        """Rank 0 waits in an all-reduce that the others join after ``seconds``."""
        if dist.get_rank() != 0:
            time.sleep(seconds)
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)


class NotAWorker:
    """No registered method."""

    def __init__(self) -> None:
        pass

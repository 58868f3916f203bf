"""PromptLoader: batches of prompts (DataProto) from an RLHFDataset, in a seeded order, with a resumable position.

This module owns batch order and the data part of a checkpoint. Epoch ``e`` visits the rows in the
permutation drawn from ``numpy.random.default_rng([seed, e])`` (or in file order without shuffle), so the
order depends only on ``(seed, epoch)``: the same on every rank, every run and after a restore, with no
RNG state to save. :meth:`PromptLoader.state_dict` is ``{epoch, position, ...}`` where ``position`` counts
the batches of ``epoch`` already handed out; restoring it makes the next batches the ones an uninterrupted
run would have seen.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from hybridrl.data.dataset import RLHFDataset
from hybridrl.protocol import DataProto


class PromptLoader:
    """Iterate an :class:`RLHFDataset` in batches of :class:`DataProto`.

    ``for batch in loader`` yields the rest of the current epoch and then moves to the next one, so a
    trainer writes ``for epoch in range(...): for batch in loader: ...`` and reads ``loader.epoch``.

    Args:
        dataset: the prompts.
        batch_size: prompts per batch (``data.train_batch_size``).
        shuffle: draw a new seeded permutation each epoch (else file order).
        seed: shuffle seed (``data.seed``, else ``trainer.seed``).
        drop_last: drop the final partial batch of each epoch (RL steps want a fixed batch size); the number
            of prompts left out per epoch is :attr:`dropped_per_epoch`.

    Raises:
        ValueError: batch_size < 1, or drop_last with fewer prompts than batch_size.
    """

    def __init__(
        self, dataset: RLHFDataset, batch_size: int, shuffle: bool = True, seed: int = 0, drop_last: bool = True
    ) -> None:
        n = len(dataset)
        if batch_size < 1:
            raise ValueError(f"data.train_batch_size ({batch_size}) must be >= 1")
        if drop_last and n < batch_size:
            raise ValueError(
                f"data.train_batch_size ({batch_size}) is larger than the dataset ({n} prompts); lower it or add data"
            )
        self.dataset, self.batch_size, self.shuffle, self.seed, self.drop_last = (
            dataset,
            batch_size,
            shuffle,
            seed,
            drop_last,
        )
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def dropped_per_epoch(self) -> int:
        """Prompts not visited in an epoch because of drop_last (a different set each shuffled epoch)."""
        return len(self.dataset) - len(self) * self.batch_size if self.drop_last else 0

    def order(self, epoch: int) -> np.ndarray:
        """Row indices of ``epoch`` in visiting order."""
        n = len(self.dataset)
        return np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)

    def __iter__(self) -> Iterator[DataProto]:
        if self.position >= len(self):  # restored from a checkpoint taken after an epoch's last batch
            self.epoch, self.position = self.epoch + 1, 0
        order = self.order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            self.position += (
                1  # count the batch as consumed when handed out: a checkpoint after the step resumes after it
            )
            batch = self.dataset.batch(order[start : start + self.batch_size])
            batch.meta_info.update(epoch=self.epoch, batch_in_epoch=self.position - 1)
            yield batch
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """The position to resume from, plus what must match on restore."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_prompts": len(self.dataset),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state``'s position.

        Raises:
            ValueError: the saved seed, shuffle, batch size or dataset size differ from this loader's (the
                order would not be the same); the message names the key and both values.
        """
        mine = self.state_dict()
        for key in ("seed", "shuffle", "batch_size", "num_prompts"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"data loader state: {key} was {state[key]!r} at save time but is {mine[key]!r} now; "
                    "restore with the same data config and files"
                )
        if not 0 <= int(state["position"]) <= len(self):
            raise ValueError(f"data loader state: position {state['position']} is outside [0, {len(self)}]")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])

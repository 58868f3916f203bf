"""DataProto: the batch that moves between RL roles (rollout, actor, reference, critic, reward).

This module owns the batch container and every single-process operation on it: construction and
validation, field selection (select / pop / union / rename), row indexing, chunk / split / concat, repeat,
reorder, padding to a divisor, mini-batch iteration and pickling. The file format of ``save_to_disk`` /
``load_from_disk`` lives in ``hybridrl/protocol_io.py``; the collectives that move a DataProto over a
process group (:func:`scatter`, :func:`all_gather`) live in ``hybridrl/protocol_dist.py`` and are
re-exported here.

A DataProto holds three things:
- ``batch``: a plain ``dict[str, torch.Tensor]``; every tensor's first dim is the batch dim;
- ``non_tensor_batch``: a ``dict[str, np.ndarray]`` (usually 1-D object arrays: uids, raw prompts,
  ground truths); first dim is the batch dim too;
- ``meta_info``: a free-form dict (temperature, step, ...), not indexed by row.

``batch`` is a plain dict rather than a ``tensordict.TensorDict`` (what verl uses) on purpose: tensordict
pins torch releases tightly, and a plain dict plus the few helpers below is all an RL loop needs. So
``len(data.batch)`` counts fields here, not rows: use ``len(data)``.

verl compatibility: the methods verl code calls take verl's argument names and follow verl's semantics
(``select`` / ``pop`` with ``batch_keys``, ``non_tensor_batch_keys``, ``meta_info_keys``; ``concat`` merges
the parts' ``meta_info["metrics"]`` into lists; ``make_iterator`` keeps row order unless asked to shuffle;
``save_to_disk`` / ``load_from_disk``; ``slice``, ``select_idxs``, ``sample_level_repeat`` and the functions
``pad_dataproto_to_divisor`` / ``unpad_dataproto``). Where hybridrl is stricter (a missing key is an error,
not skipped) the error says so. Mutation follows verl too: ``pop``, ``union``, ``rename``, ``reorder`` and
``to`` change the DataProto in place and return it (``pop`` returns the removed part); every other
operation returns a new DataProto. New DataProtos share tensor storage with their source where torch does
(a slice is a view) and get their own shallow copy of ``meta_info``.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridrl.protocol_values import merge_meta, values_equal

Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor


@dataclass
class DataProtoItem:
    """One row of a DataProto (what ``data[i]`` returns): tensors and values without the batch dim."""

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


def _key_list(keys: str | Iterable[str] | None) -> list[str] | None:
    if keys is None:
        return None
    return [keys] if isinstance(keys, str) else list(keys)


def _pick(fields: Mapping[str, Any], keys: list[str] | None) -> dict[str, Any]:
    return dict(fields) if keys is None else {k: fields[k] for k in keys}


def _as_array(key: str, value: Any) -> np.ndarray:
    """A non-tensor field as a numpy array; lists become 1-D object arrays, element by element."""
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"non-tensor {key!r} is a 0-d array; non-tensor fields need a batch dimension")
        return value
    if isinstance(value, list | tuple):
        arr = np.empty(len(value), dtype=object)
        for i, v in enumerate(value):  # not arr[:] = value: numpy would try to broadcast nested lists
            arr[i] = v
        return arr
    raise TypeError(f"non-tensor {key!r} must be a numpy array or a list, got {type(value).__name__}")


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a copy when it views a larger storage (pickling a view would ship the whole storage)."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


class DataProto:
    """A batch of tensors, non-tensor arrays and meta info that share one batch dimension.

    Args:
        batch: tensors, each ``(batch, ...)``.
        non_tensor_batch: numpy arrays (or lists, turned into 1-D object arrays), each ``(batch, ...)``.
        meta_info: values that describe the whole batch (not indexed by row).

    Raises:
        ValueError: two fields disagree on the batch size (the message names both keys and sizes), a key is
            both a tensor and a non-tensor field, or a tensor is 0-d.
        TypeError: a field has the wrong type or a key is not a string.
    """

    def __init__(
        self,
        batch: Mapping[str, torch.Tensor] | None = None,
        non_tensor_batch: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> None:
        self.batch: dict[str, torch.Tensor] = dict(batch or {})
        self.non_tensor_batch: dict[str, np.ndarray] = {k: _as_array(k, v) for k, v in (non_tensor_batch or {}).items()}
        self.meta_info: dict[str, Any] = dict(meta_info or {})
        self.check_consistency()

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, np.ndarray | Sequence[Any]] | None = None,
        meta_info: Mapping[str, Any] | None = None,
    ) -> DataProto:
        """Build from a dict of tensors, a dict of non-tensor arrays and meta info (verl's spelling)."""
        return cls(batch=tensors, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_single_dict(cls, data: Mapping[str, Any], meta_info: Mapping[str, Any] | None = None) -> DataProto:
        """Build from one dict: tensors go to ``batch``, everything else to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        others = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls(tensors, others, meta_info)

    def check_consistency(self) -> None:
        """Validate types, keys and that every field has the same batch size (call after editing the dicts)."""
        ref: tuple[str, int] | None = None
        for kind, fields in (("tensor", self.batch), ("non-tensor", self.non_tensor_batch)):
            for key, value in fields.items():
                if not isinstance(key, str):
                    raise TypeError(f"{kind} key {key!r} must be a str, got {type(key).__name__}")
                if kind == "tensor":
                    if not isinstance(value, torch.Tensor):
                        raise TypeError(f"tensor {key!r} must be a torch.Tensor, got {type(value).__name__}")
                    if value.ndim == 0:
                        raise ValueError(f"tensor {key!r} is 0-d; batch tensors need a batch dimension")
                    if key in self.non_tensor_batch:
                        raise ValueError(f"key {key!r} is both a tensor and a non-tensor field; rename one")
                elif not isinstance(value, np.ndarray):
                    raise TypeError(f"non-tensor {key!r} must be a numpy array, got {type(value).__name__}")
                size = int(value.shape[0])
                if ref is None:
                    ref = (key, size)
                elif size != ref[1]:
                    raise ValueError(f"{kind} {key!r} has batch size {size}, but {ref[0]!r} has {ref[1]}")

    @property
    def batch_size(self) -> int:
        """Rows in the batch (0 for a DataProto without fields)."""
        for fields in (self.batch, self.non_tensor_batch):
            for value in fields.values():
                return int(value.shape[0])
        return 0

    def __len__(self) -> int:
        return self.batch_size

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for k, t in self.batch.items())
        arrays = ", ".join(f"{k}: {a.dtype}{list(a.shape)}" for k, a in self.non_tensor_batch.items())
        return (
            f"DataProto(batch_size={len(self)}, batch={{{tensors}}}, non_tensor_batch={{{arrays}}}, "
            f"meta_info={list(self.meta_info)})"
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["batch"] = {k: _compact(t) for k, t in self.batch.items()}
        return state

    def _new(self, batch: dict[str, torch.Tensor], non_tensor_batch: dict[str, np.ndarray]) -> DataProto:
        return DataProto(batch, non_tensor_batch, self.meta_info)

    # ---- rows --------------------------------------------------------------------------------------------

    def _rows(self, index: Any) -> np.ndarray:
        """Any row index except an int or a positive-step slice, as an int64 array in ``[0, len)``."""
        n = len(self)
        if isinstance(index, slice):
            return np.arange(*index.indices(n), dtype=np.int64)
        if isinstance(index, torch.Tensor):
            index = index.detach().cpu().numpy()
        idx = np.asarray(index)
        if idx.dtype == bool:
            if idx.shape != (n,):
                raise IndexError(f"boolean mask has shape {list(idx.shape)}, but the batch has {n} rows")
            return np.flatnonzero(idx)
        if idx.size == 0:
            return np.zeros(0, dtype=np.int64)
        if idx.dtype.kind not in "iu" or idx.ndim != 1:
            raise TypeError(f"row index must be an int, a slice, or a 1-D integer/bool sequence, got {idx.dtype}")
        bad = idx[(idx < -n) | (idx >= n)]
        if bad.size:
            raise IndexError(f"row index {int(bad[0])} is out of range for a batch of {n} rows")
        return np.where(idx < 0, idx + n, idx).astype(np.int64)

    def __getitem__(self, index: Index) -> DataProto | DataProtoItem:
        """Rows of the batch.

        Args:
            index: an int (returns a :class:`DataProtoItem` without the batch dim), a slice (views), or a
                list / ndarray / LongTensor of row ids or a bool mask of length ``batch`` (copies).
        """
        if isinstance(index, int | np.integer) or (isinstance(index, torch.Tensor) and index.ndim == 0):
            i, n = int(index), len(self)
            if not -n <= i < n:
                raise IndexError(f"row index {i} is out of range for a batch of {n} rows")
            return DataProtoItem(
                {k: t[i] for k, t in self.batch.items()},
                {k: a[i] for k, a in self.non_tensor_batch.items()},
                self.meta_info,
            )
        if isinstance(index, slice) and (index.step is None or index.step > 0):
            return self._new(
                {k: t[index] for k, t in self.batch.items()}, {k: a[index] for k, a in self.non_tensor_batch.items()}
            )
        rows = self._rows(index)
        return self._new(
            {k: t[torch.as_tensor(rows, device=t.device)] for k, t in self.batch.items()},
            {k: a[rows] for k, a in self.non_tensor_batch.items()},
        )

    def __iter__(self) -> Iterator[DataProtoItem]:
        for i in range(len(self)):
            yield self[i]

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> DataProto:
        """``self[start:end:step]`` (verl's name)."""
        return self[start:end:step]

    def select_idxs(self, idxs: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """The rows at ``idxs`` (ids or a bool mask; verl's name for ``self[idxs]``)."""
        return self[idxs]

    # ---- fields ------------------------------------------------------------------------------------------

    def _missing(self, op: str, keys: list[str] | None, fields: Mapping[str, Any], kind: str) -> None:
        for k in keys or []:
            if k not in fields:
                skipped = op == "select" and kind != "tensor"  # verl filters these silently, ported code may rely on it
                skip = f" (verl's select skips missing {kind} keys; drop it)" if skipped else ""
                raise KeyError(f"{op}: no {kind} field {k!r}; available: {sorted(fields)}{skip}")

    def select(
        self,
        batch_keys: str | Iterable[str] | None = None,
        non_tensor_batch_keys: str | Iterable[str] | None = None,
        meta_info_keys: str | Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """A new DataProto with only the named fields (``None`` keeps all of that kind).

        Tensors are shared; ``deepcopy`` copies the non-tensor arrays and meta_info values (as verl's does).

        Raises:
            KeyError: a named field does not exist (the message lists the ones that do).
        """
        keys, arrays, metas = _key_list(batch_keys), _key_list(non_tensor_batch_keys), _key_list(meta_info_keys)
        self._missing("select", keys, self.batch, "tensor")
        self._missing("select", arrays, self.non_tensor_batch, "non-tensor")
        self._missing("select", metas, self.meta_info, "meta_info")
        non_tensors, meta = _pick(self.non_tensor_batch, arrays), _pick(self.meta_info, metas)
        if deepcopy:
            non_tensors, meta = copy.deepcopy(non_tensors), copy.deepcopy(meta)
        return DataProto(_pick(self.batch, keys), non_tensors, meta)

    def pop(
        self,
        batch_keys: str | Iterable[str] | None = None,
        non_tensor_batch_keys: str | Iterable[str] | None = None,
        meta_info_keys: str | Iterable[str] | None = None,
    ) -> DataProto:
        """Remove the named fields from this DataProto (``None`` removes none) and return them as a new one.

        Raises:
            KeyError: a named field does not exist; nothing is removed then.
        """
        keys, arrays = _key_list(batch_keys) or [], _key_list(non_tensor_batch_keys) or []
        metas = _key_list(meta_info_keys) or []
        self._missing("pop", keys, self.batch, "tensor")
        self._missing("pop", arrays, self.non_tensor_batch, "non-tensor")
        self._missing("pop", metas, self.meta_info, "meta_info")
        return DataProto(
            {k: self.batch.pop(k) for k in keys},
            {k: self.non_tensor_batch.pop(k) for k in arrays},
            {k: self.meta_info.pop(k) for k in metas},
        )

    def union(self, other: DataProto) -> DataProto:
        """Add ``other``'s fields to this DataProto in place and return it.

        A key present in both must hold equal values (tensors compared element-wise, NaN equal to NaN).

        Raises:
            ValueError: a shared key holds different values, or the batch sizes differ (names both keys).
        """
        for kind, mine, theirs in (
            ("tensor", self.batch, other.batch),
            ("non-tensor", self.non_tensor_batch, other.non_tensor_batch),
            ("meta_info", self.meta_info, other.meta_info),
        ):
            for k in theirs.keys() & mine.keys():
                if not values_equal(mine[k], theirs[k]):
                    raise ValueError(f"union: {kind} {k!r} differs between the two batches; pop or rename it first")
        merged = DataProto(
            {**self.batch, **other.batch},
            {**self.non_tensor_batch, **other.non_tensor_batch},
            {**self.meta_info, **other.meta_info},
        )  # validates before anything here changes
        self.batch, self.non_tensor_batch, self.meta_info = merged.batch, merged.non_tensor_batch, merged.meta_info
        return self

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename tensor or non-tensor fields in place (order is kept) and return this DataProto."""
        old, new = _key_list(old_keys) or [], _key_list(new_keys) or []
        if len(old) != len(new):
            raise ValueError(f"rename: {len(old)} old keys but {len(new)} new keys; pass one new name per old key")
        everything = {**self.batch, **self.non_tensor_batch}
        self._missing("rename", old, everything, "tensor or non-tensor")
        mapping = dict(zip(old, new, strict=True))
        kept = set(everything) - set(old)
        for k in new:
            if k in kept or new.count(k) > 1:
                raise ValueError(f"rename: target key {k!r} already exists; pop it or pick another name")
        self.batch = {mapping.get(k, k): v for k, v in self.batch.items()}
        self.non_tensor_batch = {mapping.get(k, k): v for k, v in self.non_tensor_batch.items()}
        return self

    # ---- splitting and joining ---------------------------------------------------------------------------

    def chunk(self, chunks: int) -> list[DataProto]:
        """Split into ``chunks`` equal contiguous parts (views), each ``(batch // chunks, ...)``.

        Raises:
            ValueError: ``batch`` is not divisible by ``chunks`` (pad with :meth:`pad_to_divisor` first).
        """
        if chunks < 1:
            raise ValueError(f"chunk: chunks must be >= 1, got {chunks}")
        n = len(self)
        if n % chunks:
            raise ValueError(
                f"chunk: batch size {n} is not divisible by {chunks} chunks; call pad_to_divisor({chunks}) first"
            )
        size = n // chunks
        return [self[i * size : (i + 1) * size] for i in range(chunks)]

    def split(self, split_size: int) -> list[DataProto]:
        """Split into parts of ``split_size`` rows (the last may be smaller), like ``torch.split``."""
        if split_size < 1:
            raise ValueError(f"split: split_size must be >= 1, got {split_size}")
        n = len(self)
        return [self[i : i + split_size] for i in range(0, n, split_size)] if n else [self[0:0]]

    @staticmethod
    def concat(data: Sequence[DataProto]) -> DataProto:
        """Concatenate DataProtos with the same fields along the batch dim (e.g. the outputs of workers).

        ``meta_info`` is merged as verl merges it: ``"metrics"`` (each part's dict of metric values, or list
        of such dicts) becomes one dict of lists, a value per part that reports the metric, in part order:
        ``{"loss": 0.5}`` and ``{"loss": 0.6}`` give ``{"loss": [0.5, 0.6]}``. Every other key is kept
        once; a key present in several parts must hold equal values there.

        Raises:
            ValueError: empty input, parts that differ in keys, tensor dtypes or trailing shapes, a meta_info
                key with different values in two parts, or metrics that are not dicts.
        """
        if not data:
            raise ValueError("concat: got no DataProto to concatenate")
        first = data[0]
        for i, part in enumerate(data[1:], start=1):
            for kind, mine, theirs in (
                ("tensor", first.batch, part.batch),
                ("non-tensor", first.non_tensor_batch, part.non_tensor_batch),
            ):
                if mine.keys() != theirs.keys():
                    k = sorted(mine.keys() ^ theirs.keys())[0]
                    has, lacks = (0, i) if k in mine else (i, 0)
                    raise ValueError(f"concat: {kind} {k!r} is in part {has} but not in part {lacks}")
                for k in mine:
                    a, b = mine[k], theirs[k]  # numpy arrays may differ in dtype (<U2 vs <U5): numpy promotes
                    if (kind == "tensor" and a.dtype != b.dtype) or a.shape[1:] != b.shape[1:]:
                        raise ValueError(
                            f"concat: {kind} {k!r} is {a.dtype}{list(a.shape[1:])} per row in part 0, "
                            f"but {b.dtype}{list(b.shape[1:])} in part {i}"
                        )
        meta = merge_meta([d.meta_info for d in data])
        return DataProto(
            {k: torch.cat([d.batch[k] for d in data]) for k in first.batch},
            {k: np.concatenate([d.non_tensor_batch[k] for d in data]) for k in first.non_tensor_batch},
            meta,
        )

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> DataProto:
        """Repeat every row ``repeat_times`` times: ``(batch, ...)`` -> ``(batch * repeat_times, ...)``.

        Args:
            repeat_times: copies of each row (>= 1).
            interleave: ``True`` gives ``a a b b`` (copies of a row are adjacent, e.g. GRPO's n samples per
                prompt); ``False`` gives ``a b a b`` (the whole batch tiled).
        """
        if repeat_times < 1:
            raise ValueError(f"repeat: repeat_times must be >= 1, got {repeat_times}")
        if interleave:
            tensors = {k: t.repeat_interleave(repeat_times, dim=0) for k, t in self.batch.items()}
            arrays = {k: np.repeat(a, repeat_times, axis=0) for k, a in self.non_tensor_batch.items()}
        else:
            tensors = {k: t.repeat(repeat_times, *([1] * (t.ndim - 1))) for k, t in self.batch.items()}
            arrays = {k: np.concatenate([a] * repeat_times) for k, a in self.non_tensor_batch.items()}
        return self._new(tensors, arrays)

    def sample_level_repeat(self, repeat_times: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Repeat row ``i`` ``repeat_times[i]`` times, copies adjacent (verl's name; 0 drops the row).

        ``(batch, ...)`` -> ``(sum(repeat_times), ...)``.

        Raises:
            ValueError: ``repeat_times`` is not one non-negative integer per row.
        """
        counts = np.asarray(repeat_times.cpu() if isinstance(repeat_times, torch.Tensor) else repeat_times)
        n = len(self)
        if counts.shape != (n,) or (n and (counts.dtype.kind not in "iu" or counts.min() < 0)):
            raise ValueError(
                f"sample_level_repeat: repeat_times must hold one integer >= 0 per row ({n}), got "
                f"{counts.dtype}{list(counts.shape)}"
            )
        counts = counts.astype(np.int64)
        return self._new(
            {k: t.repeat_interleave(torch.as_tensor(counts, device=t.device), dim=0) for k, t in self.batch.items()},
            {k: np.repeat(a, counts, axis=0) for k, a in self.non_tensor_batch.items()},
        )

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Permute the rows in place (row ``i`` becomes old row ``indices[i]``) and return this DataProto.

        Raises:
            ValueError: ``indices`` is not a permutation of ``range(batch)``.
        """
        n = len(self)
        rows = self._rows(indices)
        if len(rows) != n or not np.array_equal(np.sort(rows), np.arange(n)):
            raise ValueError(f"reorder: indices must be a permutation of range({n}), got {len(rows)} indices")
        reordered = self[rows]
        self.batch, self.non_tensor_batch = reordered.batch, reordered.non_tensor_batch
        return self

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Pad the batch to a multiple of ``divisor`` by repeating leading rows (cyclically, like verl).

        Returns:
            ``(padded, pad_size)`` with ``len(padded) == len(self) + pad_size``; undo with ``unpad(pad_size)``.
        """
        if divisor < 1:
            raise ValueError(f"pad_to_divisor: divisor must be >= 1, got {divisor}")
        n = len(self)
        pad_size = -n % divisor
        if pad_size == 0:
            return self[:], 0
        padded = DataProto.concat([self, self[np.arange(pad_size) % n]])
        padded.meta_info = dict(self.meta_info)  # not concat's merge: that would turn metrics into lists
        return padded, pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last ``pad_size`` rows (the padding added by :meth:`pad_to_divisor`)."""
        n = len(self)
        if not 0 <= pad_size <= n:
            raise ValueError(f"unpad: pad_size {pad_size} must lie in [0, {n}] for a batch of {n} rows")
        return self[: n - pad_size]

    def make_iterator(
        self,
        mini_batch_size: int,
        epochs: int = 1,
        seed: int | None = 0,
        dataloader_kwargs: Mapping[str, Any] | None = None,
        shuffle: bool | None = None,
    ) -> Iterator[DataProto]:
        """Mini-batches of ``(mini_batch_size, ...)`` rows over ``epochs`` passes through the batch.

        As in verl, rows come in order unless shuffling is asked for, with ``shuffle=True`` or verl's
        ``dataloader_kwargs={"shuffle": True}``. Each epoch visits every row exactly once; shuffled, each epoch
        draws a new permutation from one ``torch.Generator`` seeded with ``seed`` (the same on every rank and
        every run; ``seed=None``, as in verl, draws from torch's global RNG instead).

        Args:
            mini_batch_size: rows per mini-batch; must divide the batch.
            epochs: passes through the batch.
            seed: the shuffle's seed.
            dataloader_kwargs: verl's spelling; only ``"shuffle"`` means something here (there is no
                DataLoader), any other key is an error.
            shuffle: shuffle rows; ``None`` takes ``dataloader_kwargs["shuffle"]``, default ``False``.

        Raises:
            ValueError: ``batch`` is not divisible by ``mini_batch_size`` (checked here, not at first ``next``),
                an unknown ``dataloader_kwargs`` key, or ``shuffle`` disagreeing with ``dataloader_kwargs``.
        """
        n = len(self)
        if mini_batch_size < 1 or epochs < 0:
            raise ValueError(
                f"make_iterator: need mini_batch_size >= 1 and epochs >= 0, got {mini_batch_size}, {epochs}"
            )
        if n % mini_batch_size:
            raise ValueError(
                f"make_iterator: batch size {n} is not divisible by mini_batch_size {mini_batch_size}; "
                f"pad_to_divisor({mini_batch_size}) or pick a divisor"
            )
        kwargs = dict(dataloader_kwargs or {})
        for key in kwargs:
            if key != "shuffle":
                raise ValueError(
                    f"make_iterator: dataloader_kwargs key {key!r} is not supported (verl hands these to a torch "
                    "DataLoader; hybridrl's iterator has none and reads only 'shuffle'); drop it"
                )
        if shuffle is not None and "shuffle" in kwargs and bool(kwargs["shuffle"]) != shuffle:
            raise ValueError(
                f"make_iterator: shuffle={shuffle} but dataloader_kwargs['shuffle']={kwargs['shuffle']}; pass one"
            )
        shuffle = bool(kwargs.get("shuffle", False)) if shuffle is None else shuffle
        generator = torch.Generator().manual_seed(seed) if seed is not None else None

        def batches() -> Iterator[DataProto]:
            for _ in range(epochs):
                order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
                for start in range(0, n, mini_batch_size):
                    yield self[order[start : start + mini_batch_size]]

        return batches()

    # ---- devices and files -------------------------------------------------------------------------------

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DataProto:
        """Move every tensor to ``device`` in place and return this DataProto (verl semantics)."""
        self.batch = {k: t.to(device, non_blocking=non_blocking) for k, t in self.batch.items()}
        return self

    def save_to_disk(self, filepath: str | os.PathLike) -> None:
        """Write this DataProto to ``filepath`` (a safetensors file; see ``hybridrl/protocol_io.py``).

        Raises:
            TypeError: a non-tensor or meta_info value the file cannot hold (names the field): tensors, numpy
                arrays and scalars, and None/bool/int/float/str/bytes with lists, tuples and dicts of them.
        """
        from hybridrl import protocol_io

        protocol_io.save(self, filepath)

    @classmethod
    def load_from_disk(cls, filepath: str | os.PathLike) -> DataProto:
        """Read a file written by :meth:`save_to_disk`; tensors land on the CPU. Never unpickles.

        Raises:
            FileNotFoundError: no file at ``filepath``.
            ValueError: not a file written by ``save_to_disk`` (e.g. verl's pickle): refused, never unpickled.
        """
        from hybridrl import protocol_io

        return protocol_io.load(filepath)


def pad_dataproto_to_divisor(data: DataProto, size_divisor: int) -> tuple[DataProto, int]:
    """verl's name for :meth:`DataProto.pad_to_divisor`: ``(padded, pad_size)``."""
    return data.pad_to_divisor(size_divisor)


def unpad_dataproto(data: DataProto, pad_size: int) -> DataProto:
    """verl's name for :meth:`DataProto.unpad`: drops the last ``pad_size`` rows."""
    return data.unpad(pad_size)


from hybridrl.protocol_dist import all_gather, scatter  # noqa: E402  (re-export; protocol_dist imports us lazily)

__all__ = [
    "DataProto",
    "DataProtoItem",
    "all_gather",
    "pad_dataproto_to_divisor",
    "scatter",
    "unpad_dataproto",
]

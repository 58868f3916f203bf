"""DataProto: the batch that moves between RL roles (rollout, actor, reference, critic, reward).

This module owns the batch container and every single-process operation on it: construction and
validation, field selection (select / pop / union / rename), row indexing, chunk / split / concat, repeat,
reorder, padding to a divisor, mini-batch iteration, save / load and pickling. The collectives that move a
DataProto over a process group (:func:`scatter`, :func:`all_gather`) live in ``hybridrl/protocol_dist.py``
and are re-exported here.

A DataProto holds three things:
- ``batch``: a plain ``dict[str, torch.Tensor]``; every tensor's first dim is the batch dim;
- ``non_tensor_batch``: a ``dict[str, np.ndarray]`` (usually 1-D object arrays: uids, raw prompts,
  ground truths); first dim is the batch dim too;
- ``meta_info``: a free-form dict (temperature, step, ...), not indexed by row.

``batch`` is a plain dict rather than a ``tensordict.TensorDict`` (what verl uses) on purpose: tensordict
pins torch releases tightly, and a plain dict plus the few helpers below is all an RL loop needs.

Mutation follows verl, so code ported from verl keeps working: ``pop``, ``union``, ``rename``,
``reorder`` and ``to`` change the DataProto in place and return it (``pop`` returns the removed part);
every other operation returns a new DataProto. New DataProtos share tensor storage with their source where
torch does (a slice is a view) and get their own shallow copy of ``meta_info``.
"""

from __future__ import annotations

import math
import os
import pickle
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor
_FORMAT = "hybridrl.DataProto/1"


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


def _tensor_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _values_equal(a: Any, b: Any) -> bool:
    """Value equality for tensors, arrays (object arrays element-wise), containers and scalars; NaN == NaN."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensor_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype.hasobject or b.dtype.hasobject:
            return all(_values_equal(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1), strict=True))
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc" and b.dtype.kind in "fc"))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and type(a) is type(b):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # == that returns something without a truth value
        return False


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a copy when it views a larger storage (pickling a view would ship the whole storage)."""
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return t.clone()
    return t


def _encode_array(a: np.ndarray) -> Any:
    """A non-tensor array as builtins, so that ``torch.load(weights_only=True)`` can read it back."""
    if a.dtype.hasobject:
        return {"shape": list(a.shape), "items": list(a.reshape(-1))}
    if a.dtype.names is None:
        return {"shape": list(a.shape), "dtype": a.dtype.str, "data": np.ascontiguousarray(a).tobytes()}
    return a  # structured dtype: pickled by numpy, needs weights_only=False to load


def _decode_array(enc: Any) -> np.ndarray:
    if isinstance(enc, np.ndarray):
        return enc
    if "items" in enc:
        arr = np.empty(len(enc["items"]), dtype=object)
        for i, v in enumerate(enc["items"]):
            arr[i] = v
        return arr.reshape(enc["shape"])
    return np.frombuffer(enc["data"], dtype=np.dtype(enc["dtype"])).reshape(enc["shape"]).copy()


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

    # ---- fields ------------------------------------------------------------------------------------------

    def _missing(self, op: str, keys: list[str] | None, fields: Mapping[str, Any], kind: str) -> None:
        for k in keys or []:
            if k not in fields:
                raise KeyError(f"{op}: no {kind} field {k!r}; available: {sorted(fields)}")

    def select(
        self,
        keys: str | Iterable[str] | None = None,
        non_tensor_keys: str | Iterable[str] | None = None,
        meta_keys: str | Iterable[str] | None = None,
    ) -> DataProto:
        """A new DataProto with only the named fields (``None`` keeps all of that kind); tensors are shared."""
        keys, non_tensor_keys, meta_keys = _key_list(keys), _key_list(non_tensor_keys), _key_list(meta_keys)
        self._missing("select", keys, self.batch, "tensor")
        self._missing("select", non_tensor_keys, self.non_tensor_batch, "non-tensor")
        self._missing("select", meta_keys, self.meta_info, "meta_info")
        return DataProto(
            _pick(self.batch, keys), _pick(self.non_tensor_batch, non_tensor_keys), _pick(self.meta_info, meta_keys)
        )

    def pop(
        self,
        keys: str | Iterable[str] | None = None,
        non_tensor_keys: str | Iterable[str] | None = None,
        meta_keys: str | Iterable[str] | None = None,
    ) -> DataProto:
        """Remove the named fields from this DataProto (``None`` removes none) and return them as a new one."""
        keys, non_tensor_keys, meta_keys = _key_list(keys) or [], _key_list(non_tensor_keys) or [], _key_list(meta_keys)
        self._missing("pop", keys, self.batch, "tensor")
        self._missing("pop", non_tensor_keys, self.non_tensor_batch, "non-tensor")
        self._missing("pop", meta_keys, self.meta_info, "meta_info")
        return DataProto(
            {k: self.batch.pop(k) for k in keys},
            {k: self.non_tensor_batch.pop(k) for k in non_tensor_keys},
            {k: self.meta_info.pop(k) for k in meta_keys or []},
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
                if not _values_equal(mine[k], theirs[k]):
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
        """Concatenate DataProtos with the same fields along the batch dim.

        ``meta_info`` is merged; a key present in several parts must hold equal values.

        Raises:
            ValueError: empty input, or parts that differ in keys, tensor dtypes, trailing shapes or meta values.
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
        meta: dict[str, Any] = {}
        source: dict[str, int] = {}
        for i, part in enumerate(data):
            for k, v in part.meta_info.items():
                if k in meta and not _values_equal(meta[k], v):
                    raise ValueError(f"concat: meta_info {k!r} differs between part {source[k]} and part {i}; pop it")
                meta.setdefault(k, v)
                source.setdefault(k, i)
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
        return DataProto.concat([self, self[np.arange(pad_size) % n]]), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last ``pad_size`` rows (the padding added by :meth:`pad_to_divisor`)."""
        n = len(self)
        if not 0 <= pad_size <= n:
            raise ValueError(f"unpad: pad_size {pad_size} must lie in [0, {n}] for a batch of {n} rows")
        return self[: n - pad_size]

    def make_iterator(
        self, mini_batch_size: int, epochs: int = 1, shuffle: bool = True, seed: int = 0
    ) -> Iterator[DataProto]:
        """Mini-batches of ``(mini_batch_size, ...)`` rows over ``epochs`` passes through the batch.

        Each epoch visits every row exactly once; with ``shuffle`` each epoch draws a new permutation from one
        ``torch.Generator`` seeded with ``seed``, so the sequence is the same on every rank and every run.

        Raises:
            ValueError: ``batch`` is not divisible by ``mini_batch_size`` (checked here, not at first ``next``).
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
        generator = torch.Generator().manual_seed(seed)

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

    def save(self, path: str | os.PathLike) -> None:
        """Write to ``path`` with ``torch.save`` as plain dicts (views are compacted first).

        Non-tensor arrays are stored as builtins (object arrays as lists of their items, other arrays as raw
        bytes), so a file whose object arrays and meta_info hold only builtins (str, int, float, bool, None,
        list, tuple, dict) and tensors loads with ``weights_only=True``.
        """
        torch.save(
            {
                "format": _FORMAT,
                "batch": {k: _compact(t) for k, t in self.batch.items()},
                "non_tensor_batch": {k: _encode_array(a) for k, a in self.non_tensor_batch.items()},
                "meta_info": self.meta_info,
            },
            path,
        )

    @classmethod
    def load(
        cls, path: str | os.PathLike, map_location: str | torch.device | None = "cpu", weights_only: bool = True
    ) -> DataProto:
        """Read a DataProto written by :meth:`save`.

        Args:
            path: the file.
            map_location: where tensors go (``torch.load``'s argument).
            weights_only: load with torch's restricted unpickler (safe for untrusted files). Files whose
                non-tensor arrays or meta_info hold other Python objects (numpy scalars, custom classes,
                images) need ``weights_only=False``: only do that for files you trust, it runs pickle.
        """
        try:
            payload = torch.load(path, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError as err:
            if not weights_only:
                raise
            found = re.search(r"GLOBAL (\S+)", str(err))
            what = f" ({found.group(1)})" if found else ""
            raise pickle.UnpicklingError(
                f"DataProto.load({os.fspath(path)!r}): the file holds Python objects beyond tensors and builtins"
                f"{what}; if you trust the file, pass weights_only=False"
            ) from err
        if not isinstance(payload, dict) or payload.get("format") != _FORMAT:
            raise ValueError(f"DataProto.load({os.fspath(path)!r}): not a file written by DataProto.save")
        arrays = {k: _decode_array(v) for k, v in payload["non_tensor_batch"].items()}
        return cls(payload["batch"], arrays, payload["meta_info"])


from hybridrl.protocol_dist import all_gather, scatter  # noqa: E402  (re-export; protocol_dist imports us lazily)

__all__ = ["DataProto", "DataProtoItem", "all_gather", "scatter"]

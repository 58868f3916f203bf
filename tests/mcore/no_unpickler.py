"""Test helpers: every unpickler a disk read could reach made unreachable, a strict equality of loaded values, and
DCP folders with a code-running pickle planted in them (:func:`plant_in_metadata`, :func:`plant_as_item`).

:func:`unpickler_unreachable` replaces ``pickle.load`` / ``pickle.loads`` / ``pickle.Unpickler`` (and the pure-Python
one), ``torch.load`` (``torch.serialization.load``) and torch's weights-only unpickler with functions that raise,
for the duration of a ``with`` block. Object collectives keep working: ``torch.distributed`` bound its unpickler
when it was imported (in-memory messages between ranks, not files).
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import Any

import torch


class UnpicklerReachedError(AssertionError):
    """Something read through an unpickler while :func:`unpickler_unreachable` was active."""


def _raiser(name: str):
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnpicklerReachedError(f"{name} was called")

    return refuse


@contextlib.contextmanager
def unpickler_unreachable() -> Iterator[None]:
    import torch._weights_only_unpickler as wou

    targets = [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (pickle, "_Unpickler"), (torch, "load"),
               (torch.serialization, "load"), (wou, "load"), (wou, "Unpickler")]  # fmt: skip
    saved = [(mod, name, getattr(mod, name)) for mod, name in targets]
    try:
        for mod, name in targets:
            setattr(mod, name, _raiser(f"{mod.__name__}.{name}"))
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as uint8 (views compare by what they share)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def assert_same(a: Any, b: Any, where: str = "value") -> None:
    """``a`` and ``b`` are the same data: types, container structure and key order, tensors bitwise with the same
    dtype, size, stride, storage offset and requires_grad, NumPy arrays equal with the same dtype."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        same = (a.dtype, a.shape, a.stride(), a.storage_offset(), a.requires_grad)
        assert same == (b.dtype, b.shape, b.stride(), b.storage_offset(), b.requires_grad), where
        assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes(), where
        assert torch.equal(_bytes(a), _bytes(b)), f"{where}: bytes differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)[:5]} vs {list(b)[:5]}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif type(a).__module__ == "numpy" and hasattr(a, "dtype"):
        assert a.dtype == b.dtype and a.shape == b.shape and (a == b).all(), where
    else:
        assert a == b, f"{where}: {a!r:.60} vs {b!r:.60}"


def plant_in_metadata(folder: Any, payload: Any) -> None:
    """Put ``payload`` (a pickle that runs code) in the DCP folder's ``.metadata``, as its planner data."""
    path = folder / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    metadata.planner_data = payload
    path.write_bytes(pickle.dumps(metadata))


def plant_as_item(folder: Any, payload: Any) -> str:
    """Append ``payload`` to a shard of the DCP folder and point a non-tensor item at it; the shard.

    The item is the first by (shard file, name): the metadata's own order follows the order the ranks' writer
    threads finished in, which differs between runs, so its first item sits in ``__0_0.distcp`` or another file.
    """
    import dataclasses
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = pickle.loads((folder / ".metadata").read_bytes())
    items = [(i, s) for i, s in metadata.storage_data.items()
             if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata)]  # fmt: skip
    index, info = min(items, key=lambda item: (item[1].relative_path, item[0].fqn, item[1].offset))
    data = io.BytesIO()
    torch.save([payload], data)
    shard = folder / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(data.getvalue())
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(data.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    return str(shard)

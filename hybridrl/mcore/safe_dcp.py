"""``torch.distributed.checkpoint`` folders read without an unpickler: :class:`SafeFileSystemReader` and the checks.

torch's :class:`~torch.distributed.checkpoint.FileSystemReader` runs a full unpickler twice: on ``.metadata``
in ``read_metadata``, and on every non-tensor item in the planner's ``load_bytes``; its tensors go through
torch's weights-only unpickler. This reader keeps its
storage layout (``.metadata`` + ``.distcp`` shards, each item a ``torch.save`` archive at an offset) and replaces
the three:

- ``.metadata`` is read as records (:mod:`hybridrl.mcore.pickle_records`) and built as torch's own metadata
  objects from an explicit allow-list (:data:`METADATA_HANDLERS`: the dataclasses and enums DCP writes,
  ``torch.Size``, dtypes, layouts, a ``PosixPath`` checkpoint id); no class of the file's choosing is imported;
- every item, tensor or not, is read by :func:`hybridrl.mcore.torch_file.load_torch_window` (tensors, plain
  data); a non-tensor item is stored where ``DefaultLoadPlanner.load_bytes`` would store it (every planner in
  use, torch's and Megatron's ``MCoreLoadPlanner``, inherits that method; another one is refused);
- items stored through stream transforms (compression extensions) and shard paths outside the folder are refused.

:func:`check_torch_dcp` / :func:`check_dist_checkpoint` pass a folder through the same readers without loading
tensors (every rank, before any rank loads: all refuse together). :func:`load_full_state` reads a whole folder
into one process, in memory (what ``dcp_to_torch_save`` does, minus its round trip through a ``torch.save`` file).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from collections.abc import Iterator
from enum import Enum
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_fs
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from hybridrl.mcore.checkpoint_safety import CorruptCheckpointError, UnsafeCheckpointError, corrupt, refusal
from hybridrl.mcore.pickle_records import SETSTATE, Global, OutsideSubsetError, Record, read_records
from hybridrl.mcore.torch_file import (
    DTYPES,
    HANDLERS,
    Builder,
    RefusedError,
    call_args,
    check_torch_file,
    load_torch_window,
)

DIST_BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}
"""The ``metadata.json`` backends of the Megatron folders hybridrl writes and reads."""


def _dataclass(cls: type) -> Any:
    """How pickle builds ``cls`` (``NEWOBJ`` without arguments, then ``BUILD``), for an allow-listed class only:
    its own ``__setstate__`` when it has one (``TensorProperties``), else the state as its ``__dict__``."""

    def build(b: Builder, r: Record) -> Any:
        if not r.new or r.args:
            raise ValueError(f"{cls.__name__} built with arguments {r.args!r:.60}")
        state = b.build(r.state)
        obj = cls.__new__(cls)
        if SETSTATE in state:
            if "__setstate__" not in vars(cls) or len(state) != 1:
                raise ValueError(f"{cls.__name__} given a state it does not take")
            obj.__setstate__(state[SETSTATE])
        elif all(isinstance(k, str) for k in state):
            obj.__dict__.update(state)  # what pickle's BUILD does (frozen dataclasses included)
        else:
            raise ValueError(f"{cls.__name__} given attributes that are not names")
        return obj

    return build


def _enum(cls: type[Enum]) -> Any:
    return lambda b, r: cls(call_args(b, r, int | str)[0])


def _path(b: Builder, r: Record) -> pathlib.PurePath:
    parts = call_args(b, r, *[str] * len(r.args))
    return pathlib.PosixPath(*parts)


_CLASSES = [getattr(dcp_md, name) for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                               "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                               "StorageMeta")]  # fmt: skip
_CLASSES += [dcp_planner.SavePlan, dcp_planner.WriteItem, dcp_planner.TensorWriteData, dcp_planner.BytesIOWriteData]
_CLASSES += [dcp_fs._StorageInfo]
_ENUMS = (dcp_md._MEM_FORMAT_ENCODING, dcp_planner.WriteItemType)
METADATA_HANDLERS = {
    **{Global(c.__module__, c.__qualname__): _dataclass(c) for c in _CLASSES},
    **{Global(e.__module__, e.__qualname__): _enum(e) for e in _ENUMS},
    Global("pathlib", "PosixPath"): _path,  # StorageMeta.checkpoint_id of a FileSystemWriter save
    **{g: HANDLERS[g] for g in (Global("torch", "Size"), Global("torch.serialization", "_get_layout"))},
}
"""Everything a DCP ``.metadata`` may build (besides containers and dtypes): torch 2.x writes nothing else."""


_CHECKED: dict[str, tuple[tuple, dcp_md.Metadata]] = {}  # path -> (its stat, the metadata its check built)


def _stat_key(path: str) -> tuple:
    st = os.stat(path)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _checked_metadata(path: str) -> dcp_md.Metadata | None:
    """The metadata :func:`check_torch_dcp` built from ``path``, once, if the file is unchanged since: the load
    then uses exactly what was checked, and a large index is not parsed twice."""
    found = _CHECKED.pop(os.path.normpath(path), None)
    try:
        return found[1] if found is not None and found[0] == _stat_key(path) else None
    except OSError:
        return None


def read_dcp_metadata(path: str) -> dcp_md.Metadata:
    """The :class:`~torch.distributed.checkpoint.metadata.Metadata` pickled in ``path``, built without an
    unpickler (see the module docs).

    Raises:
        UnsafeCheckpointError: a global or opcode outside :data:`METADATA_HANDLERS`.
        CorruptCheckpointError: missing, truncated, or not checkpoint metadata.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
        metadata = Builder(METADATA_HANDLERS, DTYPES).build(read_records(data))
    except RefusedError as err:
        raise refusal(path, f"the global {err.name} (not a torch checkpoint-metadata class)") from None
    except OutsideSubsetError as err:
        raise refusal(path, str(err)) from None
    except Exception as err:  # missing, truncated or not a pickle: say which file
        raise corrupt(path, err) from None
    if not isinstance(metadata, dcp_md.Metadata):
        raise corrupt(path, TypeError(f"it holds a {type(metadata).__name__}, not checkpoint metadata"))
    return metadata


def _shard_path(folder: str, info: Any, fqn: str) -> str:
    """The shard file of an item; a path that leaves the folder, or a transformed item, is refused."""
    relative = getattr(info, "relative_path", None)
    if not isinstance(relative, str) or os.path.basename(relative) != relative or relative in ("", ".", ".."):
        raise refusal(os.path.join(folder, ".metadata"), f"the item {fqn} stored at {relative!r} (outside its folder)")
    path = os.path.join(folder, relative)
    if getattr(info, "transform_descriptors", None):
        raise refusal(path, f"the item {fqn} stored through transforms {info.transform_descriptors}")
    if type(info.offset) is not int or type(info.length) is not int:
        raise corrupt(path, ValueError(f"item {fqn} has no integer offset and length"))
    return path


def store_loaded_bytes(planner: LoadPlanner, item: Any, value: Any) -> None:
    """Put the non-tensor ``value`` where ``DefaultLoadPlanner.load_bytes`` puts what it unpickles."""
    if type(planner).load_bytes is not DefaultLoadPlanner.load_bytes:
        raise TypeError(f"{type(planner).__name__} overrides load_bytes: hybridrl reads non-tensor items only for "
                        "planners that store them as DefaultLoadPlanner does")  # fmt: skip
    fqn = item.dest_index.fqn
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], value)
    else:
        planner.state_dict[fqn] = value


class SafeFileSystemReader(FileSystemReader):
    """A :class:`~torch.distributed.checkpoint.FileSystemReader` that never unpickles (see the module docs)."""

    failure: UnsafeCheckpointError | CorruptCheckpointError | None = None
    """The first error of this reader: DCP reports it wrapped, :func:`readers_errors` unwraps it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_md.Metadata:
        try:
            path = str(self._get_metadata_path(kwargs.get("rank")))
            metadata = _checked_metadata(path) or read_dcp_metadata(path)
        except (UnsafeCheckpointError, CorruptCheckpointError) as err:
            self.failure = self.failure or err
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_md.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        folder, per_file = str(self.path), {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            per_file.setdefault(_shard_path(folder, info, item.storage_index.fqn), []).append(item)
        for path, items in per_file.items():
            try:
                with open(path, "rb") as f:
                    for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                        self._read_item(f, path, item, planner)
            except (UnsafeCheckpointError, CorruptCheckpointError) as err:
                self.failure = self.failure or err
                raise
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_item(self, f: Any, path: str, item: Any, planner: LoadPlanner) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        info, fqn = self.storage_data[item.storage_index], item.storage_index.fqn
        value = load_torch_window(f, info.offset, info.length, path, what=f"in its item {fqn} ")
        if item.type == LoadItemType.BYTE_IO:
            store_loaded_bytes(planner, item, value)
            return
        if not isinstance(value, torch.Tensor):
            raise corrupt(path, TypeError(f"item {fqn} holds a {type(value).__name__}, not a tensor"))
        value = narrow_tensor_by_index(value, item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != value.size():
            sizes = f"{tuple(value.size())}, the model wants {tuple(target.size())}"
            raise corrupt(path, ValueError(f"item {fqn} is {sizes}"))
        target.copy_(value)
        planner.commit_tensor(item, target)


@contextlib.contextmanager
def readers_errors(reader: SafeFileSystemReader) -> Iterator[None]:
    """Re-raise the one-line error of ``reader`` (or of a peer's) that DCP wrapped in its multi-rank
    ``CheckpointException`` (a refusal found while loading: a file changed after the check, or no check)."""
    try:
        yield
    except CheckpointException as err:
        if reader.failure is not None:
            raise reader.failure from None
        found = []  # the readers' errors in the chain of each rank's failure, the first raised last
        for exc, _ in err.failures.values():
            while exc is not None:
                if isinstance(exc, UnsafeCheckpointError | CorruptCheckpointError):
                    found.append(exc)
                exc = exc.__cause__ or exc.__context__
        unsafe = [e for e in found if isinstance(e, UnsafeCheckpointError)]
        if unsafe or found:
            raise (unsafe or found)[-1] from None
        raise


def check_torch_dcp(folder: str) -> None:
    """Pass a ``torch.distributed.checkpoint`` folder through the readers :class:`SafeFileSystemReader` uses:
    its ``.metadata`` and every item of its shards (tensors built on the meta device: no tensor bytes read).

    Raises:
        UnsafeCheckpointError: a global or opcode outside the allow-lists; the message names the file.
        CorruptCheckpointError: a file is missing or cannot be parsed.
    """
    path = os.path.join(folder, ".metadata")
    stat, metadata = _stat_key(path) if os.path.exists(path) else None, read_dcp_metadata(path)
    per_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        per_file.setdefault(_shard_path(folder, info, index.fqn), []).append((index.fqn, info))
    for shard, items in per_file.items():
        try:
            f = open(shard, "rb")  # noqa: SIM115 (closed below; a missing shard is named as corrupt)
        except OSError as err:
            raise corrupt(shard, err) from None
        with f:
            for fqn, info in items:
                load_torch_window(f, info.offset, info.length, shard, what=f"in its item {fqn} ", read=False)
    if len(_CHECKED) > 16:  # folders checked and never loaded (another rank's coordinator role)
        _CHECKED.pop(next(iter(_CHECKED)))
    _CHECKED[os.path.normpath(path)] = (stat, metadata)


def check_dist_checkpoint(folder: str) -> None:
    """Refuse a Megatron ``torch_dist`` folder whose loading would build more than tensors and plain data: its
    ``metadata.json`` backends (only :data:`DIST_BACKENDS`), ``common.pt`` and the DCP folder itself.

    Raises:
        UnsafeCheckpointError / CorruptCheckpointError: as :func:`check_torch_dcp`.
    """
    config_file = os.path.join(folder, "metadata.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise corrupt(config_file, err) from None
    for key, want in DIST_BACKENDS.items():
        if config.get(key) != want:
            raise refusal(config_file, f"{key}={config.get(key)!r} (hybridrl writes and reads only {want!r})")
    if os.path.isfile(os.path.join(folder, "common.pt")):
        check_torch_file(os.path.join(folder, "common.pt"))
    check_torch_dcp(folder)


def load_full_state(folder: str) -> dict[str, Any]:
    """Every item of the DCP folder, whole, in this process (no process group needed): the nested state dict
    that was saved, tensors on the CPU.

    Raises:
        UnsafeCheckpointError / CorruptCheckpointError: as :func:`check_torch_dcp`.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = SafeFileSystemReader(folder)
    with readers_errors(reader):
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state


__all__ = ["CorruptCheckpointError", "SafeFileSystemReader", "UnsafeCheckpointError", "check_dist_checkpoint",
           "check_torch_dcp", "load_full_state", "read_dcp_metadata", "readers_errors"]  # fmt: skip

"""Reading checkpoint files without running code from them: the checks every reader of a checkpoint goes through.

A pickle can call any importable function while it loads, so a file planted in a checkpoint folder could run
code on every rank at resume. What hybridrl reads therefore never goes through a full unpickler:

- ``.pt`` files (optimizer state) load with ``torch.load(weights_only=True)``: torch's restricted unpickler,
  which builds tensors, containers and numbers and refuses everything else (:func:`load_weights_only`);
- trainer state is JSON and RNG states are safetensors + JSON (``hybridrl.mcore.checkpoint``);
- Megatron's ``torch_dist`` folders (``model/``, ``optim/``) are checked by :func:`check_dist_checkpoint`
  BEFORE ``dist_checkpointing.load`` sees them, because two of the readers underneath it unpickle in full:
  ``torch.distributed.checkpoint.FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``, and
  ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)`` on every non-tensor item stored in
  the ``.distcp`` files (Megatron's ``ShardedObject``: the layers' ``_extra_state``). The check reads the
  globals of ``.metadata`` from its opcodes against an allow-list of the metadata dataclasses torch writes, reads
  the index itself as plain records (:mod:`hybridrl.mcore.pickle_records`: hybridrl never unpickles it), loads
  every such item (and ``common.pt``) weights-only, and accepts only the ``torch_dist`` / ``torch`` backends in
  ``metadata.json``. Once it passes, the unpickling inside torch's reader can only build the objects the check
  allowed.

What this does not cover: a file swapped between the check and the load (an attacker already racing the job
on its own file system), and the model's HF folder, which is read as safetensors and JSON only.
"""

from __future__ import annotations

import _compat_pickle
import io
import json
import os
import pickle
import pickletools
import re
from typing import Any

import torch

from hybridrl.errors import InputError
from hybridrl.mcore.pickle_records import Record, read_records

DIST_BACKENDS = {"sharded_backend": "torch_dist", "common_backend": "torch"}
_DCP = "torch.distributed.checkpoint"
# what torch.distributed.checkpoint (torch 2.x) pickles into .metadata: its own dataclasses and enums
_METADATA_CLASSES = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")  # fmt: skip
_METADATA_GLOBALS = (
    {(f"{_DCP}.metadata", name) for name in _METADATA_CLASSES}
    | {(f"{_DCP}.planner", name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")}
    | {
        (f"{_DCP}.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a FileSystemWriter save (a path, built inertly)
    }
)


class UnsafeCheckpointError(InputError, ValueError):
    """A checkpoint file holds something a safe reader refuses to build (one line naming the file)."""


class CorruptCheckpointError(InputError, ValueError):
    """A checkpoint file cannot be parsed (truncated, overwritten); one line naming the file."""


def _refusal(path: str, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} holds {what}, which loading could run as code; refusing to load it. If you did not put it "
        "there, the checkpoint folder was tampered with: resume from another checkpoint"
    )


def load_weights_only(path: str) -> Any:
    """``torch.load(path, weights_only=True)`` on CPU, refusals as :class:`UnsafeCheckpointError` naming the file."""
    with open(path, "rb") as f:
        return _weights_only(f, path)


def _weights_only(file: Any, path: str, what: str = "") -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" not in str(err):
            raise _corrupt(path, err) from None
        found = _first_global(file, err)
        raise _refusal(path, f"{what}a Python object beyond tensors and builtins ({found})") from None
    except (RuntimeError, EOFError, ValueError) as err:  # a cut zip archive, a truncated pickle
        raise _corrupt(path, err) from None


def _first_global(file: Any, err: BaseException) -> str:
    """The refused global as ``module.name`` (torch's own message may give the bare name)."""
    try:
        file.seek(0)
        return torch.serialization.get_unsafe_globals_in_checkpoint(file)[0]
    except Exception:  # not seekable, or nothing listed: fall back to torch's message
        found = re.search(r"GLOBAL (\S+)", str(err))
        return found.group(1) if found else str(err).splitlines()[0]


def _corrupt(path: str, err: BaseException) -> CorruptCheckpointError:
    detail = str(err).splitlines()[0] if str(err) else ""
    return CorruptCheckpointError(f"{path} cannot be read ({type(err).__name__}: {detail}); the file is corrupt")


_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_GETS = {"GET", "BINGET", "LONG_BINGET"}
_REFUSED_OPS = {"OBJ", "EXT1", "EXT2", "EXT4", "PERSID", "BINPERSID"}  # classes off the stack, registries, hooks


def _py3_name(module: str, name: str) -> tuple[str, str]:
    """A protocol < 3 pickle's Python 2 name as the unpickler imports it (``fix_imports``, the default)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def pickle_globals(data: bytes, path: str) -> set[tuple[str, str]]:
    """Every ``(module, name)`` global the pickle ``data`` would import, read from its opcodes without building
    anything (:func:`pickletools.genops` only parses).

    ``STACK_GLOBAL`` takes its two names off the stack: accepted only when the two ops right before it (memo
    stores aside) push known strings, so the names read here are the ones the unpickler would use.

    Raises:
        UnsafeCheckpointError: an opcode that reaches objects by other means, or a ``STACK_GLOBAL`` whose names
            are not literal strings.
    """
    found: set[tuple[str, str]] = set()
    protocol = 0
    memo: dict[int, str | None] = {}
    pushed: list[str | None] = []  # the values of the last ops that pushed (None: not a known string)
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in _REFUSED_OPS:
            raise _refusal(path, f"the pickle opcode {name}")
        if name == "PROTO":
            protocol = int(arg)
        if name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            found.add(_py3_name(module, attr) if protocol < 3 else (module, attr))
            pushed.append(None)
        elif name == "STACK_GLOBAL":
            if len(pushed) < 2 or not all(isinstance(v, str) for v in pushed[-2:]):
                raise _refusal(path, "a STACK_GLOBAL whose module and name are not literal strings")
            found.add((pushed[-2], pushed[-1]))
            pushed.append(None)
        elif name in _STRINGS:
            pushed.append(str(arg))
        elif name == "MEMOIZE":
            memo[len(memo)] = pushed[-1] if pushed else None
        elif name in _MEMO_PUTS:
            memo[int(arg)] = pushed[-1] if pushed else None
        elif name in _MEMO_GETS:
            pushed.append(memo.get(int(arg)))
        elif name not in ("FRAME", "PROTO"):
            pushed.append(None)  # any other op: what follows can no longer take names from before it
    return found


def _read_metadata(folder: str) -> Any:
    """The folder's ``.metadata`` as plain records (:mod:`hybridrl.mcore.pickle_records`: nothing built or
    imported), after its globals passed the allow-list."""
    path = os.path.join(folder, ".metadata")
    try:
        with open(path, "rb") as f:
            data = f.read()
        globals_ = pickle_globals(data, path)
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # missing, truncated or not a pickle: say which file
        raise _corrupt(path, err) from None
    for module, name in sorted(globals_):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in _METADATA_GLOBALS and not dtype:
            raise _refusal(path, f"the global {module}.{name} (not a torch checkpoint-metadata class)")
    try:
        metadata = read_records(data)
    except Exception as err:
        raise _corrupt(path, err) from None
    if not _is(metadata, "Metadata"):
        raise _corrupt(path, TypeError(f"it holds a {type(metadata).__name__}, not checkpoint metadata"))
    return metadata


def _is(record: Any, name: str) -> bool:
    return isinstance(record, Record) and record.cls == (f"{_DCP}.metadata", name)


def check_dist_checkpoint(folder: str) -> None:
    """Refuse a Megatron ``torch_dist`` folder whose loading would unpickle anything but data (see module docs).

    Raises:
        UnsafeCheckpointError: another backend in ``metadata.json``, a disallowed global in ``.metadata``, or a
            non-tensor item / ``common.pt`` that the weights-only unpickler refuses; the message names the file.
        CorruptCheckpointError: one of these files is missing or cannot be parsed.
    """
    config_file = os.path.join(folder, "metadata.json")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        raise _corrupt(config_file, err) from None
    for key, want in DIST_BACKENDS.items():
        if config.get(key) != want:
            raise _refusal(config_file, f"{key}={config.get(key)!r} (hybridrl writes and reads only {want!r})")
    if os.path.isfile(os.path.join(folder, "common.pt")):
        load_weights_only(os.path.join(folder, "common.pt"))
    check_torch_dcp(folder)


def check_torch_dcp(folder: str) -> None:
    """Refuse a ``torch.distributed.checkpoint`` folder whose loading would unpickle anything but data: its
    ``.metadata`` through the allow-list, every non-tensor item weights-only (the FSDP backend's folders, and the
    shards under Megatron's ``torch_dist`` ones).

    Raises:
        UnsafeCheckpointError / CorruptCheckpointError: as :func:`check_dist_checkpoint`.
    """
    metadata = _read_metadata(folder)
    kinds = metadata.state_dict_metadata
    for index, info in metadata.storage_data.items():
        if not _is(kinds.get(index.fqn), "BytesStorageMetadata"):
            continue  # tensors: torch reads them weights-only itself
        path = os.path.join(folder, info.relative_path)
        if getattr(info, "transform_descriptors", None):
            raise _refusal(path, f"the item {index.fqn} stored through transforms {info.transform_descriptors}")
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        _weights_only(io.BytesIO(data), path, what=f"in its item {index.fqn} ")


def check_weights_only(path: str) -> None:
    """Refuse a ``.pt`` file that :func:`load_weights_only` would refuse, without loading its tensors (it reads
    only the pickle's globals), so that every rank can check its own files before any rank starts loading.

    Raises:
        UnsafeCheckpointError: a global outside torch's weights-only allow-list.  CorruptCheckpointError: no
            readable ``.pt`` archive.
    """
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as err:  # a cut or overwritten zip archive
        raise _corrupt(path, err) from None
    if unsafe:
        raise _refusal(path, f"a Python object beyond tensors and builtins ({unsafe[0]})")

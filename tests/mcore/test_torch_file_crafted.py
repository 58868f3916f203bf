"""Crafted checkpoint files against the safe readers: every one is refused or named unreadable in one line, before
anything is allocated from its claims, and normal files that look unusual still read equal to ``torch.load``.

- model state: a non-empty ``*._extra_state`` (what TransformerEngine would unpickle) is refused by
  :func:`~hybridrl.mcore.checkpoint_safety.refuse_extra_state` on :func:`hybridrl.mcore.checkpoint.load_model`'s
  path, before any module's ``set_extra_state`` sees it;
- tensors: backward hooks other than an empty dict; views reaching past their storage (read and check mode);
- the zip directory: entry sizes and header offsets past the file's end;
- values: ``bytearray`` with an encoding other than latin-1, numbers Python cannot build, tuples nested a million
  deep, a missing file, a legacy (non-zip) file; conjugate, sparse, quantized and meta tensors are "unsupported",
  not "could run as code";
- normal files: ``Module.state_dict()`` (an ``OrderedDict`` with ``_metadata``), ``b""``, empty NumPy arrays;
- Megatron's load methods that :mod:`hybridrl.mcore.safe_load` restates are pinned by their source.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import os
import struct
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

from hybridrl.mcore import checkpoint
from hybridrl.mcore.checkpoint_safety import CorruptCheckpointError, UnsafeCheckpointError, refuse_extra_state
from hybridrl.mcore.pickle_records import MAX_TUPLE_DEPTH, read_records
from hybridrl.mcore.torch_file import check_torch_file, load_torch_file
from tests.mcore.no_unpickler import assert_same, unpickler_unreachable

READERS = (load_torch_file, check_torch_file)


class _Call:
    """Pickles as the call ``fn(*args)`` (how a crafted file names a rebuild function with chosen arguments)."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _save(tmp_path, value, name: str = "crafted.pt") -> str:
    path = str(tmp_path / name)
    torch.save(value, path)
    return path


def _tensor_call(storage_bytes: int, offset: int, size: tuple, stride: tuple, hooks=None) -> _Call:
    storage = torch.zeros(storage_bytes, dtype=torch.uint8).untyped_storage()
    hooks = OrderedDict() if hooks is None else hooks
    return _Call(torch._utils._rebuild_tensor_v3, storage, offset, size, stride, False, hooks, torch.float32)


def _one_line(err: pytest.ExceptionInfo, path: str, *parts: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(path) and all(p in msg for p in parts), msg


class _TELike(torch.nn.Module):
    """A module with extra state, as TransformerEngine's layers have; records what ``set_extra_state`` got."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2))
        self.got: list = []

    def get_extra_state(self):
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        self.got.append(state)


def test_non_empty_extra_state_is_refused_before_load_state_dict(tmp_path, monkeypatch):
    folder = str(tmp_path / "model")
    for fine in (None, torch.empty(0, dtype=torch.uint8), io.BytesIO()):
        refuse_extra_state({"chunk0": {"layer._extra_state": fine, "layer.weight": torch.ones(2)}}, folder)
    planted = torch.frombuffer(bytearray(b"\x80\x04N."), dtype=torch.uint8)  # pickle.loads would run it
    for bad in (planted, io.BytesIO(b"x"), "text"):
        with pytest.raises(UnsafeCheckpointError) as err:
            refuse_extra_state({"chunk0": {"decoder.layer._extra_state": bad}}, folder)
        _one_line(err, folder, "decoder.layer._extra_state", "does not use FP8 extra state")
    # the trainer's load path: what the checkpoint gave is checked before any module's set_extra_state
    chunk = _TELike()
    monkeypatch.setattr(checkpoint, "check_dist_checkpoint", lambda path: None)
    loaded = {"chunk0": {"weight": torch.ones(2), "_extra_state": planted}}
    monkeypatch.setattr(checkpoint.safe_load, "load", lambda sd, path: loaded)
    monkeypatch.setattr(checkpoint, "_model_sharded_state_dict", lambda chunks: {})
    with pytest.raises(UnsafeCheckpointError, match="_extra_state"):
        checkpoint.load_model([chunk], folder)
    assert chunk.got == [] and chunk.weight.sum() == 0


@pytest.mark.parametrize("hooks", [[], 0, "", torch.tensor(0), {1: 2}])
def test_backward_hooks_other_than_an_empty_dict_are_refused(tmp_path, hooks):
    path = _save(tmp_path, [_tensor_call(8, 0, (2,), (1,), hooks=hooks)])
    for read in READERS:
        with pytest.raises(UnsafeCheckpointError) as err:
            read(path)
        _one_line(err, path, "backward hooks")
    param = _Call(torch._utils._rebuild_parameter, torch.ones(2), True, hooks)
    with pytest.raises((UnsafeCheckpointError, CorruptCheckpointError)):
        load_torch_file(_save(tmp_path, param, "param.pt"))


@pytest.mark.parametrize(
    ("nbytes", "offset", "size", "stride"),
    [(0, 0, (4096,), (1,)), (8, 0, (1 << 20,), (1,)), (16, 2, (3,), (1,)), (16, 0, (2, 2), (3, 1)),
     (16, -1, (2,), (1,)), (16, 0, (2,), (-1,)), (16, 0, (-2,), (1,)), (16, 0, (2, 2), (1,))],
)  # fmt: skip
def test_views_reaching_past_their_storage_are_corrupt_in_both_modes(tmp_path, nbytes, offset, size, stride):
    path = _save(tmp_path, {"t": _tensor_call(nbytes, offset, size, stride)})
    for read in READERS:
        with pytest.raises(CorruptCheckpointError) as err:
            read(path)
        _one_line(err, path, "cannot be read", "a tensor view of size")


def test_views_that_end_at_their_storage_end_read_as_torch_load(tmp_path):
    base = torch.arange(12.0)
    value = {"tail": base[9:], "t": base.view(3, 4).t(), "empty": base[12:], "wide": base.as_strided((0, 5), (9, 9))}
    path = _save(tmp_path, value)
    with unpickler_unreachable():
        got = load_torch_file(path)
        check_torch_file(path)
    assert_same(got, torch.load(path, weights_only=True))


def _entries(path: str) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def _write(path: str, entries: dict[str, bytes]) -> None:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for n, data in entries.items():
            zf.writestr(n, data)


def _patch_directory(path: str, suffix: str, *, size: int | None = None, offset: int | None = None) -> None:
    """Rewrite the central directory record of the entry ending in ``suffix``: its sizes and/or header offset."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    at = data.find(b"PK\x01\x02")
    while at >= 0:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if bytes(data[at + 46 : at + 46 + name_len]).decode().endswith(suffix):
            if size is not None:
                struct.pack_into("<LL", data, at + 20, size, size)
            if offset is not None:
                struct.pack_into("<L", data, at + 42, offset)
        at = data.find(b"PK\x01\x02", at + 4)
    with open(path, "wb") as f:
        f.write(bytes(data))


def test_zip_directory_claims_are_bounded_by_the_file(tmp_path):
    claims = 1 << 30
    big = _save(tmp_path, torch.ones(2), "big.pt")  # the pickle and the directory agree on a 1 GiB storage
    entries = _entries(big)
    pkl = next(n for n in entries if n.endswith("data.pkl"))
    entries[pkl] = entries[pkl].replace(b"K\x02t", b"J" + struct.pack("<i", claims // 4) + b"t")
    _write(big, entries)
    _patch_directory(big, "data/0", size=claims)
    cut = _save(tmp_path, {"w": torch.ones(4)}, "cut.pt")
    _patch_directory(cut, "data.pkl", size=claims)
    far = _save(tmp_path, {"w": torch.ones(4)}, "far.pt")
    _patch_directory(far, "data/0", offset=os.path.getsize(far) + 1000)
    for path, what in ((big, "past the end"), (cut, "past the end"), (far, "outside the")):
        for read in READERS:
            with pytest.raises(CorruptCheckpointError) as err:
                read(path)
            _one_line(err, path, "cannot be read", what)


def test_malformed_values_give_one_line_errors(tmp_path):
    enc = _save(tmp_path, {"b": _Call(bytearray, "abc", "utf-16")}, "enc.pt")
    huge = _save(tmp_path, {"c": _Call(complex, 10**400, 0)}, "huge.pt")
    for path, what in ((enc, "encoding 'utf-16'"), (huge, "OverflowError")):
        for read in READERS:
            with pytest.raises(CorruptCheckpointError) as err:
                read(path)
            _one_line(err, path, "cannot be read", what)
    missing = str(tmp_path / "absent.pt")
    for read in READERS:
        with pytest.raises(CorruptCheckpointError) as err:
            read(missing)
        _one_line(err, missing, "cannot be opened (FileNotFoundError")
    legacy = str(tmp_path / "legacy.pt")
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(CorruptCheckpointError) as err:
        load_torch_file(legacy)
    _one_line(err, legacy, "legacy torch.save format (before torch 1.6)", "re-save it with torch.save's default")


def test_tuples_nested_a_million_deep_are_refused_not_hashed(tmp_path):
    deep_key = b"\x80\x02}K\x00" + b"\x85" * 1_000_000 + b"K\x01s."  # {((((0,),),)...): 1}
    with pytest.raises(ValueError, match=f"nested more than {MAX_TUPLE_DEPTH} deep"):
        read_records(deep_key)
    shallow = b"\x80\x02}K\x00" + b"\x85" * MAX_TUPLE_DEPTH + b"K\x01s."
    assert len(read_records(shallow)) == 1
    path = _save(tmp_path, {}, "deep.pt")
    entries = _entries(path)
    entries[next(n for n in entries if n.endswith("data.pkl"))] = deep_key
    _write(path, entries)
    for read in READERS:
        with pytest.raises(CorruptCheckpointError) as err:
            read(path)
        _one_line(err, path, "cannot be read", "nested more than")


def test_unusual_normal_files_read_equal_to_torch_load(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.LayerNorm(3))
    value = {"model": module.state_dict(), "b": b"", "nested": [b"", bytearray()]}
    path = _save(tmp_path, value)
    with torch.serialization.safe_globals([bytes]):  # protocol 2 writes b"" as bytes(), which torch lists apart
        want = torch.load(path, weights_only=True)
    with unpickler_unreachable():
        got = load_torch_file(path)
        check_torch_file(path)
    assert_same(got, want)
    assert got["model"]._metadata == want["model"]._metadata == module.state_dict()._metadata  # kept, as torch does
    arrays = _save(tmp_path, {"e": np.empty(0), "e2": np.zeros((0, 3), np.int32)}, "np.pt")
    with unpickler_unreachable():
        got = load_torch_file(arrays, numpy=True)
    assert got["e"].shape == (0,) and got["e"].dtype == np.float64 and got["e2"].shape == (0, 3)


@pytest.mark.parametrize(
    "make",
    [lambda: torch.ones(2, dtype=torch.complex64).conj(), lambda: torch.eye(2).to_sparse(),
     lambda: torch.empty(2, device="meta"), lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)],
)  # fmt: skip
def test_other_tensor_kinds_are_unsupported_not_unsafe(tmp_path, make):
    path = _save(tmp_path, {"t": make()})
    for read in READERS:
        with pytest.raises(CorruptCheckpointError) as err:
            read(path)
        _one_line(err, path, "unsupported tensor kind")


MEGATRON_MIRRORED = {
    "load": "960cfa14f177d722",
    "load_tensors_metadata": "be79bb1bfc40a756",
    "load_sharded_metadata": "05eb6000880fba66",
}
"""sha256 prefixes of ``TorchDistLoadShardedStrategy``'s methods, as :mod:`hybridrl.mcore.safe_load` restates them."""


def test_megatron_methods_safe_load_restates_are_unchanged():
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    for name, pinned in MEGATRON_MIRRORED.items():
        source = inspect.getsource(getattr(TorchDistLoadShardedStrategy, name))
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        assert digest == pinned, (
            f"megatron-core changed TorchDistLoadShardedStrategy.{name} (sha256 {digest}, pinned {pinned}): re-check "
            "hybridrl/mcore/safe_load.py against it, then update MEGATRON_MIRRORED"
        )

"""The readers that replace every unpickler on hybridrl's checkpoint paths, against torch's own readers.

- ``torch.save`` files (:mod:`hybridrl.mcore.torch_file`): every kind of value hybridrl's checkpoints hold (all
  dtypes, views sharing a storage, offsets, 0-d and empty tensors, parameters, containers, bytes, sizes, devices,
  the NumPy arrays of earlier RNG files) reads back equal to ``torch.load(weights_only=True)`` (bitwise, same
  dtype, stride, offset, sharing), with every unpickler made unreachable;
- DCP folders (:mod:`hybridrl.mcore.safe_dcp`): ``.metadata`` builds equal to ``pickle.load``'s, the whole folder
  equal to torch's ``FileSystemReader``'s;
- planted globals (``os.system`` in ``data.pkl``, in ``.metadata``, in a non-tensor DCP item, in Megatron's
  ``common.pt``, a stack trick hiding a name) are refused in one line naming the file and the global, by the
  checks and by the loaders themselves, and nothing runs.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections import OrderedDict

import numpy as np
import pytest
import torch

from hybridrl.mcore.checkpoint_safety import CorruptCheckpointError, UnsafeCheckpointError
from hybridrl.mcore.safe_dcp import check_torch_dcp, load_full_state, read_dcp_metadata
from hybridrl.mcore.torch_file import check_torch_file, load_torch_file
from tests.mcore.no_unpickler import (
    UnpicklerReachedError,
    assert_same,
    plant_as_item,
    plant_in_metadata,
    unpickler_unreachable,
)


class _Payload:
    """Unpickled, it creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _values() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
              torch.uint8, torch.bool, torch.complex64, torch.uint16, torch.float8_e4m3fn]  # fmt: skip
    return {
        "dtypes": {str(d): (torch.randn(3, 4, generator=g) * 4).to(d) for d in dtypes},
        "views": [base, base.t(), base[2:, 1:3], base[1]],  # one storage: stays one storage
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "grad": torch.ones(2, requires_grad=True),
        "param": torch.nn.Parameter(torch.arange(4.0)),
        "ordered": OrderedDict(b=1, a=[1.5, None, True]),
        "plain": {"s": "x", "b": b"\x00\xff", "ba": bytearray(b"ab"), "c": 1 + 2j, "set": {1, 2}, "t": (1, (2,))},
        "torch": [torch.Size([2, 3]), torch.device("cpu"), torch.float16, torch.strided],
        0: {"step": torch.tensor(7.0), "exp_avg": torch.zeros(3)},  # an optimizer state's int keys
    }


def test_torch_save_files_read_equal_to_torch_load_with_no_unpickler(tmp_path):
    path = str(tmp_path / "state.pt")
    torch.save(_values(), path)
    want = torch.load(path, map_location="cpu", weights_only=True)
    with unpickler_unreachable():
        with pytest.raises(UnpicklerReachedError):  # the guard works
            torch.load(path, weights_only=True)
        got = load_torch_file(path)
        check_torch_file(path)
    assert_same(got, want)
    views = got["views"]
    assert all(v.untyped_storage().data_ptr() == views[0].untyped_storage().data_ptr() for v in views)
    got["views"][0][0, 0] = 100.0  # writable, and shared as torch.load's are
    assert got["views"][1][0, 0] == 100.0


def test_numpy_arrays_of_earlier_rng_files(tmp_path):
    path = str(tmp_path / "rng.pt")
    torch.save({"numpy": np.random.RandomState(3).get_state(), "f": np.arange(6.0).reshape(2, 3).T}, path)
    rebuild = np.empty(0).__reduce__()[0]
    with torch.serialization.safe_globals([np.ndarray, np.dtype, type(np.dtype(np.uint32)), type(np.dtype("f8")),
                                           rebuild]):  # fmt: skip
        want = torch.load(path, weights_only=True)
    with unpickler_unreachable():
        got = load_torch_file(path, numpy=True)
    assert_same(got, want)
    with pytest.raises(UnsafeCheckpointError, match=r"beyond tensors and builtins \(numpy\._?core\.multiarray"):
        load_torch_file(path)  # NumPy only where asked for


def _one_line(err: pytest.ExceptionInfo, path: str, name: str) -> None:
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path} holds ") and name in msg, msg


def test_planted_globals_are_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_Payload(str(tmp_path / "control"))))
    assert (tmp_path / "control").exists()  # the payload does run when unpickled
    path = str(tmp_path / "planted.pt")
    torch.save({"w": torch.ones(2), "x": _Payload(str(marker))}, path)
    for read in (load_torch_file, check_torch_file):
        with pytest.raises(UnsafeCheckpointError) as err:
            read(path)
        _one_line(err, path, f"a Python object beyond tensors and builtins ({os.system.__module__}.system)")
    # a storage id naming a class that is not a storage
    trick = str(tmp_path / "storage.pt")
    torch.save(torch.ones(2), trick)
    import zipfile

    with zipfile.ZipFile(trick) as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    name = next(n for n in entries if n.endswith("data.pkl"))
    entries[name] = entries[name].replace(b"ctorch\nFloatStorage\n", b"cposix\nsystem\n")
    with zipfile.ZipFile(trick, "w", zipfile.ZIP_STORED) as zf:
        for n, data in entries.items():
            zf.writestr(n, data)
    with pytest.raises(UnsafeCheckpointError) as err:
        load_torch_file(trick)
    _one_line(err, trick, "(posix.system)")
    assert not marker.exists()


def test_a_stack_global_with_names_swapped_under_it_is_refused(tmp_path):
    # pushes "os", "system", then two harmless names it pops again: the unpickler would import os.system
    names = b"".join(b"\x8c" + bytes([len(n)]) + n for n in (b"os", b"system", b"collections", b"OrderedDict"))
    path = tmp_path / "trick.pt"
    torch.save({}, path)
    import zipfile

    with zipfile.ZipFile(path) as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    name = next(n for n in entries if n.endswith("data.pkl"))
    entries[name] = b"\x80\x04" + names + b"00\x93)R."
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for n, data in entries.items():
            zf.writestr(n, data)
    with pytest.raises(UnsafeCheckpointError, match="the pickle opcode POP is outside the data subset"):
        load_torch_file(str(path))


def test_a_cut_file_is_named_as_corrupt(tmp_path):
    path = tmp_path / "cut.pt"
    torch.save({"w": torch.ones(1000)}, path)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(CorruptCheckpointError, match=f"{path} cannot be read"):
        load_torch_file(str(path))


def _dcp_folder(folder) -> dict:
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(4, 3), "nested": {"b": torch.arange(5), "step": 3}, "extra": ["a", 2.5]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return state


def test_dcp_folders_read_equal_to_torch_reader_with_no_unpickler(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _dcp_folder(tmp_path)
    want: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(want, FileSystemReader(str(tmp_path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    want_md = pickle.loads((tmp_path / ".metadata").read_bytes())
    with unpickler_unreachable(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_torch_dcp(str(tmp_path))
        got, got_md = load_full_state(str(tmp_path)), read_dcp_metadata(str(tmp_path / ".metadata"))
    assert_same(got, want)
    assert got_md == want_md and type(got_md.storage_meta) is type(want_md.storage_meta)
    assert all(type(a) is type(b) for a, b in zip(got_md.state_dict_metadata.values(),
                                                  want_md.state_dict_metadata.values(), strict=True))  # fmt: skip


def _plant_metadata(folder, marker) -> None:
    plant_in_metadata(folder, _Payload(str(marker)))


def _plant_item(folder, marker) -> str:
    return plant_as_item(folder, _Payload(str(marker)))


def test_planted_dcp_folders_are_refused_by_the_check_and_the_reader(tmp_path):
    marker = tmp_path / "ran"
    meta, item = tmp_path / "meta", tmp_path / "item"
    _dcp_folder(meta), _dcp_folder(item)
    _plant_metadata(meta, marker)
    shard = _plant_item(item, marker)
    for read in (check_torch_dcp, load_full_state):
        with pytest.raises(UnsafeCheckpointError) as err:
            read(str(meta))
        _one_line(err, str(meta / ".metadata"), f"the global {os.system.__module__}.system (not a torch checkpoint")
        with pytest.raises(UnsafeCheckpointError) as err:
            read(str(item))
        _one_line(err, shard, "in its item ")
        assert f"beyond tensors and builtins ({os.system.__module__}.system)" in str(err.value)
    assert not marker.exists()


def test_megatron_common_strategy_reads_without_unpickling(tmp_path):
    from hybridrl.mcore.safe_load import SafeCommonLoadStrategy

    state = {"optimizer": {"param_groups": [{"lr": 0.1, "params": [0, 1]}]}, "w": torch.ones(2)}
    torch.save(state, tmp_path / "common.pt")
    with unpickler_unreachable():
        assert_same(SafeCommonLoadStrategy().load_common(str(tmp_path)), state)
    torch.save({"x": _Payload(str(tmp_path / "ran"))}, tmp_path / "common.pt")
    with pytest.raises(UnsafeCheckpointError) as err:
        SafeCommonLoadStrategy().load_common(str(tmp_path))
    _one_line(err, str(tmp_path / "common.pt"), f"({os.system.__module__}.system)")
    assert not (tmp_path / "ran").exists()

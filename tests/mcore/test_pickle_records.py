"""hybridrl.mcore.pickle_records against what pickle itself builds: a real torch.distributed.checkpoint index
read as records equals the unpickled one field by field, and streams outside the data subset are refused."""

from __future__ import annotations

import io
import os
import pickle
import warnings

import pytest
import torch

from hybridrl.mcore.pickle_records import SETSTATE, Record, read_records


def _same(record, obj) -> bool:
    """A record equals ``obj`` when it names its class and every attribute it holds does (recursively; torch leaves
    fields at their defaults out of some states)."""
    if isinstance(obj, torch.dtype):  # a global
        return record == ("torch", str(obj).removeprefix("torch."))
    if isinstance(obj, torch.layout):  # torch.serialization._get_layout("torch.strided")
        return record.args == (str(obj),)
    if isinstance(record, Record):
        cls = type(obj)
        if record.cls != (cls.__module__, cls.__qualname__):
            return False
        if isinstance(obj, torch.Size):  # built from arguments, no state
            return record.args == (tuple(obj),)
        if hasattr(obj, "_value_"):  # an enum member
            return record.args == (obj._value_,)
        if SETSTATE in record.state:
            return _same(record.state[SETSTATE], obj.__getstate__())
        return all(hasattr(obj, k) and _same(v, getattr(obj, k)) for k, v in record.state.items())
    if isinstance(record, dict):
        return len(record) == len(obj) and all(_same(a, b) and _same(record[a], obj[b])
                                                for a, b in zip(record, obj, strict=True))  # fmt: skip
    if isinstance(record, list | tuple):
        return len(record) == len(obj) and all(_same(a, b) for a, b in zip(record, obj, strict=True))
    return record == obj


def test_a_checkpoint_index_reads_as_records_equal_to_the_unpickled_one(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.ones(3, 2), "step": 7, "extra": io.BytesIO(b"x"), "nested": {"b": torch.zeros(4)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    data = (tmp_path / ".metadata").read_bytes()
    records, built = read_records(data), pickle.loads(data)
    assert records.cls == ("torch.distributed.checkpoint.metadata", "Metadata")
    assert set(records.state_dict_metadata) == set(built.state_dict_metadata) and len(records.storage_data) >= 3
    assert _same(records, built)
    info = next(iter(records.storage_data.values()))
    assert isinstance(info.offset, int) and os.path.isfile(tmp_path / info.relative_path)


def test_streams_outside_the_data_subset_are_refused():
    class Planted:
        def __reduce__(self):
            return (os.system, ("true",))

    class WithIds(pickle.Pickler):
        def persistent_id(self, obj):
            return "id" if obj == "x" else None

    out = io.BytesIO()
    WithIds(out, protocol=4).dump(["x"])
    for data in (pickle.dumps({"a": 1}, protocol=0), out.getvalue()):  # text opcodes; a persistent id
        with pytest.raises(ValueError, match="outside the data subset"):
            read_records(data)
    record = read_records(pickle.dumps(Planted(), protocol=4))  # read as data: os.system is not called
    assert record.cls == (os.system.__module__, "system") and record.args == ("true",)

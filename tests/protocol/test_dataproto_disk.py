"""DataProto.save_to_disk / load_from_disk: every supported value comes back with its type, values the
format cannot hold are refused at save time, and loading never runs code from the file (a planted pickle
payload, a torch.save file and a verl-style pickled DataProto are all refused without being unpickled)."""

from __future__ import annotations

import json
import os
import pickle
import re

import numpy as np
import pytest
import torch

from hybridrl.protocol import DataProto
from tests.protocol.test_dataproto import assert_same, make


def test_verl_roundtrip(tmp_path):
    """verl's test_torch_save_data_proto: tensors, labels and meta_info come back."""
    data = DataProto.from_dict(
        tensors={"obs": torch.tensor([[1, 2], [3, 4], [5, 6]])},
        non_tensors={"labels": ["a", "b", "c"]},
        meta_info={"info": "test_info"},
    )
    data.save_to_disk(tmp_path / "test_data.pt")
    loaded = DataProto.load_from_disk(tmp_path / "test_data.pt")
    assert torch.equal(loaded.batch["obs"], data.batch["obs"])
    assert (loaded.non_tensor_batch["labels"] == data.non_tensor_batch["labels"]).all()
    assert loaded.meta_info == data.meta_info


def test_every_supported_value_comes_back_with_its_type(tmp_path):
    d = make(5)
    d.batch["view"] = torch.arange(20.0).reshape(5, 4)[:, 1:3]  # a strided view of a larger storage
    d.batch["same"] = d.batch["prompts"]  # two fields sharing one storage
    d.batch["empty"] = torch.zeros(5, 0, dtype=torch.int32)
    d.non_tensor_batch["score"] = np.arange(5, dtype=np.float32) / 3
    d.non_tensor_batch["text"] = np.array(["a", "bb", "ccc", "d", "e"])
    d.non_tensor_batch["grid"] = np.empty((5, 2), dtype=object)
    d.non_tensor_batch["grid"][:] = [[i, str(i)] for i in range(5)]
    d.non_tensor_batch["mixed"] = np.array(
        [
            np.int64(3),
            np.float32(0.5),
            (1, "x"),
            {1: "int key", "__hybridrl__": "a user key that looks like ours"},
            b"\x00\xff",
        ],
        dtype=object,
    )
    nested = np.array([np.arange(3), np.array(["u", "v"])], dtype=object)  # what pyarrow's to_pandas gives
    d.non_tensor_batch["raw_prompt_ids"] = np.array([[1, 2], [3], [], [4, 5, 6], nested], dtype=object)
    scale = torch.tensor([1.5], dtype=torch.bfloat16)
    d.meta_info = {"temperature": 0.7, "nan": float("nan"), "inf": -float("inf"), "big": 2**70, "flag": True,
                   "tags": ["a", None], "scale": scale, "metrics": {"loss": [0.5]}}  # fmt: skip
    d.save_to_disk(tmp_path / "d.dp")
    back = DataProto.load_from_disk(tmp_path / "d.dp")
    assert_same(back, d, check_meta=False)
    assert repr(back.meta_info) == repr(d.meta_info) and back.meta_info["scale"].dtype == torch.bfloat16
    mixed = back.non_tensor_batch["mixed"]
    assert type(mixed[0]) is np.int64 and type(mixed[1]) is np.float32 and mixed[2] == (1, "x")
    assert mixed[3] == {1: "int key", "__hybridrl__": "a user key that looks like ours"} and mixed[4] == b"\x00\xff"
    ids = back.non_tensor_batch["raw_prompt_ids"]
    assert ids[3] == [4, 5, 6] and ids[4].dtype == object and ids[4][0].tolist() == [0, 1, 2]
    back.non_tensor_batch["score"][0] = 9  # arrays come back writable
    back.batch["prompts"][0, 0] = -1
    assert back.batch["same"][0, 0] != -1  # each field gets its own storage


class Custom:
    def __init__(self, value: int) -> None:
        self.value = value


def test_values_the_format_cannot_hold_are_refused_at_save(tmp_path):
    d = make(2)
    d.non_tensor_batch["obj"] = np.array([Custom(1), 3], dtype=object)
    name = f"{__name__}.Custom"
    with pytest.raises(TypeError, match=re.escape(f"save_to_disk: non_tensor_batch['obj'][0] is a {name}, which")):
        d.save_to_disk(tmp_path / "d.dp")
    with pytest.raises(TypeError, match=re.escape("save_to_disk: meta_info['cfg']['x'] is a builtins.set")):
        make(2, meta={"cfg": {"x": {1, 2}}}).save_to_disk(tmp_path / "d.dp")
    assert not (tmp_path / "d.dp").exists()


class Payload:
    """Unpickling this runs os.system: what a malicious "DataProto" file does."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_loading_never_unpickles(tmp_path):
    marker = tmp_path / "pwned"
    planted = tmp_path / "batch.pkl"
    planted.write_bytes(pickle.dumps(Payload(str(marker))))
    pickle.loads(pickle.dumps(Payload(str(tmp_path / "control"))))
    assert (tmp_path / "control").exists()  # the payload does run when unpickled
    torch_file = tmp_path / "batch.pt"
    torch.save({"batch": Payload(str(marker))}, torch_file)
    verl_style = tmp_path / "verl.pkl"  # verl's save_to_disk pickles the whole DataProto
    verl_style.write_bytes(pickle.dumps(make(2)))
    for path in (planted, torch_file, verl_style):
        with pytest.raises(ValueError, match=re.escape("not a file written by DataProto.save_to_disk; files that")):
            DataProto.load_from_disk(path)
    assert not marker.exists()
    with pytest.raises(FileNotFoundError, match=re.escape("load_from_disk('nope.dp'): no such file")):
        DataProto.load_from_disk("nope.dp")


def test_a_tampered_header_cannot_smuggle_objects(tmp_path):
    """A file whose JSON declares an object dtype (numpy would read raw bytes as pointers) is refused."""
    from safetensors.torch import load_file, save_file

    d = make(2)
    d.non_tensor_batch["score"] = np.zeros(2, dtype=np.float64)
    d.save_to_disk(tmp_path / "d.dp")
    tensors = load_file(tmp_path / "d.dp")
    extra = json.loads(bytes(tensors["non_tensor"].numpy()))
    extra["non_tensor_batch"]["score"]["dtype"] = "|O"
    tensors["non_tensor"] = torch.frombuffer(bytearray(json.dumps(extra).encode()), dtype=torch.uint8)
    save_file(tensors, tmp_path / "bad.dp", metadata={"format": "hybridrl.DataProto/2"})
    with pytest.raises(ValueError, match=re.escape("declares numpy dtype '|O', which is not a plain dtype")):
        DataProto.load_from_disk(tmp_path / "bad.dp")
    save_file({"x": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match=re.escape("not a file written by DataProto.save_to_disk")):
        DataProto.load_from_disk(tmp_path / "other.safetensors")

"""DataProto on disk: :meth:`DataProto.save_to_disk` / :meth:`DataProto.load_from_disk` (verl's names).

One safetensors file per DataProto. Reading it never runs code: safetensors holds raw tensor bytes and a
JSON header, and everything that is not a ``batch`` tensor (the non-tensor arrays, ``meta_info``) travels
as JSON in one ``uint8`` tensor. (verl pickles the DataProto instead; unpickling a file can run any code
the file names, which is why a file of that kind is refused here.)

The JSON side stores exactly these values, and gives them back with their types:
``None``, ``bool``, ``int``, ``float`` (NaN and infinities too), ``str``, ``bytes``, ``list``, ``tuple``,
``dict`` (any of these as keys), numpy arrays (object arrays element by element, other dtypes as raw
bytes), numpy scalars and torch tensors. Saving anything else (a custom class, an image object) raises a
``TypeError`` naming the field, so nothing is lost silently.
"""

from __future__ import annotations

import base64
import json
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from hybridrl.protocol import DataProto

FORMAT = "hybridrl.DataProto/2"
_TAG = "__hybridrl__"  # marks an encoded value in the JSON; user dicts holding this key are escaped
_EXTRA = "non_tensor"  # the safetensors entry that holds the JSON (batch tensors are "batch.<i>")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _array_dtype(name: str, where: str) -> np.dtype:
    """A numpy dtype read from a file: plain (no objects, no fields), else the file is refused."""
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise ValueError(f"{where}: the file declares numpy dtype {name!r}, which is not one") from None
    if dtype.hasobject or dtype.names is not None:
        raise ValueError(f"{where}: the file declares numpy dtype {name!r}, which is not a plain dtype")
    return dtype


def _encode(value: Any, where: str) -> Any:
    """``value`` as JSON-ready builtins; exact builtin types only (an ``int`` subclass would lose its type)."""
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind is tuple:
        return {_TAG: "tuple", "items": [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if kind is dict:
        if all(type(k) is str for k in value) and _TAG not in value:
            return {k: _encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        pairs = [[_encode(k, f"{where} key"), _encode(v, f"{where}[{k!r}]")] for k, v in value.items()]
        return {_TAG: "dict", "items": pairs}
    if kind is bytes:
        return {_TAG: "bytes", "data": _b64(value)}
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            items = [_encode(v, f"{where}[{i}]") for i, v in enumerate(value.reshape(-1))]
            return {_TAG: "objects", "shape": list(value.shape), "items": items}
        if value.dtype.names is None:
            raw = np.ascontiguousarray(value).tobytes()
            return {_TAG: "array", "dtype": value.dtype.str, "shape": list(value.shape), "data": _b64(raw)}
    elif isinstance(value, np.generic) and not value.dtype.hasobject and value.dtype.names is None:
        return {_TAG: "scalar", "dtype": value.dtype.str, "data": _b64(value.tobytes())}
    elif isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        dtype = str(t.dtype).removeprefix("torch.")
        return {_TAG: "tensor", "dtype": dtype, "shape": list(t.shape), "data": _b64(raw)}
    raise TypeError(
        f"save_to_disk: {where} is a {kind.__module__}.{kind.__qualname__}, which the file cannot hold safely "
        "(it keeps tensors, numpy arrays and scalars, None/bool/int/float/str/bytes and lists, tuples, dicts "
        "of them); convert it first"
    )


def _decode(value: Any, where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, where) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {k: _decode(v, where) for k, v in value.items()}
    if kind == "tuple":
        return tuple(_decode(v, where) for v in value["items"])
    if kind == "dict":
        return {_decode(k, where): _decode(v, where) for k, v in value["items"]}
    if kind == "bytes":
        return base64.b64decode(value["data"])
    if kind == "objects":
        items = value["items"]
        arr = np.empty(len(items), dtype=object)
        for i, v in enumerate(items):  # element by element: numpy would turn equal-length lists into a 2-D array
            arr[i] = _decode(v, where)
        return arr.reshape(value["shape"])
    if kind == "array":
        dtype = _array_dtype(value["dtype"], where)
        return np.frombuffer(base64.b64decode(value["data"]), dtype=dtype).reshape(value["shape"]).copy()
    if kind == "scalar":
        return np.frombuffer(base64.b64decode(value["data"]), dtype=_array_dtype(value["dtype"], where))[0]
    if kind == "tensor":
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{where}: the file declares torch dtype {value['dtype']!r}, which is not one")
        raw = bytearray(base64.b64decode(value["data"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(dtype).reshape(value["shape"])
    raise ValueError(f"{where}: unknown value kind {kind!r} in the file")


def _plain(t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """A CPU tensor that owns exactly its bytes (safetensors refuses tensors that share memory)."""
    t = t.detach().to("cpu").contiguous()
    ptr = t.untyped_storage().data_ptr()
    if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    seen.add(t.untyped_storage().data_ptr())
    return t


def save(data: DataProto, path: str | os.PathLike) -> None:
    """Write ``data`` to ``path`` (see the module docstring for what the file holds).

    Raises:
        TypeError: a non-tensor or meta_info value the format cannot hold (names the field).
    """
    from safetensors.torch import save_file

    extra = {
        "batch_keys": list(data.batch),
        "non_tensor_batch": {k: _encode(a, f"non_tensor_batch[{k!r}]") for k, a in data.non_tensor_batch.items()},
        "meta_info": _encode(data.meta_info, "meta_info"),
    }
    seen: set[int] = set()
    tensors = {f"batch.{i}": _plain(t, seen) for i, t in enumerate(data.batch.values())}
    tensors[_EXTRA] = torch.frombuffer(bytearray(json.dumps(extra).encode("utf-8")), dtype=torch.uint8)
    save_file(tensors, os.fspath(path), metadata={"format": FORMAT})


def load(path: str | os.PathLike) -> DataProto:
    """Read a file written by :func:`save`; tensors land on the CPU.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not one written by ``save_to_disk`` (a pickle, a ``torch.save`` file, a
            DataProto pickled by verl: refused, never unpickled).
    """
    from safetensors import SafetensorError, safe_open

    from hybridrl.protocol import DataProto

    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"DataProto.load_from_disk({name!r}): no such file")
    refused = (
        f"DataProto.load_from_disk({name!r}): not a file written by DataProto.save_to_disk; files that need "
        "unpickling (verl's save_to_disk, torch.save) are refused because loading them can run code. Convert "
        "one you trust in its own program (verl: DataProto.load_from_disk) and save it with save_to_disk"
    )
    try:
        with safe_open(name, framework="pt", device="cpu") as f:
            if (f.metadata() or {}).get("format") != FORMAT:
                raise ValueError(refused)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118  (safe_open has no __iter__)
    except SafetensorError:
        raise ValueError(refused) from None
    extra = json.loads(bytes(tensors.pop(_EXTRA).numpy()).decode("utf-8"))
    batch = {k: tensors[f"batch.{i}"] for i, k in enumerate(extra["batch_keys"])}
    arrays = {k: _decode(v, f"{name}: non_tensor_batch[{k!r}]") for k, v in extra["non_tensor_batch"].items()}
    return DataProto(batch, arrays, _decode(extra["meta_info"], f"{name}: meta_info"))

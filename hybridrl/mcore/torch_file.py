"""``torch.save`` files read without an unpickler: tensors, numbers, strings and containers, nothing else.

A ``torch.save`` file is a zip archive (entries stored, not compressed): ``<name>/data.pkl``, a pickle of the
saved object whose tensors point, through persistent ids ``("storage", <torch.XStorage>, key, location, n)``, at
the raw bytes of ``<name>/data/<key>``; and ``<name>/byteorder``. :func:`load_torch_file` reads the archive's
directory with :mod:`zipfile`, turns ``data.pkl`` into plain records (:func:`hybridrl.mcore.pickle_records
.read_records`: nothing imported, nothing called) and builds from them only what its allow-list names:

- containers, numbers, strings, bytes (``_codecs.encode`` of latin-1 text, as protocol 2 writes them),
  ``bytearray``, ``complex``, ``torch.Size``, ``torch.device``, dtypes and layouts;
- tensors (``torch._utils._rebuild_tensor_v2`` / ``_v3``) and parameters (``_rebuild_parameter``): each storage is
  read once, straight into a tensor torch allocates, and viewed with the saved dtype, size, stride and offset
  (``Tensor.set_``, what torch's own rebuild does) once :func:`check_view` has bounded the view by the storage;
  ``requires_grad`` as saved; backward hooks must be an empty dict (none are attached);
- with ``numpy=True``, NumPy arrays of numeric dtypes (the RNG states of earlier hybridrl versions).

Anything else raises :class:`~hybridrl.mcore.checkpoint_safety.UnsafeCheckpointError`, one line naming the file
and the global, before anything of the file is built. Zip entries must lie inside the file before they are read
or allocated; tensor kinds torch saves but these readers do not build (conjugate, sparse, quantized, meta, ...),
and anything else a malformed file makes fail, raise a one-line
:class:`~hybridrl.mcore.checkpoint_safety.CorruptCheckpointError`. :func:`load_torch_window` reads such an
archive embedded in a larger file (an item of a ``torch.distributed.checkpoint`` shard); :func:`check_torch_file`
checks a file without reading its tensors' bytes (their tensors are built on the meta device).
"""

from __future__ import annotations

import collections
import io
import re
import struct
import sys
import warnings
import zipfile
from collections.abc import Callable
from typing import IO, Any

import torch

from hybridrl.mcore.checkpoint_safety import CorruptCheckpointError, UnsafeCheckpointError, corrupt, refusal
from hybridrl.mcore.pickle_records import SETSTATE, Global, OutsideSubsetError, PersistentId, Record, read_records

DTYPES = {Global("torch", name): v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
"""The dtypes a pickle may name (``torch.float32`` pickles as the global ``torch float32``)."""
LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
with warnings.catch_warnings():  # reading a legacy storage class's dtype warns that TypedStorage is deprecated
    warnings.simplefilter("ignore")
    _STORAGES = {
        Global("torch", name): cls.dtype
        for name, cls in vars(torch).items()
        if isinstance(cls, type)
        and issubclass(cls, torch.storage._LegacyStorage)
        and name != "Storage"
        and not cls.__name__.startswith("Q")
    }  # quantized storages are not read
_STORAGES[Global("torch", "UntypedStorage")] = _STORAGES[Global("torch.storage", "UntypedStorage")] = torch.uint8
_HEADER = struct.Struct("<4s2B4HL2L2H")  # a zip entry's local header (its name and extra field follow it)
_UNSUPPORTED = ("qtensor", "sparse_tensor", "nested_tensor", "meta_tensor_no_storage", "wrapper_subclass",
                "device_tensor_from_numpy", "device_tensor_from_cpu_tensor", "parameter_with_state")  # fmt: skip
"""``torch._utils._rebuild_<kind>`` of the tensor kinds torch saves that the readers do not build."""
_LEGACY = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
"""How a legacy (non-zip) ``torch.save`` file starts: protocol 2, then torch's magic number as a long."""
_NUMERIC = re.compile(r"[biufc]\d{1,2}")


class UnsupportedError(Exception):
    """A tensor kind torch can save but these readers do not build (quantized, sparse, meta, conjugate, ...): not
    code, so the readers name it as an unreadable file rather than as a refusal."""


class RefusedError(Exception):
    """A global outside the allow-list (``name``: ``module.name``); the readers turn it into a one-line refusal."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class Builder:
    """Builds the objects records describe, through ``handlers`` (a global -> how to build a record of it) and
    ``constants`` (bare globals allowed as values); anything else raises :class:`RefusedError`. Shared records and
    containers stay shared (memo by identity), so a pickle of many references to one value stays small."""

    def __init__(self, handlers: dict, constants: dict, storage: Callable[[Any], Any] | None = None) -> None:
        self.handlers, self.constants, self.storage = handlers, constants, storage
        self._memo: dict[int, Any] = {}

    def build(self, value: Any) -> Any:
        if value is None or isinstance(value, str | bytes | int | float | complex):
            return value
        if id(value) in self._memo:
            return self._memo[id(value)]
        if isinstance(value, Global):
            if value not in self.constants:
                raise RefusedError(f"{value.module}.{value.name}")
            return self.constants[value]
        if isinstance(value, Record):
            handler = self.handlers.get(value.cls)
            if handler is None:
                raise RefusedError(f"{value.cls[0]}.{value.cls[1]}")
            out = self._memo[id(value)] = handler(self, value)
        elif isinstance(value, PersistentId):
            if self.storage is None:
                raise OutsideSubsetError("a persistent id outside a torch.save archive")
            out = self._memo[id(value)] = self.storage(value.pid)
        elif isinstance(value, list):
            out = self._memo[id(value)] = []
            out.extend(self.build(v) for v in value)
        elif isinstance(value, dict):
            out = self._memo[id(value)] = type(value)()
            for k, v in value.items():
                out[self.build(k)] = self.build(v)
            for k, v in getattr(value, "__dict__", {}).items():  # an OrderedDict's attributes (a state dict's)
                setattr(out, k, self.build(v))
        elif isinstance(value, tuple | set | frozenset):
            out = self._memo[id(value)] = type(value)(self.build(v) for v in value)
        else:
            raise OutsideSubsetError(f"a {type(value).__name__} value")
        return out


def call_args(b: Builder, r: Record, *types: Any) -> tuple:
    """The built arguments of a ``REDUCE`` record, checked against ``types`` (one per argument, a tuple of types
    or ``None`` for any); a record with state, or of ``NEWOBJ``, is not a plain call."""
    if r.new or r.state:
        raise ValueError(f"{r.cls[0]}.{r.cls[1]} built with state or NEWOBJ")
    args = tuple(b.build(a) for a in r.args)
    if len(args) > len(types) or any(t is not None and not isinstance(a, t) for a, t in zip(args, types, strict=False)):
        raise ValueError(f"{r.cls[0]}.{r.cls[1]} called with {len(args)} arguments of unexpected types")
    return args


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, tuple | list) or not all(type(v) is int for v in values):
        raise ValueError(f"expected a tuple of ints, not {values!r:.80}")
    return tuple(values)


def _encode(b: Builder, r: Record) -> bytes:
    text, encoding = call_args(b, r, str, str)
    if encoding not in ("latin1", "latin-1"):
        raise ValueError(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


def _no_hooks(hooks: Any) -> None:
    """Backward hooks as ``torch.save`` writes them: an empty dict (torch refuses to save any other)."""
    if type(hooks) not in (dict, collections.OrderedDict) or hooks:
        raise OutsideSubsetError(f"a tensor with backward hooks {hooks!r:.40} (torch.save writes an empty dict)")


def check_view(size: tuple[int, ...], stride: tuple[int, ...], offset: int, itemsize: int, nbytes: int) -> None:
    """Refuse a view that reaches outside its storage of ``nbytes`` bytes (``Tensor.set_`` would grow the
    storage, or read memory past it). A view of ``n > 0`` elements ends at element
    ``offset + sum((size_i - 1) * stride_i)``, so it needs ``(that + 1) * itemsize <= nbytes``."""
    if len(size) != len(stride) or min((offset, *size, *stride)) < 0:
        raise ValueError(f"a tensor view of size {size}, stride {stride}, offset {offset}: negative or mismatched")
    if 0 in size:
        return
    end = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
    if end * itemsize > nbytes:
        raise ValueError(f"a tensor view of size {size}, stride {stride}, offset {offset} needs {end * itemsize} "
                         f"bytes of a storage of {nbytes}")  # fmt: skip


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any, hooks: Any, dtype: Any,
            metadata: Any) -> torch.Tensor:  # fmt: skip
    """``torch._utils._rebuild_tensor_v3`` on checked values: a view of the storage, as torch builds it."""
    if not isinstance(storage, _Storage) or type(offset) is not int or not isinstance(requires_grad, bool):
        raise ValueError("a tensor rebuilt from something else than a storage, an offset and a flag")
    _no_hooks(hooks)
    if metadata is not None and (type(metadata) is not dict or metadata):  # torch.save writes it when non-empty
        raise UnsupportedError(f"a tensor with tensor metadata {metadata!r:.40} (e.g. a conjugate or negative bit)")
    size, stride = _ints(size), _ints(stride)
    check_view(size, stride, offset, dtype.itemsize, storage.untyped.nbytes())
    tensor = torch.empty((0,), dtype=dtype, device=storage.untyped.device)
    tensor.set_(storage.untyped, offset, torch.Size(size), stride)
    tensor.requires_grad = requires_grad
    return tensor


def _rebuild_v2(b: Builder, r: Record) -> torch.Tensor:
    storage, offset, size, stride, grad, hooks, *meta = call_args(b, r, *[None] * 7)
    if not isinstance(storage, _Storage):
        raise ValueError("_rebuild_tensor_v2 of something else than a storage")
    return _tensor(storage, offset, size, stride, grad, hooks, storage.dtype, meta[0] if meta else None)


def _rebuild_v3(b: Builder, r: Record) -> torch.Tensor:
    storage, offset, size, stride, grad, hooks, dtype, *meta = call_args(b, r, *[None] * 6, torch.dtype, None)
    if not isinstance(storage, _Storage) or storage.dtype != torch.uint8:
        raise ValueError("_rebuild_tensor_v3 of something else than an untyped storage")
    return _tensor(storage, offset, size, stride, grad, hooks, dtype, meta[0] if meta else None)


def _parameter(b: Builder, r: Record) -> torch.nn.Parameter:
    data, requires_grad, hooks = call_args(b, r, torch.Tensor, bool, None)
    _no_hooks(hooks)
    return torch.nn.Parameter(data, requires_grad)


def _bytearray(b: Builder, r: Record) -> bytearray:
    """``bytearray()``, ``bytearray(bytes)`` (protocol 3+) or ``bytearray(text, "latin-1")`` (protocol 2), no
    other encoding (naming one imports its codec module)."""
    args = call_args(b, r, bytes | str, str)
    if not args:
        return bytearray()
    if len(args) == 1 and isinstance(args[0], bytes):
        return bytearray(args[0])
    if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin1", "latin-1"):
        return bytearray(args[0].encode("latin1"))
    raise ValueError(
        f"bytearray called with {len(args)} arguments{f' and encoding {args[1]!r:.20}' * (len(args) == 2)}"
    )


def _empty_bytes(b: Builder, r: Record) -> bytes:
    """``bytes()``: how protocol 2 writes ``b""`` (an empty NumPy array's data, too)."""
    if call_args(b, r):
        raise ValueError("builtins.bytes called with arguments (protocol 2 writes only bytes())")
    return b""


def _unsupported(b: Builder, r: Record) -> Any:
    raise UnsupportedError(f"a tensor of a kind these readers do not build ({r.cls[0]}.{r.cls[1]})")


def _device(b: Builder, r: Record) -> torch.device:
    return torch.device(*call_args(b, r, str, int))


def _layout(b: Builder, r: Record) -> torch.layout:
    (name,) = call_args(b, r, str)
    return LAYOUTS[name]


def _np_dtype(b: Builder, r: Record) -> Any:
    import numpy as np

    code, _align, _copy = (b.build(a) for a in r.args)
    state = b.build(r.state.get(SETSTATE, ()))
    if r.new or not isinstance(code, str) or not _NUMERIC.fullmatch(code) or not isinstance(state, tuple):
        raise OutsideSubsetError(f"the NumPy dtype {code!r:.40} (only numeric dtypes are read)")
    order = state[1] if len(state) > 1 else "|"
    if order not in ("<", ">", "|", "="):
        raise ValueError(f"NumPy byte order {order!r}")
    return np.dtype(code).newbyteorder(order) if order in "<>" else np.dtype(code)


def _np_array(b: Builder, r: Record) -> Any:
    import numpy as np

    if r.new or len(r.args) != 3 or r.args[0] != ("numpy", "ndarray") or set(r.state) != {SETSTATE}:
        raise OutsideSubsetError("a NumPy object other than a plain array")
    _, shape, dtype, fortran, raw = b.build(r.state[SETSTATE])
    if not isinstance(dtype, np.dtype) or not isinstance(raw, bytes) or not isinstance(fortran, bool):
        raise ValueError("a NumPy array state that is not (version, shape, dtype, is_fortran, bytes)")
    return np.frombuffer(raw, dtype).reshape(_ints(shape), order="F" if fortran else "C").copy(order="K")


HANDLERS: dict[Global, Callable[[Builder, Record], Any]] = {
    Global("_codecs", "encode"): _encode,
    Global("builtins", "bytearray"): _bytearray,
    Global("builtins", "bytes"): _empty_bytes,
    Global("builtins", "complex"): lambda b, r: complex(*call_args(b, r, float | int, float | int)),
    Global("torch", "Size"): lambda b, r: torch.Size(_ints(call_args(b, r, tuple)[0])),
    Global("torch", "device"): _device,
    Global("torch.serialization", "_get_layout"): _layout,
    Global("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
    Global("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
    Global("torch._utils", "_rebuild_parameter"): _parameter,
    **{Global("torch._utils", f"_rebuild_{kind}"): _unsupported for kind in _UNSUPPORTED},
}
"""What a ``torch.save`` file may build (besides containers and :data:`DTYPES`)."""
NUMPY_HANDLERS = {
    **{Global(f"numpy.{core}.multiarray", "_reconstruct"): _np_array for core in ("core", "_core")},
    Global("numpy", "dtype"): _np_dtype,
}


class _Storage:
    """One storage of the archive: its bytes as a ``uint8`` untyped storage, and the dtype it was saved as."""

    def __init__(self, untyped: torch.UntypedStorage, dtype: torch.dtype) -> None:
        self.untyped, self.dtype = untyped, dtype


class _Window(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open binary file, as a file of their own (no copy)."""

    def __init__(self, file: IO[bytes], start: int, length: int) -> None:
        super().__init__()
        self.file, self.start, self.length, self.pos = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, (pos, self.pos + pos, self.length + pos)[whence])
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        want = max(0, min(len(view), self.length - self.pos))
        self.file.seek(self.start + self.pos)
        got = self.file.readinto(view[:want]) or 0
        self.pos += got
        return got


class _Archive:
    """The entries of one ``torch.save`` archive: where each entry's bytes lie, and its pickle."""

    def __init__(self, window: _Window, path: str) -> None:
        self.window = window
        if window.read(len(_LEGACY)) == _LEGACY:
            raise CorruptCheckpointError(
                f"{path} is in the legacy torch.save format (before torch 1.6), which hybridrl does not read: "
                "re-save it with torch.save's default format"
            )
        with zipfile.ZipFile(window) as zf:
            infos = {info.filename: info for info in zf.infolist()}
        pickles = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise ValueError(f"{len(pickles)} data.pkl records, not the one of a torch.save archive")
        self.prefix = pickles[0][: -len("data.pkl")]
        self.infos = infos
        order = self.read(self.prefix + "byteorder") if self.prefix + "byteorder" in infos else b"little"
        if order != b"little" or sys.byteorder != "little":
            what = order.decode(errors="replace")
            raise CorruptCheckpointError(f"{path} was saved {what}-endian; hybridrl reads little-endian checkpoints "
                                         "on little-endian machines only")  # fmt: skip
        self.storages: dict[str, _Storage] = {}

    def _span(self, name: str) -> tuple[int, int]:
        info = self.infos[name]
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{name} is compressed, which torch.save never does")
        # the directory's offsets and sizes are the file's word: bound them by the file before reading or allocating
        if not 0 <= info.header_offset <= self.window.length - _HEADER.size:
            raise ValueError(f"{name}'s header offset {info.header_offset} lies outside the {self.window.length} bytes")
        self.window.seek(info.header_offset)
        fields = _HEADER.unpack(self.window.read(_HEADER.size))
        if fields[0] != b"PK\x03\x04":
            raise ValueError(f"no zip entry header for {name}")
        start = info.header_offset + _HEADER.size + fields[10] + fields[11]
        if start + info.file_size > self.window.length:
            raise ValueError(f"{name} claims {info.file_size} bytes at {start}, past the end ({self.window.length})")
        return start, info.file_size

    def read(self, name: str) -> bytes:
        start, size = self._span(name)
        self.window.seek(start)
        data = self.window.read(size)
        if len(data) != size:
            raise EOFError(f"{name} is cut short")
        return data

    def storage(self, pid: Any, read: bool = True) -> _Storage:
        """The storage a persistent id names, read once (``read=False``: on the meta device, nothing read)."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise OutsideSubsetError(f"the persistent id {pid!r:.60} (only torch.save's storages are read)")
        _, kind, key, location, numel = pid
        if kind not in _STORAGES:
            raise RefusedError(f"{kind[0]}.{kind[1]}" if isinstance(kind, tuple) and len(kind) == 2 else repr(kind))
        if not (isinstance(key, str) and isinstance(location, str) and type(numel) is int and numel >= 0):
            raise ValueError(f"a malformed storage id {pid!r:.80}")
        dtype = _STORAGES[kind]
        if key in self.storages:
            return self.storages[key]
        start, size = self._span(f"{self.prefix}data/{key}")
        if size != numel * dtype.itemsize:
            raise ValueError(f"storage {key} holds {size} bytes, not the {numel * dtype.itemsize} its tensor needs")
        flat = torch.empty(size, dtype=torch.uint8, device="cpu" if read else "meta")
        if read and size:
            self.window.seek(start)
            if self.window.readinto(flat.numpy()) != size:
                raise EOFError(f"storage {key} is cut short")
        self.storages[key] = _Storage(flat.untyped_storage(), dtype)
        return self.storages[key]


def _load(file: IO[bytes], start: int, length: int, path: str, read: bool, numpy: bool) -> Any:
    archive = _Archive(_Window(file, start, length), path)
    records = read_records(archive.read(archive.prefix + "data.pkl"), persistent_ids=True)
    handlers = {**HANDLERS, **NUMPY_HANDLERS} if numpy else HANDLERS
    return Builder(handlers, DTYPES, lambda pid: archive.storage(pid, read)).build(records)


def load_torch_window(file: IO[bytes], start: int, length: int, path: str, what: str = "", *, read: bool = True,
                      numpy: bool = False) -> Any:  # fmt: skip
    """The object of the ``torch.save`` archive at bytes ``[start, start + length)`` of the open ``file``.

    Args:
        path: the file's name, for messages.  what: where in the file (``"in its item x "``), for messages.
        read: read the tensors' bytes (``False``: tensors on the meta device, for a check).
        numpy: also build NumPy arrays of numeric dtypes.

    Raises:
        UnsafeCheckpointError: a global or opcode outside the allow-list (one line naming ``path`` and it).
        CorruptCheckpointError: not a readable ``torch.save`` archive.
    """
    try:
        return _load(file, start, length, path, read, numpy)
    except RefusedError as err:
        raise refusal(path, f"{what}a Python object beyond tensors and builtins ({err.name})") from None
    except UnsupportedError as err:
        raise CorruptCheckpointError(
            f"{path} holds {what}{err}: an unsupported tensor kind (hybridrl reads dense tensors only); convert it "
            "with torch.load and save it again"
        ) from None
    except OutsideSubsetError as err:
        raise refusal(path, f"{what}{err}") from None
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except Exception as err:  # whatever a malformed file makes fail (MemoryError, OverflowError, ...): one line
        raise corrupt(path, err) from None


def load_torch_file(path: str, *, numpy: bool = False) -> Any:
    """What ``torch.load(path, map_location="cpu", weights_only=True)`` returns, read without an unpickler (see
    the module docs); ``numpy=True`` also builds NumPy arrays. Raises as :func:`load_torch_window`."""
    with _open(path) as f:
        return load_torch_window(f, 0, f.seek(0, 2), path, numpy=numpy)


def check_torch_file(path: str, *, numpy: bool = False) -> None:
    """Refuse what :func:`load_torch_file` would refuse, reading only the archive's directory and pickle."""
    with _open(path) as f:
        load_torch_window(f, 0, f.seek(0, 2), path, read=False, numpy=numpy)


def _open(path: str) -> IO[bytes]:
    try:
        return open(path, "rb")
    except OSError as err:
        raise CorruptCheckpointError(f"{path} cannot be opened ({type(err).__name__}: {err.strerror}); the "
                                     "checkpoint is incomplete: resume from another checkpoint") from None  # fmt: skip

"""A pickle read as plain data: the objects it describes become :class:`Record` values, nothing is imported or called.

``torch.distributed.checkpoint`` stores a checkpoint's index (``.metadata``) as a pickle of its dataclasses, and
``torch.save`` writes a pickle (``data.pkl``) next to the raw bytes of the tensors' storages. Unpickling either
would import and call whatever the file names; :func:`read_records` instead interprets the opcode stream
(:mod:`pickletools` parses it) on a stack of its own: a global becomes a :class:`Global` (its module and name),
an object built from it (``NEWOBJ``, ``REDUCE``) a :class:`Record` holding that global, its arguments and the
state ``BUILD`` gives it, and a persistent id (``torch.save``'s reference to a storage, only when asked for) a
:class:`PersistentId`. Containers, numbers, strings and bytes come out as themselves (``OrderedDict``, ``set``
and ``frozenset`` too: building those runs nothing but the builtin). Opcodes outside this data subset
(extension registries, ``INST``/``OBJ``, protocol-0 text forms, stack tricks like ``POP``/``DUP``) raise
:class:`OutsideSubsetError`. What the records may become is decided by the readers above this module, from
allow-lists (:mod:`hybridrl.mcore.torch_file`, :mod:`hybridrl.mcore.safe_dcp`).
"""

from __future__ import annotations

import _compat_pickle
import collections
import pickletools
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class Global(NamedTuple):
    """A global the pickle names (``GLOBAL`` / ``STACK_GLOBAL``): compares equal to its ``(module, name)`` tuple."""

    module: str
    name: str


class OutsideSubsetError(ValueError):
    """The pickle uses an opcode this reader does not interpret (nothing torch or DCP writes)."""


@dataclass(eq=False)
class PersistentId:
    """A ``BINPERSID`` reference: ``torch.save`` points at a storage with ``("storage", type, key, location, n)``."""

    pid: Any


@dataclass(eq=False)
class Record:
    """One object of the pickle: the global it was built from, its constructor arguments and its state."""

    cls: Global
    """The class or callable (compares equal to a ``(module, name)`` tuple)."""
    args: tuple = ()
    """The arguments ``NEWOBJ`` / ``REDUCE`` would have passed."""
    new: bool = False
    """True for ``NEWOBJ`` (``cls.__new__(cls, *args)``), False for ``REDUCE`` (``cls(*args)``)."""
    state: dict[str, Any] = field(default_factory=dict)
    """Attributes from ``BUILD`` (a ``__dict__``, slots merged in; any other state under :data:`SETSTATE`)."""

    def __getattr__(self, name: str) -> Any:
        state = self.__dict__.get("state", {})
        if name in state:
            return state[name]
        raise AttributeError(f"{self.cls[0]}.{self.cls[1]} record has no attribute {name!r}")


SETSTATE = "__setstate__"
"""The :attr:`Record.state` key of a state that is not a ``__dict__`` (the argument ``__setstate__`` would get)."""


class _Mark:
    pass


MAX_TUPLE_DEPTH = 100
"""How deeply tuples and frozensets may nest. Hashing a nested tuple recurses in C with no depth guard (a million
nested ``TUPLE1`` crash the interpreter when used as a key); torch and DCP files nest them a few levels deep."""


_PUSH_ARG = {"BININT", "BININT1", "BININT2", "LONG1", "LONG4", "BINFLOAT", "SHORT_BINUNICODE", "BINUNICODE",
             "BINUNICODE8", "SHORT_BINBYTES", "BINBYTES", "BINBYTES8", "SHORT_BINSTRING", "BINSTRING"}  # fmt: skip
_CONSTANTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_SKIPPED = {"PROTO", "FRAME"}
# globals that pickle containers: their records are the containers themselves
_CONTAINERS = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
}


def read_records(data: bytes, persistent_ids: bool = False) -> Any:
    """The value the pickle ``data`` describes, as plain data and :class:`Record` values.

    Args:
        data: the pickle.
        persistent_ids: read ``BINPERSID`` as :class:`PersistentId` (``torch.save``'s storages); else refused.

    Raises:
        OutsideSubsetError: an opcode outside the data subset.  ValueError (or IndexError, KeyError, TypeError): a
            malformed stream.
    """
    stack: list[Any] = []
    memo: dict[int, Any] = {}

    marks: list[int] = []  # stack positions of the open MARKs, innermost last
    depths: dict[int, int] = {}  # id -> nesting depth of each tuple / frozenset made (they stay alive in the result)

    def nested(items: list | tuple, make: type = tuple) -> tuple | frozenset:
        depth = 1 + max((depths.get(id(v), 0) for v in items if isinstance(v, tuple | frozenset)), default=0)
        if depth > MAX_TUPLE_DEPTH:  # checked before the items are hashed (a frozenset's)
            raise ValueError(f"tuples nested more than {MAX_TUPLE_DEPTH} deep")
        value = make(items)
        depths[id(value)] = depth
        return value

    def pop_mark() -> list[Any]:
        i = marks.pop()
        if not isinstance(stack[i], _Mark):
            raise OutsideSubsetError("a MARK consumed by an opcode that does not take one")
        items = stack[i + 1 :]
        del stack[i:]
        return items

    protocol = 0
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "PROTO":
            protocol = int(arg)
        if name in _SKIPPED:
            continue
        if name == "GLOBAL":  # protocol < 3 names Python 2 modules; the unpickler maps them (fix_imports)
            module, _, attr = str(arg).partition(" ")
            stack.append(Global(*_py3_name(module, attr)) if protocol < 3 else Global(module, attr))
            continue
        if name == "STOP":
            return stack.pop()
        if name in _PUSH_ARG:
            stack.append(arg)
        elif name in _CONSTANTS:
            stack.append(_CONSTANTS[name])
        elif name == "MARK":
            marks.append(len(stack))
            stack.append(_Mark())
        elif name in ("EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET"):
            stack.append({"EMPTY_DICT": dict, "EMPTY_LIST": list, "EMPTY_SET": set}[name]())
        elif name == "EMPTY_TUPLE":
            stack.append(())
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = nested(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif name == "TUPLE":
            stack.append(nested(pop_mark()))
        elif name == "FROZENSET":
            stack.append(nested(pop_mark(), frozenset))
        elif name == "BINPERSID" and persistent_ids:
            stack.append(PersistentId(stack.pop()))
        else:
            _structural(name, arg, stack, memo, pop_mark)
    raise ValueError("the pickle has no STOP opcode")


def _ordered_dict_attrs(target: collections.OrderedDict, state: Any) -> None:
    """``BUILD`` of an ``OrderedDict``: plain named attributes (``Module.state_dict()`` sets ``_metadata``), set in
    its ``__dict__`` as the unpickler and ``torch.load`` set them (their values still records, built by readers)."""
    if not (isinstance(state, dict) and all(isinstance(k, str) and k.isidentifier() and not k.startswith("__")
                                            for k in state)):  # fmt: skip
        raise OutsideSubsetError("BUILD of an OrderedDict with a state other than plain named attributes")
    vars(target).update(state)


def _py3_name(module: str, name: str) -> tuple[str, str]:
    """A Python 2 name of a protocol < 3 pickle as the unpickler imports it (``fix_imports``, its default)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        return _compat_pickle.NAME_MAPPING[(module, name)]
    return _compat_pickle.IMPORT_MAPPING.get(module, module), name


def _structural(name: str, arg: Any, stack: list[Any], memo: dict[int, Any], pop_mark: Any) -> None:
    """The opcodes that combine, name or remember values (:func:`read_records`)."""
    if name == "SETITEM":
        key, value = stack[-2:]
        del stack[-2:]
        stack[-1][key] = value
    elif name == "SETITEMS":
        items = pop_mark()
        stack[-1].update(zip(items[::2], items[1::2], strict=True))
    elif name == "APPEND":
        stack[-2].append(stack.pop())
    elif name == "APPENDS":
        items = pop_mark()
        stack[-1].extend(items)
    elif name == "ADDITEMS":
        items = pop_mark()
        stack[-1].update(items)
    elif name == "STACK_GLOBAL":
        module, attr = stack[-2:]
        del stack[-2:]
        if not (isinstance(module, str) and isinstance(attr, str)):
            raise OutsideSubsetError("a STACK_GLOBAL whose module and name are not strings")
        stack.append(Global(module, attr))
    elif name in ("NEWOBJ", "REDUCE"):
        cls, args = stack[-2:]
        del stack[-2:]
        if not isinstance(cls, Global) or not isinstance(args, tuple):
            raise OutsideSubsetError(f"a {name} of a {type(cls).__name__}, not of a global")
        if cls in _CONTAINERS:
            stack.append(_CONTAINERS[cls](*args))  # a builtin container filled with data: runs nothing else
        else:
            stack.append(Record(cls, args, new=name == "NEWOBJ"))
    elif name == "BUILD":
        state = stack.pop()
        if type(stack[-1]) is collections.OrderedDict:  # a module's state dict: its _metadata attribute
            _ordered_dict_attrs(stack[-1], state)
            return
        if not isinstance(stack[-1], Record):
            raise OutsideSubsetError(f"BUILD of a {type(stack[-1]).__name__}")
        if isinstance(state, tuple) and len(state) == 2 and all(isinstance(s, dict | None) for s in state):
            state = {**(state[0] or {}), **(state[1] or {})}  # (__dict__, slots)
        if not isinstance(state, dict):  # what the class's __setstate__ would take
            state = {SETSTATE: state}
        stack[-1].state.update(state)
    elif name == "MEMOIZE":
        memo[len(memo)] = stack[-1]
    elif name in ("BINPUT", "LONG_BINPUT"):
        memo[int(arg)] = stack[-1]
    elif name in ("BINGET", "LONG_BINGET"):
        stack.append(memo[int(arg)])
    else:
        raise OutsideSubsetError(f"the pickle opcode {name} is outside the data subset this reader takes")

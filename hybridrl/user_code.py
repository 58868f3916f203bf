"""Loading a user's Python file and a function from it (a custom scorer, policy loss, environment).

One home for the rules every such file follows: it is imported under a module name derived from its resolved
path (so that pickling and dataclasses inside it work and two files never collide), and each way it can fail
is a one-line :class:`ValueError` / :class:`FileNotFoundError` naming the config key, the value and the fix.
These files are the user's code by intent (named in the config); nothing read from a checkpoint or data file
is ever imported this way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


def import_user_file(path: str | os.PathLike, *, path_key: str) -> ModuleType:
    """Import the Python file ``path`` (``path_key``'s value) as a module of its own.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file cannot be imported or raises while importing (the line names the first error line).
    """
    shown, file = os.fspath(path), Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{path_key} {shown!r} does not exist; point it at a .py file")
    digest = hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]
    module_name = f"hybridrl_user_{path_key.replace('.', '_')}_{digest}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path_key} {shown!r} cannot be imported; it must be a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # pickling and dataclasses in the file need the module registered
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[module_name]
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(
            f"{path_key} {shown!r} failed to import ({type(err).__name__}: {first}); fix the file"
        ) from err
    return module


def load_user_function(path: str | os.PathLike, name: str, *, path_key: str, name_key: str) -> Callable[..., Any]:
    """The callable ``name`` defined by the Python file ``path``.

    Args:
        path: the ``.py`` file (``path_key``'s value).
        name: the function to take from it (``name_key``'s value).
        path_key / name_key: the config keys the two come from, for the error lines (e.g. ``reward.custom.path``).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file cannot be imported, raises while importing, or defines no callable ``name`` (the line
            lists the public callables it does define).
    """
    module = import_user_file(path, path_key=path_key)
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        shown = os.fspath(path)
        raise ValueError(f"{name_key} {name!r} is not a function in {shown!r} (it defines {defined}); set {name_key}")
    return fn

"""Prompt files on disk: reading parquet / jsonl (or a ``.json`` array of rows) into rows, writing rows back
(the quickstart's demo data).

This module owns the file-level checks that run before training starts: the file exists and parses,
and the required columns are there. Each failure is one line naming the file, the column and the fix.
Rows come back as plain Python values (``pyarrow``'s ``to_pylist``): a chat prompt is a list of
``{"role", "content"}`` dicts, ``reward_model`` / ``extra_info`` are dicts.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridrl.errors import InputError

JSONL_SUFFIXES = (".jsonl", ".json")


class DataError(InputError, ValueError):
    """Bad training or validation data, as the trainer reports it: one line naming the file, the row and the fix."""


def _read_table(path: Path, wanted: Sequence[str]) -> tuple[list[str], dict[str, list[Any]]]:
    """All column names of one file, and column name -> values for the ``wanted`` columns it has."""
    try:
        return _read_table_unchecked(path, wanted)
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text ({err.reason}); save the file as UTF-8") from None


def _read_table_unchecked(path: Path, wanted: Sequence[str]) -> tuple[list[str], dict[str, list[Any]]]:
    if path.suffix.lower() == ".json" and _starts_with(path, "["):  # a JSON array of row objects (not JSON Lines)
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise DataError(f"{path}: not a JSON array ({err.msg} at line {err.lineno}); fix the file") from None
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            raise DataError(f"{path}: element {bad} of the JSON array is not an object; each element must be one row")
        names = list(dict.fromkeys(k for r in rows for k in r))
        return names, {c: [r.get(c) for r in rows] for c in wanted if c in names}
    if path.suffix.lower() in JSONL_SUFFIXES:
        rows = []
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}: line {lineno} is not JSON ({err.msg}); fix or remove the line") from None
                if not isinstance(rows[-1], dict):
                    raise DataError(f"{path}: line {lineno} is not a JSON object; each line must be one row")
        names = list(dict.fromkeys(k for r in rows for k in r))
        return names, {c: [r.get(c) for r in rows] for c in wanted if c in names}
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        table = pq.read_table(path, columns=[c for c in wanted if c in names])
    except (pa.ArrowException, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"cannot read {path} as parquet ({first}); check the file (or use .jsonl)") from None
    return names, {name: table.column(name).to_pylist() for name in table.column_names}


def _starts_with(path: Path, char: str) -> bool:
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    return head.startswith(char)


def read_rows(
    path: str | os.PathLike, required: Sequence[str], optional: Sequence[str] = ()
) -> dict[str, list[Any] | None]:
    """The ``required`` and ``optional`` columns of one parquet (or ``.jsonl``) file.

    Args:
        path: the file.
        required: columns that must exist.
        optional: columns read when present.

    Returns:
        Column name -> list of row values, for exactly ``required + optional``; an optional column the file
        does not have maps to ``None`` (not to a list), so callers can tell "no column" from "null values".

    Raises:
        DataError: the file is missing or a folder, cannot be parsed, or lacks a required column (one line
            naming the file and the fix).
    """
    path = Path(path)
    check_data_file(path)
    names, table = _read_table(path, [*required, *optional])
    for col in required:
        if col not in table:
            raise DataError(f"{path}: missing column {col!r} (has {sorted(names)}); add the column to the file")
    return {c: table.get(c) for c in (*required, *optional)}


def check_data_file(path: str | os.PathLike) -> None:
    """Raise :class:`DataError` unless ``path`` is a file (a folder or a missing path, named in one line)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"data file {os.fspath(path)!r} is a folder; list its .parquet / .jsonl files in "
                        "data.train_files / val_files")  # fmt: skip
    if not path.is_file():
        raise DataError(f"data file {os.fspath(path)!r} does not exist; check data.train_files / val_files")


def write_rows(rows: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """Write rows (dicts with the same keys) to a ``.parquet`` or ``.jsonl`` file; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() in JSONL_SUFFIXES:
        with path.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path

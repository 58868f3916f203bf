"""RLHFDataset: prompt files -> tokenized, left-padded prompts; :func:`collate` turns rows into a DataProto.

This module owns the prompt schema, its checks and the prompt tensors. A file (parquet, or ``.jsonl``)
has one prompt per row:

- ``prompt`` (``data.prompt_key``, the only required column): a list of ``{"role", "content"}`` chat
  messages, or a string (one user turn); rendered with the tokenizer's chat template (see
  :mod:`hybridrl.data.tokenizers`);
- ``data_source`` (optional): a string that picks the reward scorer when ``reward.scorer`` is "auto"
  (``hybridrl.rewards.get_scorer``);
- ``reward_model`` (optional): a struct/dict whose ``ground_truth`` the rule-based scorers compare against
  (may be null for reward-model-only data);
- ``extra_info`` (optional): a struct/dict handed to scorers as is.

Other columns (``chosen``, ...) are not read. What a reward needs is the trainer's question, not the
loader's: a file without ``data_source`` or ``reward_model`` loads, and the run's start-up check
(``RewardManager.check_data_sources``) says in one line what the configured scorer is missing and how to
fix it (:attr:`RLHFDataset.data_sources` holds ``None`` for rows without a data_source).

Everything is read, checked and tokenized at construction, so bad input fails before training starts
with one line that names the file, row, value and fix. Prompts longer than ``max_prompt_length`` are
dropped (``filter_overlong_prompts``, counted in :attr:`RLHFDataset.stats` and logged), cut
(``truncation`` "left" keeps the end, "right" keeps the start, counted), or an error (``truncation``
"error"). No other row is ever dropped. Batches with a resumable position come from
:class:`hybridrl.data.loader.PromptLoader`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import numpy as np
import torch

from hybridrl.config.schema import TRUNCATIONS, DataConfig
from hybridrl.data.files import DataError, read_rows
from hybridrl.data.tokenizers import Message, Tokenizer, load_tokenizer
from hybridrl.protocol import DataProto

logger = logging.getLogger(__name__)

DATASET_ONLY_DEFAULTS: dict[str, Any] = {"filter_overlong_prompts": False}
"""Dataset options not (yet) in :class:`~hybridrl.config.schema.DataConfig`, with their defaults:
``filter_overlong_prompts`` drops prompts longer than max_prompt_length (counted) instead of applying
``truncation``."""

NON_TENSOR_KEYS = ("data_source", "ground_truth", "extra_info", "raw_prompt", "uid")


@dataclass
class _Options:
    prompt_key: str
    max_prompt_length: int
    max_response_length: int
    truncation: str
    filter_overlong_prompts: bool


def _options(config: Any) -> _Options:
    """Dataset options from a dict, a :class:`DataConfig` or None; defaults come from DataConfig."""
    if config is None:
        items: dict[str, Any] = {}
    elif is_dataclass(config):
        items = {f.name: getattr(config, f.name) for f in fields(config)}
    elif isinstance(config, Mapping) or hasattr(config, "items"):
        items = dict(config.items())
    else:
        raise TypeError(f"RLHFDataset config must be a dict or DataConfig, got {type(config).__name__}")
    data_keys = {f.name for f in fields(DataConfig)}
    for key in items:
        if key not in data_keys and key not in DATASET_ONLY_DEFAULTS:
            known = sorted(data_keys | set(DATASET_ONLY_DEFAULTS))
            raise ValueError(f"data config key {key!r} is unknown; known keys: {known}")
    base = DataConfig(**{k: v for k, v in items.items() if k in data_keys})
    opts = _Options(
        prompt_key=base.prompt_key,
        max_prompt_length=base.max_prompt_length,
        max_response_length=base.max_response_length,
        truncation=base.truncation,
        filter_overlong_prompts=bool(
            items.get("filter_overlong_prompts", DATASET_ONLY_DEFAULTS["filter_overlong_prompts"])
        ),
    )
    for key in ("max_prompt_length", "max_response_length"):
        value = getattr(opts, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"data.{key} ({value!r}) must be an integer >= 1")
    if opts.truncation not in TRUNCATIONS:
        raise ValueError(f"data.truncation ({opts.truncation!r}) must be one of {list(TRUNCATIONS)}")
    return opts


def _messages(prompt: Any, where: str, key: str) -> list[Message]:
    """A row's prompt as chat messages; one-line errors for wrong types and empty prompts."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: column {key!r} is an empty string; fill the prompt or remove the row")
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list | tuple | np.ndarray):
        raise DataError(
            f"{where}: column {key!r} is a {type(prompt).__name__}; it must be a list of {{role, content}} "
            "messages or a string"
        )
    messages = []
    for j, m in enumerate(prompt):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise DataError(f"{where}: message {j} of column {key!r} is {m!r}; each message needs str role and content")
        messages.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in messages):
        raise DataError(f"{where}: column {key!r} has no message with content; fill the prompt or remove the row")
    return messages


def _as_dict(value: Any, where: str, column: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise DataError(f"{where}: column {column!r} is a {type(value).__name__}; it must be a struct/dict or null")
    return dict(value)


class RLHFDataset:
    """Prompts of one or more files, tokenized and checked at construction.

    Args:
        data_files: parquet (or ``.jsonl``) files, read in order.
        tokenizer: anything :func:`hybridrl.data.tokenizers.load_tokenizer` takes (an HF tokenizer, a
            sentencepiece ``.model`` file, a folder, a :class:`Tokenizer`).
        config: a dict or :class:`~hybridrl.config.schema.DataConfig`; keys ``max_prompt_length``,
            ``max_response_length``, ``prompt_key``, ``truncation``, ``filter_overlong_prompts`` (other
            DataConfig fields are accepted and ignored; unknown keys are an error).

    Attributes:
        stats: ``files``, ``rows_read``, ``rows_filtered_overlong``, ``rows_truncated``, ``rows``.
        data_sources: the distinct ``data_source`` values, then ``None`` if a file has no data_source column
            (check them against the reward registry early).
        without_ground_truth: data_source -> (rows, the first one as ``"<file>: row <r> (reward_model keys
            [...])"`` or ``"... (no 'reward_model' column)"``) of the rows whose ``reward_model.ground_truth``
            is missing or null (an error where a built-in scorer scores them; data scored by a reward model
            alone needs none).

    Raises:
        FileNotFoundError / ValueError: a missing or unreadable file, a missing column, a bad or empty
            prompt, or an overlong prompt with truncation "error"; one line naming file, row and fix.
    """

    def __init__(self, data_files: str | os.PathLike | Sequence[str | os.PathLike], tokenizer: Any, config: Any = None):
        if isinstance(data_files, str | os.PathLike):
            data_files = [data_files]
        if not data_files:
            raise DataError("RLHFDataset got no data_files; set data.train_files to one or more parquet files")
        self.data_files = [os.fspath(f) for f in data_files]
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer)
        self.options = _options(config)
        self.max_prompt_length = self.options.max_prompt_length
        self.max_response_length = self.options.max_response_length
        self._rows: list[dict[str, Any]] = []
        self.without_ground_truth: dict[str, tuple[int, str]] = {}
        self.stats = {"files": len(self.data_files), "rows_read": 0, "rows_filtered_overlong": 0, "rows_truncated": 0}
        for file_idx, path in enumerate(self.data_files):
            self._load_file(file_idx, path)
        self.stats["rows"] = len(self._rows)
        if not self._rows:
            raise DataError(f"RLHFDataset has no prompts left ({self.stats}); check data files and max_prompt_length")
        sources = {r["data_source"] for r in self._rows}
        self.data_sources: list[str | None] = sorted(sources - {None}) + ([None] if None in sources else [])
        log = logger.warning if self.stats["rows_filtered_overlong"] else logger.info
        log("RLHFDataset: %s", self.summary())

    def summary(self) -> str:
        """One line: rows read, dropped (overlong) and truncated."""
        s = self.stats
        return (
            f"{s['rows']} prompts from {s['files']} file(s): {s['rows_read']} read, "
            f"{s['rows_filtered_overlong']} dropped as longer than max_prompt_length={self.max_prompt_length}, "
            f"{s['rows_truncated']} truncated ({self.options.truncation})"
        )

    def _load_file(self, file_idx: int, path: str) -> None:
        key, limit = self.options.prompt_key, self.max_prompt_length
        cols = read_rows(path, required=(key,), optional=("data_source", "reward_model", "extra_info"))
        sources, reward_models, extras = cols["data_source"], cols["reward_model"], cols["extra_info"]
        overlong: list[tuple[int, int]] = []
        for row, prompt in enumerate(cols[key]):
            where = f"{path}: row {row}"
            self.stats["rows_read"] += 1
            messages = _messages(prompt, where, key)
            source = None if sources is None else sources[row]
            if sources is not None and (not isinstance(source, str) or not source):
                raise DataError(f"{where}: column 'data_source' is {source!r}; it must be a non-empty string")
            ids = self.tokenizer.apply_chat_template(messages)
            if len(ids) > limit:
                if self.options.filter_overlong_prompts:
                    self.stats["rows_filtered_overlong"] += 1
                    continue
                if self.options.truncation == "error":
                    overlong.append((row, len(ids)))
                    continue
                ids = ids[-limit:] if self.options.truncation == "left" else ids[:limit]
                self.stats["rows_truncated"] += 1
            self._rows.append(
                {
                    "ids": ids,
                    "raw_prompt": prompt if isinstance(prompt, str) else messages,
                    "data_source": source,
                    "ground_truth": self._ground_truth(reward_models, row, where, source),
                    "extra_info": _as_dict(None if extras is None else extras[row], where, "extra_info"),
                    "uid": f"{file_idx}/{row}",
                }
            )
        if overlong:
            (row, n), more = overlong[0], len(overlong) - 1
            also = f" (and {more} more rows)" if more else ""
            raise DataError(
                f"{path}: row {row}{also}: prompt has {n} tokens > data.max_prompt_length ({limit}); raise it, "
                "set data.truncation to left/right, or set data.filter_overlong_prompts=true"
            )

    def _ground_truth(self, column: list[Any] | None, row: int, where: str, source: str | None) -> Any:
        reward_model = {} if column is None else _as_dict(column[row], where, "reward_model")
        if reward_model.get("ground_truth") is None:
            what = "no 'reward_model' column" if column is None else f"reward_model keys {sorted(reward_model)}"
            first = f"{where} ({what})"
            count, first = self.without_ground_truth.get(source, (0, first))
            self.without_ground_truth[source] = (count + 1, first)
        return reward_model.get("ground_truth")

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """One prompt: ``input_ids`` / ``attention_mask`` / ``position_ids`` ``(max_prompt_length,)``,
        left-padded, plus ``data_source``, ``ground_truth``, ``extra_info``, ``raw_prompt``, ``uid``."""
        row = self._rows[index]
        ids, pad = row["ids"], self.max_prompt_length - len(row["ids"])
        input_ids = torch.tensor([self.tokenizer.pad_token_id] * pad + ids, dtype=torch.long)
        attention_mask = torch.tensor([0] * pad + [1] * len(ids), dtype=torch.long)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(0) - 1).clamp(min=0),
            **{k: row[k] for k in NON_TENSOR_KEYS},
        }

    def batch(self, indices: Sequence[int]) -> DataProto:
        """The rows at ``indices`` as one DataProto (see :func:`collate`)."""
        return collate([self[int(i)] for i in indices])


def collate(items: Sequence[Mapping[str, Any]]) -> DataProto:
    """Stack dataset items into a DataProto.

    Tensors (each ``(max_prompt_length,)``) become ``(batch, max_prompt_length)`` in ``batch``; every other
    value goes to ``non_tensor_batch`` as a 1-D object array.

    Raises:
        ValueError: no items, or items with different keys.
    """
    if not items:
        raise ValueError("collate got no items; a batch needs at least one prompt")
    keys = list(items[0])
    for i, item in enumerate(items):
        if list(item) != keys:
            raise ValueError(f"collate: item {i} has keys {sorted(item)}, item 0 has {sorted(keys)}")
    tensors = {k: torch.stack([it[k] for it in items]) for k in keys if isinstance(items[0][k], torch.Tensor)}
    others = {k: [it[k] for it in items] for k in keys if k not in tensors}
    return DataProto(tensors, others)

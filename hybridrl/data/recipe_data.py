"""The datasets of the offline recipes: SFT examples and DPO preference pairs, as the compute batch layout.

A row becomes one sequence (SFT) or two (DPO), each laid out as every training batch of hybridrl is (see
:mod:`hybridrl.mcore.compute`): the prompt LEFT-padded to ``data.max_prompt_length``, the response RIGHT-padded to
``data.max_response_length``, and ``response_mask`` 1 on the tokens the loss reads.

SFT files (``hybridrl sft``) hold one of two schemas:

- ``messages`` (``sft.messages_key``): a chat, rendered with the tokenizer's chat template. The loss reads every
  assistant turn and nothing else: the prompt is the chat up to the first assistant turn, the response the rest,
  with ``response_mask`` 0 on the turns in between (as the agent loop masks observations). Each assistant turn
  is the text its template adds for it (``render(messages[:i+1])`` minus ``render(messages[:i],
  add_generation_prompt=True)``) and ends with EOS, as a generation ends: the next turn is appended after it,
  token-in-token-out. Messages after the last assistant turn are not read. A template that does not render
  each turn as a continuation of the one before cannot be split so: one line names the row.
- ``prompt`` (``data.prompt_key``: chat messages or a string, rendered as RL prompts are) + ``response``
  (``sft.response_key``): the response's tokens and EOS are trained on, i.e. exactly the sequences an RL run
  started from this model generates.

DPO files (``hybridrl dpo``) hold ``prompt``, ``chosen`` and ``rejected`` (``dpo.chosen_key`` /
``dpo.rejected_key``; a response is a string or a one-message assistant chat). A batch of ``k`` pairs is ``2k``
rows: the ``k`` chosen responses, then the ``k`` rejected ones in the same order.

Bad input stops at construction, before any model is built, with one line (file, row, fix): a DPO file without a
chosen / rejected column, a pair whose responses are equal, an SFT chat without an assistant turn, a sequence
longer than the data lengths with ``data.truncation`` "error" (otherwise the prompt keeps the end that
``data.truncation`` names and the response its start; both counted).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hybridrl.config.schema import DataConfig
from hybridrl.config.schema_recipes import DPOConfig, SFTConfig
from hybridrl.data.dataset import _messages
from hybridrl.data.files import DataError, read_rows
from hybridrl.data.tokenizers import Message, Tokenizer
from hybridrl.protocol import DataProto

Segments = list[tuple[list[int], bool]]
"""A sequence as ``(token ids, trained)`` pieces, in order."""


def chat_segments(tok: Tokenizer, messages: Sequence[Message], where: str) -> Segments:
    """A chat as context and assistant pieces (module docs): assistant pieces are trained, each ending with EOS.

    Raises:
        DataError: no assistant turn, or a template whose renderings are not continuations of each other.
    """
    out: Segments = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        context = tok.render_chat(messages[:i], add_generation_prompt=True)
        full = tok.render_chat(messages[: i + 1], add_generation_prompt=False)
        if not (context.startswith(done) and full.startswith(context)):
            raise DataError(
                f"{where}: the chat template does not render message {i} as a continuation of the messages before it,"
                " so its assistant tokens cannot be told apart; use prompt + response rows or a template that only "
                "appends"
            )
        out.append((tok.encode(context[len(done) :]), False))
        ids = tok.encode(full[len(context) :])
        out.append((ids if tok.eos_token_id in ids else [*ids, tok.eos_token_id], True))
        done = full
    if not out:
        raise DataError(
            f"{where}: the chat has no assistant turn (roles {[m['role'] for m in messages]}); SFT trains on "
            "assistant turns only: add one or drop the row"
        )
    return out


def response_tokens(tok: Tokenizer, value: Any, where: str, key: str) -> list[int]:
    """A response column's value (a string, or a chat of one assistant message) as ids ending with EOS."""
    one = isinstance(value, list | tuple | np.ndarray) and len(value) == 1 and isinstance(value[0], dict)
    if one and value[0].get("role") == "assistant" and isinstance(value[0].get("content"), str):
        value = value[0]["content"]
    if not isinstance(value, str):
        raise DataError(f"{where}: column {key!r} is {type(value).__name__}; it must be a string or one assistant "
                        "message [{role: assistant, content: ...}]")  # fmt: skip
    if not value.strip():
        raise DataError(f"{where}: column {key!r} is empty; fill the response or drop the row")
    return [*tok.encode(value), tok.eos_token_id]


class _SequenceSet:
    """Sequences as (prompt ids, response ids, response mask), fitted to the data lengths (module docs)."""

    def __init__(self, tokenizer: Tokenizer, data: DataConfig) -> None:
        self.tok, self.data = tokenizer, data
        self.prompts: list[list[int]] = []
        self.responses: list[list[int]] = []
        self.masks: list[list[int]] = []
        self.stats = {"rows": 0, "truncated": 0}

    def _add(self, segments: Segments, where: str) -> None:
        first = next(i for i, (_, trained) in enumerate(segments) if trained)
        prompt = [t for ids, _ in segments[:first] for t in ids]
        response = [t for ids, _ in segments[first:] for t in ids]
        mask = [int(trained) for ids, trained in segments[first:] for _ in ids]
        d = self.data
        if len(prompt) > d.max_prompt_length or len(response) > d.max_response_length:
            if d.truncation == "error":
                raise DataError(
                    f"{where}: prompt {len(prompt)} / response {len(response)} tokens exceed data.max_prompt_length "
                    f"({d.max_prompt_length}) / data.max_response_length ({d.max_response_length}); raise them or set "
                    "data.truncation=left (prompts keep their end, responses their start)"
                )
            self.stats["truncated"] += 1
            keep = d.max_prompt_length
            prompt = prompt[-keep:] if d.truncation == "left" else prompt[:keep]
            response, mask = response[: d.max_response_length], mask[: d.max_response_length]
        if not prompt or not any(mask):
            raise DataError(f"{where}: nothing left to train on after fitting to data.max_prompt_length / "
                            "max_response_length; raise them")  # fmt: skip
        self.prompts.append(prompt)
        self.responses.append(response)
        self.masks.append(mask)

    def tensors(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Rows ``rows`` in the compute layout: ``input_ids``, ``attention_mask``, ``position_ids`` ``(b, P + R)``,
        ``responses``, ``response_mask`` ``(b, R)``."""
        p, r, pad = self.data.max_prompt_length, self.data.max_response_length, self.tok.pad_token_id
        ids = torch.full((len(rows), p + r), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        loss = torch.zeros(len(rows), r, dtype=torch.long)
        for i, row in enumerate(rows):
            prompt, response = self.prompts[row], self.responses[row]
            ids[i, p - len(prompt) : p] = torch.tensor(prompt)
            ids[i, p : p + len(response)] = torch.tensor(response)
            attn[i, p - len(prompt) : p + len(response)] = 1
            loss[i, : len(response)] = torch.tensor(self.masks[row])
        return {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(1) - 1).clamp(min=0),
                "responses": ids[:, p:].clone(), "response_mask": loss}  # fmt: skip


def _files(data_files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    files = [data_files] if isinstance(data_files, str | os.PathLike) else list(data_files)
    if not files:
        raise DataError("no data files given; set data.train_files=[/path/to/train.parquet]")
    return [os.fspath(f) for f in files]


class SFTDataset:
    """SFT examples from ``messages`` or ``prompt`` + ``response`` files (module docs); ``batch`` for the loader.

    Args:
        data_files: parquet / jsonl files.
        tokenizer: a :class:`~hybridrl.data.tokenizers.Tokenizer`.
        data: the ``data`` section (prompt key, lengths, truncation); sft: the ``sft`` section.
    """

    def __init__(self, data_files: Any, tokenizer: Tokenizer, data: DataConfig, sft: SFTConfig) -> None:
        self.sequences = _SequenceSet(tokenizer, data)
        for path in _files(data_files):
            cols = read_rows(path, [], [sft.messages_key, data.prompt_key, sft.response_key])
            if cols[sft.messages_key] is not None:
                for i, chat in enumerate(cols[sft.messages_key]):
                    where = f"{path} row {i}"
                    self.sequences._add(chat_segments(tokenizer, _messages(chat, where, sft.messages_key), where),
                                        where)  # fmt: skip
            elif cols[data.prompt_key] is not None and cols[sft.response_key] is not None:
                for i, (prompt, response) in enumerate(zip(cols[data.prompt_key], cols[sft.response_key], strict=True)):
                    where = f"{path} row {i}"
                    context = tokenizer.apply_chat_template(_messages(prompt, where, data.prompt_key))
                    answer = response_tokens(tokenizer, response, where, sft.response_key)
                    self.sequences._add([(context, False), (answer, True)], where)
            else:
                raise DataError(
                    f"{path}: an SFT file needs a {sft.messages_key!r} column (sft.messages_key) or "
                    f"{data.prompt_key!r} + {sft.response_key!r} columns (data.prompt_key, sft.response_key); add them"
                )

    def __len__(self) -> int:
        return len(self.sequences.prompts)

    def batch(self, indices: Sequence[int]) -> DataProto:
        """The examples ``indices`` as one DataProto of the compute layout."""
        return DataProto.from_dict(tensors=self.sequences.tensors([int(i) for i in indices]))

    def summary(self) -> str:
        tokens = sum(sum(m) for m in self.sequences.masks)
        return f"{len(self)} examples, {tokens} assistant tokens, {self.sequences.stats['truncated']} truncated"


class PreferenceDataset:
    """DPO pairs from ``prompt`` / ``chosen`` / ``rejected`` files (module docs); ``batch`` gives ``2k`` rows.

    Args:
        data_files: parquet / jsonl files.
        tokenizer: a :class:`~hybridrl.data.tokenizers.Tokenizer`.
        data: the ``data`` section (prompt key, lengths, truncation); dpo: the ``dpo`` section (column names).
    """

    def __init__(self, data_files: Any, tokenizer: Tokenizer, data: DataConfig, dpo: DPOConfig) -> None:
        self.sequences = _SequenceSet(tokenizer, data)  # pair j: sequences 2j (chosen) and 2j + 1 (rejected)
        keys = (data.prompt_key, dpo.chosen_key, dpo.rejected_key)
        for path in _files(data_files):
            cols = read_rows(path, [], keys)
            missing = [k for k in keys if cols[k] is None]
            if missing:
                names = {data.prompt_key: "data.prompt_key", dpo.chosen_key: "dpo.chosen_key",
                         dpo.rejected_key: "dpo.rejected_key"}  # fmt: skip
                raise DataError(f"{path}: a DPO file needs columns {list(keys)} and has no {missing} "
                                f"({', '.join(names[k] for k in missing)}); add them or set the key")  # fmt: skip
            for i, (prompt, chosen, rejected) in enumerate(zip(*(cols[k] for k in keys), strict=True)):
                where = f"{path} row {i}"
                context = tokenizer.apply_chat_template(_messages(prompt, where, data.prompt_key))
                good = response_tokens(tokenizer, chosen, where, dpo.chosen_key)
                bad = response_tokens(tokenizer, rejected, where, dpo.rejected_key)
                if good == bad:
                    raise DataError(f"{where}: {dpo.chosen_key!r} equals {dpo.rejected_key!r} ({chosen!r}): the pair "
                                    "carries no preference; fix or drop the row")  # fmt: skip
                self.sequences._add([(context, False), (good, True)], where)
                self.sequences._add([(context, False), (bad, True)], where)

    def __len__(self) -> int:
        return len(self.sequences.prompts) // 2

    def batch(self, indices: Sequence[int]) -> DataProto:
        """Pairs ``indices`` as ``2k`` rows: the chosen responses, then the rejected ones (same order)."""
        pairs = [int(i) for i in indices]
        rows = [2 * j for j in pairs] + [2 * j + 1 for j in pairs]
        return DataProto.from_dict(tensors=self.sequences.tensors(rows))

    def summary(self) -> str:
        return f"{len(self)} pairs, {self.sequences.stats['truncated']} sequences truncated"

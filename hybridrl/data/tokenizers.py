"""Tokenizers behind one small interface: Hugging Face tokenizers and sentencepiece models.

This module owns :class:`Tokenizer` (``encode``, ``decode``, ``pad_token_id``, ``eos_token_id``,
``apply_chat_template``), its two implementations (:class:`HFTokenizer`, :class:`SentencePieceTokenizer`),
:func:`load_tokenizer` (a folder, a ``.model`` file or a tokenizer object) and :func:`train_sentencepiece`,
which makes a tiny tokenizer on the spot for CPU runs and tests (no hub download).

Chat templates: an HF tokenizer with a ``chat_template`` renders prompts with it. Sentencepiece models and
template-less HF tokenizers use :data:`DEFAULT_CHAT_TEMPLATE`: each message becomes ``<|role|>\\n{content}\\n``
and the generation prompt is ``<|assistant|>\\n``; no BOS is added. :func:`train_sentencepiece` makes the
three markers (:data:`CHAT_MARKERS`) and ``\\n`` single tokens.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

CHAT_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>")
"""Role markers of the default chat template (user-defined symbols of :func:`train_sentencepiece`)."""

DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
"""Default rendering of one message; the generation prompt is ``<|assistant|>\\n``."""

Message = dict[str, str]


def render_default_chat(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """Render ``messages`` with :data:`DEFAULT_CHAT_TEMPLATE` (used when a tokenizer has no template)."""
    text = "".join(DEFAULT_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages)
    return text + "<|assistant|>\n" if add_generation_prompt else text


class Tokenizer(ABC):
    """What hybridrl needs from a tokenizer. Token ids are plain ``list[int]``."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens (no BOS/EOS added)."""

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""

    @property
    @abstractmethod
    def pad_token_id(self) -> int:
        """Id used to left-pad prompts and right-pad responses."""

    @property
    @abstractmethod
    def eos_token_id(self) -> int:
        """Id that ends a response."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids (the model's vocab must be at least this)."""

    @abstractmethod
    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat prompt as text (the tokenizer's template, or :data:`DEFAULT_CHAT_TEMPLATE`)."""

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat prompt (the rendering carries any BOS the template wants)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))


class HFTokenizer(Tokenizer):
    """A ``transformers`` tokenizer. Without a pad token, EOS pads (as most decoder-only checkpoints need)."""

    def __init__(self, tokenizer: Any) -> None:
        self.hf = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has eos_token_id None; set tokenizer.eos_token before use"
            )

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def pad_token_id(self) -> int:
        pad = self.hf.pad_token_id
        return int(self.hf.eos_token_id if pad is None else pad)

    @property
    def eos_token_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        if not getattr(self.hf, "chat_template", None):
            return render_default_chat(messages, add_generation_prompt)
        return self.hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model (``.model`` file or a loaded ``SentencePieceProcessor``); default chat template.

    A model without a pad id (sentencepiece's default, ``pad_id=-1``) pads with EOS.
    """

    def __init__(self, model: str | os.PathLike | Any) -> None:
        import sentencepiece as spm

        self.model_path: str | None = None
        """The ``.model`` file, when loaded from one (what to ship next to a checkpoint)."""
        if isinstance(model, spm.SentencePieceProcessor):
            self.sp = model
        else:
            self.model_path = os.fspath(model)
            self.sp = spm.SentencePieceProcessor(model_file=self.model_path)
        if self.sp.eos_id() < 0:
            raise ValueError("sentencepiece model has no eos id (eos_id=-1); retrain it with eos_id set, e.g. 3")

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Models often have more embedding rows than the tokenizer has pieces (padding to a multiple of 64):
        # a sampled id past the vocabulary decodes to nothing.
        size = self.sp.get_piece_size()
        ids = [int(i) for i in ids if 0 <= int(i) < size]
        if skip_special_tokens:  # sentencepiece drops control ids (pad/bos/eos) itself; keep chat markers
            ids = [i for i in ids if not self.sp.is_control(i)]
        return self.sp.decode(ids)

    @property
    def pad_token_id(self) -> int:
        pad = self.sp.pad_id()
        return int(self.sp.eos_id() if pad < 0 else pad)

    @property
    def eos_token_id(self) -> int:
        return int(self.sp.eos_id())

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        return render_default_chat(messages, add_generation_prompt)


def load_tokenizer(source: Any, trust_remote_code: bool = False) -> Tokenizer:
    """A :class:`Tokenizer` from a tokenizer folder, a sentencepiece ``.model`` file or a tokenizer object.

    Args:
        source: a :class:`Tokenizer` (returned as is), an HF tokenizer, a ``SentencePieceProcessor``, a
            ``.model`` file, or a local folder holding an HF tokenizer (``tokenizer.json`` /
            ``tokenizer_config.json``) or only a ``tokenizer.model``.
        trust_remote_code: passed to ``AutoTokenizer.from_pretrained``.

    Raises:
        FileNotFoundError: ``source`` is a path that does not exist.
        ValueError: the path holds no tokenizer, or the object is not a tokenizer.
    """
    if isinstance(source, Tokenizer):
        return source
    if not isinstance(source, str | os.PathLike):
        if hasattr(source, "apply_chat_template") and hasattr(source, "eos_token_id"):
            return HFTokenizer(source)
        if type(source).__name__ == "SentencePieceProcessor":
            return SentencePieceTokenizer(source)
        raise ValueError(
            f"tokenizer of type {type(source).__name__} is not supported; pass an HF tokenizer, a "
            "SentencePieceProcessor, a sentencepiece .model file or a tokenizer folder"
        )
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {os.fspath(source)!r} does not exist; check model.tokenizer_path")
    if path.is_file():
        if path.suffix != ".model":
            raise ValueError(f"tokenizer file {os.fspath(path)!r} is not a sentencepiece .model; pass its folder")
        return SentencePieceTokenizer(path)
    if (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        return HFTokenizer(AutoTokenizer.from_pretrained(os.fspath(path), trust_remote_code=trust_remote_code))
    if (path / "tokenizer.model").exists():
        return SentencePieceTokenizer(path / "tokenizer.model")
    raise ValueError(
        f"tokenizer folder {os.fspath(path)!r} holds no tokenizer.json, tokenizer_config.json or tokenizer.model; "
        "point model.tokenizer_path at a tokenizer"
    )


def train_sentencepiece(
    texts: Iterable[str],
    vocab_size: int,
    out_prefix: str | os.PathLike,
    model_type: str = "bpe",
    extra_symbols: Sequence[str] = (),
) -> SentencePieceTokenizer:
    """Train a small sentencepiece model on ``texts`` and write ``{out_prefix}.model`` / ``.vocab``.

    Ids: pad 0, unk 1, bos 2, eos 3, then :data:`CHAT_MARKERS` and ``"\\n"`` as single tokens. Text is kept
    as is (identity normalisation, whitespace preserved, no dummy prefix), every character of ``texts`` is
    covered, and digits are split one per token (arithmetic tasks learn faster). ``vocab_size`` is an
    upper bound: a small corpus yields fewer pieces rather than an error.

    Args:
        texts: training sentences (every character a prompt or response may use should occur).
        vocab_size: largest vocabulary to build (>= 8).
        out_prefix: output path without extension.
        model_type: sentencepiece model type: "bpe", "unigram", "char" or "word".
        extra_symbols: more strings to keep as single tokens.

    Returns:
        The trained tokenizer, loaded from ``{out_prefix}.model``.
    """
    import sentencepiece as spm

    if vocab_size < 8:
        raise ValueError(f"vocab_size ({vocab_size}) must be >= 8 (4 special ids + chat markers)")
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(list(texts)),
        model_prefix=os.fspath(out_prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=1.0,
        split_digits=True,
        user_defined_symbols=[*CHAT_MARKERS, "\n", *extra_symbols],
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return SentencePieceTokenizer(f"{os.fspath(out_prefix)}.model")

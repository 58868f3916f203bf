"""Tiny tokenizers built in-process for tests (no hub): a byte-level BPE wrapped as an HF fast tokenizer,
with or without a chat template, and a sentencepiece model trained on the spot."""

from __future__ import annotations

from pathlib import Path

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "You are a helpful assistant.",
    "What is 12 + 30? The answer is #### 42",
    "Copy: 482\nCopy: 1,234\nRepeat the word hello world",
    "the quick brown fox jumps over the lazy dog 0123456789",
]


def hf_tokenizer(chat_template: bool = True, pad: bool = True):
    """A byte-level BPE as ``PreTrainedTokenizerFast`` (exact decode), ChatML template, ``<pad>`` id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>" if pad else None)
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    if chat_template:
        hf.chat_template = CHATML
    return hf


def sp_tokenizer(folder: Path, texts: list[str] | None = None, vocab_size: int = 96):
    """A sentencepiece model trained on ``texts`` (default: the test corpus), written under ``folder``."""
    from hybridrl.data import train_sentencepiece

    return train_sentencepiece(texts or CORPUS, vocab_size=vocab_size, out_prefix=folder / "sp")

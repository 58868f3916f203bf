"""Tests of hybridrl.data.tokenizers: HF (with and without a chat template) and sentencepiece behind one
interface, load_tokenizer from folders / files / objects, and train_sentencepiece."""

from __future__ import annotations

import pytest

from hybridrl.data import (
    CHAT_MARKERS,
    HFTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    render_default_chat,
    train_sentencepiece,
)
from tests.data import tiny_tokenizers

CHAT = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Copy: 482"}]


def test_hf_uses_its_chat_template_and_roundtrips(hf_tok, tmp_path):
    tok = load_tokenizer(hf_tok)
    assert isinstance(tok, HFTokenizer)
    text = tok.render_chat(CHAT)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nCopy: 482<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(CHAT)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert ids[0] == hf_tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(tok.encode("The answer is #### 1,234")) == "The answer is #### 1,234"
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1)
    assert tok.decode([*tok.encode("482"), tok.eos_token_id, tok.pad_token_id]) == "482"
    hf_tok.save_pretrained(tmp_path)  # the same tokenizer from a folder
    assert load_tokenizer(tmp_path).apply_chat_template(CHAT) == ids


def test_hf_without_template_or_pad_uses_defaults():
    tok = load_tokenizer(tiny_tokenizers.hf_tokenizer(chat_template=False, pad=False))
    assert tok.render_chat(CHAT) == "<|system|>\nYou are a helpful assistant.\n<|user|>\nCopy: 482\n<|assistant|>\n"
    assert tok.render_chat(CHAT, add_generation_prompt=False).endswith("Copy: 482\n")
    assert tok.pad_token_id == tok.eos_token_id == 1


def test_sentencepiece_markers_ids_and_roundtrip(sp_tok):
    tok = sp_tok
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 3)
    for marker in (*CHAT_MARKERS, "\n"):
        assert len(tok.encode(marker)) == 1, marker
    text = render_default_chat(CHAT)
    ids = tok.apply_chat_template(CHAT)
    assert tok.decode(ids) == text
    assert ids.count(tok.encode("<|assistant|>")[0]) == 1
    assert tok.decode([*tok.encode("Copy: 482"), tok.eos_token_id, tok.pad_token_id]) == "Copy: 482"
    assert [tok.decode([i]) for i in tok.encode("4821")] == list("4821")  # digits split
    assert load_tokenizer(tok.model_path).encode("hello") == tok.encode("hello")


def test_train_sentencepiece_small_corpus_and_folder(tmp_path):
    tok = train_sentencepiece(["ab ab", "ba"], vocab_size=1000, out_prefix=tmp_path / "tok" / "sp")
    assert tok.vocab_size < 1000  # a soft limit on a tiny corpus
    (tmp_path / "tok" / "sp.model").rename(tmp_path / "tok" / "tokenizer.model")
    assert load_tokenizer(tmp_path / "tok").encode("ab") == tok.encode("ab")
    with pytest.raises(ValueError, match=r"vocab_size \(4\) must be >= 8"):
        train_sentencepiece(["ab"], vocab_size=4, out_prefix=tmp_path / "x")


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"does not exist; check model\.tokenizer_path"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "vocab.txt").write_text("a\n")
    with pytest.raises(ValueError, match=r"is not a sentencepiece \.model"):
        load_tokenizer(tmp_path / "vocab.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"holds no tokenizer\.json"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(ValueError, match="tokenizer of type int is not supported"):
        load_tokenizer(3)

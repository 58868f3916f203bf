"""Prompt data: files (parquet / jsonl), tokenizers (HF and sentencepiece) and chat templates, the
:class:`RLHFDataset` and the resumable :class:`PromptLoader`.

    from hybridrl.data import RLHFDataset, PromptLoader, load_tokenizer
    ds = RLHFDataset(data_files=["train.parquet"], tokenizer=tok,
                     config={"max_prompt_length": 512, "max_response_length": 256})
    loader = PromptLoader(ds, batch_size=256, seed=42)
"""

from hybridrl.data.dataset import RLHFDataset, collate
from hybridrl.data.files import read_rows, write_rows
from hybridrl.data.loader import PromptLoader
from hybridrl.data.tokenizers import (
    CHAT_MARKERS,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
    render_default_chat,
    train_sentencepiece,
)

__all__ = [
    "CHAT_MARKERS",
    "HFTokenizer",
    "PromptLoader",
    "RLHFDataset",
    "SentencePieceTokenizer",
    "Tokenizer",
    "collate",
    "load_tokenizer",
    "read_rows",
    "render_default_chat",
    "train_sentencepiece",
    "write_rows",
]

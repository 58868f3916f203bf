"""The offline recipes' embedded demo, made on the spot: chat data or preference pairs, a tokenizer, a tiny model.

With ``data.demo_task: true`` (``configs/tiny_cpu_sft.yaml``, ``configs/tiny_cpu_dpo.yaml``), ``hybridrl sft`` /
``hybridrl dpo`` call :func:`make_recipe_demo` on rank 0 before anything is built. The task is the quickstart's
"copy the digits" (:mod:`hybridrl.rewards.demo`), with the same rows and the same sentencepiece tokenizer as
``hybridrl train``'s demo (:func:`hybridrl.trainer.demo_assets.make_demo_assets`, same ``trainer.seed``), so that an
SFT export warm-starts the RL demo (``model.path`` = the export) with matching token ids:

- SFT: ``messages`` rows ``[user: "Copy: 482", assistant: "482"]``; every fourth has a system turn first;
- DPO: ``prompt`` / ``chosen`` / ``rejected`` rows, chosen the right copy and rejected a copy with every digit
  wrong;
- the model: a Llama of ``model.architecture`` with the tokenizer's vocabulary, random init (SFT / DPO is what
  trains it), unless ``model.path`` is set (then that model, with this tokenizer).

Everything is seeded from ``trainer.seed``; nothing is downloaded.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import torch

from hybridrl.config import RunConfig

SYSTEM = "You copy digits."


def sft_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The demo task's rows as SFT chats (``messages``)."""
    out = []
    for i, row in enumerate(rows):
        system = [{"role": "system", "content": SYSTEM}] if i % 4 == 3 else []
        answer = {"role": "assistant", "content": row["reward_model"]["ground_truth"]}
        out.append({"messages": [*system, *row["prompt"], answer]})
    return out


def dpo_rows(rows: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """The demo task's rows as preference pairs: the right copy over a copy with every digit wrong."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        answer = row["reward_model"]["ground_truth"]
        wrong = "".join(rng.choice([d for d in "0123456789" if d != a]) for a in answer)
        out.append({"prompt": row["prompt"], "chosen": answer, "rejected": wrong})
    return out


def make_recipe_demo(cfg: RunConfig, out_dir: str, recipe: str, n_train: int = 512, n_val: int = 64) -> dict[str, str]:
    """Write the ``recipe`` demo's data, tokenizer and (without ``model.path``) model under ``out_dir``.

    Returns:
        ``{"model", "tokenizer", "train", "val"}`` paths.
    """
    import transformers

    from hybridrl.data.files import write_rows
    from hybridrl.data.tokenizers import train_sentencepiece
    from hybridrl.rewards.demo import demo_texts, make_demo_task
    from hybridrl.trainer.demo_assets import _hf_config

    os.makedirs(out_dir, exist_ok=True)
    seed = cfg.trainer.seed
    train = make_demo_task(n_train, seed=seed, split="train")  # the RL demo's rows: the same tokenizer
    val = make_demo_task(n_val, seed=seed + 1000, split="val")
    tok = train_sentencepiece(demo_texts(train + val), vocab_size=64, out_prefix=os.path.join(out_dir, "tokenizer"))
    convert = sft_rows if recipe == "sft" else (lambda rows: dpo_rows(rows, seed))
    paths = {"tokenizer": os.path.join(out_dir, "tokenizer.model"), "model": os.path.join(out_dir, "model"),
             "train": str(write_rows(convert(train), os.path.join(out_dir, f"{recipe}_train.parquet"))),
             "val": str(write_rows(convert(val), os.path.join(out_dir, f"{recipe}_val.parquet")))}  # fmt: skip
    if cfg.model.path is None:
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(_hf_config(cfg, tok.vocab_size, tok)).float()
        model.save_pretrained(paths["model"], safe_serialization=True)
        # the folder carries its tokenizer, as a checkpoint folder does: `hybridrl export` copies it along
        shutil.copy(paths["tokenizer"], os.path.join(paths["model"], "tokenizer.model"))
    return paths

"""The quickstart's embedded default, made on the spot: a task, a tokenizer and a tiny warmed-up model.

When a config has ``model.path: null`` (``configs/tiny_cpu.yaml``), ``hybridrl train`` calls
:func:`make_demo_assets` on rank 0 before anything is built:

1. the "copy the digits" task (:mod:`hybridrl.rewards.demo`): train and validation parquet files;
2. a sentencepiece tokenizer trained on the task's text (digits are single tokens);
3. a Llama (or, with ``model_type: qwen3_moe``, a Qwen3-MoE) of ``model.architecture`` with the tokenizer's
   vocabulary, random init, then a SHORT supervised
   warm-up (teacher forcing on prompt -> answer, HF transformers on one process) so that RL starts from a
   policy that sometimes copies right: the task is learnable by RL from there, not from random weights.

Everything is seeded from ``trainer.seed``; nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from functools import partial

import torch

from hybridrl.config import RunConfig


@dataclass
class DemoAssets:
    model_path: str
    tokenizer_path: str
    train_file: str
    val_file: str


def _hf_config(cfg: RunConfig, vocab_size: int, tok):
    import transformers

    a = cfg.model.architecture
    if a.model_type == "qwen3_moe":  # a tiny mixture-of-experts policy (configs/tiny_cpu_moe.yaml)
        fields = _common_fields(a, vocab_size, tok)
        return transformers.Qwen3MoeConfig(
            **fields, head_dim=a.head_dim or a.hidden_size // a.num_attention_heads, num_experts=a.num_experts,
            num_experts_per_tok=a.num_experts_per_tok, moe_intermediate_size=a.moe_intermediate_size,
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"],
        )  # fmt: skip
    return transformers.LlamaConfig(**_common_fields(a, vocab_size, tok), architectures=["LlamaForCausalLM"])


def _common_fields(a, vocab_size: int, tok) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=a.hidden_size,
        intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads or a.num_attention_heads,
        max_position_embeddings=a.max_position_embeddings or 256,
        rope_theta=a.rope_theta or 10000.0,
        rms_norm_eps=a.rms_norm_eps or 1e-6,
        tie_word_embeddings=bool(a.tie_word_embeddings),
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=2,
    )


def warm_up(model, tok, rows, steps: int, seed: int, batch_size: int = 32, lr: float = 3e-3) -> list[float]:
    """Teacher-forced next-token training on prompt -> answer + EOS (loss on the answer tokens only)."""
    examples = []
    for row in rows:
        prompt = tok.apply_chat_template(row["prompt"])
        answer = [*tok.encode(row["reward_model"]["ground_truth"]), tok.eos_token_id]
        examples.append((prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return fit(model, examples, tok.pad_token_id, steps, seed, batch_size, lr)


def fit(model, examples, pad_id: int, steps: int, seed: int, batch_size: int = 32, lr: float = 3e-3) -> list[float]:
    """Teacher-forced next-token training on ``(ids, loss_mask)`` examples (loss where the mask is 1)."""
    g = torch.Generator().manual_seed(seed)
    width = max(len(ids) for ids, _ in examples)
    optim = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(examples), (batch_size,), generator=g).tolist()
        ids = torch.full((batch_size, width), pad_id, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for i, j in enumerate(idx):
            seq, mask = examples[j]
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, : len(seq)] = torch.where(torch.tensor(mask).bool(), torch.tensor(seq), -100)
        loss = model(input_ids=ids, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


WARMUP_STEPS_ENV = "HYBRIDRL_DEMO_WARMUP_STEPS"
"""Environment variable that overrides the number of supervised warm-up steps (0 = RL from random init)."""
DEFAULT_WARMUP_STEPS = 40
"""Batches of 32 at lr 3e-3: greedy validation reward ~0.25-0.4 (10-20% exact copies); 12 steps gives
~0.05, 60 steps ~0.75, 80 steps ~0.98 (nothing left for RL to learn)."""


def make_demo_assets(
    cfg: RunConfig, out_dir: str, warmup_steps: int | None = None, n_train: int = 512, n_val: int = 64
) -> DemoAssets:
    """Write the demo task, tokenizer and warmed-up model under ``out_dir``; returns their paths. The task is
    "copy the digits", or a built-in environment's task when ``rollout.agent.env`` names one
    (:mod:`hybridrl.trainer.demo_agent`: calculator word problems, number guessing).

    ``warmup_steps`` None = ``$HYBRIDRL_DEMO_WARMUP_STEPS`` if set, else :data:`DEFAULT_WARMUP_STEPS` (copy) or
    :data:`~hybridrl.trainer.demo_agent.AGENT_WARMUP_STEPS`.
    """
    from hybridrl.trainer import demo_agent

    a = cfg.rollout.agent
    agent = a.env if a.path is None and a.env in demo_agent.AGENT_DEMOS else None
    if warmup_steps is None:
        default = demo_agent.AGENT_WARMUP_STEPS if agent else DEFAULT_WARMUP_STEPS
        warmup_steps = int(os.environ.get(WARMUP_STEPS_ENV, default))
    import transformers

    from hybridrl.data.files import write_rows
    from hybridrl.data.tokenizers import train_sentencepiece
    from hybridrl.rewards.demo import demo_texts, make_demo_task

    os.makedirs(out_dir, exist_ok=True)
    seed = cfg.trainer.seed
    make = partial(demo_agent.agent_rows, agent) if agent else make_demo_task
    train, val = make(n_train, seed=seed, split="train"), make(n_val, seed=seed + 1000, split="val")
    assets = DemoAssets(
        model_path=os.path.join(out_dir, "model"),
        tokenizer_path=os.path.join(out_dir, "tokenizer.model"),
        train_file=str(write_rows(train, os.path.join(out_dir, "train.parquet"))),
        val_file=str(write_rows(val, os.path.join(out_dir, "val.parquet"))),
    )
    prefix = os.path.join(out_dir, "tokenizer")
    if agent:
        tok = train_sentencepiece(demo_agent.agent_texts(agent, train + val), vocab_size=demo_agent.AGENT_VOCAB,
                                  out_prefix=prefix, extra_symbols=demo_agent.AGENT_SYMBOLS)  # fmt: skip
    else:
        tok = train_sentencepiece(demo_texts(train + val), vocab_size=64, out_prefix=prefix)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(cfg, tok.vocab_size, tok)).float()
    losses = []
    if warmup_steps and agent:
        examples = demo_agent.agent_examples(agent, tok, train, seed)
        losses = fit(model, examples, tok.pad_token_id, warmup_steps, seed, lr=demo_agent.AGENT_WARMUP_LR)
    elif warmup_steps:
        losses = warm_up(model, tok, train, warmup_steps, seed)
    model.save_pretrained(assets.model_path, safe_serialization=True)
    # the model folder carries its tokenizer, as a checkpoint folder does: `hybridrl export` copies it along
    shutil.copy(assets.tokenizer_path, os.path.join(assets.model_path, "tokenizer.model"))
    if losses:
        print(f"[demo] supervised warm-up: {warmup_steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
    return assets

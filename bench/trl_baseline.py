"""TRL's ``GRPOTrainer`` on ``bench/step_vs_hf.py``'s work: the peer the speed goals are measured against.

TRL is not a dependency of hybridrl: install it into a folder of its own and point ``--trl-site`` at it
(``pip install --no-deps --target DIR trl==1.16.0 datasets pandas xxhash multiprocess python-dateutil``; the rest
of its dependencies, transformers and accelerate among them, are hybridrl's own). The settings are TRL's defaults
(HF ``generate``, no vLLM) except the work's and gradient checkpointing, off unless ``--trl-checkpointing``
(TRL 1.16 turns it on by default, and HF ``generate`` then runs without its KV cache: every new token recomputes
the whole sequence, several times slower here; off is the stronger baseline): 16 prompts x 4 generations,
one optimizer step per generation batch, temperature 1 with top-k / top-p off, ``beta`` 0.04, lr 1e-5, fp32 on
CPU, the same reward. The prompts are the rendered chat text of hybridrl's default template, tokenized by the same
sentencepiece model behind a ``transformers`` tokenizer, so both sides see the same prompt tokens.

Per step: TRL's own profiling spans (``transformers.generate``, the rewards, ``_prepare_inputs`` whose remainder
is the reference pass), the step's wall time (trainer callbacks; the update is the step after ``_prepare_inputs``)
and the step's tokens (TRL's ``num_tokens``: prompt + completion tokens).
"""

from __future__ import annotations

import json
import time
from typing import ClassVar


def _tokenizer(model_file: str):
    import sentencepiece as spm
    import transformers

    class SentencePieceHF(transformers.PreTrainedTokenizer):
        """A sentencepiece model as a slow ``transformers`` tokenizer (what TRL's ``processing_class`` must be)."""

        vocab_files_names: ClassVar[dict] = {}

        def __init__(self, path: str, **kwargs) -> None:
            self.sp = spm.SentencePieceProcessor(model_file=path)
            pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.sp.eos_id()
            super().__init__(eos_token=self.sp.id_to_piece(self.sp.eos_id()), pad_token=self.sp.id_to_piece(pad),
                             padding_side="left", **kwargs)  # fmt: skip

        @property
        def vocab_size(self) -> int:
            return self.sp.get_piece_size()

        def get_vocab(self) -> dict[str, int]:
            return {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}

        def _tokenize(self, text: str) -> list[str]:
            return self.sp.encode(text, out_type=str)

        def _convert_token_to_id(self, token: str) -> int:
            return self.sp.piece_to_id(token)

        def _convert_id_to_token(self, index: int) -> str:
            return self.sp.id_to_piece(int(index)) if 0 <= int(index) < self.vocab_size else ""

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return self.sp.decode_pieces([t for t in tokens if t])

    return SentencePieceHF(model_file)


def trl_worker(spec: dict, scorer_source: str, prompts: int, n: int, kl_coef: float, lr: float) -> None:
    """Run ``spec['steps']`` GRPO steps with TRL; per-step records to ``spec['out']`` (module docs)."""
    import datasets
    import pyarrow.parquet as pq
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    from hybridrl.data.tokenizers import load_tokenizer

    torch.set_num_threads(spec["threads"])
    ours = load_tokenizer(spec["tokenizer"])
    rows = pq.read_table(spec["data"]).to_pylist()
    data = datasets.Dataset.from_list(
        [{"prompt": ours.render_chat(r["prompt"]), "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )
    scorer: dict = {}
    exec(scorer_source, scorer)

    def reward(prompts, completions, ground_truth, **kwargs):
        return [scorer["compute_score"]("arith", c, g) for c, g in zip(completions, ground_truth, strict=True)]

    spans: dict[str, float] = {}
    original = profiling.ProfilingContext._log_metrics

    def record(self, duration: float) -> None:
        spans[self.name] = spans.get(self.name, 0.0) + duration
        original(self, duration)

    profiling.ProfilingContext._log_metrics = record
    records: list[dict] = []
    seen: list[dict] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            spans.clear()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            records.append({**spans, "step": time.perf_counter() - self.start})

        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs or {}))

    config = GRPOConfig(
        output_dir=spec["work"], per_device_train_batch_size=prompts * n, num_generations=n,
        max_completion_length=spec["response"], temperature=1.0, top_k=0, top_p=1.0, beta=kl_coef, learning_rate=lr,
        weight_decay=0.0, max_grad_norm=1.0, max_steps=spec["steps"], logging_steps=1, report_to="none",
        save_strategy="no", use_cpu=True, bf16=False, fp16=False, shuffle_dataset=False, seed=spec["seed"],
        dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=spec.get("gradient_checkpointing", False),
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=_tokenizer(spec["tokenizer"]), callbacks=[Timer()])  # fmt: skip
    trainer.train()
    tokens = [entry["num_tokens"] for entry in seen if "num_tokens" in entry]
    for i, rec in enumerate(records):
        rec["tokens"] = tokens[i] - (tokens[i - 1] if i else 0.0) if i < len(tokens) else float("nan")
        nan = float("nan")
        rec["generate"] = rec.get("GRPOTrainer.transformers.generate", nan)
        rec["reward"] = rec.get("GRPOTrainer._calculate_rewards", nan)
        # the reference pass runs inside _prepare_inputs, after generation and rewards; the rest is the update
        rec["ref"] = rec.get("GRPOTrainer._prepare_inputs", nan) - rec["generate"] - rec["reward"]
        rec["update"] = rec["step"] - rec.get("GRPOTrainer._prepare_inputs", nan)
    settings = {"gradient_checkpointing": config.gradient_checkpointing, "loss_type": config.loss_type}
    with open(spec["out"], "w") as f:
        json.dump({"records": records, "settings": settings}, f)

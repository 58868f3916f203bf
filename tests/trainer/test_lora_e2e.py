"""GRPO with LoRA end to end on 2 CPU ranks: ``hybridrl train tiny_cpu_lora.yaml`` for 2 steps, then ``hybridrl
export`` of its checkpoint on 1 rank (saved at TP2, rebuilt at TP1), both through ``python -m hybridrl`` (cli.main).

- the reference is the actor with its adapters off: at step 1 ``B = 0``, so the KL to it is exactly 0; after the
  first updates the adapters move the policy and the KL is not 0;
- vLLM generates with the merged weights: its log-probs equal the (adapted) actor's at both steps, after the
  adapters changed too (without the merge in the push, step 2's mismatch was 0.16, with it 2.6e-7);
- the export writes the merged HF model and a PEFT folder; transformers on the merged model equals peft's
  adapter on the run's base model, and the adapter changes the logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank


def _hybridrl(nproc: int, *args: str) -> str:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), "-m", "hybridrl", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result.stdout + result.stderr


def test_grpo_with_lora_trains_pushes_merged_weights_and_exports(tmp_path):
    import peft
    import transformers

    run = tmp_path / "run"
    _hybridrl(2, "train", "tiny_cpu_lora.yaml", "trainer.total_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1",
              "trainer.loggers=[jsonl]", f"trainer.default_local_dir={run}")  # fmt: skip
    steps = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s["step"] > 0]
    assert [s["step"] for s in steps] == [1, 2]
    assert steps[0]["actor/kl"] == 0.0  # B = 0: the actor is its reference
    assert abs(steps[1]["actor/kl"]) > 1e-4  # the adapters trained
    for s in steps:
        assert s["rollout/logprob_mismatch"] < 1e-5, s["rollout/logprob_mismatch"]  # vLLM holds the merged weights
    ckpt = run / "global_step_2"
    assert json.loads((ckpt / "actor" / "lora.json").read_text())["rank"] == 8

    out = tmp_path / "hf"
    log = _hybridrl(1, "export", str(ckpt), str(out))
    assert f"(LoRA adapter: {out / 'lora_adapter'})" in log
    base_path = json.loads((ckpt / "actor" / "source.json").read_text())["source"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, out / "lora_adapter").eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = adapted(input_ids=ids).logits
        assert float((merged(input_ids=ids).logits - want).abs().max()) <= 1e-5
        with adapted.disable_adapter():
            assert float((adapted(input_ids=ids).logits - want).abs().max()) > 1e-2

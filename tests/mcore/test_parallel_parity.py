"""Megatron on CPU (gloo): TP=2, PP=2 and PP=2 x VPP=2 give the loss and gradients of a 1-rank run.

One 2-rank launch runs every layout (each launch costs seconds of imports): first the reference with
TP=1 (each rank is a whole model, dp=2), then each split, loaded with the same full weights and fed the
same micro-batches. A last case re-enables batched p2p on gloo under VPP, the setting known to
give silently wrong losses; the test reports how far it lands from the reference, which shows the
comparison can fail.
"""

from __future__ import annotations

import pytest
import torch

from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank

TOL = 1e-5  # fp32


def _micro_batches(vocab: int, n: int = 4, mb: int = 2, seq: int = 16):
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (mb, seq), generator=g)
        out.append(
            {
                "input_ids": ids,
                "position_ids": torch.arange(seq).expand(mb, seq).contiguous(),
                "labels": torch.roll(ids, -1, dims=1),
            }
        )
    return out


def _token_mean(per_token_loss, batch):
    loss = per_token_loss.float().mean()
    return loss, {"loss": loss.detach().clone()}


def _run_case(shape, case: dict, full=None):
    import torch.distributed as dist

    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import gpt
    from tests.mcore.shards import gather_full, load_full

    layout = ParallelLayout.from_world(dist.get_world_size(), tp=case["tp"], pp=case["pp"], vpp=case["vpp"])
    init_model_parallel(layout, seed=1234)
    config = gpt.make_config(shape, perform_initialization=full is None)  # loaded: no init, as the roles build
    for key, value in case.get("force", {}).items():  # behind make_config's back: it refuses these on gloo
        setattr(config, key, value)
    chunks = gpt.build_model_chunks(shape, config)
    if full is not None:
        load_full(chunks, full)
    metrics = gpt.forward_backward(chunks, _micro_batches(shape.vocab_size), _token_mean)
    weights = gather_full(chunks, "data")
    grads = gather_full(chunks, "grad")
    losses = [m["loss"].item() for m in metrics]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, losses)
    losses = max(everyone, key=len)  # from a last-stage rank
    return weights, grads, losses, config.batch_p2p_comm


def _parity_body(rank: int, world_size: int, cases: list[dict]) -> dict:
    from hybridrl.mcore.gpt import GPTShape

    shape = GPTShape(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, vocab_size=128
    )
    full, ref_grads, ref_losses, _ = _run_case(shape, {"tp": 1, "pp": 1, "vpp": 1})
    report = {"ref_losses": ref_losses, "refused": ""}
    try:
        from hybridrl.mcore import gpt

        gpt.make_config(shape, batch_p2p_comm=True)
    except ValueError as err:
        report["refused"] = str(err)
    for case in cases:
        _, grads, losses, batch_p2p = _run_case(shape, case, full)
        grad_diff = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
        report[case["name"]] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "grad_diff": grad_diff,
            "grad_keys_match": sorted(grads) == sorted(ref_grads),
            "n_losses": len(losses),
            "batch_p2p_comm": batch_p2p,
        }
    return report


CASES = [
    {"name": "tp2", "tp": 2, "pp": 1, "vpp": 1},
    {"name": "pp2", "tp": 1, "pp": 2, "vpp": 1},
    {"name": "pp2_vpp2", "tp": 1, "pp": 2, "vpp": 2},
    # Megatron's default on gloo: the trap this project guards against (expected to be wrong).
    {"name": "pp2_vpp2_batched_p2p", "tp": 1, "pp": 2, "vpp": 2, "force": {"batch_p2p_comm": True}},
]


@pytest.fixture(scope="module")
def report():
    return run_ranks(_parity_body, 2, CASES, timeout=600)[0]


@pytest.mark.parametrize("name", ["tp2", "pp2", "pp2_vpp2"])
def test_split_matches_single_rank(report, name):
    r = report[name]
    assert r["grad_keys_match"]
    assert r["n_losses"] == len(report["ref_losses"]) == 4
    assert r["loss_diff"] <= TOL, r
    assert r["grad_diff"] <= TOL, r


def test_gloo_forces_unbatched_p2p(report):
    assert report["pp2_vpp2"]["batch_p2p_comm"] is False
    assert "gives silently wrong pipeline activations on gloo" in report["refused"]


def test_batched_p2p_on_gloo_is_caught(report):
    """The comparison above would catch the silent gloo bug: with batched p2p the losses drift."""
    r = report["pp2_vpp2_batched_p2p"]
    assert r["batch_p2p_comm"] is True
    assert r["loss_diff"] > 100 * TOL or r["grad_diff"] > 100 * TOL, r

"""hybridrl.mcore.compute / vocab_parallel / loss_scaling: numerics against independent references.

One 2-rank gloo launch checks:
- vocab-parallel log-probs and entropy at TP=2 (and their gradients) against ``torch.log_softmax`` on the
  full vocabulary, with temperature, a padded vocabulary and bf16 logits;
- padding invariance: a sample's log-probs alone (no padding) equal those it gets batched with longer and
  shorter samples, and a control with padding treated as tokens shows the comparison can fail;
- loss scaling: the same global batch split as TP2 x 1 micro-batch, TP2 x 4, PP2 x 4, PP2 x VPP2 x 4,
  DP2 x 2 and DP2 x 1 gives the gradients and loss of an independent reference (a TP=1 model run sample by
  sample WITHOUT padding, loss aggregated by hand) for each aggregation mode;
- forward-only log-probs (broadcast over PP, gathered over DP) equal the reference's, and so do critic
  values (a scalar output layer) at TP2 and PP2.
Unit tests without ranks cover the batch preparation, the value head, the aggregation formulas and errors.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.multirank import run_ranks

SHAPE = dict(
    num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96, vocab_size=128
)
PROMPT_LENS = [5, 9, 3, 7, 6, 2, 8, 4]
RESPONSE_LENS = [6, 3, 8, 0, 5, 7, 1, 4]  # sample 3 has no response token at all
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
NORM = 8.0  # loss_scale_factor of seq-mean-token-sum-norm (the longest response)
TEMPERATURE = 0.8
ENT_COEF = 0.01
CASES = [  # (name, layout, micro_batch_size); the global batch has 8 samples
    ("tp2_mb8", {"tp": 2}, 8),
    ("tp2_mb2", {"tp": 2}, 2),
    ("pp2_mb2", {"pp": 2}, 2),
    ("pp2_vpp2_mb2", {"pp": 2, "vpp": 2}, 2),
    ("dp2_mb2", {}, 2),
    ("dp2_mb4", {}, 4),
]
FP32_TOL = 1e-5


# ---- data ---------------------------------------------------------------------------------------------
def make_samples(vocab: int, seed: int = 11) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS, strict=True)):
        mask = torch.ones(r)
        if i == 4:
            mask[2] = 0.0  # an interior token left out of the loss (e.g. a tool output)
        out.append(
            {
                "prompt": torch.randint(1, vocab, (p,), generator=g),
                "response": torch.randint(1, vocab, (r,), generator=g),
                "adv": torch.randn(r, generator=g),
                "old": -math.log(vocab) + 0.3 * torch.randn(r, generator=g),
                "mask": mask,
            }
        )
    return out


def pad_samples(samples, pad_id: int = 0, all_valid: bool = False) -> dict[str, torch.Tensor]:
    """Left-padded prompts, right-padded responses (``all_valid``: pretend padding is real tokens)."""
    P = max(len(s["prompt"]) for s in samples)
    R = max(len(s["response"]) for s in samples)
    n = len(samples)
    ids = torch.full((n, P + R), pad_id, dtype=torch.long)
    am = torch.zeros(n, P + R, dtype=torch.long)
    resp = torch.full((n, R), pad_id, dtype=torch.long)
    rmask, adv, old = torch.zeros(n, R), torch.zeros(n, R), torch.zeros(n, R)
    for i, s in enumerate(samples):
        p, r = len(s["prompt"]), len(s["response"])
        ids[i, P - p : P], ids[i, P : P + r] = s["prompt"], s["response"]
        am[i, P - p : P + r] = 1
        resp[i, :r], rmask[i, :r], adv[i, :r], old[i, :r] = s["response"], s["mask"], s["adv"], s["old"]
    if all_valid:
        am[:] = 1
    return {
        "input_ids": ids,
        "attention_mask": am,
        "position_ids": (am.cumsum(1) - 1).clamp(min=0),
        "responses": resp,
        "response_mask": rmask,
        "advantages": adv,
        "old_log_probs": old,
    }


def ppo_like_per_token(log_probs, entropy, adv, old):
    return -adv * torch.exp(log_probs - old) - ENT_COEF * entropy


def ppo_like_loss(outputs, mb):
    ratio = torch.exp(outputs["log_probs"] - mb["old_log_probs"])
    per_token = ppo_like_per_token(outputs["log_probs"], outputs["entropy"], mb["advantages"], mb["old_log_probs"])
    return per_token, {"ratio_mean": ratio.mean().detach()}


# ---- rank bodies ----------------------------------------------------------------------------------------
def _init(layout_kw):
    from tests.mcore.shards import init_layout

    init_layout(**layout_kw)


def _model(shape, full=None):
    from tests.mcore.shards import build_chunks

    return build_chunks(shape, full)


def _check_vocab_parallel() -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from hybridrl.mcore import vocab_parallel

    _init({"tp": 2})
    group, rank = mpu.get_tensor_model_parallel_group(), mpu.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(5)
    full = 3 * torch.randn(4, 7, 128, generator=g)
    target = torch.randint(0, 120, (4, 7), generator=g)
    w_lp, w_ent = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    report = {}
    for name, vocab_size, dtype in (
        ("full", None, torch.float32),
        ("padded", 120, torch.float32),
        ("bf16", None, torch.bfloat16),
    ):
        logits = full.to(dtype)
        local = logits.chunk(2, dim=-1)[rank].clone().requires_grad_(True)
        lp, ent = vocab_parallel.log_probs_and_entropy(local, target, group, TEMPERATURE, vocab_size)
        (w_lp * lp + w_ent * ent).sum().backward()
        parts = [torch.empty_like(local.grad) for _ in range(2)]
        dist.all_gather(parts, local.grad, group=group)
        grad = torch.cat(parts, dim=-1).float()

        ref_in = logits.float().clone().requires_grad_(True)
        valid = ref_in[..., : vocab_size or 128] / TEMPERATURE
        logp_all = torch.log_softmax(valid, dim=-1)
        ref_lp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        ref_ent = -(logp_all.exp() * logp_all).sum(-1)
        (w_lp * ref_lp + w_ent * ref_ent).sum().backward()
        # gradients come back in the logits dtype: bf16 may round each element by 2^-8 relative
        rounding = ref_in.grad.abs() * (2.0**-8 if dtype == torch.bfloat16 else 0.0)
        report[name] = {
            "lp": (lp - ref_lp).abs().max().item(),
            "ent": (ent - ref_ent).abs().max().item(),
            "grad": (grad - ref_in.grad).abs().max().item(),
            "grad_excess": ((grad - ref_in.grad).abs() - rounding).max().item(),
        }
    return report


def _reference(shape, samples) -> dict:
    """TP=1 model, one unpadded sample at a time: log-probs, entropy, and per-mode loss and gradients."""
    import torch.distributed as dist

    from hybridrl.mcore import gpt
    from tests.mcore.shards import global_named_parameters

    _init({})
    chunks = _model(shape)
    full = {n: p.detach().clone() for n, p in global_named_parameters(chunks)}
    box = [full]
    dist.broadcast_object_list(box, src=0)  # the same weights everywhere, whatever the init did
    full = box[0]
    chunks = _model(shape, full)
    (model,) = chunks
    out = {"full": full, "log_probs": [], "entropy": [], "loss": {}, "grads": {}}
    for mode in MODES:
        model.zero_grad()
        sums, n_tok, n_seq = [], 0.0, 0.0
        for s in samples:
            p, r = len(s["prompt"]), len(s["response"])
            ids = torch.cat([s["prompt"], s["response"]]).unsqueeze(0)
            logits = model(ids, torch.arange(p + r).unsqueeze(0), gpt.causal_mask(p + r))[0, p - 1 : p + r - 1]
            logp_all = torch.log_softmax(logits / TEMPERATURE, dim=-1)
            lp = logp_all.gather(-1, s["response"].unsqueeze(-1)).squeeze(-1)
            ent = -(logp_all.exp() * logp_all).sum(-1)
            if mode == MODES[0]:
                out["log_probs"].append(lp.detach())
                out["entropy"].append(ent.detach())
            tok = (ppo_like_per_token(lp, ent, s["adv"], s["old"]) * s["mask"]).sum()
            n = float(s["mask"].sum())
            sums.append(tok / max(n, 1.0) if mode == "seq-mean-token-mean" else tok)
            n_tok += n
            n_seq += 1.0 if n > 0 else 0.0
        denominator = {"token-mean": n_tok, "token-sum": 1.0, "seq-mean-token-sum-norm": n_seq * NORM}.get(mode, n_seq)
        loss = sum(sums) / denominator
        loss.backward()
        out["loss"][mode] = loss.item()
        out["grads"][mode] = {n: p.grad.detach().clone() for n, p in global_named_parameters(chunks)}
    return out


def _valid_diff(result: torch.Tensor, ref: list[torch.Tensor], rows) -> float:
    return max(((result[i, : len(ref[j])] - ref[j]).abs().max().item() for i, j in rows if len(ref[j])), default=0.0)


def _check_padding(shape, samples, ref) -> dict:
    from hybridrl.mcore import compute

    _init({"tp": 2})
    chunks = _model(shape, ref["full"])
    batched = compute.compute_log_probs(chunks, pad_samples(samples), 2, TEMPERATURE, with_entropy=True)
    control = compute.compute_log_probs(chunks, pad_samples(samples, all_valid=True), 2, TEMPERATURE)
    alone_diff, ent_diff, ref_diff = 0.0, 0.0, 0.0
    for i in (0, 1, 2, 5):  # short and long prompts / responses
        alone = compute.compute_log_probs(chunks, pad_samples([samples[i]]), 1, TEMPERATURE, with_entropy=True)
        r = len(samples[i]["response"])
        alone_diff = max(alone_diff, (alone["log_probs"][0] - batched["log_probs"][i, :r]).abs().max().item())
        ent_diff = max(ent_diff, (alone["entropy"][0] - batched["entropy"][i, :r]).abs().max().item())
        ref_diff = max(ref_diff, (alone["log_probs"][0] - ref["log_probs"][i]).abs().max().item())
    rows = [(i, i) for i in range(len(samples))]
    return {
        "alone_vs_batched": alone_diff,
        "entropy_alone_vs_batched": ent_diff,
        "alone_vs_reference": ref_diff,
        "batched_vs_reference": _valid_diff(batched["log_probs"], ref["log_probs"], rows),
        "control_padding_as_tokens": _valid_diff(control["log_probs"], ref["log_probs"], rows),
    }


def _check_case(shape, samples, ref, layout_kw, mbs) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from hybridrl.mcore import compute
    from tests.mcore.shards import global_named_parameters, local_shards

    _init(layout_kw)
    chunks = _model(shape, ref["full"])
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    local = {k: v.chunk(dp)[dp_rank] for k, v in pad_samples(samples).items()}
    head = compute.LogProbHead(temperature=TEMPERATURE, with_entropy=True)
    report = {}
    for mode in MODES:
        for chunk in chunks:
            chunk.zero_grad()
        out = compute.forward_backward(
            chunks, local, ppo_like_loss, mbs, head=head, loss_agg_mode=mode, loss_scale_factor=NORM
        )
        expected = local_shards(chunks, ref["grads"][mode])
        diff, scale = 0.0, 0.0
        for name, p in global_named_parameters(chunks):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad, group=mpu.get_data_parallel_group())  # the optimizer's job, done by hand here
            diff = max(diff, (grad - expected[name]).abs().max().item())
            scale = max(scale, expected[name].abs().max().item())
        report[mode] = {
            "grad_diff": diff,
            "grad_scale": scale,
            "loss_diff": abs(out.loss - ref["loss"][mode]),
            "metric_keys": sorted(out.metrics),
        }
    lp = compute.compute_log_probs(chunks, local, mbs, TEMPERATURE, with_entropy=True, gather_dp=True)
    rows = [(i, i) for i in range(len(samples))]
    report["log_probs_diff"] = _valid_diff(lp["log_probs"], ref["log_probs"], rows)
    report["entropy_diff"] = _valid_diff(lp["entropy"], ref["entropy"], rows)
    report["gathered_rows"] = lp["log_probs"].shape[0]
    if layout_kw.get("vpp"):  # 3 micro-batches of 3 (padded) -> 4: the interleaved schedule wants a multiple of pp
        lp3 = compute.compute_log_probs(chunks, local, 3, TEMPERATURE, gather_dp=True)
        report["log_probs_diff_mb3"] = _valid_diff(lp3["log_probs"], ref["log_probs"], rows)
    return report


class _ScalarHead(torch.nn.Module):
    """A critic's output layer for the test: ``(s, b, h) -> (s, b, 1)``, replicated over TP."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return hidden @ self.weight.t(), None


def _critic(shape, full):
    chunks = _model(shape, full)  # the LM head loaded, then swapped for the scalar head
    for chunk in chunks:
        if chunk.post_process:
            chunk.output_layer = _ScalarHead(full["critic_head"])
    return chunks


def _check_values(shape, samples, ref) -> dict:
    """Critic values through ``compute_values`` at TP2 and PP2 vs a TP=1 per-sample reference."""
    from hybridrl.mcore import compute, gpt

    full = dict(
        ref["full"], critic_head=0.5 * torch.randn(1, shape.hidden_size, generator=torch.Generator().manual_seed(2))
    )
    _init({})
    (critic,) = _critic(shape, full)
    expected = []
    with torch.no_grad():
        for s in samples:
            p, r = len(s["prompt"]), len(s["response"])
            ids = torch.cat([s["prompt"], s["response"]]).unsqueeze(0)
            expected.append(
                critic(ids, torch.arange(p + r).unsqueeze(0), gpt.causal_mask(p + r))[0, p - 1 : p + r - 1, 0]
            )
    report = {}
    # mbs 3 does not divide the 8 samples (the last micro-batch is padded), 16 exceeds them
    for name, layout_kw, mbs in (("tp2", {"tp": 2}, 2), ("pp2", {"pp": 2}, 2), ("pp2_mb3", {"pp": 2}, 3),
                                 ("tp2_mb16", {"tp": 2}, 16)):  # fmt: skip
        _init(layout_kw)
        values = compute.compute_values(_critic(shape, full), pad_samples(samples), mbs)
        report[name] = _valid_diff(values, expected, [(i, i) for i in range(len(samples))])
        report[name + "_rows"] = values.shape[0]
    report["scale"] = max(e.abs().max().item() for e in expected if len(e))
    return report


def _compute_body(rank: int, world_size: int) -> dict:
    from hybridrl.mcore.gpt import GPTShape

    shape = GPTShape(**SHAPE)
    samples = make_samples(shape.vocab_size)
    report = {"vocab": _check_vocab_parallel()}
    ref = _reference(shape, samples)
    report["ref_loss"] = ref["loss"]
    report["mode_grad_gap"] = min(
        max((ref["grads"][a][k] - ref["grads"][b][k]).abs().max().item() for k in ref["grads"][a])
        for a in MODES
        for b in MODES
        if a < b
    )
    report["padding"] = _check_padding(shape, samples, ref)
    report["values"] = _check_values(shape, samples, ref)
    for name, layout_kw, mbs in CASES:
        report[name] = _check_case(shape, samples, ref, layout_kw, mbs)
    return report


@pytest.fixture(scope="module")
def reports():
    out = run_ranks(_compute_body, 2, timeout=600)
    print("compute report (rank 0):", out[0])
    return out


# ---- multi-rank tests -----------------------------------------------------------------------------------
multirank = pytest.mark.multirank


@multirank
@pytest.mark.parametrize("name", ["full", "padded", "bf16"])
def test_vocab_parallel_matches_full_softmax(reports, name):
    for rep in reports:
        r = rep["vocab"][name]
        assert r["lp"] <= FP32_TOL and r["ent"] <= FP32_TOL, r
        assert r["grad_excess"] <= FP32_TOL, r


@multirank
def test_padding_does_not_leak(reports):
    for rep in reports:
        r = rep["padding"]
        assert r["alone_vs_batched"] <= FP32_TOL, r
        assert r["entropy_alone_vs_batched"] <= FP32_TOL, r
        assert r["alone_vs_reference"] <= FP32_TOL and r["batched_vs_reference"] <= FP32_TOL, r
        assert r["control_padding_as_tokens"] > 1e-2, r  # padding seen as tokens would be caught


@multirank
@pytest.mark.parametrize("case", [c[0] for c in CASES])
@pytest.mark.parametrize("mode", MODES)
def test_loss_scaling_independent_of_split(reports, case, mode):
    for rep in reports:
        r = rep[case][mode]
        assert r["grad_diff"] <= 1e-6 * max(1.0, r["grad_scale"]), r
        assert r["loss_diff"] <= FP32_TOL * max(1.0, abs(rep["ref_loss"][mode])), r
        assert r["metric_keys"] == ["ratio_mean"], r


@multirank
def test_modes_are_distinguishable(reports):
    """Different aggregation modes give clearly different gradients, so the split test can tell them apart."""
    assert reports[0]["mode_grad_gap"] > 1e-3, reports[0]["mode_grad_gap"]


@multirank
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_forward_only_log_probs(reports, case):
    for rep in reports:
        r = rep[case]
        assert r["gathered_rows"] == len(PROMPT_LENS)
        assert r["log_probs_diff"] <= FP32_TOL and r["entropy_diff"] <= FP32_TOL, r
        assert r.get("log_probs_diff_mb3", 0.0) <= FP32_TOL, r


@multirank
def test_critic_values_match_reference(reports):
    for rep in reports:
        r = rep["values"]
        assert r["scale"] > 0.1, r  # the values are not trivially zero
        for name in ("tp2", "pp2", "pp2_mb3", "tp2_mb16"):
            assert r[name] <= FP32_TOL and r[name + "_rows"] == len(PROMPT_LENS), (name, r)


# ---- unit tests (no ranks) -------------------------------------------------------------------------------
def test_prepare_batch_rolls_left_padding_and_positions():
    from hybridrl.mcore import compute

    samples = make_samples(128)[:3]
    batch = pad_samples(samples)
    out = compute.prepare_batch(batch)
    P = max(PROMPT_LENS[:3])
    for i, s in enumerate(samples):
        p, r = len(s["prompt"]), len(s["response"])
        assert torch.equal(out["model_input_ids"][i, : p + r], torch.cat([s["prompt"], s["response"]]))
        assert torch.equal(out["model_position_ids"][i, : p + r], torch.arange(p + r))
        # the position that predicts response token t: last prompt token first
        assert torch.equal(out["response_positions"][i], torch.arange(p - 1, p - 1 + out["responses"].shape[1]))
        assert int(batch["attention_mask"][i, : P - p].sum()) == 0
    mask = out["model_attention_mask"]
    assert mask.shape == (3, 1, batch["input_ids"].shape[1], batch["input_ids"].shape[1])
    assert not bool(mask.all(dim=-1).any()), "a fully masked query row gives NaN in fused softmax"


def test_trim_padding_keeps_every_valid_token_and_position():
    from hybridrl.mcore import compute
    from tests.mcore.test_logprobs_hf import padded_batch

    batch = compute.prepare_batch(padded_batch(prompt=31, response=19))  # rows of 16, 7, 8 tokens in 50 columns
    trimmed = compute.trim_padding(batch, multiple=8)
    assert trimmed["model_input_ids"].shape == (3, 16) and trimmed["model_attention_mask"].shape == (3, 1, 16, 16)
    assert torch.equal(trimmed["model_input_ids"], batch["model_input_ids"][:, :16])
    assert torch.equal(trimmed["model_attention_mask"], batch["model_attention_mask"][:, :, :16, :16])
    valid = batch["response_mask"].bool()  # the positions read for valid response tokens are all kept
    assert torch.equal(trimmed["response_positions"][valid], batch["response_positions"][valid])
    assert int(trimmed["response_positions"].max()) == 15
    assert compute.trim_padding(batch, multiple=24)["model_input_ids"].shape[1] == 24  # rounded up
    assert compute.trim_padding(batch, multiple=64) is batch  # the full width already: unchanged
    rows = compute.split_micro_batches(batch, 1)
    assert [compute.trim_padding(mb)["model_input_ids"].shape[1] for mb in rows] == [16, 8, 8]
    exact = [compute.trim_padding(mb, multiple=1) for mb in rows]  # no rounding: each row's last token is the edge
    assert [mb["model_input_ids"].shape[1] for mb in exact] == [16, 7, 8]
    for mb, full in zip(exact, rows, strict=True):
        assert torch.equal(mb["model_input_ids"], full["model_input_ids"][:, : int(full["model_lengths"])])


def test_attention_mask_blocks_padding_and_future():
    from hybridrl.mcore.compute import attention_mask

    valid = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    m = attention_mask(valid)[:, 0]
    assert torch.equal(m[1], torch.triu(torch.ones(5, 5, dtype=torch.bool), 1))
    assert m[0, :3, 3:].all() and not m[0, 2, :3].any()  # valid queries see valid past keys only
    assert not m[0, 4, 4] and m[0, 4, 3]  # a pad query row keeps only its own key (no NaN)


def test_value_head_reads_the_predicting_position():
    from hybridrl.mcore import compute

    batch = pad_samples(make_samples(128)[:3])
    out = compute.prepare_batch(batch)
    s = batch["input_ids"].shape[1]
    left_pad = batch["attention_mask"].argmax(1)
    # critic output whose value at each rolled position is its ORIGINAL (unrolled) sequence index
    original_index = (torch.arange(s).unsqueeze(0) + left_pad.unsqueeze(1)) % s
    values = compute.ValuesHead()(original_index.float().unsqueeze(-1), out)["values"]
    r = batch["responses"].shape[1]
    assert torch.equal(values, (s - r - 1 + torch.arange(r)).float().expand(3, r))


def test_aggregate_formulas_by_hand():
    from hybridrl.algos import aggregation
    from hybridrl.mcore import loss_scaling

    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    expect = {"token-mean": (1 + 2 + 4) / 3, "token-sum": 1 + 2 + 4, "seq-mean-token-sum": (3 + 4) / 2,
              "seq-mean-token-mean": (1.5 + 4) / 2, "seq-mean-token-sum-norm": (3 + 4) / 2 / NORM}  # fmt: skip
    for mode, value in expect.items():
        denom = loss_scaling.global_denominator(mask, mode, None, NORM)  # one process: local == global
        assert aggregation.aggregate(per_token, mask, mode, denom).item() == pytest.approx(value), mode
    # two halves with the global denominator add up to the whole
    denom = loss_scaling.global_denominator(mask, "token-mean", None)
    halves = sum(aggregation.aggregate(per_token[i : i + 1], mask[i : i + 1], "token-mean", denom) for i in range(3))
    assert halves.item() == pytest.approx(expect["token-mean"])


def test_bad_inputs_name_the_key():
    from hybridrl.mcore import compute, loss_scaling

    batch = pad_samples(make_samples(128)[:2])
    hole = dict(batch, attention_mask=batch["attention_mask"].clone())
    last = hole["attention_mask"].shape[1] - batch["responses"].shape[1]
    hole["attention_mask"][0, last - 3] = 0  # a hole inside the prompt
    with pytest.raises(ValueError, match="attention_mask row 0"):
        compute.prepare_batch(hole)
    shifted = dict(batch, responses=batch["responses"].roll(1, dims=1))
    with pytest.raises(ValueError, match=r"batch\['responses'\] row 0"):
        compute.prepare_batch(shifted)
    with pytest.raises(KeyError, match="responses"):
        compute.prepare_batch({k: v for k, v in batch.items() if k != "responses"})
    with pytest.raises(ValueError, match=r"micro_batch_size \(3\)"):
        compute.split_micro_batches(compute.prepare_batch(batch), 3)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        loss_scaling.global_denominator(torch.ones(1, 1), "token-median", None)
    with pytest.raises(ValueError, match="loss_scale_factor"):
        compute.forward_backward([], batch, lambda o, mb: (o, {}), 1, loss_agg_mode="seq-mean-token-sum-norm")

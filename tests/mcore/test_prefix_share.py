"""Prompt-shared passes (``share_prefix``, hybridrl.mcore.prefix_share) equal the unshared ones and HF's.

The batch is a rollout batch of GRPO-like groups: prompts of different lengths LEFT-padded, responses of
different lengths (one empty) RIGHT-padded, groups of 1 to 4 responses, in an order where the micro-batches cut
a group in two. HF transformers is the independent reference, run row by row on the unpacked batch (its forward
with the attention mask and ``position_ids = cumsum(mask) - 1``): log-probs and entropy at a temperature, critic
values (a ``*ForSequenceClassification`` checkpoint) and the gradient of a PPO-like token-mean loss (HF's
gradients are saved as a checkpoint and loaded by the bridge, so each rank compares its own shards).

One 2-rank gloo launch runs every layout: DP2 (TP1, each rank half the batch), TP2, PP2 and PP2 x VPP2, plus TP2
with full activation recompute (the packed attention runs again in backward from the saved mask alone). Shared
vs unshared: log-probs, entropy, values, loss and every gradient within 1e-6 (fp32); both vs HF within 1e-5.
Also: a batch without two rows of one prompt (n = 1) runs unshared, and a sliding-window model is refused with
``share_prefix=True`` and runs unshared in auto mode. Without ranks: the packed layout, read back through the
unpacking index, puts each response token's predecessor (and its position) where the token is predicted and
lets each query see exactly the keys of its own unpacked row; auto mode packs a GRPO batch, not singletons.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import hf_tiny
from tests.multirank import run_ranks

multirank = pytest.mark.multirank

PROMPT, RESPONSE = 14, 9  # padded widths; the longest prompt and response are shorter
GROUPS = [(7, (5, 2, 6)), (4, (3,)), (11, (6, 8, 1, 4)), (3, (2, 0)), (9, (7, 3))]  # (prompt length, responses)
TEMPERATURE = 0.8
ENT_COEF = 0.01
SHARED_TOL, HF_TOL = 1e-6, 1e-5  # log-probs / entropy: relative to max(1, |value|) (1e-6 is 2 ulp at 5 nats)
LAYOUTS = {  # name: (layout, micro-batch size of the update, of the forward passes, model overrides)
    "dp2": ({}, 3, 4, {}),
    "tp2": ({"tp": 2}, 4, 5, {}),
    "pp2": ({"pp": 2}, 4, 5, {}),
    "pp2_vpp2": ({"pp": 2, "vpp": 2}, 3, 5, {}),  # the interleaved schedule takes a multiple of pp micro-batches
    "tp2_recompute": ({"tp": 2}, 4, 5, {"recompute_granularity": "full", "recompute_method": "uniform",
                                        "recompute_num_layers": 1}),
}  # fmt: skip


def grpo_batch(groups=GROUPS, seed: int = 3) -> dict[str, torch.Tensor]:
    """Rows of ``groups`` (each response under its group's prompt), with advantages and old log-probs."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for plen, rlens in groups:
        prompt = torch.randint(1, hf_tiny.VOCAB, (plen,), generator=g)
        rows += [(prompt, torch.randint(1, hf_tiny.VOCAB, (r,), generator=g)) for r in rlens]
    b = len(rows)
    ids = torch.zeros(b, PROMPT + RESPONSE, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(rows):
        ids[i, PROMPT - len(p) : PROMPT], ids[i, PROMPT : PROMPT + len(r)] = p, r
        mask[i, PROMPT - len(p) : PROMPT + len(r)] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, PROMPT:].clone(),
        "response_mask": mask[:, PROMPT:].float(),
        "advantages": torch.randn(b, RESPONSE, generator=g),
        "old_log_probs": -5.0 + 0.3 * torch.randn(b, RESPONSE, generator=g),
    }


def per_token_loss(log_probs, entropy, mb):
    return -mb["advantages"] * torch.exp(log_probs - mb["old_log_probs"]) - ENT_COEF * entropy


def loss_fn(outputs, mb):
    return per_token_loss(outputs["log_probs"], outputs["entropy"], mb), {"lp_sum": outputs["log_probs"].sum()}


# ---- the HF reference (parent process) -----------------------------------------------------------------
def hf_reference(actor_path: str, critic_path: str, batch: dict, grad_dir: str) -> dict[str, torch.Tensor]:
    """Log-probs, entropy, values on the unpacked rows; the token-mean loss's gradient saved to ``grad_dir``."""
    import transformers

    kwargs = dict(dtype=torch.float32, attn_implementation="eager")
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    window = slice(PROMPT - 1, -1)  # response token t is predicted at p + t - 1
    model = transformers.AutoModelForCausalLM.from_pretrained(actor_path, **kwargs)
    logp_all = torch.log_softmax(model(**inputs).logits[:, window] / TEMPERATURE, dim=-1)
    log_probs = logp_all.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    mask = batch["response_mask"]
    loss = (per_token_loss(log_probs, entropy, batch) * mask).sum() / mask.sum()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    model.save_pretrained(grad_dir, safe_serialization=True)
    critic = transformers.AutoModelForSequenceClassification.from_pretrained(critic_path, **kwargs)
    with torch.no_grad():
        values = critic.score(critic.model(**inputs).last_hidden_state)[:, window, 0]
    return {"log_probs": log_probs.detach(), "entropy": entropy.detach(), "values": values, "loss": loss.detach()}


# ---- rank body -----------------------------------------------------------------------------------------
def _grads(chunks) -> dict[str, torch.Tensor]:
    return {f"{i}.{n}": p.grad.detach().clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}


def _update(actor, batch, micro, share, mode="token-mean"):
    """One forward+backward; the gradient summed over DP (what the optimizer does), the global loss."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from hybridrl.mcore import compute

    for p in actor.parameters():
        p.grad = None
    head = compute.LogProbHead(temperature=TEMPERATURE, with_entropy=True)
    out = compute.forward_backward(actor.chunks, batch, loss_fn, micro, head=head, share_prefix=share,
                                   loss_agg_mode=mode, loss_scale_factor=8.0)  # fmt: skip
    grads = _grads(actor.chunks)
    for g in grads.values():
        dist.all_reduce(g, group=mpu.get_data_parallel_group())
    return out.loss, grads


def _local(batch):
    """This rank's data-parallel part of the batch (contiguous, as the workers' dispatch splits it)."""
    from megatron.core import parallel_state as mpu

    dp, rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    return {k: v.chunk(dp)[rank] for k, v in batch.items()}


def _layout_checks(paths, batch, ref, layout, micro, fwd_micro, overrides) -> dict:
    from hybridrl.mcore import compute, roles
    from tests.mcore.shards import init_layout

    init_layout(**layout)
    actor = roles.build_actor(paths["actor"], **overrides)
    local = _local(batch)
    out, diff = {}, {}
    for share in (False, True, None):
        lp = compute.compute_log_probs(actor.chunks, local, fwd_micro, TEMPERATURE, with_entropy=True,
                                       gather_dp=True, share_prefix=share)  # fmt: skip
        out[share] = {**lp, "update": _update(actor, local, micro, share)}
    mask = batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        scale = out[False][key].abs().clamp(min=1.0)
        diff[f"{key}/shared"] = ((out[True][key] - out[False][key]).abs() / scale)[mask].max().item()
        diff[f"{key}/auto"] = ((out[None][key] - out[False][key]).abs() / scale)[mask].max().item()
        diff[f"{key}/shared_abs"] = (out[True][key] - out[False][key])[mask].abs().max().item()
        diff[f"{key}/hf"] = (out[True][key] - ref[key])[mask].abs().max().item()
    (loss_u, g_u), (loss_s, g_s) = out[False]["update"], out[True]["update"]
    hf_grads = _grads_of(roles.build_actor(paths["grads"]))
    diff["grad/shared"] = max((g_s[n] - g_u[n]).abs().max().item() for n in g_u)
    diff["grad/hf"] = max((g_s[n] - hf_grads[n]).abs().max().item() for n in g_u)
    diff["grad/scale"] = max(g.abs().max().item() for g in hf_grads.values())
    diff["loss/shared"], diff["loss/hf"] = abs(loss_s - loss_u), abs(loss_s - ref["loss"].item())
    (norm_u, gn_u), (norm_s, gn_s) = (_update(actor, local, micro, s, "seq-mean-token-sum-norm") for s in (False, True))
    diff["norm_mode/shared"] = max(abs(norm_s - norm_u), *((gn_s[n] - gn_u[n]).abs().max().item() for n in gn_u))
    critic = roles.build_critic(paths["critic"], **overrides)
    values = {s: compute.compute_values(critic.chunks, local, fwd_micro, gather_dp=True, share_prefix=s)
              for s in (False, True)}  # fmt: skip
    diff["values/shared"] = (values[True] - values[False])[mask].abs().max().item()
    diff["values/hf"] = (values[True] - ref["values"])[mask].abs().max().item()
    return diff


def _grads_of(model) -> dict[str, torch.Tensor]:
    """The loaded 'gradient checkpoint': its parameters are HF's gradients in this rank's layout."""
    return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(model.chunks) for n, p in c.named_parameters()}


def _fallbacks(paths, batch) -> dict:
    """n = 1 runs unshared; a sliding-window model is refused with True and runs unshared in auto mode."""
    from hybridrl.mcore import compute, prefix_share, roles
    from tests.mcore.shards import init_layout

    init_layout(tp=2)
    singles = grpo_batch([(5, (3,)), (7, (4,)), (2, (6,)), (8, (1,))])
    actor = roles.build_actor(paths["actor"])
    prepared = compute.prepare_batch(singles)
    res = {"n1_plan": prefix_share.choose(actor.chunks, prepared, 2, 4, True, False)}
    lp = [compute.compute_log_probs(actor.chunks, singles, 2, share_prefix=s)["log_probs"] for s in (False, True)]
    res["n1_diff"] = (lp[0] - lp[1]).abs().max().item()
    window = roles.build_actor(paths["mistral"])
    res["window_auto"] = prefix_share.choose(window.chunks, compute.prepare_batch(batch), 4, 12, None, False)
    try:
        compute.compute_log_probs(window.chunks, batch, 4, share_prefix=True)
        res["window_error"] = None
    except ValueError as e:
        res["window_error"] = str(e)
    return res


def _body(rank: int, world_size: int, paths: dict, batch: dict, ref: dict) -> dict:
    out = {name: _layout_checks(paths, batch, ref, *spec) for name, spec in LAYOUTS.items()}
    out["fallbacks"] = _fallbacks(paths, batch)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    batch = grpo_batch()
    paths = {
        "actor": hf_tiny.make_checkpoint("llama", str(tmp_path_factory.mktemp("actor")), seed=21),
        "critic": hf_tiny.make_checkpoint("llama", str(tmp_path_factory.mktemp("critic")), seed=22, score=True),
        "mistral": hf_tiny.make_checkpoint("mistral", str(tmp_path_factory.mktemp("mistral")), seed=23),
        "grads": str(tmp_path_factory.mktemp("grads")),
    }
    ref = hf_reference(paths["actor"], paths["critic"], batch, paths["grads"])
    return ref, run_ranks(_body, 2, paths, batch, ref, timeout=900)


@multirank
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shared_equals_unshared_and_hf(results, layout):
    ref, per_rank = results
    for rank, out in enumerate(per_rank):
        d = out[layout]
        for key in ("log_probs", "entropy"):
            assert d[f"{key}/shared"] <= SHARED_TOL and d[f"{key}/auto"] <= SHARED_TOL, (rank, key, d)
            assert d[f"{key}/hf"] <= HF_TOL, (rank, key, d)
        assert d["values/shared"] <= SHARED_TOL and d["values/hf"] <= HF_TOL, (rank, d)
        assert d["loss/shared"] <= SHARED_TOL and d["loss/hf"] <= HF_TOL, (rank, d)
        assert d["grad/shared"] <= SHARED_TOL and d["norm_mode/shared"] <= SHARED_TOL, (rank, d)
        assert d["grad/hf"] <= HF_TOL * max(1.0, d["grad/scale"]), (rank, d)
    # the references are not trivially close: log-probs spread over nats, gradients are O(0.01-1)
    assert ref["log_probs"][ref["log_probs"] != 0].std() > 0.3 and per_rank[0][layout]["grad/scale"] > 1e-2


@multirank
def test_fallbacks(results):
    _, per_rank = results
    for out in per_rank:
        f = out["fallbacks"]
        assert f["n1_plan"] is None and f["n1_diff"] == 0.0  # nothing to share: the unshared pass itself
        assert f["window_auto"] is None
        assert f["window_error"] and "actor.share_prompt_prefix" in f["window_error"]
        assert "sliding-window" in f["window_error"]


# ---- the packed layout, without ranks --------------------------------------------------------------------
def _visible_keys(micro: dict, j: int, col: int) -> set[int]:
    """Packed columns of row ``j`` that the query at ``col`` attends to, read from the packed mask."""
    rw, w = micro["model_attention_mask"].shape[2:]
    pw = w - rw
    mask = micro["model_attention_mask"][j]
    if col < pw:  # prompt queries: causal over the valid prompt (the mask's prompt columns give validity)
        return {c for c in range(col + 1) if not mask[0, 0, c]}
    slot, t = divmod(col - pw, rw)
    row = mask[slot, t]
    return {c for c in range(pw) if not row[c]} | {pw + slot * rw + c for c in range(rw) if not row[pw + c]}


def test_packed_layout_reproduces_each_row():
    from hybridrl.mcore import compute, prefix_share

    batch = grpo_batch()
    prepared = compute.prepare_batch(batch)
    b = len(batch["input_ids"])
    plan = prefix_share.plan(prepared, 4, b, one_width=False)
    seen = []
    for micro in plan.micro_batches:
        ids, pos = micro["model_input_ids"], micro["model_position_ids"]
        length = ids.shape[1]
        for i in range(len(micro["responses"])):
            valid = micro["attention_mask"][i].bool()
            row_tokens = micro["input_ids"][i][valid].tolist()  # the unpacked row: prompt then response
            p = len(row_tokens) - int(micro["response_mask"][i].sum())
            for t in range(len(row_tokens) - p):
                j, col = divmod(int(micro["packed_index"][i, t]), length)
                # the predicting position holds the previous token of the row, at its row position
                assert ids[j, col] == row_tokens[p + t - 1] and pos[j, col] == p + t - 1
                # and attends to exactly the tokens before it in the row (same tokens, same positions)
                keys = _visible_keys(micro, j, col)
                assert sorted(pos[j, c].item() for c in keys) == list(range(p + t))
                assert [ids[j, c].item() for c in sorted(keys, key=lambda c: pos[j, c].item())] == row_tokens[: p + t]
        seen += micro["input_ids"].tolist()
    assert sorted(seen) == sorted(batch["input_ids"].tolist())  # every row once
    assert torch.equal(torch.stack([torch.tensor(r) for r in seen]), batch["input_ids"][plan.order])


@pytest.mark.parametrize("heads,groups,dtype", [(4, 4, torch.float32), (6, 2, torch.float32), (4, 2, torch.bfloat16)])
def test_packed_attention_is_each_querys_softmax_over_its_keys(heads, groups, dtype):
    """The packed core attention alone, multi-head and grouped-query, fp32 and bf16: each query's output (and the
    gradients) equal a float64 softmax over exactly the keys ``_visible_keys`` reads from the packed mask, query
    head ``h`` on key/value group ``h // (heads / groups)``. Layouts and values are independent of the kernel."""
    from hybridrl.mcore import compute, prefix_share

    batch = grpo_batch()
    micro = prefix_share.plan(compute.prepare_batch(batch), 16, len(batch["input_ids"]), one_width=False)
    micro = micro.micro_batches[0]
    mask = micro["model_attention_mask"]
    g, length, d, scale = mask.shape[0], micro["model_input_ids"].shape[1], 8, 0.3
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(length, g, n, d, generator=gen).to(dtype).requires_grad_()
               for n in (heads, groups, groups))  # fmt: skip
    out = prefix_share.SharedPrefixAttention(scale)(q, k, v, mask)
    weight = torch.randn(out.shape, generator=gen)
    (out.float() * weight).sum().backward()

    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = torch.zeros(length, g, heads, d, dtype=torch.float64)
    for j in range(g):
        for col in range(length):
            keys = sorted(_visible_keys(micro, j, col))
            for h in range(heads):
                kv = h // (heads // groups)
                probs = torch.softmax(k64[keys, j, kv] @ q64[col, j, h] * scale, dim=0)
                ref[col, j, h] = probs @ v64[keys, j, kv]
    (ref.reshape(length, g, heads * d) * weight).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref.reshape(length, g, heads * d), atol=tol, rtol=tol)
    for x, x64 in zip((q, k, v), (q64, k64, v64), strict=True):
        torch.testing.assert_close(x.grad.double(), x64.grad, atol=tol, rtol=tol)


def test_auto_packs_groups_not_singletons():
    from hybridrl.mcore import compute, prefix_share

    grpo = compute.prepare_batch(grpo_batch([(12, (3,) * 8), (10, (2, 3, 1, 3, 3, 2, 3, 3))]))
    packed = prefix_share.plan(grpo, 8, 16, one_width=False, multiple=1)
    # 2 packed rows of 12 + 8 * 3 and 10 + 8 * 3 columns instead of 16 rows of up to 15
    assert packed.tokens == 36 + 34 and packed.unshared_tokens == 8 * 15 + 8 * 13 and packed.shared_responses == 16
    singles = compute.prepare_batch(grpo_batch([(5, (3,)), (7, (4,)), (2, (6,))]))
    assert prefix_share.plan(singles, 3, 3, one_width=False).shared_responses == 0


def test_config_key_defaults_to_auto_and_refuses_a_sliding_window_model(tmp_path):
    import json

    from hybridrl.config import ConfigError, load_config

    assert load_config("tiny_cpu_grpo.yaml").actor.share_prompt_prefix is None  # auto
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    shape = load_config("tiny_cpu_grpo.yaml").model.architecture  # the config's shape, as a Mistral checkpoint
    fields = {k: v for k, v in vars(shape).items() if v is not None}
    (mistral / "config.json").write_text(json.dumps({**fields, "model_type": "mistral", "sliding_window": 4096}))
    base = ["data.demo_task=false", f"model.path={mistral}", "model.architecture.model_type=null",
            "data.train_files=[x.parquet]"]  # fmt: skip
    load_config("tiny_cpu_grpo.yaml", [*base, "actor.share_prompt_prefix=false"])
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu_grpo.yaml", [*base, "actor.share_prompt_prefix=true"])
    assert str(info.value) == (
        "actor.share_prompt_prefix (true) cannot pack a sliding-window model (sliding_window 4096); set it to null "
        "(auto: row by row here) or false"
    )

"""MoE models (Qwen3-MoE with and without norm_topk_prob, Mixtral) on Megatron equal HF transformers.

One 2-rank gloo launch (``moe_worker``) builds each tiny MoE (4 experts, top-2, 2 layers, vocab 197 padded to
256) through the trainer's builders on DP2, EP2 (the two DP ranks hold 2 experts each), PP2 and, for the
frozen reference role, TP2, and checks against HF transformers, the independent reference here:

- response log-probs of a left/right-padded batch (fp32, <= 1e-4);
- one actor step (torch optimizer backend, the CPU path) vs HF: the loss is the token-mean policy-gradient
  loss plus ``router_aux_loss_coef`` times Megatron's load-balancing loss, written here from the Switch
  Transformer formula (Fedus et al. 2021) over HF's own router logits: per micro-batch (one row) and layer,
  ``E * sum_i f_i P_i`` with ``f_i`` the fraction of the row's T*k routing slots on expert i and ``P_i`` the
  mean router probability; averaged over rows. ``torch.nn.utils.clip_grad_norm_`` clips at half the true
  norm (active) and AdamW steps. The grad norm (expert shards counted once per expert, summed over EP
  ranks), the logged aux loss and the updated weights must match;
- the export from EP2, PP2 and TP2 equals the source checkpoint bit for bit and loads in transformers.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.mcore import hf_tiny_moe
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank
VOCAB = hf_tiny_moe.VOCAB
PROMPT, RESPONSE = 12, 8
OPTIM = dict(lr=1e-2, wd=0.1, betas=(0.9, 0.999), eps=1e-2)
AUX_COEF = 0.1  # large enough that a wrong aux-loss scale moves the grad norm far past the tolerance
LOGP_TOL, NORM_TOL = 1e-4, 1e-5


def make_batch(prompt_lens, response_lens, seed: int) -> dict[str, torch.Tensor]:
    """Prompts LEFT-padded to PROMPT, responses RIGHT-padded to RESPONSE; advantages per token."""
    g = torch.Generator().manual_seed(seed)
    b = len(prompt_lens)
    ids = torch.zeros(b, PROMPT + RESPONSE, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        ids[i, PROMPT - p : PROMPT + r] = torch.randint(1, VOCAB, (p + r,), generator=g)
        mask[i, PROMPT - p : PROMPT + r] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, PROMPT:].clone(), "response_mask": mask[:, PROMPT:].clone(),
            "advantages": torch.randn(b, RESPONSE, generator=g)}  # fmt: skip


def _hf(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def hf_log_probs(model, batch: dict) -> torch.Tensor:
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    logits = model(**inputs).logits[:, PROMPT - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def switch_aux_loss(router_logits: torch.Tensor, topk: int) -> torch.Tensor:
    """``E * sum_i f_i P_i`` over the tokens of ``router_logits`` ``(T, E)`` (Switch Transformer, eq. 4-6)."""
    t, e = router_logits.shape
    probs = torch.softmax(router_logits.float(), dim=-1)
    chosen = torch.zeros(t, e).scatter_(1, torch.topk(router_logits, topk, dim=-1).indices, 1.0)
    return e * ((chosen.sum(0) / (t * topk)) * probs.mean(0)).sum()


def hf_step(path: str, after: str, batch: dict) -> dict:
    """HF's loss (policy gradient + aux), clip_grad_norm_ at half the true norm, one AdamW step saved to ``after``."""
    model = _hf(path)
    out = model(**{k: batch[k] for k in ("input_ids", "position_ids")}, output_router_logits=True)
    logp = torch.log_softmax(out.logits[:, PROMPT - 1 : -1].float(), -1)
    logp = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].float()
    pg = (-batch["advantages"] * logp * mask).sum() / mask.sum()
    b, s = batch["input_ids"].shape
    k = model.config.num_experts_per_tok
    per_row = [sum(switch_aux_loss(layer.view(b, s, -1)[row], k) for layer in out.router_logits) for row in range(b)]
    aux = torch.stack(per_row).mean()
    (pg + model.config.router_aux_loss_coef * aux).backward()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    true_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
    norm = float(torch.nn.utils.clip_grad_norm_(params, 0.5 * true_norm))
    decay = [p for n, p in named if not (p.dim() <= 1 or n.endswith(".bias"))]
    no_decay = [p for n, p in named if p.dim() <= 1 or n.endswith(".bias")]
    groups = [{"params": decay, "weight_decay": OPTIM["wd"]}, {"params": no_decay, "weight_decay": 0.0}]
    torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"]).step()
    model.save_pretrained(after, safe_serialization=True)
    return {"norm": norm, "clip": 0.5 * true_norm, "aux": aux.item() / model.config.num_hidden_layers}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.mcore import moe_worker

    root = tmp_path_factory.mktemp("moe")
    padded = make_batch((9, 4, 7, 2), (6, 3, 1, 5), seed=4)
    full = make_batch((PROMPT,) * 4, (RESPONSE,) * 4, seed=5)  # no padding: every micro-batch's aux sees T = 20
    full["response_mask"][:, -3:] = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 1, 1]])
    cases, refs = {}, {}
    for seed, arch in enumerate(hf_tiny_moe.ARCHS):
        path = hf_tiny_moe.make_checkpoint(arch, str(root / arch), seed=seed, router_aux_loss_coef=AUX_COEF)
        with torch.no_grad():
            refs[(arch, "log_probs")] = hf_log_probs(_hf(path).eval(), padded)
        cases[arch] = {"path": path}
        if arch != "qwen3_moe_nonorm":
            refs[(arch, "step")] = hf_step(path, str(root / f"{arch}_after"), full)
            cases[arch].update(after=str(root / f"{arch}_after"), clip=refs[(arch, "step")]["clip"])
    spec = {"cases": cases, "padded": padded, "full": full, "optim": OPTIM, "out": str(root / "export"),
            "export_arch": "qwen3_moe", "export_layouts": ("ep2", "pp2")}  # fmt: skip
    results = run_ranks(moe_worker.body, 2, spec, timeout=900)
    return refs, results, padded, spec


LAYOUTS = ("dp2", "ep2", "pp2", "tp2", "tp2_sp")


@pytest.mark.parametrize("arch", list(hf_tiny_moe.ARCHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_log_probs_match_hf(run, layout, arch):
    refs, results, padded, _ = run
    valid = padded["response_mask"].bool()
    for rank, r in enumerate(results):
        got = torch.as_tensor(r[(layout, arch, "log_probs")])
        diff = (got - refs[(arch, "log_probs")])[valid].abs().max().item()
        print(f"{layout} {arch} rank {rank}: max |log-prob diff| {diff:.2e}")
        assert diff <= LOGP_TOL, (layout, arch, rank, diff)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("layout", ["dp2", "ep2", "pp2", "tp2_sp"])
def test_step_matches_hf_clip_and_adamw(run, layout, arch):
    refs, results, _, _ = run
    ref = refs[(arch, "step")]
    for rank, r in enumerate(results):
        got = r[(layout, arch, "step", rank)]
        rel = abs(got["norm"] - ref["norm"]) / ref["norm"]
        print(f"{layout} {arch} rank {rank}: grad norm {got['norm']:.7f} vs HF {ref['norm']:.7f} ({rel:.1e}); "
              f"aux {got['aux']:.7f} vs {ref['aux']:.7f}; weights {got['weights']:.1e} "
              f"update {got['update']:.1e}")  # fmt: skip
        assert not got["skipped"] and rel <= NORM_TOL, (layout, arch, rank, got, ref)
        assert abs(got["aux"] - ref["aux"]) <= 1e-5 * ref["aux"], (got["aux"], ref["aux"])
        assert got["weights"] <= 1e-5 and got["update"] <= 1e-3, (layout, arch, rank, got)
        want_experts = 2 * 4 * 2 // (2 if layout == "ep2" else 1) // (2 if layout == "pp2" else 1)  # fc1+fc2
        assert got["experts"] == want_experts, (layout, got["experts"])


@pytest.mark.parametrize("layout", ["ep2", "pp2", "tp2"])
def test_export_round_trip_is_bit_exact_and_loads_in_transformers(run, layout):
    _, _, padded, spec = run
    source = spec["cases"][spec["export_arch"]]["path"]
    want, got = load_file(f"{source}/model.safetensors"), load_file(f"{spec['out']}/{layout}/model.safetensors")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
    with torch.no_grad():
        exported = hf_log_probs(_hf(f"{spec['out']}/{layout}").eval(), padded)
        assert torch.equal(exported, hf_log_probs(_hf(source).eval(), padded))

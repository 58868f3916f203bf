"""The routing-mismatch metric and routing replay on Megatron MoE models, against HF transformers.

The rollout's routes here come from a reference forward (no vLLM: tests/rollout/test_vllm_routes.py checks vLLM's
own): HF transformers' model of a checkpoint whose routers were perturbed (a policy a little off the trained one,
as a rollout engine is after numerics or an update drift), top-k of its router logits per token and layer, each
response's last token and padding marked unknown (-1) as the rollout engine marks them. One 2-rank gloo launch
(``routing_worker``) runs the trained checkpoint through the actor's builders on DP2, EP2 and PP2:

- replay off: ``moe/routing_mismatch`` equals a count written here from HF's own router logits of the trained
  checkpoint (top-k sets vs the routes, over response tokens with ``response_mask`` 1 and known routes, all
  layers);
- replay on: ``moe/routing_mismatch`` is 0, ``moe/routing_mismatch_router`` equals the same count over the
  router choices of HF's forward with the routes forced (later layers see other inputs then), the router
  weight's gradient of a policy-gradient loss equals HF's through that forced forward (no aux loss here), and
  the log-probs equal HF's forward with the same routes forced into its routers (fp32, <= 1e-5), and differ from
  the unforced log-probs (the test can fail).
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import hf_tiny_moe
from tests.mcore.test_moe_parity import _hf, hf_log_probs, make_batch
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank
ARCHS = ("qwen3_moe", "qwen3_moe_nonorm", "mixtral")  # nonorm: gate weights from the full softmax
ROUTES_KEY = "rollout_routed_experts"
LOGP_TOL = 1e-5


def hf_routes(model, batch: dict) -> torch.Tensor:
    """``(b, s, layers, k)`` top-k experts of HF's router logits for ``batch``'s tokens."""
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        logits = model(**inputs, output_router_logits=True).router_logits
    b, s = batch["input_ids"].shape
    k = model.config.num_experts_per_tok
    return torch.stack([torch.topk(z.view(b, s, -1), k, dim=-1).indices for z in logits], dim=2)


def mark_unknown(routes: torch.Tensor, batch: dict) -> torch.Tensor:
    """-1 at padding and at each response's last token (generation never forwards it)."""
    routes = routes.clone()
    mask = batch["attention_mask"].bool()
    routes[~mask] = -1
    last = mask.long().cumsum(1).argmax(1)  # the last valid column of each row
    routes[torch.arange(len(routes)), last] = -1
    return routes


def independent_mismatch(own: torch.Tensor, routes: torch.Tensor, batch: dict) -> float:
    """Fraction of (response token, layer) pairs with known routes whose expert sets differ."""
    s, r = batch["input_ids"].shape[1], batch["responses"].shape[1]
    policy = torch.zeros(batch["input_ids"].shape, dtype=torch.bool)
    policy[:, s - r :] = batch["response_mask"].bool()
    pairs = policy.unsqueeze(-1) & (routes >= 0).all(-1)
    differs = (own.sort(-1).values != routes.sort(-1).values).any(-1)
    return (differs & pairs).sum().item() / pairs.sum().item()


def forced_log_probs(model, batch: dict, routes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's log-probs with every layer's router sent to ``routes`` (its own top-k where -1); the gate weights are
    the router's softmax at those experts, renormalised as the model does. Also the top-k each router would have
    picked in that forward ``(b, s, layers, k)``."""
    b, s = batch["input_ids"].shape
    picked: dict[int, torch.Tensor] = {}
    norm = getattr(model.config, "norm_topk_prob", True)
    for layer, block in enumerate(model.model.layers):
        gate = block.mlp.gate if hasattr(block.mlp, "gate") else block.block_sparse_moe.gate
        forced = routes[:, :, layer].reshape(b * s, -1)

        def forward(hidden, gate=gate, forced=forced, layer=layer):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            probs = torch.softmax(logits.float(), dim=-1)
            own = picked[layer] = torch.topk(probs, gate.top_k, dim=-1).indices
            index = torch.where((forced >= 0).all(-1, keepdim=True), forced, own)
            scores = probs.gather(1, index)
            scores = scores / scores.sum(-1, keepdim=True) if norm else scores
            return logits, scores.to(logits.dtype), index

        gate.forward = forward
    logp = hf_log_probs(model, batch)
    return logp, torch.stack([picked[i].view(b, s, -1) for i in range(len(picked))], dim=2)


def forced_router_grads(model, batch: dict, logp: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per layer, the router weight's gradient of the token-mean ``-A_t log pi(y_t)`` through the forced forward."""
    mask = batch["response_mask"].float()
    ((-batch["advantages"] * logp * mask).sum() / mask.sum()).backward()
    gates = [b.mlp.gate if hasattr(b.mlp, "gate") else b.block_sparse_moe.gate for b in model.model.layers]
    return {layer: gate.weight.grad.clone() for layer, gate in enumerate(gates)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tests.mcore import routing_worker

    root = tmp_path_factory.mktemp("routing")
    cases, refs = {}, {}
    for seed, arch in enumerate(ARCHS):
        # no aux loss: the router's gradient is the policy loss's alone, comparable with HF's forced forward
        path = hf_tiny_moe.make_checkpoint(arch, str(root / arch), seed=seed, router_aux_loss_coef=0.0)
        batch = make_batch((9, 4, 7, 2), (6, 3, 8, 5), seed=10 + seed)
        rollout = _hf(path).eval()
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # the rollout policy: routers a little off the trained ones
            for name, p in rollout.named_parameters():
                if name.endswith("gate.weight"):
                    p.add_(0.5 * p.std() * torch.randn(p.shape, generator=g))
        routes = mark_unknown(hf_routes(rollout, batch), batch)
        trained = _hf(path).eval()
        with torch.no_grad():
            plain = hf_log_probs(trained, batch)
        own = hf_routes(trained, batch)
        forced, picked = forced_log_probs(trained, batch, routes)  # patches trained's routers
        grads = forced_router_grads(trained, batch, forced)
        forced = forced.detach()
        refs[arch] = {
            "router_grads": grads,
            "mismatch": independent_mismatch(own, routes, batch),
            "mismatch_replayed": independent_mismatch(picked, routes, batch),
            "plain": plain,
            "forced": forced,
            "valid": batch["response_mask"].bool(),
        }
        cases[arch] = {"path": path, "batch": {**batch, ROUTES_KEY: routes.to(torch.int16)}}
    spec = {"cases": cases, "layouts": tuple(routing_worker.LAYOUTS)}
    return refs, run_ranks(routing_worker.body, 2, spec, timeout=900)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["dp2", "ep2", "pp2"])
def test_metric_and_replay(run, layout, arch):
    refs, results = run
    ref = refs[arch]
    assert 0.05 < ref["mismatch"] < 0.95, ref["mismatch"]  # the perturbation makes routes disagree, not all
    for rank, result in enumerate(results):
        r = result[(layout, arch)]
        off, on = r[("metrics", False)], r[("metrics", True)]
        print(f"{layout} {arch} rank {rank}: mismatch {off['moe/routing_mismatch']:.4f} (HF count "
              f"{ref['mismatch']:.4f}); replay: {on['moe/routing_mismatch']:.4f}, router "
              f"{on['moe/routing_mismatch_router']:.4f} (HF {ref['mismatch_replayed']:.4f})")  # fmt: skip
        assert r["routers"] == (1 if layout == "pp2" else 2)  # this rank's MoE layers
        assert abs(off["moe/routing_mismatch"] - ref["mismatch"]) < 1e-9
        assert off["moe/routing_mismatch_router"] == off["moe/routing_mismatch"]
        assert on["moe/routing_mismatch"] == 0.0
        assert abs(on["moe/routing_mismatch_router"] - ref["mismatch_replayed"]) < 1e-9


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["dp2", "ep2", "pp2"])
def test_replayed_router_gradient_equals_hf_forced_routes(run, layout, arch):
    """Replay keeps the router differentiable: its weight's gradient (summed over the data-parallel ranks, each
    holding its shard's part of the global token-mean) equals HF's through the forced forward."""
    refs, results = run
    for layer, want in refs[arch]["router_grads"].items():
        name = f"decoder.layers.{layer}.mlp.router.weight"
        parts = [torch.as_tensor(r[(layout, arch)][("router_grads", True)][name]) for r in results
                 if name in r[(layout, arch)][("router_grads", True)]]  # fmt: skip
        got = parts[0] if layout == "pp2" else sum(parts)  # PP: one rank holds the layer and the whole batch
        rel = ((got - want).norm() / want.norm()).item()
        print(f"{layout} {arch} layer {layer}: router grad vs HF forced {rel:.1e} (|grad| {want.norm():.3e})")
        assert want.norm() > 0 and rel <= 1e-5, rel


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["dp2", "ep2", "pp2"])
def test_replayed_log_probs_equal_hf_forced_routes(run, layout, arch):
    refs, results = run
    ref, valid = refs[arch], refs[arch]["valid"]
    for rank, result in enumerate(results):
        r = result[(layout, arch)]
        replayed = torch.as_tensor(r[("log_probs", True)])
        forced = (replayed - ref["forced"])[valid].abs().max().item()
        plain = (torch.as_tensor(r["log_probs_plain"]) - ref["plain"])[valid].abs().max().item()
        routed_off = (torch.as_tensor(r[("log_probs", False)]) - ref["plain"])[valid].abs().max().item()
        moved = (ref["forced"] - ref["plain"])[valid].abs().max().item()
        print(f"{layout} {arch} rank {rank}: replay vs HF forced {forced:.1e}; no replay vs HF {routed_off:.1e}, "
              f"no routes vs HF {plain:.1e}; forcing moves HF by {moved:.2f}")  # fmt: skip
        assert moved > 1e-2  # forcing the routes changes the log-probs: the comparison can fail
        assert forced <= LOGP_TOL and plain <= LOGP_TOL and routed_off <= LOGP_TOL


def test_replay_without_recorded_routes_is_an_error():
    from hybridrl.mcore import routing

    assert routing.keys_in({ROUTES_KEY: torch.zeros(1)}, replay=True) == (ROUTES_KEY,)
    assert routing.keys_in({}, replay=False) == ()
    with pytest.raises(RuntimeError, match=r"actor\.moe\.routing_replay is on, but the rollout batch has no"):
        routing.keys_in({}, replay=True)

"""hybridrl.mcore.optimizer and lr_schedule: the same update for every parallel split, and the step's rules.

One 4-rank gloo launch:
- an independent reference: a TP=1 model run sample by sample (no padding), the token-mean loss written by
  hand, ``torch.nn.utils.clip_grad_norm_`` and ``torch.optim.AdamW`` with the warmup learning rate written
  out; two steps with clipping active;
- the same two steps through ``compute.forward_backward`` + ``build_optimizer`` at TP4, TP2xDP2, PP2xDP2
  and DP4 (torch path), and at TP2xDP2 through the Megatron path (DDP + ``get_megatron_optimizer``, no
  distributed optimizer: the part of the GPU path that runs on CPU): every rank's weights must equal its
  shard of the reference, and the reported grad norms the reference's;
- the number of collectives in one ``step()`` does not grow with the model (2 and 4 layers), and does grow
  with the number of buckets (the count is real);
- tied embeddings at PP2 (grads of the last stage's copy summed with the embedding's) train like PP1;
- a NaN gradient on one rank (sharded param, and a TP-replicated norm weight that the norm does not count)
  skips the step everywhere: weights, Adam state and schedule untouched, ``skipped`` reported.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.mcore.test_compute import make_samples, pad_samples, ppo_like_per_token
from tests.multirank import run_ranks

SHAPE = dict(
    num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=4, ffn_hidden_size=96, vocab_size=128
)
# eps = 1e-4, not 1e-8: Adam divides by sqrt(v) + eps, so on the few elements whose gradient is ~1e-8 (dead
# SwiGLU units) the update is sign(g) * lr and fp32 summation-order noise flips it between splits (measured:
# 9 of 12288 elements off by 2.6e-5 with eps=1e-8). Typical |g| here is ~1e-3, so Adam stays in its normal regime.
LR, WARMUP, WD, BETAS, EPS = 2e-3, 3, 0.1, (0.9, 0.95), 1e-4
LAYOUTS = [  # (name, layout, optimizer backend)
    ("tp4", {"tp": 4}, "torch"),
    ("tp2_dp2", {"tp": 2}, "torch"),
    ("pp2_dp2", {"pp": 2}, "torch"),
    ("dp4", {}, "torch"),
    ("tp2_dp2_megatron", {"tp": 2}, "megatron"),
]
STEPS = 2


def _loss_fn(outputs, mb):
    """Token-mean of the PPO-like loss of test_compute (the optimizer tests use token-mean)."""
    lp = outputs["log_probs"]
    return ppo_like_per_token(lp, torch.zeros_like(lp), mb["advantages"], mb["old_log_probs"]), {}


def _batches(vocab: int) -> list[list[dict]]:
    return [make_samples(vocab, seed=100 + step) for step in range(STEPS)]


def _init(layout_kw):
    from tests.mcore.shards import init_layout

    init_layout(**layout_kw)


def _model(shape, full=None):
    from tests.mcore.shards import build_chunks

    return build_chunks(shape, full)


def _reference(shape, batches) -> dict:
    """Plain torch on a whole TP=1 model: per-sample forward, hand-written loss, clip_grad_norm_, AdamW."""
    import torch.distributed as dist

    from hybridrl.mcore import gpt
    from tests.mcore.shards import global_named_parameters

    _init({})
    (model,) = _model(shape)
    box = [{n: p.detach().clone() for n, p in global_named_parameters([model])}]
    dist.broadcast_object_list(box, src=0)
    full = box[0]
    (model,) = _model(shape, full)
    named = list(global_named_parameters([model]))
    groups = [
        {"params": [p for _, p in named if p.dim() > 1], "weight_decay": WD},
        {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS)
    norms, clip = [], None
    for step, samples in enumerate(batches):
        model.zero_grad()
        total, n_tok = 0.0, 0.0
        for s in samples:
            p, r = len(s["prompt"]), len(s["response"])
            ids = torch.cat([s["prompt"], s["response"]]).unsqueeze(0)
            logits = model(ids, torch.arange(p + r).unsqueeze(0), gpt.causal_mask(p + r))[0, p - 1 : p + r - 1]
            lp = torch.log_softmax(logits, -1).gather(-1, s["response"].unsqueeze(-1)).squeeze(-1)
            total = total + (ppo_like_per_token(lp, torch.zeros_like(lp), s["adv"], s["old"]) * s["mask"]).sum()
            n_tok += float(s["mask"].sum())
        (total / n_tok).backward()
        if clip is None:  # clip at half the first norm, so clipping is active on every step
            clip = 0.5 * math.sqrt(sum(float(p.grad.pow(2).sum()) for _, p in named))
        norms.append(float(torch.nn.utils.clip_grad_norm_([p for _, p in named], clip)))
        for g in opt.param_groups:
            g["lr"] = LR * (step + 1) / WARMUP  # warmup: step s (0-based) uses lr * (s + 1) / W
        opt.step()
    final = {n: p.detach().clone() for n, p in named}
    return {"full": full, "final": final, "norms": norms, "clip": clip}


def _weights_diff(chunks, expected_full: dict) -> float:
    """Largest per-tensor relative difference of this rank's params vs its shard of ``expected_full``."""
    from tests.mcore.shards import global_named_parameters, local_shards

    expected = local_shards(chunks, expected_full)
    rel = 0.0
    for name, p in global_named_parameters(chunks):
        ref = expected[name]
        rel = max(rel, (p.detach() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-12))
    return rel


def _run_layout(shape, ref, batches, layout_kw, backend) -> dict:
    from megatron.core import parallel_state as mpu

    from hybridrl.mcore import compute
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer

    _init(layout_kw)
    chunks = _model(shape, ref["full"])
    config = OptimConfig(
        lr=LR,
        warmup_steps=WARMUP,
        weight_decay=WD,
        betas=BETAS,
        eps=EPS,
        clip_grad=ref["clip"],
        backend=backend,
        use_distributed_optimizer=False,
    )
    opt = build_optimizer(chunks, config)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    results = []
    for samples in batches:
        local = {k: v.chunk(dp)[dp_rank] for k, v in pad_samples(samples).items()}
        opt.zero_grad()
        compute.forward_backward(opt.chunks, local, _loss_fn, 1)
        results.append(opt.step())
    return {
        "weights_rel_diff": _weights_diff(chunks, ref["final"]),
        "moved_from_init": _weights_diff(chunks, ref["full"]),
        "norms": [r.grad_norm for r in results],
        "lrs": [r.lr for r in results],
        "skipped": [r.skipped for r in results],
    }


class _CountCollectives:
    """Counts torch.distributed collective calls inside a ``with`` block (test-side wrapper)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all")

    def __enter__(self):
        import torch.distributed as dist

        self.count, self._saved = 0, {n: getattr(dist, n) for n in self.NAMES}

        def wrap(fn):
            def counted(*args, **kwargs):
                self.count += 1
                return fn(*args, **kwargs)

            return counted

        for name, fn in self._saved.items():
            setattr(dist, name, wrap(fn))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _count_collectives(shape_kw, bucket_numel) -> dict:
    from hybridrl.mcore import compute
    from hybridrl.mcore.gpt import GPTShape
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer

    shape = GPTShape(**shape_kw)
    _init({"tp": 2})
    opt = build_optimizer(_model(shape), OptimConfig(lr=LR, bucket_numel=bucket_numel, backend="torch"))
    compute.forward_backward(opt.chunks, _local_batch(shape), _loss_fn, 2)
    with _CountCollectives() as counter:
        opt.step()
    return {"collectives": counter.count, "buckets": len(opt.buckets), "params": len(opt.params)}


def _local_batch(shape, seed: int = 11):
    from megatron.core import parallel_state as mpu

    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    return {k: v.chunk(dp)[dp_rank] for k, v in pad_samples(make_samples(shape.vocab_size, seed)).items()}


def _nan_skips(shape) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from hybridrl.mcore import compute
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer
    from tests.mcore.shards import global_named_parameters

    _init({"tp": 2})
    chunks = _model(shape)
    opt = build_optimizer(chunks, OptimConfig(lr=LR, warmup_steps=WARMUP, clip_grad=1.0, backend="torch"))
    before = [p.detach().clone() for p in opt.params]
    report = {}
    # (case, global rank that gets the NaN, which param): a TP shard, and a replicated norm weight on TP rank 1
    for case, bad_rank, pick in (("sharded", 3, "linear_qkv.weight"), ("replicated", 1, "input_layernorm.weight")):
        opt.zero_grad()
        compute.forward_backward(opt.chunks, _local_batch(shape), _loss_fn, 2)
        if dist.get_rank() == bad_rank:
            param = next(p for n, p in global_named_parameters(chunks) if n.endswith(pick))
            assert pick != "input_layernorm.weight" or not getattr(param, "tensor_model_parallel", False)
            param.grad.view(-1)[0] = float("nan")
        result = opt.step()
        report[case] = {
            "skipped": result.skipped,
            "norm_is_nan": math.isnan(result.grad_norm),
            "unchanged": all(torch.equal(a, p.detach()) for a, p in zip(before, opt.params, strict=True)),
            "num_steps": opt.num_steps,
            "adam_state": len(opt.optimizer.state),
        }
    opt.zero_grad()
    compute.forward_backward(opt.chunks, _local_batch(shape), _loss_fn, 2)
    result = opt.step()
    report["after"] = {
        "skipped": result.skipped,
        "num_steps": opt.num_steps,
        "lr": result.lr,
        "changed": not all(torch.equal(a, p.detach()) for a, p in zip(before, opt.params, strict=True)),
        "tp_rank": mpu.get_tensor_model_parallel_rank(),
    }
    return report


def _tied_embeddings(shape_kw) -> dict:
    """Tied embeddings: PP2 (the last stage holds a ``shared`` copy) must train exactly like PP1 (one param)."""
    import torch.distributed as dist

    from hybridrl.mcore import compute
    from hybridrl.mcore.gpt import GPTShape
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer
    from tests.mcore.shards import gather_full, global_named_parameters, load_full

    shape = GPTShape(**dict(shape_kw, tie_embeddings=True))
    out, full = {}, None
    for name, layout_kw in (("pp1", {}), ("pp2", {"pp": 2})):
        _init(layout_kw)
        chunks = _model(shape)
        if full is None:
            box = [gather_full(chunks, "data")]
            dist.broadcast_object_list(box, src=0)
            full = box[0]
        names = {n for n, _ in global_named_parameters(chunks)}
        load_full(
            chunks,
            dict(full, **{"output_layer.weight": full["embedding.word_embeddings.weight"]})
            if "output_layer.weight" in names
            else full,
        )
        opt = build_optimizer(chunks, OptimConfig(lr=LR, clip_grad=0.5, eps=EPS, backend="torch"))
        norms = []
        for step in range(STEPS):
            opt.zero_grad()
            compute.forward_backward(opt.chunks, _local_batch(shape, seed=7 + step), _loss_fn, 2)
            norms.append(opt.step().grad_norm)
        out[name] = (norms, gather_full(chunks, "data"))
    (n1, w1), (n2, w2) = out["pp1"], out["pp2"]
    return {
        "norms": (n1, n2),
        "weights_diff": max((w1[k] - w2[k]).abs().max().item() for k in w1),
        "copy_diff": (w2["output_layer.weight"] - w2["embedding.word_embeddings.weight"]).abs().max().item(),
        "moved": (w1["embedding.word_embeddings.weight"] - full["embedding.word_embeddings.weight"]).abs().max().item(),
    }


def _optimizer_body(rank: int, world_size: int) -> dict:
    from hybridrl.mcore.gpt import GPTShape

    shape = GPTShape(**SHAPE)
    batches = _batches(shape.vocab_size)
    ref = _reference(shape, batches)
    report = {"ref_norms": ref["norms"], "clip": ref["clip"]}
    for name, layout_kw, backend in LAYOUTS:
        report[name] = _run_layout(shape, ref, batches, layout_kw, backend)
    report["count_4_layers"] = _count_collectives(SHAPE, 40_000_000)
    report["count_2_layers"] = _count_collectives(dict(SHAPE, num_layers=2), 40_000_000)
    report["count_small_buckets"] = _count_collectives(SHAPE, 20_000)
    report["nan"] = _nan_skips(GPTShape(**dict(SHAPE, num_query_groups=2)))
    report["tied"] = _tied_embeddings(SHAPE)
    # Qwen3's q/k layernorms: replicated over TP, but each TP rank's gradient covers only its own heads
    qk = GPTShape(**dict(SHAPE, qk_norm=True))
    qk_ref = _reference(qk, batches)
    report["qk_ref_norms"] = qk_ref["norms"]
    report["qk_norm_tp4"] = _run_layout(qk, qk_ref, batches, {"tp": 4}, "torch")
    return report


@pytest.fixture(scope="module")
def reports():
    out = run_ranks(_optimizer_body, 4, timeout=600)
    print("optimizer report (rank 0):", out[0])
    return out


# ---- multi-rank tests -----------------------------------------------------------------------------------
multirank = pytest.mark.multirank


@multirank
@pytest.mark.parametrize("name", [entry[0] for entry in LAYOUTS])
def test_step_matches_reference_for_every_split(reports, name):
    for rank, rep in enumerate(reports):
        r = rep[name]
        assert r["skipped"] == [False] * STEPS, (rank, r)
        assert r["weights_rel_diff"] <= 1e-5, (rank, r)
        assert r["moved_from_init"] > 1e-3, (rank, r)  # the update is large against the tolerance
        assert r["lrs"] == pytest.approx([LR * (s + 1) / WARMUP for s in range(STEPS)]), (rank, r)
        for norm, ref_norm in zip(r["norms"], rep["ref_norms"], strict=True):
            assert norm == pytest.approx(ref_norm, rel=1e-5), (rank, r, rep["ref_norms"])
            assert norm > rep["clip"], "clipping must be active in this test"


@multirank
def test_qk_norm_grads_are_summed_over_tp(reports):
    """q/k layernorm weights stay equal to a whole model's under TP 4 (their partial gradients are summed over TP,
    as Megatron's finalize_model_grads does); without the sum every rank stepped on its own heads' part."""
    for rank, rep in enumerate(reports):
        r = rep["qk_norm_tp4"]
        assert r["skipped"] == [False] * STEPS and r["weights_rel_diff"] <= 1e-5, (rank, r)
        assert r["norms"] == pytest.approx(rep["qk_ref_norms"], rel=1e-5), (rank, r)


@multirank
def test_collectives_per_step_do_not_grow_with_the_model(reports):
    for rep in reports:
        big, small, many = rep["count_4_layers"], rep["count_2_layers"], rep["count_small_buckets"]
        assert big["params"] > small["params"]
        assert big["collectives"] == small["collectives"] == 2, (big, small)  # 1 DP bucket + 1 norm
        assert many["buckets"] > 2 and many["collectives"] == many["buckets"] + 1, many


@multirank
@pytest.mark.parametrize("case", ["sharded", "replicated"])
def test_nan_grad_skips_the_step_everywhere(reports, case):
    for rank, rep in enumerate(reports):
        r = rep["nan"][case]
        assert r["skipped"] and r["norm_is_nan"], (rank, r)
        assert r["unchanged"] and r["num_steps"] == 0 and r["adam_state"] == 0, (rank, r)


@multirank
def test_step_after_a_skip_applies_the_first_lr(reports):
    for rank, rep in enumerate(reports):
        r = rep["nan"]["after"]
        assert not r["skipped"] and r["changed"] and r["num_steps"] == 1, (rank, r)
        assert r["lr"] == pytest.approx(LR / WARMUP), "skipped steps must not advance the schedule"


@multirank
def test_tied_embeddings_under_pp_train_like_one_stage(reports):
    for rank, rep in enumerate(reports):
        r = rep["tied"]
        assert r["norms"][0] == pytest.approx(r["norms"][1], rel=1e-6), (rank, r)
        assert r["weights_diff"] <= 1e-6 and r["copy_diff"] == 0.0, (rank, r)
        assert r["moved"] > 1e-4, (rank, r)


# ---- unit tests (no ranks) -------------------------------------------------------------------------------
def test_lr_schedule_values_by_hand():
    from hybridrl.mcore.lr_schedule import LRSchedule

    warm = LRSchedule(lr=1.0, warmup_steps=4)
    assert [warm(s) for s in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    lin = LRSchedule(lr=1.0, min_lr=0.1, warmup_steps=2, total_steps=12, decay_style="linear")
    # step 2 starts the decay (q = 0), step 7 is halfway (q = 0.5), step >= 12 stays at min_lr
    assert [lin(s) for s in (0, 1, 2, 7, 12, 50)] == pytest.approx([0.5, 1.0, 1.0, 0.55, 0.1, 0.1])
    cos = LRSchedule(lr=2.0, min_lr=0.0, warmup_steps=0, total_steps=8, decay_style="cosine")
    # q = 0, 1/4, 1/2, 1: (1 + cos(pi q)) / 2 = 1, (1 + sqrt(2)/2)/2, 1/2, 0
    assert [cos(s) for s in (0, 2, 4, 8)] == pytest.approx([2.0, 1.0 + math.sqrt(2) / 2, 1.0, 0.0])


def test_lr_schedule_errors_name_the_field():
    from hybridrl.mcore.lr_schedule import LRSchedule

    with pytest.raises(ValueError, match="decay_style"):
        LRSchedule(lr=1.0, decay_style="step")
    with pytest.raises(ValueError, match=r"total_steps \(None\)"):
        LRSchedule(lr=1.0, decay_style="cosine")
    with pytest.raises(ValueError, match=r"min_lr \(2.0\)"):
        LRSchedule(lr=1.0, min_lr=2.0)


def test_plan_buckets_groups_by_dtype_and_size():
    from hybridrl.mcore.optimizer import plan_buckets

    params = [
        torch.nn.Parameter(torch.zeros(n, dtype=d))
        for n, d in (
            (4, torch.float32),
            (4, torch.float32),
            (3, torch.bfloat16),
            (9, torch.float32),
            (2, torch.float32),
        )
    ]
    assert plan_buckets(params, 8) == [[0, 1], [3], [4], [2]]
    assert plan_buckets(params, 100) == [[0, 1, 3, 4], [2]]
    with pytest.raises(ValueError, match="bucket_numel"):
        plan_buckets(params, 0)


def test_distributed_optimizer_needs_cuda():
    """The GPU path's configuration builds here; asking for the DistributedOptimizer on CPU is a clear error."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer

    assert DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True).bucket_size is None
    assert MegatronOptimizerConfig(lr=1e-3, bf16=True, use_distributed_optimizer=True, clip_grad=1.0).bf16
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"use_distributed_optimizer=True needs CUDA"):
            build_optimizer([], OptimConfig(backend="megatron"))
    with pytest.raises(ValueError, match="optimizer backend"):
        build_optimizer([], OptimConfig(backend="deepspeed"))


def _offload_body(rank, world):
    import torch

    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer, move_optimizer_state
    from tests.mcore.shards import build_chunks, init_layout

    init_layout(tp=2)
    from hybridrl.mcore.gpt import GPTShape

    shape = GPTShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                     vocab_size=128)  # fmt: skip
    chunks = build_chunks(shape)
    opt = build_optimizer(chunks, OptimConfig(lr=1e-3, clip_grad=0.0))
    for p in opt.params:
        p.grad = torch.ones_like(p)
    opt.step()
    tensors = [v for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
    nbytes = sum(v.numel() * v.element_size() for v in tensors if v.device.type != "meta")
    moved = move_optimizer_state(opt, "meta")  # a device the state is not on: every tensor moves
    on_meta = all(v.device.type == "meta" for st in opt.optimizer.state.values() for v in st.values()
                  if torch.is_tensor(v) and v.dim() > 0)  # fmt: skip
    grads_dropped = all(p.grad is None for p in opt.params)
    return {"moved": moved, "expected": nbytes, "on_meta": on_meta, "grads_dropped": grads_dropped}


def test_optimizer_state_offload_moves_every_tensor():
    from tests.multirank import run_ranks

    for r in run_ranks(_offload_body, 2, timeout=300):
        assert r["on_meta"] and r["grads_dropped"]
        assert r["moved"] == r["expected"] > 0


def test_parked_weights_outside_ddp_buffers_come_back():
    """RoleModel.offload parks weights that are not views of Megatron DDP's buffers (torch optimizer, or no
    DistributedOptimizer) on the CPU; bringing them back must call onload even though every parameter is now on
    the CPU (it returned early, and the next forward ran CPU weights against CUDA inputs)."""
    from hybridrl.mcore.optimizer import move_model_weights

    class Parked:  # RoleModel's offload state after offload() on a GPU: offloaded, parameters in host memory
        def __init__(self):
            self.offloaded, self.calls = True, []

        def parameters(self):
            return iter([torch.zeros(2)])

        def onload(self):
            self.calls.append("onload")
            self.offloaded = False

        def offload(self):
            self.calls.append("offload")

    model = Parked()
    move_model_weights(None, model, to_host=False)
    assert model.calls == ["onload"] and not model.offloaded
    move_model_weights(None, model, to_host=False)  # home already: nothing more
    assert model.calls == ["onload"]

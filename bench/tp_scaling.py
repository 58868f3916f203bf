"""Does tensor parallelism over this machine's cores pay, and how much of the fp32 GEMM peak does training use?

The work is ``bench/step_vs_hf.py``'s actor update on one rollout batch (``--model small``: the 23.7M Llama, 16
prompts x 4 responses of ``--response-length`` tokens, one micro-batch, the GRPO actor loss with a k3 KL term),
through the trainer's own calls (``roles.build_actor`` from the HF checkpoint, ``compute.forward_backward`` with
``ActorLoss``, prompt sharing on auto). Three layouts, each timed as the median of ``--reps`` passes after a
warm-up, in two launches (a 1-rank one alternating 1 and 2 threads, then a 2-rank TP2 one):

- ``1 rank x 1 thread``: the single-core baseline;
- ``1 rank x 2 threads``: one process using both cores through intra-op threads;
- ``TP2 x 1 thread``: Megatron tensor parallelism, one rank per core, gloo all-reduces between them.

The GEMM peak is measured in the same launches: a 2048^3 fp32 ``mm`` on one thread, on two threads in one
process, and on one thread in each of the two TP ranks at once (the machine's peak). Each pass's share of it
is its counted FLOPs (``torch.utils.flop_counter`` on the same call: the GEMMs and attention matmuls it runs)
over its time and the peak of the cores it used. For TP2 the time inside ``torch.distributed.all_reduce`` (the
TP collectives) is counted too. Goal: TP2 >= 1.6x the 1-thread rank and no slower than 1 rank x 2 threads.

    python bench/tp_scaling.py [--model small|tiny] [--response-length 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


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
    """Seconds and calls inside ``torch.distributed.all_reduce`` while active (Megatron calls it by attribute)."""

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
    from step_profile import _batch

    from hybridrl.algos.objectives import ActorLoss
    from hybridrl.config.schema_roles import ActorConfig
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import compute, roles

    init_model_parallel(ParallelLayout.from_world(world, tp=tp), seed=1)
    actor = roles.build_actor(paths["model"])
    batch = _batch(paths, 16, 4, response)
    objective = ActorLoss(ActorConfig(use_kl_loss=True, kl_loss_coef=0.04, kl_loss_type="low_var_kl"))
    head = compute.LogProbHead(with_entropy=True, vocab_size=actor.shape.vocab_size)
    micro = len(batch["input_ids"])

    def fwd_bwd():
        for p in actor.chunks[0].parameters():
            p.grad = None
        compute.forward_backward(actor.chunks, batch, objective, micro, head=head, share_prefix=None)

    return fwd_bwd


def _time(fn, reps: int) -> float:
    fn()  # warm-up
    walls = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def _one_rank(rank: int, world: int, paths: dict, args: dict) -> dict:
    fwd_bwd = _setup(world, 1, paths, args["response"])
    out: dict = {"flops": _flops(fwd_bwd), "time": {1: [], 2: []}, "peak": {1: [], 2: []}}
    for rnd in range(2):  # 1 then 2 threads, then 2 then 1: drifts in the machine's load hit both
        for threads in (1, 2) if rnd == 0 else (2, 1):
            torch.set_num_threads(threads)
            out["peak"][threads].append(gemm_peak())
            out["time"][threads].append(_time(fwd_bwd, args["reps"]))
    return out


def _tp2(rank: int, world: int, paths: dict, args: dict) -> dict:
    import torch.distributed as dist

    fwd_bwd = _setup(world, 2, paths, args["response"])
    flops = _flops(fwd_bwd)
    dist.barrier()
    peak = gemm_peak()  # both ranks at once: one core each
    dist.barrier()
    wall = _time(fwd_bwd, args["reps"])
    with _AllReduceTimer() as ar:
        fwd_bwd()
    return {"flops": flops, "time": wall, "peak": peak, "allreduce_s": ar.seconds, "allreduce_calls": ar.calls,
            "allreduce_mb": ar.bytes / 2**20}  # fmt: skip


def main() -> None:
    from step_vs_hf import make_assets

    from hybridrl.distributed.spawn import run_ranks

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "small"), default="small")
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", default=None, help="write the work folder here")
    args = ap.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="hybridrl_tp_scaling_")
    paths = make_assets(os.path.join(work, args.model), args.model)
    spec = {"response": args.response_length, "reps": args.reps}
    one = run_ranks(_one_rank, 1, paths, spec, timeout=3600)[0]
    tp = run_ranks(_tp2, 2, paths, spec, timeout=3600)
    t1, t2 = min(one["time"][1]), min(one["time"][2])
    p1, p2 = max(one["peak"][1]), max(one["peak"][2])
    t_tp = max(r["time"] for r in tp)
    p_tp = sum(r["peak"] for r in tp)
    rows = [("1 rank x 1 thread", t1, one["flops"], p1), ("1 rank x 2 threads", t2, one["flops"], p2),
            ("TP2 x 1 thread", t_tp, sum(r["flops"] for r in tp), p_tp)]  # fmt: skip
    print(f"{args.model} Llama ({paths['params'] / 1e6:.2f}M), actor fwd+bwd of 64 responses of {args.response_length} "
          f"tokens, one micro-batch; median of {args.reps} (best of 2 rounds for 1 rank)")  # fmt: skip
    print(f"{'layout':20s} {'s/pass':>7s} {'vs 1x1':>7s} {'GFLOP':>7s} {'peak GFLOP/s':>13s} {'share of peak':>14s}")
    for name, t, flops, peak in rows:
        share = 100 * flops / 1e9 / t / peak
        print(f"{name:20s} {t:7.3f} {t1 / t:6.2f}x {flops / 1e9:7.1f} {peak:13.1f} {share:13.0f}%")
    ar = tp[0]
    print(f"TP2: {ar['allreduce_calls']} all-reduces, {ar['allreduce_mb']:.1f} MiB, {ar['allreduce_s']:.3f} s "
          f"({100 * ar['allreduce_s'] / t_tp:.0f}% of the pass) on rank 0")  # fmt: skip
    print(
        f"goal: TP2 / 1x1 = {t1 / t_tp:.2f}x (>= 1.6x: {'met' if t1 / t_tp >= 1.6 else 'NOT met'}); "
        f"TP2 / 1x2 = {t2 / t_tp:.2f}x (>= 1.0x: {'met' if t2 / t_tp >= 1.0 else 'NOT met'})"
    )


if __name__ == "__main__":
    main()

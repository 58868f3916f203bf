"""Forward+backward tokens/s of a small Llama-shaped Megatron model on CPU: TP1 vs TP2 (vs DP2).

One 2-rank gloo launch, one thread per rank, all cases in the same run so the ratios are comparable:
- TP1: rank 0 alone runs the whole model while rank 1 waits (the single-process baseline);
- TP2: both ranks run one model split by tensor parallelism (same global batch as TP1);
- DP2: both ranks run a whole model on half the global batch each.

    python bench/mcore_throughput.py [--steps 6] [--hidden 256] [--layers 4] [--seq 128]
"""

from __future__ import annotations

import argparse
import time

import torch


def _case(shape, tp: int, micro: list[dict], steps: int, active: bool) -> float:
    import torch.distributed as dist

    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import gpt

    init_model_parallel(ParallelLayout.from_world(dist.get_world_size(), tp=tp), seed=1)
    chunks = gpt.build_model_chunks(shape, gpt.make_config(shape))
    dist.barrier()
    elapsed = float("nan")
    if active:
        loss_fn = lambda out, b: (out.mean(), {})  # noqa: E731
        gpt.forward_backward(chunks, micro[:1], loss_fn)  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            gpt.forward_backward(chunks, micro, loss_fn)
        elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed


def _body(rank: int, world: int, args: dict) -> dict:
    import torch.distributed as dist

    from hybridrl.mcore.gpt import GPTShape

    h = args["hidden"]
    shape = GPTShape(args["layers"], h, h // 64, max(1, h // 128), int(h * 8 / 3) // 64 * 64, 8192, args["seq"])
    g = torch.Generator().manual_seed(0)
    mb, n_micro, seq = 2, 4, args["seq"]

    def batch(n: int) -> list[dict]:
        return [
            {
                "input_ids": (ids := torch.randint(0, shape.vocab_size, (mb, seq), generator=g)),
                "labels": ids.roll(-1, 1),
                "position_ids": torch.arange(seq).expand(mb, seq).contiguous(),
            }
            for _ in range(n)
        ]

    tokens = args["steps"] * n_micro * mb * seq
    out = {}
    out["TP1 (1 rank)"] = (_case(shape, 1, batch(n_micro), args["steps"], active=rank == 0), tokens)
    out["TP2 (2 ranks)"] = (_case(shape, 2, batch(n_micro), args["steps"], active=True), tokens)
    out["DP2 (2 ranks)"] = (_case(shape, 1, batch(n_micro // 2), args["steps"], active=True), tokens)
    times = [None] * world
    dist.all_gather_object(times, out)
    return {k: (max(t[k][0] for t in times if t[k][0] == t[k][0]), out[k][1]) for k in out}


def main() -> None:
    from hybridrl.distributed.spawn import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = vars(parser.parse_args())
    result = run_ranks(_body, 2, args, timeout=1200)[0]
    base = result["TP1 (1 rank)"]
    base_tps = base[1] / base[0]
    print(f"model hidden={args['hidden']} layers={args['layers']} seq={args['seq']}, fp32, 1 thread per rank")
    print(f"{'case':16s} {'seconds':>9s} {'tokens/s':>10s} {'vs TP1':>7s}")
    for name, (secs, tokens) in result.items():
        print(f"{name:16s} {secs:9.2f} {tokens / secs:10.0f} {tokens / secs / base_tps:6.2f}x")


if __name__ == "__main__":
    main()

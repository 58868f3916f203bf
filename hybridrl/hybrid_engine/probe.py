"""The switch's self-check: after each push, sampled elements of the rollout weights are compared with the actor's.

A wrong reshard plan (q/k/v heads in the wrong rows, gate and up swapped, a vocab shard off by one) still writes
every element once, so nothing else notices it until generation quietly degrades. :class:`SwitchProbe` samples,
for every vLLM tensor of every rollout rank, one element per head-sized run of rows (one per ``head_dim`` columns
for the row-parallel ``o_proj`` / ``down_proj``), and after each push checks each rank's values against the
training shards' values at the same Hugging Face coordinates, cast to the rollout dtype: bit-exact, or a one-line
:class:`ProbeError` naming the parameter on every rank.

The index math here is a second spelling of both layouts, written from their definitions (vLLM's
``QKVParallelLinear`` / ``MergedColumnParallelLinear`` / ``VocabParallelEmbedding``, Megatron's per-group
``[q heads, k, v]`` rows and per-rank ``[gate_r; up_r]``), and shares no code with
:mod:`~hybridrl.hybrid_engine.vllm_layout` or :mod:`hybridrl.mcore.bridge_layout`, which the planner is built on:
a check must not inherit the bug it looks for. Llama-style names only (every family of ``vllm_layout.FAMILIES``).
Experts: each part ``{w13_weight|w2_weight}@e`` of vLLM's stacked tensors (``FusedMoE``: expert by expert
``[gate_j; up_j]`` rows and down's columns of rank j, or with expert parallelism whole experts
``j * E / tp + e``) is sampled like ``gate_up_proj`` / ``down_proj``, against Megatron's per-expert
``linear_fc1`` ``[gate_r; up_r]`` / ``linear_fc2`` on the expert-parallel rank holding that expert.

Cost per push: one gather of the sampled elements (about one per 128 rows), one ``all_reduce`` of the expected
values (float64, the samples of all rollout ranks; each is filled by exactly one rank) and one of the first
mismatch; no forward pass.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from hybridrl.hybrid_engine.planner import source_stage
from hybridrl.hybrid_engine.vllm_layout import vllm_padded_vocab

VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
SALT = 131  # column (or row) of each sample: a fixed pseudo-random walk, so samples do not line up


class ProbeError(RuntimeError):
    """The rollout weights differ from the actor's after a push (the message names the tensor and the fix)."""


def _hf_expert(name: str, j: int, row: torch.Tensor, col: torch.Tensor, shape, tp: int, ep: bool) -> tuple | None:
    """Like :func:`_hf` for a part of a stacked vLLM expert tensor; None for any other name."""
    m = re.match(r"(model\.layers\.\d+\.\w+\.)experts\.routed_experts\.(w13|w2)_weight@(\d+)$", name)
    if m is None:
        return None
    moe = shape.moe
    f, (gate, up, down) = moe.ffn_hidden_size, moe.hf_expert_names
    expert = j * (moe.num_experts // tp) + int(m.group(3)) if ep else int(m.group(3))
    per, first = (f, 0) if ep else (f // tp, j * (f // tp))
    prefix = f"{m.group(1)}experts.{expert}."
    if m.group(2) == "w13":
        return [f"{prefix}{gate if r < per else up}.weight" for r in row.tolist()], first + row % per, col
    return [f"{prefix}{down}.weight"] * len(row), row, first + col


def _hf(name: str, j: int, row: torch.Tensor, col: torch.Tensor, shape, tp: int, pad: bool, ep: bool = False) -> tuple:
    """vLLM rollout rank ``j``'s element (row, col) of ``name`` -> (HF name per element, HF row, HF col)."""
    hd, kv, f = shape.kv_channels, shape.num_query_groups, shape.ffn_hidden_size
    expert = _hf_expert(name, j, row, col, shape, tp, ep) if shape.moe is not None else None
    if expert is not None:
        return expert
    m = re.match(r"(model\.layers\.\d+\.)(self_attn|mlp)\.(qkv_proj|gate_up_proj|o_proj|down_proj)\.(\w+)$", name)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        first = j * (vllm_padded_vocab(shape.vocab_size) // tp) if pad else 0
        return [name] * len(row), row + first, col
    if m is None:
        return [name] * len(row), row, col
    p, kind, suffix = m.group(1), m.group(3), m.group(4)
    if kind == "qkv_proj":
        q_rows = shape.num_attention_heads // tp * hd
        kv_n, kv_first = (1, j // (tp // kv)) if tp >= kv else (kv // tp, j * (kv // tp))
        names, rows = [], []
        for r in row.tolist():
            if r < q_rows:
                names.append(f"{p}self_attn.q_proj.{suffix}")
                rows.append(j * q_rows + r)
            else:
                r -= q_rows
                which = "k" if r < kv_n * hd else "v"
                names.append(f"{p}self_attn.{which}_proj.{suffix}")
                rows.append(kv_first * hd + r % (kv_n * hd))
        return names, torch.tensor(rows, dtype=torch.int64), col
    if kind == "gate_up_proj":
        half = f // tp
        names = [f"{p}mlp.{'gate' if r < half else 'up'}_proj.weight" for r in row.tolist()]
        return names, j * half + row % half, col
    full = shape.num_attention_heads * hd if kind == "o_proj" else f
    return [name] * len(row), row, j * (full // tp) + col


def _megatron(hf: str, row: int, col: int, shape, tp: int, fused: bool) -> tuple[str, int, int, int, bool]:
    """HF element (row, col) of ``hf`` -> (Megatron name, TP rank, local row, local col, replicated)."""
    hd, kv, f = shape.kv_channels, shape.num_query_groups, shape.ffn_hidden_size
    qpg = shape.num_attention_heads // kv
    if hf in ("model.embed_tokens.weight", "lm_head.weight"):
        per = shape.padded_vocab // tp
        name = "embedding.word_embeddings.weight" if hf.startswith("model.embed") else "output_layer.weight"
        return name, row // per, row % per, col, False
    if hf == "model.norm.weight":
        return "decoder.final_layernorm.weight", 0, row, col, True
    layer, rest = re.match(r"model\.layers\.(\d+)\.(.+)$", hf).groups()
    m = f"decoder.layers.{layer}."
    if shape.moe is not None:
        expert = _megatron_expert(m, rest, row, col, shape, tp, fused)
        if expert is not None:
            return expert
        fused = fused and rest != "post_attention_layernorm.weight"  # the MoE block keeps its own pre-MLP norm
    norms = {
        "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight" if fused else "input_layernorm.weight",
        "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight" if fused else "pre_mlp_layernorm.weight",
        "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
        "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    }
    if rest in norms:
        return m + norms[rest], 0, row, col, True
    x, suffix = re.match(r"(?:self_attn|mlp)\.(\w)\w*_proj\.(\w+)$", rest).groups()
    if x in "qkv":
        group, within = (row // hd // qpg, row // hd % qpg) if x == "q" else (row // hd, qpg + (x == "v"))
        per = kv // tp  # query groups per TP rank
        full = group * (qpg + 2) * hd + within * hd + row % hd
        rank = group // per
        return f"{m}self_attention.linear_qkv.{suffix}", rank, full - rank * per * (qpg + 2) * hd, col, False
    if x in "gu":  # gate / up: rank r holds [gate_r; up_r]
        per = f // tp
        return f"{m}mlp.linear_fc1.weight", row // per, row % per + (per if x == "u" else 0), col, False
    full = shape.num_attention_heads * hd if x == "o" else f
    per = full // tp
    name = f"{m}self_attention.linear_proj.weight" if x == "o" else f"{m}mlp.linear_fc2.weight"
    return name, col // per, row, col % per, False


def _megatron_expert(m: str, rest: str, row: int, col: int, shape, tp: int, grouped: bool) -> tuple | None:
    """Like :func:`_megatron` for an HF router / expert element (``rest`` after the layer prefix); None else."""
    moe = shape.moe
    if rest == f"{moe.hf_prefix}.gate.weight":
        return f"{m}mlp.router.weight", 0, row, col, True
    x = re.match(rf"{moe.hf_prefix}\.experts\.(\d+)\.(\w+)\.weight$", rest)
    if x is None:
        return None
    e, which = int(x.group(1)), moe.hf_expert_names.index(x.group(2))
    per, fc = moe.ffn_hidden_size // tp, "linear_fc2" if which == 2 else "linear_fc1"
    name = f"{m}mlp.experts.{fc}.weight{e}" if grouped else f"{m}mlp.experts.local_experts.{e}.{fc}.weight"
    if which == 2:  # down: columns split over TP
        return name, col // per, row, col % per, False
    return name, row // per, row % per + (per if which == 1 else 0), col, False


def _samples(name: str, shape_t: tuple[int, ...], shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) sampled in a vLLM tensor: one per head-sized run of rows (of columns for o_proj / down_proj),
    plus the last row; vocab tensors at most ~64 rows."""
    hd = shape.kv_channels
    rows, cols = shape_t[0], (shape_t[1] if len(shape_t) > 1 else 1)
    if name.endswith(("o_proj.weight", "down_proj.weight")) or "w2_weight@" in name:
        c = torch.arange(0, cols, hd, dtype=torch.int64)
        return (c * SALT + 7) % rows, c
    stride = max(hd, rows // 64) if name in VOCAB else hd
    r = torch.unique(torch.cat([torch.arange(0, rows, stride, dtype=torch.int64), torch.tensor([rows - 1])]))
    return r, (r * SALT + 7) % cols


class SwitchProbe:
    """Sampled elements of every rollout rank's vLLM tensors and where the actor holds them (see the module).

    Args:
        plan: the switch's :class:`~hybridrl.hybrid_engine.planner.ReshardPlan` (its vLLM tensor names and shapes
            per rollout rank and its Megatron shard shapes; not its block plans).
        rank: this global rank.
        pad_vocab: the rollout tensors' vocab is vLLM-padded and split (the plan's setting).
        fused_norms: TransformerEngine's norm names.
        dtype: the rollout dtype (the actor's values are cast to it before comparing).
    """

    def __init__(self, plan, rank: int, pad_vocab: bool, fused_norms: bool, dtype: torch.dtype) -> None:
        self.dtype, self.where = dtype, []  # sample -> (rollout rank, vLLM name, row, col, Megatron name, tp, HF ...)
        self._plan, self._rank, self._pad, self._fused = plan, rank, pad_vocab, fused_norms
        fill: dict[str, tuple[list[int], list[int]]] = {}
        check: dict[str, tuple[list[int], list[int]]] = {}
        for j in range(plan.rollout_tp):
            for d in plan.dests[j]:
                self._sample(j, d, fill, check if j == plan.layout.rollout_coords(rank).tp else None)
        # one index_select per tensor, then ONE scatter / compare over all samples
        self.fill = [(n, torch.tensor(el, dtype=torch.int64)) for n, (_, el) in fill.items()]
        self.fill_idx = torch.tensor([i for idx, _ in fill.values() for i in idx], dtype=torch.int64)
        self.check = [(n, torch.tensor(el, dtype=torch.int64)) for n, (_, el) in check.items()]
        self.check_idx = torch.tensor([i for idx, _ in check.values() for i in idx], dtype=torch.int64)
        self.samples = len(self.where)

    def _sample(self, j: int, d, fill: dict, check: dict | None) -> None:
        plan, shape, layout = self._plan, self._plan.shape, self._plan.layout
        rows, cols = _samples(d.name, d.shape, shape)
        ep = getattr(plan, "expert_parallel", False)
        hf_names, hf_rows, hf_cols = _hf(d.name, j, rows, cols, shape, plan.rollout_tp, self._pad, ep)
        width = d.shape[1] if len(d.shape) > 1 else 1
        for r, c, hn, hr, hc in zip(rows.tolist(), cols.tolist(), hf_names, hf_rows.tolist(), hf_cols.tolist(),
                                    strict=True):  # fmt: skip
            if hr >= shape.vocab_size and d.name in VOCAB:
                continue  # vLLM's padding rows: no actor value
            mname, t, lr, lc, replicated = _megatron(hn, hr, hc, shape, layout.tp, self._fused)
            if hn == "lm_head.weight" and shape.tie_embeddings:
                mname = "embedding.word_embeddings.weight"
            stage = source_stage(mname, shape.num_layers, layout.pp, layout.vpp)
            src_shape, holder_ep = plan.sources[mname].shape, plan.sources[mname].ep_rank or 0
            i = len(self.where)
            self.where.append((j, d.name, r, c, mname, t, hn, hr, hc))
            at = dict(tp=0 if replicated else t, cp=holder_ep % layout.cp, dp=holder_ep // layout.cp, pp=stage)
            if layout.rank_of(**at) == self._rank:
                f = fill.setdefault(mname, ([], []))
                f[0].append(i)
                f[1].append(lr * (src_shape[1] if len(src_shape) > 1 else 1) + lc)
            if check is not None:
                ch = check.setdefault(d.name, ([], []))
                ch[0].append(i)
                ch[1].append(r * width + c)

    def run(self, tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Compare this rank's rollout ``tensors`` with the actor's ``params`` (collective over the world).

        Returns:
            ``{"probe_s", "probe_samples"}``.

        Raises:
            ProbeError: on every rank, naming the first mismatching tensor (the same message everywhere).
        """
        t0 = time.perf_counter()
        device = next(iter(params.values())).device
        expected = torch.zeros(self.samples, dtype=torch.float64, device=device)
        if self.fill:
            values = torch.cat([params[n].reshape(-1)[el.to(device)].to(self.dtype) for n, el in self.fill])
            expected[self.fill_idx.to(device)] = values.double()
        dist.all_reduce(expected)
        first, got = self.samples, None
        if self.check:
            held = torch.cat([tensors[n].reshape(-1)[el.to(device)] for n, el in self.check]).double()
            bad = (held != expected[self.check_idx.to(device)]).nonzero().flatten().cpu()
            if len(bad):
                k = int(bad[self.check_idx[bad].argmin()])
                first, got = int(self.check_idx[k]), float(held[k])
        flag = torch.tensor([first], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag) < self.samples:
            raise ProbeError(self._message(int(flag), float(expected[int(flag)]), got if first == int(flag) else None))
        return {"probe_s": time.perf_counter() - t0, "probe_samples": float(self.samples)}

    def _message(self, i: int, want: float, got: float | None) -> str:
        j, name, r, c, mname, t, hn, hr, hc = self.where[i]
        held = f"holds {got!r}" if got is not None else "differs"
        return (
            f"reshard probe: {name}[{r}, {c}] on rollout rank {j} {held} but the actor has {want!r} there "
            f"({hn}[{hr}, {hc}] = {mname} on tp rank {t}): the reshard plan put the wrong rows into this tensor; fix "
            f"its layout in hybridrl/hybrid_engine/vllm_layout.py or hybridrl/mcore/bridge_layout.py "
            f"(rollout.sync_probe=false skips this check)"
        )

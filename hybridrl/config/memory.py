"""A per-rank memory estimate of a run config, printed by ``hybridrl validate-config``.

Model size comes from ``model.architecture`` (and the checkpoint's ``config.json`` when ``model.path`` is a
local folder). The estimate counts, per rank, what the colocated roles keep resident:

- actor: weights (2 B/param in bf16, 4 in fp32) + gradients (4 B, fp32 grad buffer) + Adam (12 B: fp32
  master copy and two moments), the 12 B divided over DP when the distributed optimizer is on (GPU);
- reference: weights (0 when ``ref.param_offload``); critic: like the actor (its own model if set);
- rollout: vLLM's share of the device (``rollout.gpu_memory_utilization`` x device memory, GPU only).

Weights split over TP x PP (embedding and output layer over TP only). Activations are not counted; they
depend on micro-batch size, sequence length and recompute. Numbers are for planning, not a guarantee.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

GIB = 2**30

# Shapes of the public checkpoints the packaged configs name (from their published config.json files), so
# that a config can be sized on a login node without the weights. A local model.path always wins.
KNOWN_SHAPES = {
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32),
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8),
    "llama-3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8),
}  # fmt: skip


@dataclass
class Arch:
    vocab: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    def params(self) -> tuple[int, int]:
        """(transformer-layer params, embedding + output params)."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        per_layer = qkv + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.ffn + 2 * self.hidden
        embed = self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden
        return self.layers * per_layer, embed


def architecture(cfg: Any, path: str | None = None) -> Arch | None:
    """The model's shape from the config (and a local checkpoint's config.json); None when unknown.

    ``path`` defaults to ``model.path``; another path (a separate critic) ignores ``model.architecture``.
    """
    fields: dict[str, Any] = {}
    own = path is None or path == cfg.model.path
    path = cfg.model.path if path is None else path
    for key, shape in KNOWN_SHAPES.items():
        if path and key in path.lower():
            fields.update(shape)
    if path and os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            fields.update(json.load(f))
    if own:
        fields.update({k: v for k, v in vars(cfg.model.architecture).items() if v is not None})
    need = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if any(fields.get(k) is None for k in need):
        return None
    heads = fields["num_attention_heads"]
    return Arch(
        vocab=fields["vocab_size"],
        hidden=fields["hidden_size"],
        ffn=fields["intermediate_size"],
        layers=fields["num_hidden_layers"],
        heads=heads,
        kv_heads=fields.get("num_key_value_heads") or heads,
        head_dim=fields.get("head_dim") or fields["hidden_size"] // heads,
        tied=bool(fields.get("tie_word_embeddings", False)),
    )


def per_rank_params(arch: Arch, tp: int, pp: int) -> int:
    layers, embed = arch.params()
    return layers // (tp * pp) + embed // tp


def estimate(cfg: Any, device_gib: float = 141.0, on_gpu: bool = True) -> dict[str, float] | None:
    """GiB per rank of each resident part (see the module docstring); None when the model size is unknown."""
    arch = architecture(cfg)
    if arch is None:
        return None
    m = cfg.actor.megatron
    n = per_rank_params(arch, m.tp_size, m.pp_size)
    wbytes = 4 if cfg.model.dtype == "float32" else 2
    dist_opt = on_gpu and m.use_distributed_optimizer is not False
    optim = 12 / (m.dp_size or 1) if dist_opt else 12
    out = {
        "actor weights": n * wbytes / GIB,
        "actor grads": n * 4 / GIB,
        "actor optimizer": n * optim / GIB,
    }
    if cfg.ref.enable and not cfg.ref.param_offload:
        out["reference weights"] = n * wbytes / GIB
    if cfg.critic.enable:
        critic = architecture(cfg, cfg.critic.model_path) if cfg.critic.model_path else arch
        if critic is not None:
            nc = per_rank_params(critic, m.tp_size, m.pp_size)
            out["critic"] = nc * (wbytes + 4 + optim) / GIB
    if on_gpu:
        out["rollout (vLLM share)"] = cfg.rollout.gpu_memory_utilization * device_gib
    out["total"] = sum(out.values())
    return out


def report(cfg: Any, device_gib: float = 141.0) -> str:
    """Printable lines of :func:`estimate`."""
    arch = architecture(cfg)
    est = estimate(cfg, device_gib)
    if arch is None or est is None:
        return "memory: unknown (model.path is not a local folder and model.architecture is incomplete)"
    layers, embed = arch.params()
    lines = [f"memory per rank (GiB, GPU with {device_gib:.0f} GiB; model {(layers + embed) / 1e9:.2f}B params):"]
    lines += [f"  {name:22s} {gib:8.2f}" for name, gib in est.items()]
    if est["total"] > device_gib:
        lines.append(
            f"  warning: {est['total']:.0f} GiB > {device_gib:.0f} GiB; raise tp/pp, offload, or lower rollout share"
        )
    return "\n".join(lines)

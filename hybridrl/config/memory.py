"""A per-rank memory estimate of a run config, printed by ``hybridrl validate-config``.

Model size comes from ``model.architecture`` (and the checkpoint's ``config.json`` when ``model.path`` is a
local folder). Per rank, each trainable role (actor, critic) holds weights (2 B/param in bf16, 4 in fp32),
fp32 gradients (4 B) and Adam state (8 B of moments, + 4 B fp32 master copy of 16-bit weights), the Adam
state divided over DP only by Megatron's DistributedOptimizer (``optim.backend`` and
``megatron.use_distributed_optimizer``, whose "auto" / None mean on with CUDA, as the run decides).
Frozen roles (reference, reward model) hold weights. Weights split over TP x PP (embedding and output layer
over TP only).

The device is a GPU when ``--device-gib`` is given or the config uses CUDA graphs
(``rollout.enforce_eager`` false); otherwise a CPU run, whose numbers are host RAM. On a GPU two phases are
summed: while vLLM generates (it holds ``rollout.gpu_memory_utilization`` x device memory; parts whose
``param_offload`` / ``optimizer_offload`` flag is set wait in host RAM) and while the roles train (vLLM
asleep with ``rollout.free_cache_engine``; an offloaded reference / reward model stays on the host). On CPU,
vLLM holds its weights and ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache (hybridrl sets 1), and offloading moves
nothing. Activations are not counted; they depend on micro-batch size, sequence length and recompute.
Numbers are for planning, not a guarantee.
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
                       num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
    "qwen2-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
    "llama-3-70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192),
}  # fmt: skip
KNOWN_REPOS = {
    "meta-llama/llama-2-7b-hf": "llama-2-7b", "meta-llama/llama-2-7b-chat-hf": "llama-2-7b",
    "qwen/qwen2-7b": "qwen2-7b", "qwen/qwen2-7b-instruct": "qwen2-7b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b", "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b", "meta-llama/meta-llama-3-70b-instruct": "llama-3-70b",
}  # fmt: skip
"""Exact Hub names (lower case) of those checkpoints: a fine-tune or long-context variant under another name
may differ (its max_position_embeddings above all), so nothing is assumed for it."""


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


def model_fields(cfg: Any, path: str | None = None) -> dict[str, Any]:
    """The model's config.json fields as far as known before loading: a packaged config's public shape
    (:data:`KNOWN_SHAPES`), a local checkpoint's ``config.json``, then ``model.architecture`` overrides.

    ``path`` defaults to ``model.path``; another path (a separate critic) ignores ``model.architecture``.
    """
    fields: dict[str, Any] = {}
    own = path is None or path == cfg.model.path
    path = cfg.model.path if path is None else path
    family = KNOWN_REPOS.get(path.lower()) if path else None
    if family:
        fields.update(KNOWN_SHAPES[family])
    if path and os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            fields.update(json.load(f))
    if own:
        fields.update({k: v for k, v in vars(cfg.model.architecture).items() if v is not None})
    return fields


def architecture(cfg: Any, path: str | None = None) -> Arch | None:
    """The model's shape (:func:`model_fields`); None when unknown."""
    fields = model_fields(cfg, path)
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


def per_rank_params(arch: Arch, tp: int, pp: int, lm_head: bool = True) -> int:
    """Parameters one rank holds: layers over TP x PP, embedding (and output layer) over TP.

    ``lm_head=False``: a critic / reward model, whose output layer is a ``(1, hidden)`` score head.
    """
    layers, embed = arch.params()
    if not lm_head and not arch.tied:
        embed -= arch.vocab * arch.hidden - arch.hidden
    return layers // (tp * pp) + embed // tp


def optimizer_bytes(optim: Any, megatron: Any, dtype: str, on_gpu: bool, dp: int) -> tuple[float, str]:
    """Adam bytes per parameter on one rank, and why: 8 (two fp32 moments) + 4 (fp32 master copy) for 16-bit
    weights, divided over the ``dp`` ranks only on Megatron's DistributedOptimizer. ``backend="auto"`` and
    ``use_distributed_optimizer=None`` (of the role's ``megatron`` options) resolve as the run does
    (hybridrl.mcore.optimizer): on with CUDA."""
    per_param = 8 if dtype == "float32" else 12
    backend = optim.backend if optim.backend != "auto" else ("megatron" if on_gpu else "torch")
    dist = megatron.use_distributed_optimizer
    sharded = backend == "megatron" and (on_gpu if dist is None else dist)
    if sharded:
        return per_param / dp, f"{per_param} B/param / dp {dp}: distributed optimizer"
    why = f"{backend} backend" + (", no distributed optimizer" if backend == "megatron" else "")
    return per_param, f"{per_param} B/param, not sharded ({why})"


@dataclass
class Part:
    """One resident piece of a role on one rank."""

    gib: float
    note: str = ""
    """How it was sized (shown after the number)."""
    away: str = ""
    """GPU only: where it is while vLLM generates, when an offload flag moves it ("" = on the device)."""
    away_in_training: bool = False
    """Also off the device while the roles train (an offloaded frozen model is onloaded only for its forward)."""


@dataclass
class Estimate:
    """GiB per rank of a config's parts and of vLLM, on the assumed device."""

    device: str
    """What was assumed and why (one phrase)."""
    on_gpu: bool
    device_gib: float | None
    parts: dict[str, Part]
    rollout_gib: float | None
    """vLLM's memory; None on a GPU of unknown size (then ``rollout_share`` of it)."""
    rollout_share: float
    rollout_note: str
    vllm_sleeps: bool
    """GPU with rollout.free_cache_engine: vLLM frees its memory (level-2 sleep) while the roles train."""

    def roles(self, generating: bool) -> float:
        """GiB of the roles on the device while vLLM generates, or while they train (during the critic's update
        every trainable role is on the device). On CPU everything, always: offloading moves nothing."""
        if not self.on_gpu:
            return sum(p.gib for p in self.parts.values())
        gone = (lambda p: bool(p.away)) if generating else (lambda p: p.away_in_training)
        return sum(p.gib for p in self.parts.values() if not gone(p))

    def phases(self) -> tuple[float, float] | None:
        """(while generating, while training) with vLLM; None on a GPU of unknown size."""
        if self.rollout_gib is None:
            return None
        asleep = self.vllm_sleeps
        return self.roles(True) + self.rollout_gib, self.roles(False) + (0.0 if asleep else self.rollout_gib)

    def smallest_device(self) -> float:
        """GPU: the device GiB that holds both phases when vLLM takes ``rollout_share`` of it."""
        free = 1.0 - self.rollout_share
        generating = self.roles(True) / free if free > 0 else float("inf")
        return max(generating, self.roles(False) / (1.0 if self.vllm_sleeps else free))


def assumed_device(cfg: Any, device_gib: float | None) -> tuple[bool, str]:
    """GPU when ``device_gib`` is given or the config uses CUDA graphs; otherwise a CPU run (host RAM)."""
    if device_gib is not None:
        return True, f"GPU with {device_gib:g} GiB"
    if not cfg.rollout.enforce_eager:
        return True, "GPU of unknown size (CUDA graphs: rollout.enforce_eager false; --device-gib N sets it)"
    return False, "CPU run, host RAM (rollout.enforce_eager true; --device-gib N for a GPU)"


def estimate(cfg: Any, device_gib: float | None = None, layout: Any = None) -> Estimate | None:
    """Per-rank memory of a loaded config (see the module docstring); None when the model size is unknown.

    Args:
        cfg: a config from :func:`hybridrl.config.load_config` (derived fields filled).
        device_gib: memory of one GPU; None = unknown (CPU unless the config uses CUDA graphs).
        layout: the run's :class:`~hybridrl.distributed.ParallelLayout`; None =
            :func:`~hybridrl.config.layout.run_layout` of ``cfg``.
    """
    arch = architecture(cfg)
    if arch is None:
        return None
    if layout is None:
        from hybridrl.config.layout import run_layout

        layout = run_layout(cfg)
    on_gpu, device = assumed_device(cfg, device_gib)
    wbytes = 4 if cfg.model.dtype == "float32" else 2
    parts: dict[str, Part] = {}

    def trainable(role: str, section: Any, shape: Arch, lm_head: bool) -> None:
        n = per_rank_params(shape, layout.tp, layout.pp, lm_head)
        optim, why = optimizer_bytes(section.optim, section.megatron, cfg.model.dtype, on_gpu, layout.dp)
        when = "while vLLM generates" if role == "actor" else "outside its passes"
        weights, state = on_gpu and section.param_offload, on_gpu and section.optimizer_offload
        parts[f"{role} weights"] = Part(n * wbytes / GIB, away=f"host RAM {when}" * weights)
        parts[f"{role} grads"] = Part(n * 4 / GIB, "fp32", away=f"freed {when}" * state)
        parts[f"{role} optimizer"] = Part(n * optim / GIB, why, away=f"host RAM {when}" * state)

    def frozen(name: str, shape: Arch, lm_head: bool, offload: bool) -> None:
        n = per_rank_params(shape, layout.tp, layout.pp, lm_head)
        away = "host RAM outside its forwards" if on_gpu and offload else ""
        parts[name] = Part(n * wbytes / GIB, away=away, away_in_training=bool(away))

    trainable("actor", cfg.actor, arch, True)  # every role on the run's one layout
    if cfg.ref.enable:
        frozen("reference weights", arch, True, cfg.ref.param_offload)
    if cfg.critic.enable:
        critic = architecture(cfg, cfg.critic.model_path) if cfg.critic.model_path else arch
        if critic is not None:
            trainable("critic", cfg.critic, critic, False)
    rm = cfg.reward.model
    scorer = architecture(cfg, rm.path) if rm.enable and rm.path else None
    if scorer is not None:
        frozen("reward model", scorer, False, rm.param_offload)

    r = cfg.rollout
    if on_gpu:
        rollout = None if device_gib is None else r.gpu_memory_utilization * device_gib
        size = "the device" if device_gib is None else f"{device_gib:g} GiB"
        note = f"rollout.gpu_memory_utilization {r.gpu_memory_utilization:g} x {size}: weights + KV cache"
    else:
        kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))  # hybridrl's default when unset
        rollout = per_rank_params(arch, layout.rollout_tp, 1) * (4 if r.dtype == "float32" else 2) / GIB + kv
        note = f"its weights + VLLM_CPU_KVCACHE_SPACE {kv:g} GiB of KV cache"
    sleeps = on_gpu and r.free_cache_engine
    return Estimate(device, on_gpu, device_gib, parts, rollout, r.gpu_memory_utilization, note, sleeps)


def report(cfg: Any, device_gib: float | None = None, layout: Any = None) -> str:
    """Printable lines of :func:`estimate`."""
    arch = architecture(cfg)
    est = estimate(cfg, device_gib, layout)
    if arch is None or est is None:
        return "memory: unknown (model.path is not a local folder and model.architecture is incomplete)"
    layers, embed = arch.params()
    lines = [
        f"memory per rank in GiB, {est.device}; model {(layers + embed) / 1e9:.2f}B params, activations not counted:"
    ]
    for name, p in est.parts.items():
        lines.append(f"  {name:18s} {p.gib:8.2f}  {'; '.join(x for x in (p.note, p.away) if x)}".rstrip())
    rollout = "" if est.rollout_gib is None else f"{est.rollout_gib:.2f}"
    lines.append(f"  {'rollout (vLLM)':18s} {rollout:>8s}  {est.rollout_note}")
    phases = est.phases()
    if not est.on_gpu:
        lines.append(f"  {'total':18s} {phases[0]:8.2f}")
        return "\n".join(lines)
    asleep = "vLLM asleep" if est.vllm_sleeps else "vLLM awake (rollout.free_cache_engine false)"
    if phases is None:
        awake = "" if est.vllm_sleeps else f" + {est.rollout_share:g} x the device"
        lines.append(f"  {'while generating':18s} {est.roles(True):8.2f}  + {est.rollout_share:g} x the device")
        lines.append(f"  {'while training':18s} {est.roles(False):8.2f}{awake}  {asleep}")
        lines.append(f"  fits a GPU of {est.smallest_device():.0f} GiB or more")
        return "\n".join(lines)
    lines.append(f"  {'while generating':18s} {phases[0]:8.2f}")
    lines.append(f"  {'while training':18s} {phases[1]:8.2f}  {asleep}")
    if max(phases) > device_gib:
        lines.append(
            f"  warning: {max(phases):.0f} GiB > the GPU's {device_gib:g} GiB; raise tp/pp, offload (actor/critic "
            "param_offload / optimizer_offload, ref.param_offload) or lower rollout.gpu_memory_utilization"
        )
    return "\n".join(lines)

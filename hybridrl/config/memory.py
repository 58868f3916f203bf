"""A per-rank memory estimate of a run config, printed by ``hybridrl validate-config``.

Model size comes from ``model.architecture`` (and the checkpoint's ``config.json`` when ``model.path`` is a
local folder). Per rank, each trainable role (actor, critic) holds weights (2 B/param in bf16, 4 in fp32),
fp32 gradients (4 B) and Adam state (8 B of moments, + 4 B fp32 master copy of 16-bit weights), the Adam
state divided over DP only by Megatron's DistributedOptimizer (``optim.backend`` and
``megatron.use_distributed_optimizer``, whose "auto" / None mean on with CUDA, as the run decides).
Frozen roles (reference, reward model) hold weights. A LoRA actor (``actor.lora``) holds its frozen weights plus
the adapters, gradients and Adam state for the adapters only, and the reference is the actor itself
(:mod:`hybridrl.config.memory_lora`); its report adds the same run's full fine-tuning total. Weights split over
TP x PP (embedding and output layer over TP only).

The device is a GPU when ``--device-gib`` is given or the config uses CUDA graphs
(``rollout.enforce_eager`` false); otherwise a CPU run, whose numbers are host RAM. On a GPU two phases are
summed: while vLLM generates (it holds ``rollout.gpu_memory_utilization`` x device memory; parts whose
``param_offload`` / ``optimizer_offload`` flag is set wait in host RAM) and while the roles train (vLLM
asleep with ``rollout.free_cache_engine``; an offloaded reference / reward model stays on the host). On CPU,
vLLM holds its weights and the KV cache that :mod:`hybridrl.config.kv_cache` sizes
(``rollout.cpu_kv_cache_gib``), and offloading moves nothing. Activations are not counted; they depend on
micro-batch size, sequence length and recompute. Numbers are for planning, not a guarantee.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from hybridrl.config.kv_cache import config_size
from hybridrl.config.memory_lora import adapter_params

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
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, max_position_embeddings=40960, tie_word_embeddings=False),
}  # fmt: skip
KNOWN_REPOS = {
    "meta-llama/llama-2-7b-hf": "llama-2-7b", "meta-llama/llama-2-7b-chat-hf": "llama-2-7b",
    "qwen/qwen2-7b": "qwen2-7b", "qwen/qwen2-7b-instruct": "qwen2-7b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b", "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
    "meta-llama/meta-llama-3-70b": "llama-3-70b", "meta-llama/meta-llama-3-70b-instruct": "llama-3-70b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b", "qwen/qwen3-30b-a3b-base": "qwen3-30b-a3b",
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
    experts: int = 0
    """Routed experts per layer (MoE; 0 = dense): each layer's MLP is ``experts`` SwiGLU MLPs of width ``ffn``
    plus an ``(experts, hidden)`` router."""

    def params(self) -> tuple[int, int]:
        """(transformer-layer params without the experts, embedding + output params)."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        mlp = self.experts * self.hidden if self.experts else 3 * self.hidden * self.ffn  # router, or dense MLP
        per_layer = qkv + self.heads * self.head_dim * self.hidden + mlp + 2 * self.hidden
        embed = self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden
        return self.layers * per_layer, embed

    def expert_params(self) -> int:
        """Parameters of all experts of all layers (split over EP x TP x PP)."""
        return self.layers * self.experts * 3 * self.hidden * self.ffn


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
    moe = {"ffn": fields["intermediate_size"], **_moe(fields)}
    return Arch(
        vocab=fields["vocab_size"],
        hidden=fields["hidden_size"],
        layers=fields["num_hidden_layers"],
        heads=heads,
        kv_heads=fields.get("num_key_value_heads") or heads,
        head_dim=fields.get("head_dim") or fields["hidden_size"] // heads,
        tied=bool(fields.get("tie_word_embeddings", False)),
        **moe,
    )


def _moe(fields: dict[str, Any]) -> dict[str, int]:
    """Arch overrides of an MoE config: the expert count and width (Mixtral's ``intermediate_size`` is it)."""
    experts = fields.get("num_experts") or fields.get("num_local_experts") or 0
    if not experts or fields.get("model_type") not in ("qwen3_moe", "mixtral"):
        return {}
    return {"experts": int(experts), "ffn": int(fields.get("moe_intermediate_size") or fields["intermediate_size"])}


def per_rank_params(arch: Arch, tp: int, pp: int, lm_head: bool = True, ep: int = 1) -> int:
    """Parameters one rank holds: layers over TP x PP, experts over EP x TP x PP, embedding (and output layer)
    over TP.

    ``lm_head=False``: a critic / reward model, whose output layer is a ``(1, hidden)`` score head.
    """
    layers, embed = arch.params()
    if not lm_head and not arch.tied:
        embed -= arch.vocab * arch.hidden - arch.hidden
    return layers // (tp * pp) + arch.expert_params() // (ep * tp * pp) + embed // tp


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

    lora = cfg.actor.lora if cfg.actor.lora.enable else None

    def trainable(role: str, section: Any, shape: Arch, lm_head: bool) -> None:
        if getattr(section, "backend", "megatron") == "fsdp":  # docs/fsdp.md: fp32 shards of all of it per rank
            n, share = -(-per_rank_params(shape, 1, 1, lm_head) // layout.world_size), f"/ {layout.world_size} ranks"
            parts[f"{role} weights"] = Part(n * 4 / GIB, f"fp32 master, FSDP {share}")
            parts[f"{role} grads"] = Part(n * 4 / GIB, f"fp32, FSDP {share}")
            parts[f"{role} optimizer"] = Part(n * 8 / GIB, f"8 B/param, FSDP {share}")
            return
        n = per_rank_params(shape, layout.tp, layout.pp, lm_head, layout.ep)
        optim, why = optimizer_bytes(section.optim, section.megatron, cfg.model.dtype, on_gpu, layout.dp)
        experts = shape.expert_params() // (layout.ep * layout.tp * layout.pp)
        if experts:  # expert states shard over the expert-data-parallel ranks (dp / ep), the rest over dp
            edp = layout.dp // layout.ep
            edp_optim, _ = optimizer_bytes(section.optim, section.megatron, cfg.model.dtype, on_gpu, edp)
            optim = ((n - experts) * optim + experts * edp_optim) / n
            why += f" (experts: {edp_optim:g} B/param, {edp} expert-DP ranks)"
        when = "while vLLM generates" if role == "actor" else "outside its passes"
        weights, state = on_gpu and section.param_offload, on_gpu and section.optimizer_offload
        trained, adapters, note = n, 0, ""
        if role == "actor" and lora is not None:  # frozen weights + adapters; grads and Adam state for adapters only
            trained = adapters = adapter_params(shape, lora, layout.tp, layout.pp)
            note = f"+ LoRA r={lora.rank}: {adapters / 1e6:.2f}M trained params"
        parts[f"{role} weights"] = Part((n + adapters) * wbytes / GIB, note, away=f"host RAM {when}" * weights)
        parts[f"{role} grads"] = Part(trained * 4 / GIB, "fp32", away=f"freed {when}" * state)
        parts[f"{role} optimizer"] = Part(trained * optim / GIB, why, away=f"host RAM {when}" * state)

    def frozen(name: str, shape: Arch, lm_head: bool, offload: bool, backend: str = "megatron") -> None:
        n = per_rank_params(shape, layout.tp, layout.pp, lm_head, layout.ep)
        if backend == "fsdp":
            n = -(-per_rank_params(shape, 1, 1, lm_head) // layout.world_size)
        away = "host RAM outside its forwards" if on_gpu and offload else ""
        parts[name] = Part(n * wbytes / GIB, away=away, away_in_training=bool(away))

    trainable("actor", cfg.actor, arch, True)  # every role on the run's one layout
    if cfg.ref.enable and lora is not None:
        parts["reference weights"] = Part(0.0, "the actor with its LoRA adapters off (no copy)")
    elif cfg.ref.enable:
        frozen("reference weights", arch, True, cfg.ref.param_offload, cfg.ref.backend)
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
        kv = config_size(cfg, model_fields(cfg))  # the size the engine will take (rollout.cpu_kv_cache_gib)
        rollout = per_rank_params(arch, layout.rollout_tp, 1) * (4 if r.dtype == "float32" else 2) / GIB + kv.gib
        note = f"its weights + {kv.describe()}"
    sleeps = on_gpu and r.free_cache_engine
    return Estimate(device, on_gpu, device_gib, parts, rollout, r.gpu_memory_utilization, note, sleeps)


def _full_fine_tuning(cfg: Any, device_gib: float | None, layout: Any) -> Estimate | None:
    """The estimate of the same run without LoRA (the comparison a LoRA config's report prints); None otherwise."""
    if not cfg.actor.lora.enable:
        return None
    import copy

    full = copy.deepcopy(cfg)
    full.actor.lora.enable = False
    return estimate(full, device_gib, layout)


def report(cfg: Any, device_gib: float | None = None, layout: Any = None) -> str:
    """Printable lines of :func:`estimate`."""
    arch = architecture(cfg)
    est = estimate(cfg, device_gib, layout)
    if arch is None or est is None:
        return "memory: unknown (model.path is not a local folder and model.architecture is incomplete)"
    layers, embed = arch.params()
    total = (layers + embed + arch.expert_params()) / 1e9
    experts = f" ({arch.expert_params() / 1e9:.2f}B in {arch.experts} experts per layer)" if arch.experts else ""
    lines = [f"memory per rank in GiB, {est.device}; model {total:.2f}B params{experts}, activations not counted:"]
    for name, p in est.parts.items():
        lines.append(f"  {name:18s} {p.gib:8.2f}  {'; '.join(x for x in (p.note, p.away) if x)}".rstrip())
    rollout = "" if est.rollout_gib is None else f"{est.rollout_gib:.2f}"
    lines.append(f"  {'rollout (vLLM)':18s} {rollout:>8s}  {est.rollout_note}")
    phases = est.phases()
    full = _full_fine_tuning(cfg, device_gib, layout)
    if not est.on_gpu:
        lines.append(f"  {'total':18s} {phases[0]:8.2f}")
        if full is not None:
            same = "the same run with actor.lora.enable=false"
            lines.append(f"  {'full fine-tuning':18s} {full.phases()[0]:8.2f}  {same}")
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
    if full is not None:
        lines.append(f"  {'full fine-tuning':18s} {max(full.phases()):8.2f}  peak of the same run with "
                     "actor.lora.enable=false")  # fmt: skip
    if max(phases) > device_gib:
        lines.append(
            f"  warning: {max(phases):.0f} GiB > the GPU's {device_gib:g} GiB; raise tp/pp, offload (actor/critic "
            "param_offload / optimizer_offload, ref.param_offload) or lower rollout.gpu_memory_utilization"
        )
    return "\n".join(lines)

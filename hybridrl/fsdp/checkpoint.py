"""Checkpoints of an FSDP role: model + optimizer through ``torch.distributed.checkpoint``, read safely.

Owns the FSDP half of a role's checkpoint folder (``hybridrl.trainer.checkpoint`` owns the folder itself):

    <role>/state/        torch.distributed.checkpoint of {"model": ..., "optim": ...} (each rank writes its shards)
    <role>/lr.json       updates applied (the LR schedule is a pure function of it) and the backend's name
    <role>/config.json   the role's HF config

The state dicts are FSDP's sharded ones (``get_state_dict``): tensors keyed by parameter name with their global
shapes, so a checkpoint saved on N ranks loads on M, model and Adam moments alike (DCP reshards on load), and on
the same ranks it resumes bit-exactly.

:func:`export_role` writes a saved critic as an HF ``*ForSequenceClassification`` folder (``num_labels=1``), the
format the Megatron critic reads and writes (``score.weight`` = the value head), on one process.

Nothing is unpickled (:mod:`hybridrl.mcore.checkpoint_safety`): DCP reads the folder through
:class:`hybridrl.mcore.safe_dcp.SafeFileSystemReader` (``.metadata`` built from an allow-list of torch's metadata
classes, every item of the shards read as tensors or plain data), after every rank passed it through
:func:`~hybridrl.mcore.safe_dcp.check_torch_dcp` (:func:`check_role`); the export reads it the same way, in memory.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hybridrl.mcore.checkpoint_safety import CorruptCheckpointError
from hybridrl.mcore.safe_dcp import SafeFileSystemReader, check_torch_dcp, load_full_state, readers_errors

BACKEND = "fsdp"


def _state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer.optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_role(model: torch.nn.Module, optimizer: Any, path: str, hf_config: Any = None) -> None:
    """Write the model's shards (+ the optimizer's and its update count) under the new folder ``path``. Collective."""
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dcp.save(_state(model, optimizer), checkpoint_id=os.path.join(path, "state"))
    if dist.get_rank() == 0:
        if hf_config is not None:
            hf_config.to_json_file(os.path.join(path, "config.json"))
        with open(os.path.join(path, "lr.json"), "w", encoding="utf-8") as f:
            json.dump({"backend": BACKEND, "num_steps": optimizer.num_steps if optimizer else 0}, f)
    dist.barrier()


def check_role(path: str) -> None:
    """Pass every file of the role folder ``path`` that :func:`load_role` reads through readers that cannot run
    code; nothing is loaded.

    Raises:
        CorruptCheckpointError: the folder was written by another backend, or a file cannot be parsed.
        UnsafeCheckpointError: a file holds more than tensors and plain data.
    """
    if os.path.isdir(os.path.join(path, "model")) and not os.path.isdir(os.path.join(path, "state")):
        raise CorruptCheckpointError(f"{path} holds a Megatron role (model/), not an FSDP one (state/): resume it "
                                     "with this role's backend set to megatron, as it was saved")  # fmt: skip
    _read_lr(path)
    check_torch_dcp(os.path.join(path, "state"))


def _read_lr(path: str) -> dict[str, Any]:
    file = os.path.join(path, "lr.json")
    try:
        with open(file, encoding="utf-8") as f:
            doc = json.load(f)
        return {"backend": str(doc["backend"]), "num_steps": int(doc["num_steps"])}
    except (OSError, ValueError, KeyError, TypeError) as err:
        what = f"{type(err).__name__}: {err}"
        raise CorruptCheckpointError(f"{file} cannot be read ({what}); the file is corrupt") from None


def load_role(model: torch.nn.Module, optimizer: Any, path: str) -> None:
    """Fill the model (+ optimizer and its update count) from ``path``, on any number of ranks. Collective."""
    check_role(path)
    state = _state(model, optimizer)
    reader = SafeFileSystemReader(os.path.join(path, "state"))
    with readers_errors(reader):
        dcp.load(state, storage_reader=reader)
    if optimizer is None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(model, state["model"])
        return
    set_state_dict(model, optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    optimizer.num_steps = _read_lr(path)["num_steps"]


def export_role(role_dir: str, out_dir: str) -> None:
    """Write the FSDP critic saved in ``role_dir`` as an HF ``*ForSequenceClassification`` folder ``out_dir``
    (config.json + model.safetensors; the backbone under the class's base-model prefix, the head as
    ``score.weight``). One process, no process group: DCP's shards are read whole (checked first)."""
    import transformers
    from safetensors.torch import save_file
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as NAMES

    check_role(role_dir)
    model = load_full_state(os.path.join(role_dir, "state"))["model"]
    if "head.weight" not in model or model["head.weight"].shape[0] != 1:
        raise CorruptCheckpointError(f"{role_dir} holds no value head (head.weight of shape [1, h]): not a critic")
    config = transformers.AutoConfig.from_pretrained(role_dir)
    cls = NAMES.get(config.model_type)
    if cls is None:
        raise ValueError(f"transformers has no sequence-classification class for model_type {config.model_type!r}; "
                         f"{role_dir} cannot be exported as an HF critic")  # fmt: skip
    prefix = getattr(transformers, cls).base_model_prefix
    tensors = {f"{prefix}.{k.removeprefix('backbone.')}": v for k, v in model.items() if k.startswith("backbone.")}
    tensors["score.weight"] = model["head.weight"]
    config.architectures, config.num_labels = [cls], 1
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    config.save_pretrained(out_dir)

"""Megatron's ``dist_checkpointing.load`` without an unpickler: the load strategies hybridrl passes it.

``dist_checkpointing.load(sharded_state_dict, folder, sharded_strategy, common_strategy)`` reads a ``torch_dist``
folder through two strategies, both of which unpickle by default: the common one ``torch.load``\\ s ``common.pt``
(every rank), the sharded one hands the folder to torch's ``FileSystemReader`` (``pickle.load`` of ``.metadata``,
``torch.load`` of every item). :func:`load` passes instead

- :class:`SafeCommonLoadStrategy`: ``common.pt`` (and any per-object ``.pt`` file of the ``torch`` common backend)
  through :func:`hybridrl.mcore.torch_file.load_torch_file`;
- :class:`SafeTorchDistLoadStrategy`: Megatron's own conversion of the sharded state dict to torch's sharded
  tensors and its :class:`~megatron.core.dist_checkpointing.strategies.torch.MCoreLoadPlanner` (global-shape
  checks), read through :class:`hybridrl.mcore.safe_dcp.SafeFileSystemReader`. Megatron's
  ``TorchDistLoadShardedStrategy.load`` builds its reader inside the method, so the subclass states the same
  steps (Megatron's key mapping and conversion helpers, its planner, then torch's ``dcp.load``) with the reader
  swapped; ``tests/mcore/test_torch_file_crafted.py`` pins the source of the Megatron methods this mirrors, so
  an upgrade that changes them fails until this module is checked against them again. The metadata queries
  (``load_tensors_metadata``, ``load_sharded_metadata``) read ``.metadata`` through the safe reader too.

Nothing is patched: the strategies are arguments. The folder's ``metadata.json`` (JSON) must name the
``torch_dist`` / ``torch`` backends (:func:`hybridrl.mcore.safe_dcp.check_dist_checkpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies import torch as mtorch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from hybridrl.mcore.safe_dcp import SafeFileSystemReader, read_dcp_metadata, readers_errors
from hybridrl.mcore.torch_file import load_torch_file


class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
    """Megatron's ``torch`` common strategy, its ``.pt`` files read by :func:`load_torch_file` (never unpickled)."""

    def load_common(self, checkpoint_dir: str | Path) -> Any:
        return load_torch_file(os.path.join(checkpoint_dir, COMMON_STATE_FNAME))

    def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        def load_one(obj: ShardedObject) -> Any:
            return load_torch_file(os.path.join(checkpoint_dir, f"{obj.unique_key}.pt"))

        return dict_list_map_inplace(load_one, sharded_objects_state_dict)


class SafeTorchDistLoadStrategy(mtorch.TorchDistLoadShardedStrategy):
    """Megatron's ``torch_dist`` load strategy reading through :class:`SafeFileSystemReader` (see module docs)."""

    def load(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> Any:
        planner = _planner(sharded_state_dict)
        flat, keys, renames = mtorch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        torch_state = mtorch.mcore_to_pyt_state_dict(flat, True)
        reader = SafeFileSystemReader(checkpoint_dir)
        with readers_errors(reader):
            dcp.load(torch_state, storage_reader=reader, planner=planner)
        self.cached_global_metadata = planner.metadata  # what the planner read through the safe reader
        return _to_mcore(torch_state, keys, renames, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: Path, metadata: Any = None) -> Any:
        if metadata is None:
            metadata = read_dcp_metadata(os.path.join(checkpoint_dir, ".metadata"))
        return super().load_tensors_metadata(checkpoint_dir, metadata)

    def load_sharded_metadata(self, checkpoint_dir: Path) -> Any:
        metadata = read_dcp_metadata(os.path.join(checkpoint_dir, ".metadata"))
        objects = {}
        for key, kind in metadata.state_dict_metadata.items():
            if isinstance(kind, BytesStorageMetadata):
                obj = ShardedObject.empty_from_unique_key(key)
                objects[obj.unique_key] = obj
        return {**objects, **self.load_tensors_metadata(checkpoint_dir, metadata)}


def _planner(sharded_state_dict: Any) -> mtorch.MCoreLoadPlanner:
    """Megatron's load planner, told which tensors' global shapes must equal the checkpoint's: all but those
    marked ``allow_shape_mismatch`` (handed over by key)."""
    strict, loose = [], {}
    for value in nested_values(sharded_state_dict):
        if isinstance(value, ShardedTensor) and value.allow_shape_mismatch:
            loose[value.key] = value
        elif isinstance(value, ShardedTensor):
            strict.append(value)
    return mtorch.MCoreLoadPlanner(shapes_validation_sharded_tensors=strict, allow_shape_mismatch_sharded_tensors=loose)


def _to_mcore(torch_state: dict, keys: Any, renames: Any, template: Any) -> Any:
    """The loaded torch sharded tensors as local tensors under the caller's keys, in its dict types."""
    local = {key: mtorch._unwrap_pyt_sharded_tensor(value) for key, value in torch_state.items()}
    loaded = mtorch._replace_sharded_keys_with_state_dict_keys(local, keys, renames)
    mtorch._restore_dict_types(loaded, template)
    return loaded


def load(sharded_state_dict: dict[str, Any], checkpoint_dir: str) -> dict[str, Any]:
    """``dist_checkpointing.load`` of a ``torch_dist`` folder through the strategies above. Collective."""
    return dist_checkpointing.load(
        sharded_state_dict,
        checkpoint_dir,
        sharded_strategy=SafeTorchDistLoadStrategy(),
        common_strategy=SafeCommonLoadStrategy(),
    )

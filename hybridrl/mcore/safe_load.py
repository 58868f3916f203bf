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
  steps with the reader swapped; the metadata queries (``load_tensors_metadata``, ``load_sharded_metadata``)
  read ``.metadata`` through the safe reader too.

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
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        # the same split Megatron makes: tensors whose global shape must match, and those allowed to differ
        checked = [t for t in tensors if not t.allow_shape_mismatch]
        loose = {t.key: t for t in tensors if t.allow_shape_mismatch}
        template = sharded_state_dict
        flat, flat_mapping, rename_mapping = mtorch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state_dict = mtorch.mcore_to_pyt_state_dict(flat, True)
        reader = SafeFileSystemReader(checkpoint_dir)
        planner = mtorch.MCoreLoadPlanner(
            shapes_validation_sharded_tensors=checked, allow_shape_mismatch_sharded_tensors=loose
        )
        with readers_errors(reader):
            dcp.load(pyt_state_dict, storage_reader=reader, planner=planner)
        self.cached_global_metadata = planner.metadata
        loaded = {k: mtorch._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        loaded = mtorch._replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        mtorch._restore_dict_types(loaded, template)
        return loaded

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


def load(sharded_state_dict: dict[str, Any], checkpoint_dir: str) -> dict[str, Any]:
    """``dist_checkpointing.load`` of a ``torch_dist`` folder through the strategies above. Collective."""
    return dist_checkpointing.load(
        sharded_state_dict,
        checkpoint_dir,
        sharded_strategy=SafeTorchDistLoadStrategy(),
        common_strategy=SafeCommonLoadStrategy(),
    )

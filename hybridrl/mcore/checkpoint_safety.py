"""Reading checkpoints without running code from them: the guarantee, and the errors of the readers that give it.

A pickle can call any importable function while it loads, and torch's weights-only unpickler is still an
unpickler (a restricted one, whose allow-list is torch's to change). So nothing hybridrl reads from a checkpoint
folder goes through an unpickler at all:

- ``torch.save`` files (the CPU optimizer state ``optim_rank{r}.pt``, Megatron's ``common.pt``, the ``trainer.pt``
  and ``rng_rank{r}.pt`` of earlier versions) are read by :mod:`hybridrl.mcore.torch_file`: the zip archive's
  directory, its pickle interpreted as plain records (:mod:`hybridrl.mcore.pickle_records`), and from those only
  tensors (their storages read straight from the file), containers, numbers and strings;
- ``torch.distributed.checkpoint`` folders (FSDP's ``state/``, Megatron's ``torch_dist`` ``model/`` and ``optim/``)
  are read by :class:`hybridrl.mcore.safe_dcp.SafeFileSystemReader`: ``.metadata`` built as torch's own metadata
  dataclasses from an explicit allow-list, every item of the ``.distcp`` shards (tensors and the non-tensor
  ``ShardedObject`` bytes alike) through :mod:`~hybridrl.mcore.torch_file`;
- Megatron's ``dist_checkpointing.load`` is given that reader and a ``common.pt`` reader through its strategy
  arguments (:mod:`hybridrl.mcore.safe_load`); its ``metadata.json`` is JSON;
- trainer state is JSON, RNG states are safetensors + JSON, the model's HF folder safetensors + JSON;
- what the model state hands to modules' ``set_extra_state`` (TransformerEngine unpickles a non-empty value) must
  be empty: :func:`refuse_extra_state`.

Before any rank loads, every rank checks what it will read with the same readers (tensors on the meta device:
nothing of their bytes is read), so all ranks refuse a planted file together: the ``check_*`` functions of
:mod:`hybridrl.mcore.safe_dcp` and :mod:`hybridrl.mcore.torch_file`.

Not covered: a process that can write the checkpoint folder while the job runs can still change what a rank
reads between its check and its load; it reads those files through the same readers, so at worst it loads
wrong numbers, never code.
"""

from __future__ import annotations

import io
from typing import Any

from hybridrl.errors import InputError


class UnsafeCheckpointError(InputError, ValueError):
    """A checkpoint file holds something a safe reader refuses to build (one line naming the file)."""


class CorruptCheckpointError(InputError, ValueError):
    """A checkpoint file cannot be parsed (truncated, overwritten); one line naming the file."""


def refusal(path: str, what: str) -> UnsafeCheckpointError:
    """The one-line refusal of ``path``, which holds ``what`` (``"the global os.system"``)."""
    return UnsafeCheckpointError(
        f"{path} holds {what}, which loading could run as code; refusing to load it. If you did not put it "
        "there, the checkpoint folder was tampered with: resume from another checkpoint"
    )


def corrupt(path: str, err: BaseException) -> CorruptCheckpointError:
    """The one-line error of a file ``path`` that cannot be parsed (``err``: why)."""
    detail = str(err).splitlines()[0] if str(err) else ""
    return CorruptCheckpointError(f"{path} cannot be read ({type(err).__name__}: {detail}); the file is corrupt")


def refuse_extra_state(state: dict[str, Any], folder: str) -> None:
    """Refuse a model state whose ``*._extra_state`` holds anything but what TransformerEngine saves with FP8 off.

    ``Module.load_state_dict`` hands each ``_extra_state`` value to the module's ``set_extra_state``, and
    TransformerEngine's unpickles a non-empty one (``pickle.loads`` of a ``uint8`` tensor's bytes, ``torch.load``
    of a ``BytesIO`` in older versions). hybridrl trains without FP8, whose layers save ``None`` or an empty tensor
    there, so anything else is refused before ``load_state_dict`` sees it.

    Args:
        state: a (nested) state dict as read from ``folder``.  folder: the checkpoint folder, for the message.

    Raises:
        UnsafeCheckpointError: one line naming the key and ``folder``.
    """
    for key, value in state.items():
        if isinstance(value, dict):
            refuse_extra_state(value, folder)
        elif str(key).endswith("_extra_state") and not _empty_extra_state(value):
            raise UnsafeCheckpointError(
                f"{folder} holds a non-empty {key} ({type(value).__name__}), which TransformerEngine would unpickle "
                "on load; hybridrl does not use FP8 extra state, so it refuses to load it: resume from another "
                "checkpoint"
            )


def _empty_extra_state(value: Any) -> bool:
    import torch

    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 0
    return isinstance(value, io.BytesIO) and not value.getbuffer().nbytes

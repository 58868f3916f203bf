"""Reading and validating Hugging Face safetensors checkpoints, without allocating any model.

Owns :class:`HFCheckpoint` (one ``model.safetensors`` or the shards listed in
``model.safetensors.index.json``: which file holds each tensor, shapes from the headers only, and reads of
just the rows a rank needs via ``safe_open(...).get_slice(name)[rows]``) and :func:`validate`, which checks
names and shapes against the config (and TP divisibility) before any rank builds a model. Every failure is
a :class:`CheckpointError` whose one line names the tensor or file and the fix.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from typing import Any

import torch
from safetensors import safe_open

from hybridrl.errors import InputError
from hybridrl.mcore import bridge_layout as layout
from hybridrl.mcore.gpt import GPTShape
from hybridrl.mcore.hf_config import check_tp

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Present in some HF checkpoints, never needed: RoPE buffers of old Llama saves.
_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")


class CheckpointError(InputError, ValueError):
    """A checkpoint that does not match the config or cannot be read; the message names the tensor and fix."""


class HFCheckpoint:
    """A local HF safetensors checkpoint: which file holds each tensor, header shapes, sliced reads.

    Opening reads only the index and the safetensors headers; tensors are read piece by piece.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"checkpoint folder {self.path!r} does not exist; pass a save_pretrained folder")
        self.files: dict[str, str] = {}  # tensor name -> file path
        self._handles: dict[str, Any] = {}
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise CheckpointError(f"cannot read {index} ({err}); re-save the checkpoint") from err
            self.files = {name: os.path.join(self.path, file) for name, file in weight_map.items()}
        else:
            single = os.path.join(self.path, SINGLE)
            files = (
                [single]
                if os.path.isfile(single)
                else sorted(os.path.join(self.path, f) for f in os.listdir(self.path) if f.endswith(".safetensors"))
            )
            if not files:
                found = ", ".join(sorted(os.listdir(self.path))) or "nothing"
                raise CheckpointError(
                    f"no safetensors weights in {self.path} (found: {found}); "
                    f"re-save with save_pretrained(..., safe_serialization=True)"
                )
            for file in files:
                names = self._open(file).keys()
                self.files.update((name, file) for name in names)

    def _open(self, file: str) -> Any:
        if file in self._handles:
            return self._handles[file]
        if not os.path.isfile(file):
            raise CheckpointError(f"{file} is listed in {INDEX} but missing; copy the shard or re-save the checkpoint")
        try:
            handle = safe_open(file, framework="pt")
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read {file} ({err}); the file is corrupt or not safetensors") from err
        self._handles[file] = handle
        return handle

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's shape, from the headers only."""
        out = {}
        for name, file in self.files.items():
            handle = self._open(file)
            names = handle.keys()
            if name not in names:
                raise CheckpointError(f"{INDEX} maps {name} to {os.path.basename(file)}, which lacks it; re-save")
            out[name] = tuple(handle.get_slice(name).get_shape())
        return out

    def read(self, pieces: Iterable[layout.Piece], dim: int, hf_shape: tuple[int, ...]) -> torch.Tensor:
        """Concatenate ``pieces`` along ``dim`` (zeros for padding pieces), reading only those rows."""
        parts: list[torch.Tensor | int] = []
        for p in pieces:
            if p.hf is None:
                parts.append(p.size)  # zero rows, made below in the checkpoint's dtype
                continue
            sl = self._open(self.files[p.hf]).get_slice(p.hf)
            parts.append(sl[p.start : p.stop] if dim == 0 else sl[:, p.start : p.stop])
        dtype = next((t.dtype for t in parts if isinstance(t, torch.Tensor)), torch.float32)
        pad = list(hf_shape)
        for i, part in enumerate(parts):
            if isinstance(part, int):
                pad[dim] = part
                parts[i] = torch.zeros(pad, dtype=dtype)
        return torch.cat(parts, dim=dim)


def validate(
    ckpt: HFCheckpoint, shape: GPTShape, tp: int, head: str = "lm", optional: Iterable[str] = ()
) -> dict[str, tuple[int, ...]]:
    """Check a checkpoint against ``shape`` before any model is built.

    Args:
        ckpt: the checkpoint.
        shape: the architecture from its ``config.json`` (``hf_config.shape_from_hf``).
        tp: the tensor-parallel size it will be split over.
        head: ``"lm"`` or ``"score"`` (see ``bridge_layout.tensor_maps``).
        optional: HF names that may be absent (e.g. ``score.weight`` of a critic built from a causal LM).

    Returns:
        The expected HF shapes (name -> shape) that are present.

    Raises:
        CheckpointError / HFConfigError: missing, unexpected or mis-shaped tensors, or a ``tp`` that does not
        divide the heads.
    """
    check_tp(shape, tp)
    expected = layout.hf_shapes(shape, head)
    found = ckpt.shapes()
    optional = set(optional)
    # lm_head of a tied model, or of a causal LM loaded under a score head, is not used.
    unused = {"lm_head.weight"} if head != "lm" or shape.tie_embeddings else set()
    for name in expected:
        if name not in found and name not in optional:
            raise CheckpointError(f"tensor {name} is missing from {ckpt.path}; {_missing_fix(name, shape)}")
    for name, got in found.items():
        if name in expected:
            if got != expected[name]:
                fix = (
                    "a score head needs num_labels=1"
                    if name == "score.weight"
                    else "use the config.json saved with these weights"
                )
                raise CheckpointError(
                    f"tensor {name} has shape {list(got)} but config.json implies {list(expected[name])}; {fix}"
                )
        elif name not in unused and not _IGNORED.search(name):
            raise CheckpointError(
                f"unexpected tensor {name} in {ckpt.path} (shape {list(got)}); the config.json "
                f"(num_hidden_layers={shape.num_layers}, head={head}) does not describe these weights"
            )
    return {name: s for name, s in expected.items() if name in found}


def _missing_fix(name: str, shape: GPTShape) -> str:
    if name == "score.weight":
        return (
            "a reward model needs a *ForSequenceClassification checkpoint with num_labels=1 (a critic may start at 0)"
        )
    if name == "lm_head.weight":
        return "a policy needs a *ForCausalLM checkpoint (set tie_word_embeddings=true if its head is the embedding)"
    return (
        f"config.json (num_hidden_layers={shape.num_layers}, tie_word_embeddings={shape.tie_embeddings}) "
        f"does not match the weights, or the save was partial"
    )

"""The Megatron models of the RLHF roles, built from Hugging Face checkpoints on the SAME process groups.

Owns how each role's model is built and what state it keeps:

- actor: trainable causal LM (LM head, vocab-parallel logits ``(b, s, padded_vocab / tp)``);
- reference: the same causal LM, frozen (``requires_grad=False``, eval mode), optionally offloaded to host
  memory between uses (:meth:`RoleModel.offload` / :meth:`RoleModel.onload`);
- critic: the same backbone with a scalar value head instead of the LM head, trainable;
- reward model: backbone + scalar head, frozen; the head must come from the checkpoint.

Value head (critic, reward model): Megatron's ``GPTModel(post_process=True)`` whose ``output_layer`` is
replaced by :class:`ValueHead`, a bias-free ``Linear(h, 1)`` replicated over TP (a size-1 output cannot be
split; every TP rank sees the same final hidden states, so replicas stay equal). It is stored as HF's
``score.weight`` (``*ForSequenceClassification`` with ``num_labels=1``), so a critic or reward model
round-trips through the same bridge. A critic built from a causal-LM checkpoint gets a zero-initialised
head (or a small normal one, or one read from a separate checkpoint); its ``lm_head`` is ignored. The model
returns per-token values ``(b, s, 1)`` from the last pipeline stage.

Every build validates the checkpoint against its config.json (names, shapes, TP divisibility) before any
rank allocates the model.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes

from hybridrl.mcore import bridge, gpt, hf_config, lora

ROLES = ("actor", "reference", "critic", "reward")


class ValueHead(torch.nn.Module):
    """Scalar head ``values = hidden @ weight.T``: weight ``(1, h)``, replicated over TP.

    Called by ``GPTModel`` in place of its output layer: ``(s, b, h) -> ((s, b, 1), None)``.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype, init_std: float = 0.0) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1, hidden_size, dtype=dtype))
        # replicated over TP: counted once by the grad norm (Megatron's attributes for a non-split tensor)
        set_defaults_if_not_set_tensor_model_parallel_attributes(self.weight)
        self.sequence_parallel = False  # set by the builder from the model's TransformerConfig
        if init_std > 0:
            torch.nn.init.normal_(self.weight, std=init_std)

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        if self.sequence_parallel:
            # under sequence parallelism the decoder's output holds this TP rank's s/tp positions (Megatron's own
            # output layer gathers them): gather the full sequence so that every TP rank computes all values and
            # the same head gradient (the gather's backward hands each rank its slice of the hidden grad)
            from megatron.core import tensor_parallel

            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.matmul(hidden, self.weight.t()), None


def score_model_chunks(shape: gpt.GPTShape, config: Any, dtype: torch.dtype, init_std: float = 0.0) -> list:
    """Model chunks with a scalar :class:`ValueHead` instead of the LM head (critic, reward model): built
    untied, then the last stage's vocab output layer is swapped for the head, on its device, with the
    model's sequence parallelism and the same initial weight on every TP rank."""
    chunks = gpt.build_model_chunks(dataclasses.replace(shape, tie_embeddings=False), config)
    for chunk in chunks:
        if chunk.post_process:
            head = ValueHead(shape.hidden_size, dtype, init_std).to(chunk.decoder.final_layernorm.weight.device)
            head.sequence_parallel = bool(getattr(config, "sequence_parallel", False))
            chunk.output_layer = head
            _sync_over_tp(head.weight)
    return chunks


@dataclass
class RoleModel:
    """One role's Megatron model on this rank, with what built it."""

    role: str
    chunks: list[torch.nn.Module]
    shape: gpt.GPTShape
    config: Any  # TransformerConfig
    hf_config: Any  # transformers PretrainedConfig
    head: str  # "lm" or "score" (see bridge_layout.tensor_maps)
    trainable: bool
    source: str
    offloaded: bool = False
    _devices: dict[int, torch.device] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # however the chunks were built or filled (an HF folder, a training checkpoint, random init), the grad
        # norm, clipping and every TP-aware reader need each parameter's tensor-parallel attributes
        gpt.check_tensor_parallel_attributes(self.chunks)

    def parameters(self):
        """This rank's parameters over all chunks."""
        for chunk in self.chunks:
            yield from chunk.parameters()

    def offload(self) -> None:
        """Move the weights to host memory (pinned on GPU); a no-op move on CPU, where only the state flips."""
        if self.offloaded:
            return
        for i, p in enumerate(self.parameters()):
            self._devices[i] = p.device
            if p.device.type != "cpu":
                host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=True)
                p.data = host.copy_(p.data, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.offloaded = True

    def onload(self) -> None:
        """Bring the weights back to the devices they came from."""
        if not self.offloaded:
            return
        for i, p in enumerate(self.parameters()):
            device = self._devices.get(i, p.device)
            if p.device != device:
                p.data = p.data.to(device, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.offloaded = False

    def require_onloaded(self) -> None:
        """Raise if the weights are offloaded (call before a forward)."""
        if self.offloaded:
            raise RuntimeError(f"{self.role} model is offloaded; call onload() before using it")

    def export(self, out_dir: str | os.PathLike, **kwargs: Any) -> None:
        """Write this role's model as an HF folder (collective; see :func:`bridge.export`); LoRA adapters merged."""
        self.require_onloaded()
        with lora.merged(self.chunks):
            bridge.export(
                self.chunks, self.shape, self.hf_config, out_dir, head=self.head, source=self.source, **kwargs
            )


def _sync_over_tp(tensor: torch.Tensor) -> None:
    """Replicated parameters start equal on every TP rank (their random init may differ)."""
    if mpu.get_tensor_model_parallel_world_size() > 1:
        with torch.no_grad():
            dist.broadcast(
                tensor.data, mpu.get_tensor_model_parallel_src_rank(), group=mpu.get_tensor_model_parallel_group()
            )


def _freeze(chunks: list[torch.nn.Module]) -> None:
    for chunk in chunks:
        chunk.eval()
        for p in chunk.parameters():
            p.requires_grad_(False)


def _build(
    role: str,
    path: str | os.PathLike,
    head: str,
    optional: tuple[str, ...] = (),
    dtype: torch.dtype = torch.float32,
    vocab_divisor: int = gpt.VOCAB_DIVISOR,
    value_head_std: float = 0.0,
    **config_overrides: Any,
) -> RoleModel:
    path = os.fspath(path)
    hf = hf_config.load_hf_config(path)
    # Every parameter is overwritten by bridge.load (it raises on any it cannot fill), so Megatron's random
    # init would be wasted: it was ~99% of the build time of a 125M model (bench/load_checkpoint.py).
    config_overrides.setdefault("perform_initialization", False)
    shape, config = hf_config.from_hf(hf, dtype, vocab_divisor, **config_overrides)
    ckpt = bridge.HFCheckpoint(path)
    bridge.validate(ckpt, shape, mpu.get_tensor_model_parallel_world_size(), head=head, optional=optional)
    if head == "score":
        chunks = score_model_chunks(shape, config, dtype, value_head_std)
    else:
        chunks = gpt.build_model_chunks(shape, config)
    bridge.load(chunks, shape, ckpt, head=head, optional=optional)
    return RoleModel(role, chunks, shape, config, hf, head, trainable=True, source=path)


def build_actor(path: str | os.PathLike, **kwargs: Any) -> RoleModel:
    """The trainable policy from an HF causal-LM folder.

    Args:
        path: local HF folder (config.json + safetensors).
        **kwargs: ``dtype``, ``vocab_divisor`` and ``TransformerConfig`` overrides.
    """
    return _build("actor", path, "lm", **kwargs)


def build_reference(path: str | os.PathLike, offload: bool = False, **kwargs: Any) -> RoleModel:
    """The frozen reference policy (``requires_grad=False``, eval mode); ``offload=True`` parks it on the host."""
    model = _build("reference", path, "lm", **kwargs)
    _freeze(model.chunks)
    model.trainable = False
    if offload:
        model.offload()
    return model


def build_critic(
    path: str | os.PathLike,
    value_head_path: str | os.PathLike | None = None,
    value_head_std: float = 0.0,
    **kwargs: Any,
) -> RoleModel:
    """The trainable critic: backbone from ``path`` plus a scalar value head.

    The head is read from ``score.weight`` of ``path`` when present (a ``*ForSequenceClassification``
    checkpoint), else from ``value_head_path`` (a folder or file holding ``score.weight`` ``(1, h)``), else
    initialised to zeros (``value_head_std > 0``: normal with that std).
    """
    model = _build("critic", path, "score", optional=("score.weight",), value_head_std=value_head_std, **kwargs)
    has_score = "score.weight" in bridge.HFCheckpoint(path).files
    if value_head_path is not None and not has_score:
        _load_value_head(model, value_head_path)
    return model


def build_reward_model(path: str | os.PathLike, **kwargs: Any) -> RoleModel:
    """The frozen reward model from a ``*ForSequenceClassification`` folder with ``num_labels=1``."""
    model = _build("reward", path, "score", **kwargs)
    _freeze(model.chunks)
    model.trainable = False
    return model


def _load_value_head(model: RoleModel, path: str | os.PathLike) -> None:
    from safetensors import safe_open

    path = os.fspath(path)
    if os.path.isdir(path):
        ckpt = bridge.HFCheckpoint(path)
        file = ckpt.files.get("score.weight")
    else:
        file = path
    if file is None or not os.path.isfile(file):
        raise bridge.CheckpointError(f"value_head_path {path!r} holds no score.weight; save the head as score.weight")
    with safe_open(file, framework="pt") as f:
        names = f.keys()
        if "score.weight" not in names:
            raise bridge.CheckpointError(f"{file} holds no score.weight (found {sorted(names)[:5]}); rename the head")
        weight = f.get_tensor("score.weight")
    if tuple(weight.shape) != (1, model.shape.hidden_size):
        raise bridge.CheckpointError(
            f"score.weight in {file} has shape {list(weight.shape)}, expected [1, {model.shape.hidden_size}]"
        )
    for chunk in model.chunks:
        if chunk.post_process:
            with torch.no_grad():
                chunk.output_layer.weight.copy_(weight)


BUILDERS = {"actor": build_actor, "reference": build_reference, "critic": build_critic, "reward": build_reward_model}

"""The critic's and the reference's HF model under FSDP2: built from an HF folder, sharded, offloaded between uses.

A :class:`TokenModel` is an HF transformers backbone (``AutoModel``: the decoder without its LM head) plus the
role's head, and returns per-response-token tensors ``(mb, r)`` directly, so that one FSDP root owns the whole
forward (the embedding, final norm and head are the root's parameters; each decoder layer is its own FSDP unit):

- critic: ``values = hidden @ score.weight.T``, a bias-free ``Linear(h, 1)``, as the Megatron critic's
  :class:`hybridrl.mcore.roles.ValueHead`: read from ``score.weight`` of the folder when it has one (a
  ``*ForSequenceClassification`` checkpoint with ``num_labels=1``), zero otherwise, so both backends start
  from the same values;
- reference: the causal LM's ``lm_head`` (tied to the embedding where the model ties them), log-softmax over
  the model's vocabulary at the rollout's temperature, read at each response token.

The output of response token ``t`` is read at the position that predicts it (``response_positions``, see
:mod:`hybridrl.fsdp.compute`); only those rows go through the head, so the reference never holds the logits
of the prompt.

Sharding: ``fully_shard`` on every decoder layer (the classes HF lists in ``_no_split_modules``) and on the
root, over a 1-D mesh of all ranks. The critic's parameters stay fp32 (the optimizer's master copy) and compute
in ``model.dtype`` (FSDP's mixed precision, gradients reduced in fp32); the frozen reference is stored in
``model.dtype``.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

KINDS = ("value", "log_prob")


class TokenModel(torch.nn.Module):
    """An HF backbone and a head whose outputs are read at the response tokens.

    Args:
        backbone: an HF ``*Model`` (decoder stack, ``last_hidden_state`` out).
        head: ``Linear(h, 1)`` (``kind="value"``) or the LM head ``Linear(h, V)`` (``kind="log_prob"``).
        kind: "value" or "log_prob".
    """

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Module, kind: str) -> None:
        super().__init__()
        assert kind in KINDS, kind
        self.backbone, self.head, self.kind = backbone, head, kind

    def forward(
        self,
        input_ids: torch.Tensor,
        response_positions: torch.Tensor,
        responses: torch.Tensor | None = None,
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Per-response-token outputs ``(mb, r)`` fp32.

        Args:
            input_ids: ``(mb, s)`` rows that start with their first real token (causal attention only: the
                padding at a row's end is never attended to by its real tokens).
            response_positions: ``(mb, r)`` the sequence index whose output belongs to response token ``t``.
            responses: ``(mb, r)`` token ids (``kind="log_prob"``).
            temperature: logits are divided by it before the log-softmax.
        """
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = self.backbone(input_ids=input_ids, position_ids=positions, use_cache=False).last_hidden_state
        index = response_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
        out = self.head(hidden.gather(1, index))
        if self.kind == "value":
            return out.squeeze(-1).float().clone()  # not a view: FSDP hooks the root's output for its backward
        logits = out.float() / temperature
        return logits.log_softmax(-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1).clone()


@functools.cache
def fsdp_mesh() -> DeviceMesh:
    """The 1-D mesh over every rank of the run (both FSDP roles share it), on this process's device type."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),), mesh_dim_names=("fsdp",))


def home_device() -> torch.device:
    """Where the role's shards live while in use: this rank's CUDA device, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def read_checkpoint_tensor(path: str, name: str) -> torch.Tensor | None:
    """Tensor ``name`` of the safetensors files of the HF folder ``path``, or None when no file holds it."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            file = json.load(f)["weight_map"].get(name)
        files = [os.path.join(path, file)] if file else []
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    for file in files:
        with safe_open(file, framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                return f.get_tensor(name)
    return None


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules); it cannot be "
                         "sharded layer by layer: set critic.backend / ref.backend to megatron")  # fmt: skip
    return layers


def shard(model: TokenModel, dtype: torch.dtype, mesh: DeviceMesh | None = None) -> TokenModel:
    """``fully_shard`` each decoder layer and the root over ``mesh`` (default :func:`fsdp_mesh`), computing in
    ``dtype`` with fp32 gradient reduction; the shards are moved to :func:`home_device`."""
    mesh = mesh or fsdp_mesh()
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
    kwargs: dict[str, Any] = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
    model.to(home_device())
    for layer in _decoder_layers(model.backbone):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _from_pretrained(cls: Any, path: str) -> torch.nn.Module:
    """``cls.from_pretrained(path)`` in fp32 (the master copy), without transformers' load report: the critic's
    backbone is read from a folder that may hold a head (``score.weight``, ``lm_head``) it does not use."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return cls.from_pretrained(path, dtype=torch.float32)
    finally:
        logging.set_verbosity(level)


def build_critic(path: str, dtype: torch.dtype = torch.float32) -> TokenModel:
    """The trainable critic from the HF folder ``path``: backbone + ``score`` head (module docs), sharded."""
    import transformers

    backbone = _from_pretrained(transformers.AutoModel, path)
    hidden = backbone.config.hidden_size
    head = torch.nn.Linear(hidden, 1, bias=False)
    weight = read_checkpoint_tensor(path, "score.weight")
    with torch.no_grad():
        if weight is None:
            head.weight.zero_()
        elif tuple(weight.shape) != (1, hidden):
            raise ValueError(f"score.weight in {path} has shape {list(weight.shape)}, expected [1, {hidden}]: a "
                             "value head has one output (num_labels=1)")  # fmt: skip
        else:
            head.weight.copy_(weight)
    model = TokenModel(backbone, head, "value")
    model.config = backbone.config
    return shard(model.train(), dtype)


def build_reference(path: str, dtype: torch.dtype = torch.float32) -> TokenModel:
    """The frozen reference policy from the HF causal-LM folder ``path`` (eval mode, no gradients), sharded."""
    import transformers

    causal = _from_pretrained(transformers.AutoModelForCausalLM, path).to(dtype)  # frozen: no fp32 master
    model = TokenModel(causal.base_model, causal.get_output_embeddings(), "log_prob")
    model.config = causal.config
    for p in model.parameters():
        p.requires_grad_(False)
    return shard(model.eval(), dtype)


def move_model(model: torch.nn.Module, device: torch.device | str) -> int:
    """Move this rank's shards to ``device`` (offload to the host, or back); returns the bytes moved (0 when they
    are there already, as on a CPU-only machine)."""
    target = torch.device(device)
    moved = sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != target.type)
    if moved:
        model.to(target)
        if torch.cuda.is_available() and target.type == "cpu":
            torch.cuda.empty_cache()
    return moved


def local_bytes(tensors) -> int:
    """Bytes this rank holds of ``tensors`` (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total

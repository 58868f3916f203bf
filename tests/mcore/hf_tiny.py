"""Test helpers: tiny Hugging Face checkpoints built in-process, their reference outputs, and Megatron forwards.

The HF side is the independent reference: models come from transformers' own classes (seeded, weights
re-drawn so biases, norms and logits are O(1)), are saved with ``save_pretrained`` and read back with
``from_pretrained`` for the reference forward. The Megatron side runs on the current layout through
``gpt.forward_backward`` and gathers vocab-parallel logits over TP here, in the tests only.
"""

from __future__ import annotations

import os

import torch

VOCAB = 250  # not a multiple of 64: vocab padding is exercised
SEQ = 16
BATCH = 2
_COMMON = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=4,
    intermediate_size=96,
    vocab_size=VOCAB,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
)
# arch -> (config class, extra config fields). Each case exercises one feature of the mapping.
ARCHS = {
    # llama3 RoPE scaling, untied, sharded save (see make_checkpoint)
    "llama": (
        "LlamaConfig",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            max_position_embeddings=16384,
        ),
    ),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),  # qkv bias, tied embeddings
    "mistral": ("MistralConfig", dict(sliding_window=8)),  # window < SEQ: the band mask matters
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),  # QK-norm, head_dim != h / heads
}


def tiny_config(arch: str, num_labels: int | None = None, **overrides):
    import transformers

    cls_name, extra = ARCHS[arch]
    kwargs = {**_COMMON, **extra, **overrides}
    if num_labels is not None:
        kwargs.update(num_labels=num_labels, pad_token_id=0)
    return getattr(transformers, cls_name)(**kwargs)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.2))


def make_checkpoint(arch: str, out_dir: str, seed: int = 0, score: bool = False, max_shard_size=None, **overrides):
    """Save a tiny ``arch`` model (``score=True``: ``*ForSequenceClassification``, 1 label) to ``out_dir``."""
    import transformers

    config = tiny_config(arch, num_labels=1 if score else None, **overrides)
    prefix = type(config).__name__.removesuffix("Config")
    cls = getattr(transformers, f"{prefix}ForSequenceClassification" if score else f"{prefix}ForCausalLM")
    torch.manual_seed(seed)
    model = cls(config)
    _randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 256}')  # a stand-in tokenizer file the export must copy
    return out_dir


def input_ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def hf_outputs(path: str, ids: torch.Tensor, score: bool = False) -> torch.Tensor:
    """HF reference: logits ``(b, s, vocab)``, or per-token scores ``(b, s, 1)`` of a classification model."""
    import transformers

    cls = transformers.AutoModelForSequenceClassification if score else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        if score:
            return model.score(model.model(input_ids=ids).last_hidden_state)
        return model(input_ids=ids).logits


def megatron_outputs(chunks, vocab: int | None, ids: torch.Tensor, n_micro: int = 1) -> torch.Tensor | None:
    """Forward ``ids`` through this layout's chunks; the full output on every rank (TP-gathered logits
    sliced to ``vocab``; ``vocab=None`` for a value head). ``ids`` is split into ``n_micro`` micro-batches
    (virtual pipelining needs at least PP of them). Collective over the world."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from hybridrl.mcore import gpt

    batches = [
        {
            "input_ids": part,
            "position_ids": torch.arange(part.shape[1], device=part.device).expand_as(part).contiguous(),
        }
        for part in ids.chunk(n_micro)
    ]

    def keep(output, _):
        if vocab is not None and mpu.get_tensor_model_parallel_world_size() > 1:
            parts = [torch.empty_like(output) for _ in range(mpu.get_tensor_model_parallel_world_size())]
            dist.all_gather(parts, output.contiguous(), group=mpu.get_tensor_model_parallel_group())
            output = torch.cat(parts, dim=-1)
        output = output[..., :vocab] if vocab is not None else output
        return output.float().mean(), {"out": output.detach().clone()}

    with torch.no_grad():
        metrics = gpt.forward_backward(chunks, batches, keep, forward_only=True)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, torch.cat([m["out"] for m in metrics]) if metrics else None)
    return next(o for o in everyone if o is not None)


def portable(obj):
    """Tensors -> numpy arrays, recursively: results cross the rank queue by value.

    torch.multiprocessing sends tensors as shared-memory handles that the parent can only open while the
    child still lives; a child that exits first makes the parent fail with FileNotFoundError.
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: portable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(portable(v) for v in obj)
    return obj


def tensors(obj):
    """Inverse of :func:`portable`."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: tensors(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(tensors(v) for v in obj)
    return obj

"""Test helpers: tiny Hugging Face MoE checkpoints (Qwen3-MoE, Mixtral) built in-process from seeds.

4 experts, top-2, 2 layers, an odd vocabulary (197, padded to 256). Weights are re-drawn so router logits are
O(1) (tokens spread over the experts, top-k decisions are not near ties) and norms are not all ones. The HF
side is transformers' own classes, saved with ``save_pretrained`` (per-expert tensors on disk).
"""

from __future__ import annotations

import os

import torch

VOCAB = 197
EXPERTS, TOPK = 4, 2
_COMMON = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, head_dim=32,
               vocab_size=VOCAB, rms_norm_eps=1e-5, max_position_embeddings=256, num_experts_per_tok=TOPK,
               tie_word_embeddings=False, router_aux_loss_coef=0.01)  # fmt: skip
_QWEN3_MOE = dict(num_experts=EXPERTS, moe_intermediate_size=64, intermediate_size=96, decoder_sparse_step=1,
                  mlp_only_layers=[])  # fmt: skip
ARCHS = {
    # softmax over all experts then top-k, renormalised (norm_topk_prob) or not; QK-norm
    "qwen3_moe": ("Qwen3MoeConfig", dict(_QWEN3_MOE, norm_topk_prob=True)),
    "qwen3_moe_nonorm": ("Qwen3MoeConfig", dict(_QWEN3_MOE, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=EXPERTS, intermediate_size=64)),  # softmax over top-k
}


def tiny_config(arch: str, **overrides):
    import transformers

    cls_name, extra = ARCHS[arch]
    return getattr(transformers, cls_name)(**{**_COMMON, **extra, **overrides})


def make_checkpoint(arch: str, out_dir: str, seed: int = 0, **overrides) -> str:
    """Save a tiny MoE ``arch`` causal LM to ``out_dir`` (returned)."""
    import transformers

    config = tiny_config(arch, **overrides)
    cls = getattr(transformers, type(config).__name__.removesuffix("Config") + "ForCausalLM")
    torch.manual_seed(seed)
    model = cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "gate.weight" in name:  # router: O(1) logits
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / p.shape[-1] ** 0.5))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.6 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.2))
    model.save_pretrained(out_dir, safe_serialization=True)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        f.write('{"model_max_length": 256}')
    return out_dir

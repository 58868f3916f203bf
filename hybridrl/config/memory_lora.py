"""The memory estimate of a LoRA actor (``actor.lora``), for :mod:`hybridrl.config.memory`.

With LoRA the actor holds its frozen weights plus the adapter factors; gradients and Adam state exist only for
the factors; the reference policy is the actor with its adapters off, so it holds nothing of its own. A factor is
counted as it is allocated on one rank (:mod:`hybridrl.mcore.lora`): a column-parallel linear (``linear_qkv``,
``linear_fc1``: ``A (r, in)`` replicated, ``B (out / tp, r)``), a row-parallel one (``linear_proj``,
``linear_fc2``: ``A (r, in / tp)``, ``B (out, r)`` replicated); a fused linear adapted for some of its projections
still holds ``B`` for all its rows.
"""

from __future__ import annotations

from typing import Any

MODULE_OF = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
             "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}  # fmt: skip
MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def adapted_modules(targets: list[str]) -> set[str]:
    """Megatron linears adapted by ``actor.lora.target_modules`` (unknown names are the config checks' to report)."""
    out: set[str] = set()
    for name in targets:
        if name == "all-linear":
            out.update(MODULES)
        elif name in MODULES:
            out.add(name)
        elif name in MODULE_OF:
            out.add(MODULE_OF[name])
    return out


def adapter_params(arch: Any, lora: Any, tp: int, pp: int) -> int:
    """Adapter parameters one rank holds (all its layers: ``arch.layers / pp`` of them)."""
    h, hd, r = arch.hidden, arch.head_dim, lora.rank
    shapes = {  # module: (in, out, column-parallel)
        "linear_qkv": (h, (arch.heads + 2 * arch.kv_heads) * hd, True),
        "linear_proj": (arch.heads * hd, h, False),
        "linear_fc1": (h, 2 * arch.ffn, True),
        "linear_fc2": (arch.ffn, h, False),
    }
    per_layer = 0
    for module in adapted_modules(list(lora.target_modules)):
        fan_in, fan_out, column = shapes[module]
        per_layer += r * fan_in + fan_out * r // tp if column else r * fan_in // tp + fan_out * r
    return arch.layers * per_layer // pp

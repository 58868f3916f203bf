"""SwiGLU of the MLP's ``linear_fc1`` output, ``silu(gate) * up``, keeping only its input for the backward.

Megatron's MLP without TransformerEngine or its jit-fused kernels (``bias_activation_fusion``, off here: its
``torch.compile``'d kernel would compile at start-up) computes the gated unit as ``silu(gate) * (up + offset)``
from two views of ``linear_fc1``'s output ``x = [gate | up]`` (``(..., 2f)``). Autograd then keeps three tensors
per layer for the backward: ``x`` (the ``silu`` reads its view), ``silu(gate)`` and ``up + 0.0`` (both ``(..., f)``,
the multiplication's inputs), and the backward of the two views concatenates the two halves of the gradient into
a new ``(..., 2f)`` tensor.

:func:`swiglu` keeps ``x`` only and writes both halves of the gradient straight into one ``(..., 2f)`` tensor,
rows in cache-sized chunks. With ``s = sigmoid(gate)`` and ``g`` the output's gradient:

    d out / d up   = silu(gate) = gate * s
    d out / d gate = up * s * (1 + gate * (1 - s)) = up * (s + silu(gate) * (1 - s))

The output is bitwise Megatron's (``x + 0.0 == x``); the gradient differs from autograd's ``silu_backward`` by
float rounding (fp32: ~1e-7 relative; 16-bit inputs are computed in fp32 and rounded once, as autograd does).
At the 23.7M bench model's update size (8704 tokens, f = 1536, 2 threads) the activation's forward + backward
takes 83-88 ms instead of Megatron's 159-168 ms, and each layer keeps 2 x tokens x f fewer values until the
backward (107 MiB there).

Used by :func:`hybridrl.mcore.gpt.build_model_chunks` (when :func:`hybridrl.mcore.gpt.swiglu_module` says so:
dense models on Megatron's local spec) as the MLP's ``activation_func`` submodule, which Megatron calls on the
whole ``x`` when ``use_te_activation_func`` is set; a plain function, so it adds no module, parameter or
checkpoint key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 2**16
"""Gate elements per chunk of rows in the backward (256 KiB in fp32, with their up and gradient rows in cache)."""


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        gate, up = x.chunk(2, dim=-1)
        ctx.save_for_backward(x)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        f = x.shape[-1] // 2
        rows = x.reshape(-1, 2 * f)
        g = grad.reshape(-1, f)
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        compute = torch.promote_types(x.dtype, torch.float32)  # 16-bit: one rounding at the end, as autograd's
        direct = compute == x.dtype
        step = max(1, CHUNK_ELEMENTS // max(f, 1))
        for i in range(0, rows.shape[0], step):
            c = slice(i, i + step)
            gate, up, g_c = rows[c, :f].to(compute), rows[c, f:].to(compute), g[c].to(compute)
            s = torch.sigmoid(gate)
            silu = gate * s
            if direct:
                torch.mul(silu, g_c, out=out[c, f:])
            else:
                out[c, f:] = silu * g_c
            d_gate = silu.mul_(torch.rsub(s, 1)).add_(s).mul_(g_c)  # d silu / d gate = s + silu (1 - s), times g
            if direct:
                torch.mul(d_gate, up, out=out[c, :f])
            else:
                out[c, :f] = d_gate.mul_(up)
        return out.view(x.shape)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :f]) * x[..., f:]`` for ``x`` ``(..., 2f)``, differentiable (module docs)."""
    if x.shape[-1] % 2:
        raise ValueError(f"swiglu needs an even last dimension [gate | up], got {tuple(x.shape)}")
    return _SwiGLU.apply(x)

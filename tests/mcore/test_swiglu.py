"""The MLP's gated unit (hybridrl.mcore.swiglu) against Megatron's unfused formula and fp64 autograd.

Reference: Megatron's local-spec MLP computes ``silu(gate) * (up + 0.0)`` from two views of ``linear_fc1``'s output;
fp64 autograd of the same formula gives the gradient. The forward equals Megatron's bitwise in fp32; the gradient
is within 1e-6 relative to max(1, |value|) of fp64 (several chunks of rows and one); bf16 follows its own rounding
(within 2^-7 of fp64); the backward keeps the input only (one saved tensor, where Megatron's keeps three). The
builders the trainer uses install it (tests/mcore/test_roles.py), and the HF parity tests
(test_hf_parity.py, test_grad_norm_hf.py) run through it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridrl.mcore import swiglu as swiglu_module
from hybridrl.mcore.swiglu import swiglu

F_DIM = 48


def _megatron(x: torch.Tensor) -> torch.Tensor:
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * (up + 0.0)


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(5, 7, 2 * F_DIM, generator=g)).to(dtype)
    grad = torch.randn(5, 7, F_DIM, generator=g).to(dtype)
    return x, grad


def _run(fn, x, grad):
    leaf = x.clone().requires_grad_(True)
    out = fn(leaf)
    out.backward(grad)
    return out.detach(), leaf.grad


@pytest.mark.parametrize("chunk", [F_DIM * 4, 2**30])  # several chunks (the last one short), and one
def test_swiglu_equals_megatron_forward_and_fp64_gradient(chunk, monkeypatch):
    monkeypatch.setattr(swiglu_module, "CHUNK_ELEMENTS", chunk)
    x, grad = _inputs()
    ours, ours_grad = _run(swiglu, x, grad)
    theirs, _ = _run(_megatron, x, grad)
    assert torch.equal(ours, theirs)
    ref, ref_grad = _run(_megatron, x.double(), grad.double())
    for a, b in ((ours, ref), (ours_grad, ref_grad)):
        assert ((a.double() - b).abs() / b.abs().clamp(min=1.0)).max().item() < 1e-6


def test_swiglu_bf16_follows_fp64_within_its_rounding():
    x, grad = _inputs(torch.bfloat16)
    ours, ours_grad = _run(swiglu, x, grad)
    assert ours.dtype == ours_grad.dtype == torch.bfloat16
    ref, ref_grad = _run(_megatron, x.double(), grad.double())
    for a, b in ((ours, ref), (ours_grad, ref_grad)):
        assert ((a.double() - b).abs() / b.abs().clamp(min=1.0)).max().item() < 2**-7


def test_swiglu_keeps_only_its_input_for_the_backward():
    x, _ = _inputs()
    for fn, expected in ((swiglu, 1), (_megatron, 3)):
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor, saved: list = saved) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            fn(x.clone().requires_grad_(True))
        assert len({t.untyped_storage().data_ptr() for t in saved}) == expected, fn


def test_swiglu_refuses_an_odd_width():
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu(torch.zeros(2, 5))

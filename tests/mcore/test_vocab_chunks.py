"""The vocab log-prob / entropy head in chunks of rows (hybridrl.mcore.vocab_parallel) equals a full log-softmax.

One process (no tensor parallelism; the TP2 case is tests/mcore/test_compute.py): logits of 13 rows x 50
columns, a chunk of 4 rows (so four chunks, the last one short), at temperature 0.7, with a padded vocabulary (the
last 6 columns out of the softmax) and without. Reference: ``torch.log_softmax`` in fp64 on the same logits.
Log-probs, entropy and the gradient of a loss that uses both, only the log-probs (the entropy's gradient never
arrives) or only the entropy, within 1e-6 relative to max(1, |value|); the chunked results equal the one-chunk
results within 1e-7.

With ``grad_into_logits`` (what the trainer's ``LogProbHead`` passes) the backward writes the gradient into the
logits' memory: the gradient is bitwise the one of a fresh tensor (fp32 and bf16 logits, padded or not), lies
in the logits' storage, and a second function that saved the same logits raises instead of reading the gradient.
"""

from __future__ import annotations

import pytest
import torch

from hybridrl.mcore import vocab_parallel

ROWS, VOCAB, TEMPERATURE = 13, 50, 0.7


def _reference(logits, target, vocab_size, w_lp, w_ent):
    x = logits.double().detach().requires_grad_(True)
    logp_all = torch.log_softmax(x[..., :vocab_size] / TEMPERATURE, dim=-1)
    lp = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    loss = sum(w * v for w, v in ((w_lp, lp), (w_ent, ent)) if w is not None).sum()
    loss.backward()
    return lp.detach(), ent.detach(), x.grad


def _ours(logits, target, vocab_size, w_lp, w_ent, chunk: int, monkeypatch):
    monkeypatch.setattr(vocab_parallel, "CHUNK_ELEMENTS", chunk)
    x = logits.detach().clone().requires_grad_(True)
    lp, ent = vocab_parallel.log_probs_and_entropy(x, target, None, TEMPERATURE, vocab_size)
    loss = sum(w * v for w, v in ((w_lp, lp), (w_ent, ent)) if w is not None).sum()
    loss.backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("vocab_size", [None, VOCAB - 6])
@pytest.mark.parametrize("uses", ["both", "log_probs", "entropy"])
def test_chunked_head_equals_log_softmax(vocab_size, uses, monkeypatch):
    g = torch.Generator().manual_seed(4)
    logits = 4 * torch.randn(ROWS, VOCAB, generator=g)
    target = torch.randint(0, vocab_size or VOCAB, (ROWS,), generator=g)
    w_lp = torch.randn(ROWS, generator=g) if uses in ("both", "log_probs") else None
    w_ent = torch.randn(ROWS, generator=g) if uses in ("both", "entropy") else None
    ref = _reference(logits, target, vocab_size or VOCAB, w_lp, w_ent)
    chunked = _ours(logits, target, vocab_size, w_lp, w_ent, 4 * (vocab_size or VOCAB), monkeypatch)
    whole = _ours(logits, target, vocab_size, w_lp, w_ent, 2**30, monkeypatch)
    for ours, theirs, name in zip(chunked, ref, ("log_probs", "entropy", "grad"), strict=True):
        scale = theirs.abs().clamp(min=1.0)  # fp32: 1e-6 relative is a few ulp at 20 nats
        assert ((ours.double() - theirs).abs() / scale).max().item() < 1e-6, name
    if vocab_size is not None:  # padding columns get exactly no gradient
        assert not chunked[2][:, vocab_size:].any()
    for a, b in zip(chunked, whole, strict=True):
        assert (a - b).abs().max().item() < 1e-7


def _leaf_grad(logits, target, vocab_size, w_lp, w_ent, reuse: bool, seen: dict):
    leaf = logits.clone().requires_grad_(True)
    logits = leaf * 1.0  # a non-leaf, as the output layer's output is
    logits.register_hook(lambda g: seen.update(storage=g.untyped_storage().data_ptr()))
    lp, ent = vocab_parallel.log_probs_and_entropy(logits, target, None, TEMPERATURE, vocab_size, reuse)
    loss = sum(w * v for w, v in ((w_lp, lp), (w_ent, ent)) if w is not None).sum()
    loss.backward()
    return leaf.grad, logits.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab_size", [None, VOCAB - 6])
@pytest.mark.parametrize("uses", ["both", "log_probs"])
def test_gradient_into_logits_equals_a_fresh_gradient(dtype, vocab_size, uses, monkeypatch):
    monkeypatch.setattr(vocab_parallel, "CHUNK_ELEMENTS", 4 * VOCAB)  # several chunks: each read before overwritten
    g = torch.Generator().manual_seed(5)
    logits = (4 * torch.randn(ROWS, VOCAB, generator=g)).to(dtype)
    target = torch.randint(0, vocab_size or VOCAB, (ROWS,), generator=g)
    w_lp = torch.randn(ROWS, generator=g)
    w_ent = torch.randn(ROWS, generator=g) if uses == "both" else None
    fresh_seen, reuse_seen = {}, {}
    fresh, fresh_ptr = _leaf_grad(logits, target, vocab_size, w_lp, w_ent, False, fresh_seen)
    reused, reuse_ptr = _leaf_grad(logits, target, vocab_size, w_lp, w_ent, True, reuse_seen)
    assert torch.equal(fresh, reused)
    assert reuse_seen["storage"] == reuse_ptr and fresh_seen["storage"] != fresh_ptr
    if vocab_size is not None:
        assert not reused[:, vocab_size:].any()


def test_gradient_into_logits_fails_loudly_when_the_logits_are_needed_again():
    g = torch.Generator().manual_seed(6)
    leaf = torch.randn(ROWS, VOCAB, generator=g).requires_grad_(True)
    logits = leaf * 1.0
    target = torch.randint(0, VOCAB, (ROWS,), generator=g)
    first = vocab_parallel.log_probs(logits, target)  # saves the same logits: its backward runs second
    second, _ = vocab_parallel.log_probs_and_entropy(logits, target, grad_into_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (first + second).sum().backward()


@pytest.mark.parametrize("vocab_size", [None, VOCAB - 6])
def test_without_entropy_is_bitwise_the_log_probs_and_gradient_of_the_full_head(vocab_size, monkeypatch):
    """``with_entropy=False`` (the reference and old-log-prob passes) skips the entropy's pass and returns None for
    it; the log-probs, and the gradient of a loss on them, are bitwise those of the head that also computes the
    entropy, whether that entropy is left out of the loss or enters it times 0 (the actor loss before it detached
    an unused entropy: then the backward ran the entropy's term)."""
    monkeypatch.setattr(vocab_parallel, "CHUNK_ELEMENTS", 4 * VOCAB)
    g = torch.Generator().manual_seed(7)
    logits = 4 * torch.randn(ROWS, VOCAB, generator=g)
    target = torch.randint(0, vocab_size or VOCAB, (ROWS,), generator=g)
    w_lp = torch.randn(ROWS, generator=g)
    results = {}
    for mode in ("no_entropy", "entropy_unused", "entropy_times_0"):
        x = logits.clone().requires_grad_(True)
        lp, ent = vocab_parallel.log_probs_and_entropy(
            x, target, None, TEMPERATURE, vocab_size, with_entropy=mode != "no_entropy"
        )
        loss = (w_lp * lp).sum() if mode != "entropy_times_0" else (w_lp * lp - 0.0 * ent).sum()
        loss.backward()
        results[mode] = (lp.detach(), ent, x.grad)
    assert results["no_entropy"][1] is None
    for mode in ("entropy_unused", "entropy_times_0"):
        assert torch.equal(results["no_entropy"][0], results[mode][0]), mode
        assert torch.equal(results["no_entropy"][2], results[mode][2]), mode
    ref_lp, _, ref_grad = _reference(logits, target, vocab_size or VOCAB, w_lp, None)
    assert (results["no_entropy"][0].double() - ref_lp).abs().max().item() < 1e-5
    assert (results["no_entropy"][2].double() - ref_grad).abs().max().item() < 1e-6

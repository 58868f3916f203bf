"""The output layer runs on the response positions only (hybridrl.mcore.response_logits), with unchanged numerics.

On one gloo rank, and on two at TP2 with sequence parallelism (the decoder's output split along the sequence:
the selection gathers it itself), through the trainer's calls (``compute.compute_log_probs`` / ``compute_values`` /
``forward_backward`` on models from ``roles``), for unshared and prompt-shared (packed) passes of a GRPO-like
batch: a hook counts the rows that reach each output layer (``rows x r`` per micro-batch, never the whole
``b x s`` grid), and log-probs, entropy, critic values, the loss and every gradient (the actor's and, from a
value loss, the critic's) equal those of the same pass with the selection off (the full output gathered
afterwards) within 1e-6; log-probs equal HF transformers' within 1e-5 (the independent reference, unpacked
rows). A head that does not declare ``reads_responses_only`` still gets the full ``(mb, s, V)`` output.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import hf_tiny
from tests.mcore.test_prefix_share import TEMPERATURE, grpo_batch, hf_reference, loss_fn
from tests.multirank import run_ranks

TOL, HF_TOL = 1e-6, 1e-5


class _FullHead:
    """A user head that reads the model output itself (no ``reads_responses_only``): sees ``(mb, s, V)``."""

    keys = ("width",)

    def __call__(self, output, micro_batch):
        rows, r = micro_batch["responses"].shape
        return {"width": torch.full((rows, r), float(output.shape[1]))}


def _count_rows(chunks, seen: list[int]):
    from megatron.core.models.gpt import GPTModel

    def hook(module, args, output):  # after the layer: the selection's pre-hook has run
        logits = output[0] if isinstance(output, tuple) else output
        seen.append(logits.shape[0] * logits.shape[1])

    return [m.output_layer.register_forward_hook(hook) for c in chunks for m in c.modules()
            if isinstance(m, GPTModel) and m.post_process]  # fmt: skip


def _passes(actor, critic, batch, share):
    from hybridrl.mcore import compute

    for p in actor.parameters():
        p.grad = None
    lp = compute.compute_log_probs(actor.chunks, batch, 4, TEMPERATURE, with_entropy=True, share_prefix=share)
    head = compute.LogProbHead(temperature=TEMPERATURE, with_entropy=True)
    step = compute.forward_backward(actor.chunks, batch, loss_fn, 4, head=head, share_prefix=share)
    grads = {n: p.grad.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    values = compute.compute_values(critic.chunks, batch, 4, share_prefix=share)
    for p in critic.parameters():
        p.grad = None
    compute.forward_backward(critic.chunks, batch, lambda o, mb: ((o["values"] - mb["advantages"]) ** 2, {}), 4,
                             head=compute.ValuesHead(), share_prefix=share)  # fmt: skip
    grads.update({f"critic.{n}": p.grad.detach().clone() for n, p in critic.chunks[0].named_parameters()})
    return {**lp, "values": values, "loss": torch.tensor(step.loss)}, grads


def _body(rank: int, world_size: int, paths: dict, batch: dict) -> dict:
    from hybridrl.mcore import compute, response_logits, roles
    from tests.mcore.shards import init_layout

    init_layout(tp=world_size)
    options = {"sequence_parallel": True} if world_size > 1 else {}
    actor, critic = roles.build_actor(paths["actor"], **options), roles.build_critic(paths["critic"], **options)
    out: dict = {}
    for share in (False, True):
        seen: list[int] = []
        handles = _count_rows(actor.chunks, seen)
        selected = _passes(actor, critic, batch, share)
        for h in handles:
            h.remove()
        original = response_logits.usable
        response_logits.usable = lambda chunks, head: False
        try:
            full = _passes(actor, critic, batch, share)
        finally:
            response_logits.usable = original
        out[share] = {"seen": seen, "selected": selected, "full": full}
    width = compute.forward_outputs(actor.chunks, batch, 4, _FullHead())["width"]
    out["user_head_width"] = float(width.max())
    return out


def _even_width(batch: dict) -> dict:
    """``batch`` with one more column of response padding when its width is odd: sequence parallelism splits the
    sequence over 2 ranks (a run's width, max_prompt_length + max_response_length, is checked to allow it)."""
    if batch["input_ids"].shape[1] % 2 == 0:
        return batch
    out = {k: torch.nn.functional.pad(v, (0, 1)) for k, v in batch.items()}
    out["position_ids"] = (out["attention_mask"].cumsum(1) - 1).clamp(min=0)
    out["old_log_probs"][:, -1] = -5.0
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return {
        "actor": hf_tiny.make_checkpoint("llama", str(tmp_path_factory.mktemp("actor")), seed=21),
        "critic": hf_tiny.make_checkpoint("llama", str(tmp_path_factory.mktemp("critic")), seed=22, score=True),
    }


@pytest.fixture(scope="module", params=["tp1", "tp2_sp"])
def results(request, paths, tmp_path_factory):
    world = 2 if request.param == "tp2_sp" else 1
    batch = grpo_batch() if world == 1 else _even_width(grpo_batch())
    ref = hf_reference(paths["actor"], paths["critic"], batch, str(tmp_path_factory.mktemp("grads")))
    return batch, ref, run_ranks(_body, world, paths, batch, timeout=600)[0]


@pytest.mark.parametrize("share", [False, True])
def test_output_layer_sees_only_response_positions(results, share):
    batch, _, res = results
    rows, r = batch["responses"].shape
    seen = res[share]["seen"]
    # the log-prob pass and the update, micro-batches of at most 4 rows: each row's r positions, nothing else
    assert sum(seen) == 2 * rows * r and max(seen) <= 4 * r, seen


@pytest.mark.parametrize("share", [False, True])
def test_numerics_unchanged_and_equal_hf(results, share):
    batch, ref, res = results
    (sel, sel_g), (full, full_g) = res[share]["selected"], res[share]["full"]
    mask = batch["response_mask"].bool()
    for key in ("log_probs", "entropy", "values"):
        assert (sel[key] - full[key])[mask].abs().max().item() < TOL, key
    assert abs(float(sel["loss"]) - float(full["loss"])) < TOL
    assert max((sel_g[n] - full_g[n]).abs().max().item() for n in full_g) < TOL
    assert (sel["log_probs"] - ref["log_probs"])[mask].abs().max().item() < HF_TOL
    assert (sel["values"] - ref["values"])[mask].abs().max().item() < HF_TOL


def test_user_head_gets_the_full_output(results):
    batch, _, res = results
    assert res["user_head_width"] > batch["responses"].shape[1]

"""The actor update's memory traffic: what the update must not do, checked where it would show.

- ``TorchOptimizer`` (built by ``build_optimizer``, as the trainer does) steps torch's fused AdamW on CPU, and keeps
  it after loading a checkpoint saved without it; its weights after three clipped steps equal those of
  ``torch.optim.AdamW``'s per-param loop (torch's CPU default, the independent reference) on the same gradients,
  within 1e-6 (fp32: an ulp of reordering per step).
- The vocab-parallel log-prob / entropy backward writes its gradient in place: no ``aten::copy_`` in backward
  (its numerics against ``torch.log_softmax`` are tests/mcore/test_vocab_chunks.py).
- The output layer of a selected pass (hybridrl.mcore.response_logits) gets ``[1, rows * r, h]``, so the logits
  that reach the head are a view of the output layer's own output (GPTModel's ``[s, b] -> [b, s]`` transpose
  copies nothing); values against the unselected pass and HF transformers are tests/mcore/test_response_logits.py.
- In that update the log-prob head's backward writes the logits' gradient into the logits' own memory
  (``grad_into_logits``, set by ``LogProbHead``): the gradient the output layer receives lies in the logits' storage
  (numerics against a fresh gradient: tests/mcore/test_vocab_chunks.py).
- Without an entropy bonus the update's head gets no entropy gradient and skips that term of its backward; the
  gradients equal those of the former ``pg - 0 * H`` bitwise.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridrl.mcore import vocab_parallel
from tests.mcore import hf_tiny
from tests.mcore.test_prefix_share import grpo_batch
from tests.multirank import run_ranks

LR, WD, STEPS = 1e-2, 0.1, 3


class _Ops(TorchDispatchMode):
    """Records the aten ops that run while active."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def test_vocab_backward_writes_the_gradient_in_place():
    g = torch.Generator().manual_seed(0)
    for vocab_size, temperature in ((None, 1.0), (40, 0.7)):
        logits = torch.randn(12, 48, generator=g).requires_grad_(True)
        target = torch.randint(0, 40, (12,), generator=g)
        lp, ent = vocab_parallel.log_probs_and_entropy(logits, target, None, temperature, vocab_size)
        loss = (lp * torch.randn(12, generator=g)).sum() + ent.sum()
        with _Ops() as ops:
            loss.backward()
        assert "copy_" not in ops.names, ops.names


class _ProbeHead:
    """``inner`` (a head reading the response positions only), recording what it receives in ``seen``."""

    reads_responses_only = True

    def __init__(self, inner, seen: dict) -> None:
        self.inner, self.seen = inner, seen

    @property
    def keys(self) -> tuple[str, ...]:
        return self.inner.keys

    def bind(self, chunks) -> _ProbeHead:
        return _ProbeHead(self.inner.bind(chunks), self.seen)

    def __call__(self, output, micro_batch):
        self.seen.setdefault("head_storage", output.untyped_storage().data_ptr())
        self.seen.setdefault("head_shape", tuple(output.shape))
        if output.requires_grad and "grad_hook" not in self.seen:
            self.seen["grad_hook"] = True
            output.register_hook(lambda g: self.seen.update(grad_storage=g.untyped_storage().data_ptr()))
        return self.inner(output, micro_batch)


def _body(rank: int, world_size: int, paths: dict, batch: dict) -> dict:
    from megatron.core.models.gpt import GPTModel

    from hybridrl.mcore import compute, roles
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer
    from tests.mcore.shards import init_layout
    from tests.mcore.test_prefix_share import loss_fn

    init_layout()
    actor = roles.build_actor(paths["actor"])
    config = OptimConfig(lr=LR, weight_decay=WD, clip_grad=0.5, backend="torch")
    opt = build_optimizer(actor.chunks, config)
    params = opt.params
    reference_params = [p.detach().clone().requires_grad_(True) for p in params]
    names = {id(p): n for n, p in actor.chunks[0].named_parameters()}
    no_wd = [p.dim() <= 1 or names[id(p)].endswith(".bias") for p in params]
    reference = torch.optim.AdamW(
        [{"params": [q for q, skip in zip(reference_params, no_wd, strict=True) if not skip], "weight_decay": WD},
         {"params": [q for q, skip in zip(reference_params, no_wd, strict=True) if skip], "weight_decay": 0.0}],
        lr=LR, foreach=False, fused=False,
    )  # fmt: skip
    seen: dict = {}
    model = next(m for m in actor.chunks[0].modules() if isinstance(m, GPTModel))

    def record(module, args, output):  # a forward hook sees the args as the selection's pre-hook left them
        seen.setdefault("input", tuple(args[0].shape))
        seen.setdefault("layer_storage", output[0].untyped_storage().data_ptr())

    hooks = [model.output_layer.register_forward_hook(record)]
    head = _ProbeHead(compute.LogProbHead(with_entropy=True), seen)
    for _ in range(STEPS):
        opt.zero_grad()
        compute.forward_backward(actor.chunks, batch, loss_fn, 4, head=head)
        for q, p in zip(reference_params, params, strict=True):
            q.grad = p.grad.clone()
        torch.nn.utils.clip_grad_norm_(reference_params, 0.5)
        opt.step()
        reference.step()
    for h in hooks:
        h.remove()
    weight_diff = max((p - q).abs().max().item() for p, q in zip(params, reference_params, strict=True))
    fused = {g["fused"] for g in opt.optimizer.param_groups}
    # a checkpoint of a run without the fused kernel: loading it keeps this run's choice
    state = opt.state_dict()
    for group in state["optimizer"]["param_groups"]:
        group["fused"] = False
    opt.load_state_dict(state)
    after_load = {g["fused"] for g in opt.optimizer.param_groups}
    return {"weight_diff": weight_diff, "fused": fused, "fused_after_load": after_load, "seen": seen,
            "rows_r": tuple(batch["responses"][:4].shape)}  # fmt: skip


def test_fused_adamw_and_the_logits_layout(tmp_path):
    batch = grpo_batch()
    paths = {"actor": hf_tiny.make_checkpoint("llama", str(tmp_path / "actor"), seed=21)}
    res = run_ranks(_body, 1, paths, batch, timeout=600)[0]
    assert res["fused"] == {True} and res["fused_after_load"] == {True}, res
    assert res["weight_diff"] < 1e-6, res["weight_diff"]
    rows, r = res["rows_r"]
    seen = res["seen"]
    assert seen["input"][:2] == (1, rows * r), seen
    assert seen["head_shape"][:2] == (rows, r), seen
    assert seen["head_storage"] == seen["layer_storage"], "the logits were copied between output layer and head"
    assert seen["grad_storage"] == seen["head_storage"], "the head's gradient was not written into the logits"


def _entropy_body(rank: int, world_size: int, paths: dict, batch: dict) -> dict:
    from hybridrl.algos.objectives import ActorLoss
    from hybridrl.config.schema_roles import ActorConfig
    from hybridrl.mcore import compute, roles
    from hybridrl.mcore.optimizer import OptimConfig, build_optimizer
    from tests.mcore.shards import init_layout

    init_layout()
    actor = roles.build_actor(paths["actor"])
    opt = build_optimizer(actor.chunks, OptimConfig(lr=LR, backend="torch"))  # its chunks, as the worker passes
    params = opt.params
    objective = ActorLoss(ActorConfig(use_kl_loss=True, kl_loss_coef=0.1))  # entropy_coeff: 0, the default
    assert objective.entropy_coeff == 0

    def former(outputs, mb):  # the composition before: the entropy times 0, kept in the graph
        loss, metrics = objective(outputs, mb)
        return loss - 0.0 * outputs["entropy"], metrics

    fn = vocab_parallel._VocabParallelLogProbEntropy
    backward, branches = fn.backward, []

    def recording(ctx, grad_logp, grad_entropy):
        branches.append(grad_entropy is not None)
        return backward(ctx, grad_logp, grad_entropy)

    fn.backward = staticmethod(recording)
    grads, losses, taken = [], [], []
    try:
        for loss_fn in (objective, former):
            for p in params:
                p.grad = None
            branches.clear()
            # the worker's head and call (ActorWorker.update_actor)
            head = compute.LogProbHead(with_entropy=True, vocab_size=actor.shape.vocab_size)
            out = compute.forward_backward(opt.chunks, batch, loss_fn, 4, head=head)
            grads.append([p.grad.clone() for p in params])
            losses.append(float(out.loss))
            taken.append(sorted(set(branches)))
    finally:
        fn.backward = backward
    same = all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    return {"same": same, "losses": losses, "taken": taken}


def test_an_update_without_an_entropy_bonus_skips_the_entropys_gradient(tmp_path):
    """With ``entropy_coeff: 0`` the trainer's objective and head (``ActorLoss``, ``LogProbHead(with_entropy=True)``)
    hand the vocab head's backward no entropy gradient, so it takes the log-prob-only branch; the loss and every
    parameter's gradient equal, bitwise, those of the former ``pg - 0 * H``, whose zero gradient ran the entropy
    branch."""
    batch = grpo_batch()
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.1
    paths = {"actor": hf_tiny.make_checkpoint("llama", str(tmp_path / "actor"), seed=21)}
    res = run_ranks(_entropy_body, 1, paths, batch, timeout=600)[0]
    assert res["taken"] == [[False], [True]], res["taken"]
    assert res["losses"][0] == res["losses"][1], res["losses"]
    assert res["same"]

"""CriticWorker.update_critic on 2 gloo ranks (TP 1 x DP 2), through the worker group the trainer uses.

- critic.loss_agg_mode is the critic's own (the actor's stays token-mean): the update's loss equals the value
  loss aggregated by hand with verl's definition of each of the five modes, over the whole batch (both DP
  ranks), loss_scale_factor given or derived (data.max_response_length);
- ppo_mini_batch_size counts prompts: 2 prompts x rollout.n 2 in mini-batches of 1 prompt are 2 optimizer steps
  (read off the warmup learning rate), not 4.
The first update's loss is computed before any weight changes, on the values compute_values returned; with
``values`` (the old values) equal to them the clip is idle and the per-token loss is ``0.5 (V - R)^2``.
"""

from __future__ import annotations

import pytest
import torch

from tests.mcore import hf_tiny
from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank

LENGTHS = ((10, 6), (4, 3), (7, 1), (5, 8))  # (prompt, response) per row: 2 prompts x rollout.n 2
PROMPT, RESPONSE = 10, 8  # RESPONSE = tiny_cpu.yaml's data.max_response_length
MODES = [("token-mean", None), ("token-sum", None), ("seq-mean-token-sum", None), ("seq-mean-token-mean", None),
         ("seq-mean-token-sum-norm", None), ("seq-mean-token-sum-norm", 3.0)]  # fmt: skip
BASE = ["actor.megatron.tp_size=1", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_gpu=1", "actor.loss_agg_mode=token-mean", "critic.optim.lr=1.0",
        "critic.optim.lr_warmup_steps=100"]  # fmt: skip


def _batch(seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(LENGTHS), PROMPT + RESPONSE, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(LENGTHS):
        ids[i, PROMPT - p : PROMPT + r] = torch.randint(1, hf_tiny.VOCAB, (p + r,), generator=g)
        mask[i, PROMPT - p : PROMPT + r] = 1
    response_mask = mask[:, PROMPT:].clone()
    response_mask[0, 2] = 0  # a token the policy did not write (a tool's output): out of the loss
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, PROMPT:].clone(),
        "response_mask": response_mask,
        "returns": torch.randn(len(LENGTHS), RESPONSE, generator=g) * response_mask,
    }


def _body(rank: int, world: int, path: str, batch: dict) -> dict:
    from hybridrl.config import load_config, run_layout
    from hybridrl.distributed import init_model_parallel
    from hybridrl.protocol import DataProto
    from hybridrl.trainer.rl_trainer import role_workers
    from hybridrl.workers import ResourcePool, WorkerGroup

    layout = run_layout(load_config("tiny_cpu.yaml", BASE, world_size=world), world)
    init_model_parallel(layout)

    def update(overrides: list[str]) -> tuple[list, dict]:
        cfg = load_config("tiny_cpu.yaml", BASE + overrides, world_size=world)
        critic = WorkerGroup(ResourcePool(process_on_nodes=[world]), role_workers(cfg, layout, path)["critic"])
        values = critic.compute_values(DataProto.from_dict(tensors=batch)).batch["values"]
        data = DataProto.from_dict(tensors={**batch, "values": values})  # old values = current: the clip is idle
        return values.tolist(), critic.update_critic(data).meta_info["metrics"]

    out = {}
    for mode, scale in MODES:
        extra = [f"critic.loss_scale_factor={scale}"] if scale else []
        values, metrics = update([f"critic.loss_agg_mode={mode}", "critic.ppo_mini_batch_size=2", *extra])
        out[f"{mode}/{scale}"] = (values, metrics["critic/loss"])
    _, metrics = update(["critic.ppo_mini_batch_size=1"])
    out["lr"] = metrics["critic/lr"]
    return out


def _by_hand(values: torch.Tensor, batch: dict, mode: str, scale: float | None) -> float:
    """verl's agg_loss definitions over the whole batch (core_algos.py; actor.yaml's loss_scale_factor)."""
    m = batch["response_mask"].double()
    per_token = 0.5 * (values.double() - batch["returns"].double()) ** 2
    sums, lengths = (per_token * m).sum(1), m.sum(1)
    seqs = float((lengths > 0).sum())
    return {
        "token-mean": float(sums.sum() / lengths.sum()),
        "token-sum": float(sums.sum()),
        "seq-mean-token-sum": float(sums.sum() / seqs),
        "seq-mean-token-mean": float((sums / lengths).sum() / seqs),
        "seq-mean-token-sum-norm": float(sums.sum() / seqs / (scale or RESPONSE)),
    }[mode]


def test_critic_loss_modes_and_mini_batch_unit(tmp_path):
    path = hf_tiny.make_checkpoint("llama", str(tmp_path / "critic"), seed=4, score=True)  # a nonzero value head
    batch = _batch()
    for got in run_ranks(_body, 2, path, batch, timeout=600):
        for mode, scale in MODES:
            values, loss = got[f"{mode}/{scale}"]
            expected = _by_hand(torch.tensor(values), batch, mode, scale)
            assert loss == pytest.approx(expected, rel=1e-5), (mode, scale, loss, expected)
        # warmup lr of update k is (k + 1) / 100: the mean over 2 updates is 0.015 (4 updates would give 0.025)
        assert got["lr"] == pytest.approx((1 + 2) / 2 / 100), got["lr"]

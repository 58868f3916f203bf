"""torchrun worker of test_checkpoint_parts.py (2 ranks, TP 2): a trained role's checkpoint part, round trip.

    torchrun --nproc-per-node 2 -m tests.trainer.parts_worker HF_SCORE_MODEL CKPT_DIR RESULT_FILE

A critic worker group (the trainer's builders and tiny_cpu.yaml) updates once, then saves through its declared
methods (``save_checkpoint`` + ``state_dict``, JSON round trip); a fresh group checks and loads it
(``check_checkpoint``, ``load_checkpoint``, ``load_state_dict``); a third fresh group loads nothing. All three
then make the same second update. Rank 0 writes RESULT_FILE (torch.save): each group's second-update metrics,
values after it, and update count. The ``__main__`` guard matters: dist_checkpointing.save starts a
spawn-context manager that re-imports it.
"""

from __future__ import annotations

import json
import os
import sys

import torch

PROMPT, RESPONSE = 6, 8  # RESPONSE = tiny_cpu.yaml's data.max_response_length
# 2 prompts x rollout.n 2 in mini-batches of 1 prompt: 2 updates per step, in an order drawn from the update count
OVERRIDES = ["data.train_batch_size=2", "rollout.n=2", "critic.ppo_mini_batch_size=1", "critic.optim.lr=1e-2",
             "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_gpu=1"]  # fmt: skip


def _batch(seed: int, vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (4, PROMPT + RESPONSE), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    mask[2, PROMPT + 5 :] = 0  # a short response
    ids = ids * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(1) - 1).clamp(min=0),
        "responses": ids[:, PROMPT:].clone(),
        "response_mask": mask[:, PROMPT:].clone(),
        "returns": torch.randn(4, RESPONSE, generator=g),
    }


def main(model_path: str, ckpt: str, result_file: str) -> None:
    import torch.distributed as dist

    from hybridrl.config import load_config, run_layout
    from hybridrl.distributed import init_distributed, init_model_parallel
    from hybridrl.protocol import DataProto
    from hybridrl.trainer.rl_trainer import role_workers
    from hybridrl.workers import ResourcePool, WorkerGroup
    from tests.mcore import hf_tiny

    init_distributed()
    cfg = load_config("tiny_cpu.yaml", OVERRIDES, world_size=2)
    layout = run_layout(cfg, 2)
    init_model_parallel(layout, seed=cfg.trainer.seed)
    pool = ResourcePool(process_on_nodes=[2])

    def critic() -> WorkerGroup:
        return WorkerGroup(pool, role_workers(cfg, layout, model_path)["critic"])

    def update(group: WorkerGroup, seed: int) -> dict:
        batch = _batch(seed, hf_tiny.VOCAB)
        values = group.compute_values(DataProto.from_dict(tensors=batch)).batch["values"]
        return group.update_critic(DataProto.from_dict(tensors={**batch, "values": values})).meta_info["metrics"]

    trained = critic()
    update(trained, seed=1)
    path = os.path.join(ckpt, "critic")
    trained.save_checkpoint(path)
    state = json.loads(json.dumps(trained.state_dict()))  # what trainer_state.json keeps
    restored, fresh = critic(), critic()
    restored.check_checkpoint(path)
    restored.load_checkpoint(path)
    restored.load_state_dict(state)
    out = {"state": state}
    probe = DataProto.from_dict(tensors=_batch(3, hf_tiny.VOCAB))
    for name, group in (("trained", trained), ("restored", restored), ("fresh", fresh)):
        metrics = update(group, seed=2)
        out[name] = {"metrics": metrics, "values": group.compute_values(probe).batch["values"],
                     "version": group.state_dict()["version"]}  # fmt: skip
    if dist.get_rank() == 0:
        torch.save(out, result_file)
    dist.barrier()


if __name__ == "__main__":
    main(*sys.argv[1:4])

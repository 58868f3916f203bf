"""The LR schedule advances once per optimizer update, so its length is counted in updates: trainer steps x
(train_batch_size / ppo_mini_batch_size, both in prompts) x ppo_epochs. Counted in trainer steps, a cosine
decay would end after 1/updates-per-step of the run and the rest train at min_lr."""

from __future__ import annotations

import math

from hybridrl.config import load_config
from hybridrl.config.checks import optimizer_steps
from hybridrl.workers.megatron_workers import optim_config


def test_schedule_spans_the_whole_run_in_updates():
    cfg = load_config(
        "tiny_cpu.yaml",
        ["trainer.total_steps=10", "data.train_batch_size=8", "rollout.n=2", "actor.ppo_mini_batch_size=2",
         "actor.ppo_micro_batch_size_per_gpu=2", "actor.ppo_epochs=2", "critic.ppo_mini_batch_size=4",
         "critic.ppo_micro_batch_size_per_gpu=2", "critic.ppo_epochs=1", "actor.optim.lr_decay_style=cosine",
         "actor.optim.lr=1.0", "actor.optim.min_lr=0.0", "actor.optim.lr_warmup_ratio=0.1"],
        world_size=2,
    )  # fmt: skip
    assert optimizer_steps(cfg, "actor") == 10 * (8 // 2) * 2 == 80  # 2 prompts = 4 responses per update
    assert optimizer_steps(cfg, "critic") == 10 * (8 // 4) * 1 == 20
    schedule = optim_config(cfg.actor.optim, optimizer_steps(cfg, "actor")).schedule()
    per_step = 8
    assert schedule(0) == 1.0 / 8  # warmup: 10% of 80 updates
    # halfway through the run (trainer step 5 of 10), a cosine from 1 to 0 after 8 warmup updates is near 0.5
    halfway = schedule(5 * per_step)
    assert math.isclose(halfway, 0.5 * (1 + math.cos(math.pi * (40 - 8) / (80 - 8))), rel_tol=1e-9)
    assert 0.4 < halfway < 0.7
    assert schedule(9 * per_step) > 0.0  # the last trainer step still learns

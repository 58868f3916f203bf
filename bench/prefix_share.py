"""What prompt sharing saves (``share_prefix``, hybridrl.mcore.prefix_share): FLOPs and time of the scoring and
training passes on GRPO groups, shared vs unshared, CPU, one rank.

A ~24M-parameter Llama (hidden 512, 4 layers, 8 heads in 4 KV groups, SwiGLU 1536, vocabulary 11008), fp32.
The batch: ``--groups`` prompts of ``--prompt`` tokens, each with ``--n`` responses of ``--response`` tokens
(the defaults: n = 8 and a 4:1 prompt:response ratio, 128:32), left/right-padded as rollout pads them, one group
per micro-batch (``--micro`` = n). Both passes run in the same process, alternated, median of ``--repeat``:
- scoring: ``compute.compute_log_probs`` with entropy (old / reference log-probs; critic values cost the same);
- training: ``compute.forward_backward`` of a PPO-like loss (the actor update's forward + backward).
FLOPs are counted from the shapes the model runs: per token the linear layers (q/k/v, o, SwiGLU, output layer),
and per (query, key) pair the attention scores and the weighted sum that are actually computed (dense ``s x s``
per unshared row; the prompt block plus each response against ``[prompt, own]`` per packed row); training counts
backward as twice forward. Log-probs and gradients of the two passes are compared too.

    python bench/prefix_share.py [--groups 4] [--n 8] [--prompt 128] [--response 32] [--repeat 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPE = dict(num_layers=4, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=1536,
             vocab_size=11008, max_seq_len=4096)  # fmt: skip


def grpo_batch(groups: int, n: int, prompt: int, response: int, vocab: int, seed: int = 0) -> dict:
    """``groups`` prompts x ``n`` responses, padded to 1.25x the lengths (as rollout pads to the maxima)."""
    g = torch.Generator().manual_seed(seed)
    pw, rw = prompt + prompt // 4, response + response // 4
    b = groups * n
    ids = torch.zeros(b, pw + rw, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i in range(groups):
        p = torch.randint(1, vocab, (prompt,), generator=g)
        for j in range(i * n, (i + 1) * n):
            ids[j, pw - prompt : pw], ids[j, pw : pw + response] = p, torch.randint(1, vocab, (response,), generator=g)
            mask[j, pw - prompt : pw + response] = 1
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, pw:].clone(),
            "response_mask": mask[:, pw:].float(), "advantages": torch.randn(b, rw, generator=g)}  # fmt: skip


def forward_flops(shape, micro_batches: list[dict]) -> float:
    """Forward FLOPs of the micro-batches as the model runs them (module docs)."""
    h, heads, groups, ffn = shape.hidden_size, shape.num_attention_heads, shape.num_query_groups, shape.ffn_hidden_size
    d = shape.kv_channels
    per_token = shape.num_layers * 2 * (h * (heads + 2 * groups) * d + heads * d * h + 3 * h * ffn)
    per_token += 2 * h * shape.padded_vocab
    per_pair = shape.num_layers * 4 * heads * d  # q.k and p.v per head
    total = 0.0
    for mb in micro_batches:
        rows, width = mb["model_input_ids"].shape
        mask = mb["model_attention_mask"]
        if "packed_index" in mb:  # packed: (G, K, Rw, Pw + Rw)
            k, rw, w = mask.shape[1:]
            pairs = (w - rw) ** 2 + k * rw * w
        else:
            pairs = width * width
        total += rows * (width * per_token + pairs * per_pair)
    return total


def _micro_batches(chunks, batch, micro: int, share: bool) -> list[dict]:
    """The micro-batches ``compute`` runs for this batch (the same calls as forward_backward)."""
    from hybridrl.mcore import compute, prefix_share

    prepared = compute.prepare_batch(batch)
    if share:
        return prefix_share.plan(prepared, micro, len(batch["input_ids"]), one_width=False).micro_batches
    prepared, _ = compute.group_by_length(chunks, prepared)
    return compute.micro_batches_trimmed(chunks, prepared, micro)


def _time(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _body(rank: int, world: int, args: dict) -> dict:
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import compute, gpt

    torch.set_num_threads(args["threads"])
    init_model_parallel(ParallelLayout.from_world(world), seed=1)
    shape = gpt.GPTShape(**SHAPE)
    chunks = gpt.build_model_chunks(shape, gpt.make_config(shape))
    params = sum(p.numel() for c in chunks for p in c.parameters())
    batch = grpo_batch(args["groups"], args["n"], args["prompt"], args["response"], shape.vocab_size)
    micro = args["micro"] or args["n"]

    def loss_fn(outputs, mb):
        return -mb["advantages"] * torch.exp(outputs["log_probs"] - outputs["log_probs"].detach()), {}

    def score(share):
        return compute.compute_log_probs(chunks, batch, micro, with_entropy=True, share_prefix=share)

    def train(share):
        for p in chunks[0].parameters():
            p.grad = None
        compute.forward_backward(chunks, batch, loss_fn, micro, share_prefix=share)
        return {n: p.grad.clone() for n, p in chunks[0].named_parameters()}

    out = {"params": params, "flops": {s: forward_flops(shape, _micro_batches(chunks, batch, micro, s)) for s in
                                       (False, True)}}  # fmt: skip
    lp = {s: score(s)["log_probs"] for s in (False, True)}  # also the warm-up
    grads = {s: train(s) for s in (False, True)}
    valid = batch["response_mask"].bool()
    out["lp_diff"] = float((lp[True] - lp[False])[valid].abs().max())
    out["grad_diff"] = max(float((grads[True][n] - grads[False][n]).abs().max()) for n in grads[False])
    times = {(p, s): [] for p in ("scoring", "training") for s in (False, True)}
    for _ in range(args["repeat"]):  # alternated: load on the machine hits both sides alike
        for s in (False, True):
            times[("scoring", s)] += _time(lambda s=s: score(s), 1)
            times[("training", s)] += _time(lambda s=s: train(s), 1)
    out["times"] = {k: statistics.median(v) for k, v in times.items()}
    return out


def main() -> None:
    from hybridrl.distributed.spawn import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--micro", type=int, default=0, help="responses per micro-batch (0: n)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = vars(parser.parse_args())
    res = run_ranks(_body, 1, args, timeout=7200)[0]
    flops = res["flops"]
    print(
        f"Llama {res['params'] / 1e6:.1f}M params, fp32, 1 rank x {args['threads']} thread(s); {args['groups']} "
        f"prompts x n={args['n']}, prompt:response {args['prompt']}:{args['response']}, micro-batch "
        f"{args['micro'] or args['n']}; median of {args['repeat']}, shared and unshared alternated"
    )
    print(f"{'pass':10s} {'unshared GFLOP':>15s} {'shared GFLOP':>13s} {'FLOPs':>7s} {'unshared s':>11s} "
          f"{'shared s':>9s} {'time':>7s}")  # fmt: skip
    for name, factor in (("scoring", 1), ("training", 3)):
        fu, fs = factor * flops[False] / 1e9, factor * flops[True] / 1e9
        tu, ts = res["times"][(name, False)], res["times"][(name, True)]
        print(f"{name:10s} {fu:15.1f} {fs:13.1f} {fs / fu:6.3f}x {tu:11.3f} {ts:9.3f} {ts / tu:6.3f}x")
    print(f"shared vs unshared: log-probs max |diff| {res['lp_diff']:.2e}, gradients max |diff| {res['grad_diff']:.2e}")


if __name__ == "__main__":
    main()

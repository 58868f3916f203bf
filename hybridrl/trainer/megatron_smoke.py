"""Interim quickstart job: train the config's tiny model with Megatron tensor/pipeline parallelism on CPU.

Until the RL trainer (``fit()``) exists, ``bash launch/quickstart.sh`` runs this: it reads a run config
(default ``tiny_cpu.yaml``), initialises the launch environment and Megatron's groups from
``actor.megatron``, builds the model from ``model.architecture`` with random weights, and trains it with
AdamW on a toy next-token task (``x[t+1] = (5 * x[t] + 3) mod 64``) through Megatron's pipeline schedule.
The loss must fall from ~ln(vocab) towards 0, and every tensor-parallel rank must agree on it.

    torchrun --nproc-per-node 2 -m hybridrl.trainer.megatron_smoke [CONFIG] [key=value ...]
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.distributed as dist

from hybridrl.config import load_config
from hybridrl.distributed import ParallelLayout, init_distributed, init_model_parallel

TASK_TOKENS = 64


def toy_batch(generator: torch.Generator, batch: int, seq: int) -> dict[str, torch.Tensor]:
    """Sequences of ``x[t+1] = (5 x[t] + 3) mod 64`` from random starts; labels are the next tokens."""
    x = torch.empty(batch, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, TASK_TOKENS, (batch,), generator=generator)
    for t in range(seq):
        x[:, t + 1] = (5 * x[:, t] + 3) % TASK_TOKENS
    return {
        "input_ids": x[:, :-1].contiguous(),
        "labels": x[:, 1:].contiguous(),
        "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
    }


def main(argv: list[str]) -> int:
    from hybridrl.mcore import gpt  # Megatron is imported only once the launch is known to be sane

    name = argv[0] if argv and "=" not in argv[0] else "tiny_cpu.yaml"
    overrides = [a for a in argv if "=" in a]
    penv = init_distributed()
    cfg = load_config(name, overrides, world_size=penv.world_size)
    mcfg, arch = cfg.actor.megatron, cfg.model.architecture
    layout = ParallelLayout.from_world(penv.world_size, tp=mcfg.tp_size, pp=mcfg.pp_size, vpp=mcfg.vpp_size or 1)
    init_model_parallel(layout, seed=cfg.trainer.seed)
    shape = gpt.GPTShape(
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads or arch.num_attention_heads,
        ffn_hidden_size=arch.intermediate_size,
        vocab_size=arch.vocab_size,
        max_seq_len=arch.max_position_embeddings or 512,
        rope_theta=arch.rope_theta or 10000.0,
        norm_eps=arch.rms_norm_eps or 1e-6,
    )
    dtype = getattr(torch, cfg.model.dtype)
    chunks = gpt.build_model_chunks(shape, gpt.make_config(shape, dtype=dtype))
    params = [p for c in chunks for p in c.parameters()]
    optim = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    if penv.rank == 0:
        n = sum(p.numel() for p in params)
        print(f"[smoke] {layout.describe()}  model {arch.model_type} {n / 1e6:.2f}M params on rank 0", flush=True)

    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    steps = 30
    first = last = float("nan")
    start = time.perf_counter()
    for step in range(steps):
        micro = [toy_batch(gen, 2, 32) for _ in range(2)]
        optim.zero_grad(set_to_none=True)
        metrics = gpt.forward_backward(chunks, micro, lambda out, b: (out.mean(), {"loss": out.mean().detach()}))
        optim.step()
        loss = torch.tensor([sum(m["loss"].item() for m in metrics) / max(1, len(metrics))])
        dist.all_reduce(loss, op=dist.ReduceOp.MAX)  # only the last PP stage holds it; others report 0
        last = loss.item()
        first = last if step == 0 else first
        if penv.rank == 0 and (step % 5 == 0 or step == steps - 1):
            print(f"[smoke] step {step:3d}  loss {last:.4f}", flush=True)
    elapsed = time.perf_counter() - start
    ok = last < 0.5 * first and math.isfinite(last)
    if penv.rank == 0:
        verdict = "learned" if ok else "DID NOT LEARN"
        print(f"[smoke] {verdict}: loss {first:.3f} -> {last:.3f} in {steps} steps ({elapsed:.1f} s)", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Memory of an FSDP critic vs a Megatron one, per rank, on the same model, ranks and update (2 CPU gloo ranks).

The critic is built as the trainer builds it (``role_workers`` of tiny_cpu.yaml with ``critic.backend`` and the
layout overridden, from one random-init HF Llama folder with a value head, made here: ``--hidden 512 --layers 8``
by default, ~40M parameters, fp32), runs ``compute_values`` + ``update_critic`` on 16 responses, and reports per rank:

- ``state MB``: parameters + gradients (one per trainable parameter, what an update holds) + Adam moments, counted
  from the tensors this rank holds (a DTensor counts its local shard);
- ``peak RSS MB``: the process's peak resident set minus its RSS before the build (the build's transient copies
  included: each FSDP rank reads the whole HF folder before sharding it). The ranks run with glibc's
  ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB, so that freed large buffers (FSDP's gathered layers and unsharded
  gradients, freed after each layer) go back to the OS as they would to a GPU caching allocator; with glibc's
  default (a threshold that grows after frees) the heap keeps them and FSDP's peak RSS reads as a full replica's.

Three layouts, one launch each: Megatron TP 1 x DP 2 (the baseline: each rank a full replica), Megatron TP 2
(layers split), FSDP over both ranks. Ratios are against the baseline, from the same invocation.

    python bench/fsdp_memory.py [--hidden 512] [--layers 8] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PROMPT, RESPONSE, ROWS = 16, 8, 16
LAYOUTS = (("megatron", 1, "Megatron TP1 x DP2"), ("megatron", 2, "Megatron TP2"), ("fsdp", 1, "FSDP x 2"))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (ROWS, PROMPT + RESPONSE), generator=g)
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(1) - 1,
            "responses": ids[:, PROMPT:].clone(), "response_mask": mask[:, PROMPT:].clone(),
            "returns": torch.randn(ROWS, RESPONSE, generator=g)}  # fmt: skip


def _body(rank: int, world: int, path: str, backend: str, tp: int, vocab: int) -> dict[str, float]:
    from hybridrl.config import load_config, run_layout
    from hybridrl.distributed import init_model_parallel
    from hybridrl.protocol import DataProto
    from hybridrl.trainer.rl_trainer import role_workers
    from hybridrl.workers import ResourcePool, WorkerGroup

    overrides = [f"actor.megatron.tp_size={tp}", f"critic.backend={backend}", "data.train_batch_size=16",
                 "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=4",
                 f"critic.model_path={path}"]  # fmt: skip
    cfg = load_config("tiny_cpu.yaml", overrides, world_size=world)
    layout = run_layout(cfg, world)
    init_model_parallel(layout)
    before = _rss_mb()
    critic = WorkerGroup(ResourcePool(process_on_nodes=[world]), role_workers(cfg, layout, path)["critic"])
    batch = _batch(vocab)
    values = critic.compute_values(DataProto.from_dict(tensors=batch)).batch["values"]
    critic.update_critic(DataProto.from_dict(tensors={**batch, "values": values}))
    worker = critic.worker
    params = [p for p in worker.model.parameters()]
    trainable = [p for p in params if p.requires_grad]
    optim = worker.optimizer.optimizer
    moments = [v for s in optim.state.values() for k, v in s.items() if torch.is_tensor(v) and k != "step"]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {"params": _local_bytes(params) / 2**20, "grads": _local_bytes(trainable) / 2**20,
            "moments": _local_bytes(moments) / 2**20, "peak": peak - before}  # fmt: skip


def _checkpoint(out: str, hidden: int, layers: int, vocab: int) -> str:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=vocab, max_position_embeddings=512, num_labels=1, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(config)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    from hybridrl.distributed.spawn import run_ranks

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # the spawned ranks' allocator (module docs)
    with tempfile.TemporaryDirectory() as tmp:
        path = _checkpoint(os.path.join(tmp, "critic"), args.hidden, args.layers, args.vocab)
        rows = []
        for backend, tp, name in LAYOUTS:
            per_rank = run_ranks(_body, 2, path, backend, tp, args.vocab, timeout=900)
            rows.append((name, max(per_rank, key=lambda r: r["params"] + r["grads"] + r["moments"])))
    base_state = sum(rows[0][1][k] for k in ("params", "grads", "moments"))
    base_peak = rows[0][1]["peak"]
    print(f"critic hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, fp32, 2 ranks (largest rank shown)")
    print(f"{'layout':<20}{'params MB':>10}{'grads MB':>10}{'Adam MB':>10}{'state MB':>10}{'x base':>8}"
          f"{'peak RSS MB':>13}{'x base':>8}")  # fmt: skip
    for name, r in rows:
        state = r["params"] + r["grads"] + r["moments"]
        print(f"{name:<20}{r['params']:>10.1f}{r['grads']:>10.1f}{r['moments']:>10.1f}{state:>10.1f}"
              f"{state / base_state:>8.2f}{r['peak']:>13.1f}{r['peak'] / base_peak:>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()

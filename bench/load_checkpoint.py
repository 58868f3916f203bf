"""Load time and peak memory of a ~100M-parameter HF Llama checkpoint: Megatron TP2 via the bridge vs transformers.

One random ``LlamaForCausalLM`` is saved as safetensors in a temporary folder, then read back in the same run:
- HF from_pretrained: ``LlamaForCausalLM.from_pretrained(path)`` in one process (the baseline);
- HF build + load_state_dict: ``LlamaForCausalLM(config)`` (random init), then ``load_file`` + ``load_state_dict``;
- Megatron TP2: two gloo ranks each build their half of the model (``gpt.build_model_chunks``) and fill it with
  ``bridge.load``, which reads only that rank's rows (seconds are the slower rank's).

Every case runs in fresh processes with one thread each, so the peak RSS (``ru_maxrss``) is that case's own;
"+RSS" is the peak above the process's RSS just before construction (i.e. what the model and its load cost).
The file is in the page cache for every case (it was just written).

    python bench/load_checkpoint.py [--dtype fp32|bf16] [--hidden 768] [--layers 12]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import threading
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _anon_mb() -> float:
    """Anonymous resident memory (heap, tensors), leaving out file-backed pages such as mmap-ed safetensors."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 1024


class _AnonPeak:
    """Samples :func:`_anon_mb` every 2 ms in a thread (a lower bound on the true peak)."""

    def __enter__(self) -> _AnonPeak:
        self.start, self.peak, self._stop = _anon_mb(), _anon_mb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _anon_mb())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_mb())


def _result(construct: float, load: float, base: float, phases: list[_AnonPeak], params: int) -> dict:
    return {
        "construct": construct,
        "load": load,
        "peak": _peak_mb(),
        "grow": _peak_mb() - base,
        "anon": [ph.peak - phases[0].start for ph in phases],
        "params": params,
    }


def _hf_body(rank: int, world: int, path: str, dtype_name: str, mode: str) -> dict:
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = DTYPES[dtype_name]
    config = LlamaConfig.from_pretrained(path)
    base = _rss_mb()
    if mode == "from_pretrained":
        construct = float("nan")
        with _AnonPeak() as ph_load:
            start = time.perf_counter()
            model = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
            load = time.perf_counter() - start
        phases = [ph_load, ph_load]
    else:
        with _AnonPeak() as ph_build:
            start = time.perf_counter()
            model = LlamaForCausalLM._from_config(config, dtype=dtype)
            construct = time.perf_counter() - start
        with _AnonPeak() as ph_load:
            start = time.perf_counter()
            model.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=True)
            load = time.perf_counter() - start
        phases = [ph_build, ph_load]
    assert next(model.parameters()).dtype == dtype
    return _result(construct, load, base, phases, sum(p.numel() for p in model.parameters()))


def _mcore_body(rank: int, world: int, path: str, dtype_name: str, init: bool) -> list[dict]:
    import torch.distributed as dist

    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.mcore import bridge, gpt, hf_config

    init_model_parallel(ParallelLayout.from_world(world, tp=world), seed=1)
    hf = hf_config.load_hf_config(path)  # outside the timing: its first call imports transformers
    dist.barrier()
    base = _rss_mb()
    with _AnonPeak() as ph_build:
        start = time.perf_counter()
        shape, config = hf_config.from_hf(hf, DTYPES[dtype_name], perform_initialization=init)
        chunks = gpt.build_model_chunks(shape, config)
        construct = time.perf_counter() - start
    dist.barrier()
    with _AnonPeak() as ph_load:
        start = time.perf_counter()
        ckpt = bridge.HFCheckpoint(path)
        bridge.validate(ckpt, shape, world)
        skipped = bridge.load(chunks, shape, ckpt)
        load = time.perf_counter() - start
    assert not skipped, skipped
    params = sum(p.numel() for c in chunks for p in c.parameters())
    mine = _result(construct, load, base, [ph_build, ph_load], params)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def _write_checkpoint(path: str, args: dict) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=args["hidden"],
        num_hidden_layers=args["layers"],
        num_attention_heads=args["hidden"] // 64,
        num_key_value_heads=args["hidden"] // 192,
        intermediate_size=args["ffn"],
        vocab_size=args["vocab"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM._from_config(config, dtype=DTYPES[args["dtype"]])
    model.save_pretrained(path, safe_serialization=True, max_shard_size="100GB")  # one file: HF-manual reads it
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    from hybridrl.distributed.spawn import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--hidden", type=int, default=768, help="multiple of 384 (64-dim heads, 3 q heads per kv)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    args = vars(parser.parse_args())
    with tempfile.TemporaryDirectory(prefix="hybridrl-load-bench-") as path:
        n_params = _write_checkpoint(path, args)
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
        launch = lambda fn, n, *a: run_ranks(fn, n, path, args["dtype"], *a, timeout=900)[0]  # noqa: E731
        rows = {
            "HF from_pretrained": [launch(_hf_body, 1, "from_pretrained")],
            "HF build+load_state": [launch(_hf_body, 1, "manual")],
            "Megatron TP2 bridge": launch(_mcore_body, 2, True),
            "  same, no init": launch(_mcore_body, 2, False),
        }
    base = rows["HF from_pretrained"][0]["load"]
    print(
        f"Llama hidden={args['hidden']} layers={args['layers']} ffn={args['ffn']} vocab={args['vocab']}: "
        f"{n_params / 1e6:.1f}M params, {args['dtype']}, safetensors {size / 2**20:.0f} MiB; 1 thread per process"
    )
    head = f"{'case':20s} {'construct s':>11s} {'load s':>7s} {'total s':>8s} {'vs HF':>6s}"
    print(f"{head} {'peak RSS MiB':>12s} {'+RSS MiB':>9s} {'+anon build/load':>17s} {'params':>6s}")
    for name, ranks in rows.items():
        construct = max(r["construct"] for r in ranks)
        load = max(r["load"] for r in ranks)
        total = load if construct != construct else construct + load
        cons = "(inside)" if construct != construct else f"{construct:.2f}"
        for i, r in enumerate(ranks):
            label = name if i == 0 else f"  rank {i}"
            times = f"{cons:>11s} {load:7.2f} {total:8.2f} {total / base:5.2f}x" if i == 0 else " " * 36
            anon = "/".join(f"{a:.0f}" for a in r["anon"])
            print(
                f"{label:20s} {times} {r['peak']:12.0f} {r['grow']:9.0f} {anon:>17s} {r['params'] / 1e6:5.1f}M"
                + (" (rank 0)" if len(ranks) > 1 and i == 0 else "")
            )
    print(
        "seconds: the slower rank's. vs HF: total / HF from_pretrained. +RSS: peak RSS above the RSS before\n"
        "construction. +anon: sampled peak of anonymous RSS (no mmap-ed file pages) above it, in construction / load."
    )


if __name__ == "__main__":
    main()

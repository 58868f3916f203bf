"""One GRPO step, hybridrl vs plain HF transformers + ``generate`` (the TRL-style baseline), on the same work.

The work (made in-process, nothing downloaded): arithmetic prompts ("12+7=", reward 1 when the response parses to
the sum), a sentencepiece tokenizer trained on them, a random-init HF Llama checkpoint (``--model tiny``: hidden
128, 2 layers, 0.85M params; ``small``: hidden 512, 4 layers, 23.7M params), 16 prompts x 4 samples per step,
responses of up to ``--response-length`` tokens (32), temperature 1, a reference model with a k3 KL loss (0.04),
PPO clip loss, one optimizer step per rollout, AdamW lr 1e-5, grad clip 1.0, fp32.

- baseline (what TRL's GRPOTrainer does without vLLM, written here with transformers alone, one process, all
  cores as torch threads): ``generate`` with sampling -> reward -> reference forward -> group advantages -> policy
  forward with grad + backward + clip + AdamW. No old-log-prob pass: with one step per rollout the ratio is 1.
- hybridrl: ``hybridrl train`` (the real entry: ``python -m hybridrl train`` for one process, under ``torchrun``
  for more) on the same checkpoint, tokenizer, prompts (in order) and reward (a custom scorer file), ``--nproc``
  processes (default: 2 for tiny (DP2), 1 for small, as the issue's best layouts), its stages from
  ``metrics.jsonl`` (``rollout`` includes the weight switch).

Both run as subprocesses of this script, alternated (HF first in odd rounds, hybridrl first in even ones), with
``--steps`` steps each; the first ``--warmup`` steps (default 1) are dropped: a CPU process's heap keeps growing
for its first few steps (the 23.7M model at 128 tokens: the reference pass touches ~87k fresh pages in each of
steps 2-4, ~0.9 s on this machine, and none from step 6; peak RSS 3.1 -> 4.3 GB), so ``--warmup 5 --steps 8``
measures the steady state a long run sees, for every side alike. Per stage: seconds per step and hybridrl / HF; for the
step: tokens/s (prompt + response tokens / step time) and its ratio; peak memory: the largest sum of RSS and of PSS
(shared pages counted once) over the side's process tree: RSS sampled every 0.2 s (cheap), PSS read whenever the
RSS sum reaches a new high (reading PSS walks every page of a process: 50 ms for a 4.6 GiB one, a fifth of a core
when it ran every 0.2 s, which slowed the sides' two-thread GEMMs). hybridrl's includes vLLM's
zero-filled KV cache per engine (sized to the rollout unless ``VLLM_CPU_KVCACHE_SPACE`` or
``rollout.cpu_kv_cache_gib`` says otherwise) and the launcher.

    python bench/step_vs_hf.py [--model tiny|small|both] [--response-length 32] [--steps 3] [--rounds 1]
    python bench/step_vs_hf.py --profile [--model small]   # where hybridrl's passes spend their time (in-process)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
MODELS = {  # HF Llama fields; vocab > the tokenizer's pieces (rows past it are never sampled by a trained model)
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2176),
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=10880),
}  # fmt: skip
NPROC = {"tiny": 2, "small": 1}
PROMPTS, N, KL_COEF, LR = 16, 4, 0.04, 1e-5
STAGES = (("rollout", "generate"), ("reward", "reward"), ("old_log_prob", None), ("ref", "ref"), ("adv", "adv"),
          ("update_actor", "update"), ("step", "step"))  # fmt: skip
"""(hybridrl stage, baseline stage) rows of the table."""
SCORER = '''def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1.0 when the response parses to the sum."""
    try:
        return float(int(solution_str.strip().split()[0]) == int(ground_truth))
    except (ValueError, IndexError):
        return 0.0
'''


# ---- the work ----------------------------------------------------------------------------------------------
def make_assets(out: str, model: str, count: int = 256, seed: int = 0) -> dict[str, str]:
    """Prompts (parquet), tokenizer, scorer and a random-init HF checkpoint under ``out``."""
    import torch
    import transformers

    from hybridrl.data.files import write_rows
    from hybridrl.data.tokenizers import train_sentencepiece

    rng = random.Random(seed)
    rows = []
    for i in range(count):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append(
            {
                "data_source": "arith",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"index": i},
            }
        )
    os.makedirs(out, exist_ok=True)
    texts = [r["prompt"][0]["content"] + r["reward_model"]["ground_truth"] for r in rows] + ["0123456789 +="]
    tok = train_sentencepiece(texts, vocab_size=64, out_prefix=os.path.join(out, "tokenizer"))
    config = transformers.LlamaConfig(**MODELS[model], max_position_embeddings=512, rms_norm_eps=1e-6,
                                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                                      eos_token_id=tok.eos_token_id, bos_token_id=2)  # fmt: skip
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(config).float()
    paths = {
        "model": os.path.join(out, "model"),
        "tokenizer": os.path.join(out, "tokenizer.model"),
        "data": str(write_rows(rows, os.path.join(out, "train.parquet"))),
        "scorer": os.path.join(out, "scorer.py"),
    }
    hf.save_pretrained(paths["model"], safe_serialization=True)
    with open(paths["scorer"], "w") as f:
        f.write(SCORER)
    paths["params"] = sum(p.numel() for p in hf.parameters())
    return paths


# ---- the baseline: transformers alone ------------------------------------------------------------------------
def _logps(model, ids, mask, response: int):
    """Per-token log-probs ``(b, response)`` of the last ``response`` tokens (temperature 1)."""
    import torch

    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    logits = logits[:, -response - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -response:].unsqueeze(-1)).squeeze(-1)


def hf_worker(spec: dict) -> None:
    """The baseline's steps (module docs); per-step stage seconds and tokens to ``spec['out']``."""
    import pyarrow.parquet as pq
    import torch
    import transformers

    from hybridrl.data.tokenizers import load_tokenizer

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    tok = load_tokenizer(spec["tokenizer"])
    rows = pq.read_table(spec["data"]).to_pylist()
    policy = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
    optim = torch.optim.AdamW(policy.parameters(), lr=LR, weight_decay=0.0)
    scorer = {}
    exec(SCORER, scorer)
    records = []
    for step in range(spec["steps"]):
        times, start = {}, time.perf_counter()
        batch = rows[step * PROMPTS : (step + 1) * PROMPTS]
        prompts = [tok.apply_chat_template(r["prompt"]) for r in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts]).repeat_interleave(N, 0)
        mask = (torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        mask = mask.repeat_interleave(N, 0)
        t = time.perf_counter()
        with torch.no_grad():
            seqs = policy.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                   top_p=1.0, max_new_tokens=spec["response"], pad_token_id=tok.pad_token_id,
                                   eos_token_id=tok.eos_token_id)  # fmt: skip
        times["generate"] = time.perf_counter() - t
        t = time.perf_counter()
        out = seqs[:, width:]
        r = out.shape[1]
        is_eos = out == tok.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1), r)
        resp_mask = (torch.arange(r)[None] <= first[:, None]).float()  # up to and including EOS
        texts = [tok.decode(o[: int(f)].tolist()) for o, f in zip(out, first, strict=True)]
        truth = [row["reward_model"]["ground_truth"] for row in batch for _ in range(N)]
        rewards = torch.tensor([scorer["compute_score"]("arith", s, g) for s, g in zip(texts, truth, strict=True)])
        times["reward"] = time.perf_counter() - t
        full_mask = torch.cat([mask, resp_mask.long()], 1)
        t = time.perf_counter()
        with torch.no_grad():
            ref_lp = _logps(ref, seqs, full_mask, r)
        times["ref"] = time.perf_counter() - t
        t = time.perf_counter()
        grouped = rewards.view(-1, N)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        times["adv"] = time.perf_counter() - t
        t = time.perf_counter()
        lp = _logps(policy, seqs, full_mask, r)
        ratio = torch.exp(lp - lp.detach())  # one optimizer step per rollout: old log-probs are the current ones
        pg = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
        diff = ref_lp - lp
        per_token = pg + KL_COEF * (torch.exp(diff) - diff - 1)  # k3 (Schulman 2020)
        loss = (per_token * resp_mask).sum() / resp_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        times["update"] = time.perf_counter() - t
        times["step"] = time.perf_counter() - start
        records.append({**times, "tokens": float(full_mask.sum()), "reward": float(rewards.mean())})
    with open(spec["out"], "w") as f:
        json.dump(records, f)


# ---- running the two sides -----------------------------------------------------------------------------------
def _label(proc) -> str:
    """A process of the tree by its role: ``rank N`` (a torchrun worker), else its program's name."""
    try:
        rank = proc.environ().get("RANK")
    except Exception:  # psutil.Error and platforms without environ()
        rank = None
    return f"rank {rank}" if rank is not None else proc.name()


def _run(cmd: list[str], env: dict, log: str) -> tuple[float, float, float, str]:
    """Run ``cmd``; (wall seconds, peak summed RSS GiB, peak summed PSS GiB of its process tree, the PSS of each of
    its processes at that peak). Exits on failure.

    RSS counts a page shared by n processes (libtorch's code, the files they map) n times; PSS counts 1/n of it
    in each, so the summed PSS is the memory the tree really holds. For one process the two differ only by pages
    shared with processes outside the tree."""
    import psutil

    peak = [0.0, 0.0]
    parts = [""]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        start = time.perf_counter()

        def poll() -> None:
            root = psutil.Process(proc.pid)
            pss_at = 0.0  # the RSS sum when PSS was last read
            seen: set[int] = set()  # the tree's pids at the previous poll
            while proc.poll() is None:
                try:
                    alive = [p for p in (root, *root.children(recursive=True)) if p.is_running()]
                    # A child younger than one poll may still share its parent's memory: Python's subprocess (lscpu,
                    # ninja, uname started by vLLM and torch) uses vfork, whose child maps the parent's pages as its
                    # own until it execs, so its PSS would count them again. A process is counted from the poll
                    # after the one that first saw it.
                    tree = [p for p in alive if p.pid in seen]
                    seen = {p.pid for p in alive}
                    rss = sum(p.memory_info().rss for p in tree) / 2**30
                    peak[0] = max(peak[0], rss)
                    if rss > pss_at * 1.01:  # a new high: read PSS (expensive) now
                        pss_at = rss
                        infos = [(p, p.memory_full_info()) for p in tree]
                        pss = sum(i.pss for _, i in infos) / 2**30
                        if pss > peak[1]:
                            peak[1] = pss
                            parts[0] = ", ".join(f"{_label(p)} {i.pss / 2**30:.2f}" for p, i in infos)
                except psutil.Error:
                    pass
                time.sleep(0.2)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        proc.wait()
        watcher.join()
    if proc.returncode:
        with open(log) as f:
            sys.exit(f"failed (rc {proc.returncode}): {' '.join(cmd)}\n{f.read()[-5000:]}")
    return time.perf_counter() - start, peak[0], peak[1], parts[0]


def run_hf(paths: dict, args, work: str, threads: int) -> dict:
    spec = {**paths, "steps": args.steps, "response": args.response_length, "threads": threads, "seed": 1,
            "out": os.path.join(work, "hf.json")}  # fmt: skip
    with open(os.path.join(work, "hf_spec.json"), "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, os.path.abspath(__file__), "--hf-worker", os.path.join(work, "hf_spec.json")]
    wall, peak, pss, parts = _run(cmd, env, os.path.join(work, "hf.log"))
    with open(spec["out"]) as f:
        return {"records": json.load(f), "peak_gb": peak, "pss_gb": pss, "pss_parts": parts, "wall": wall}


def run_trl(paths: dict, args, work: str, threads: int) -> dict:
    """TRL's GRPOTrainer on the same work (``bench/trl_baseline.py``), from ``--trl-site``."""
    spec = {**paths, "steps": args.steps, "response": args.response_length, "threads": threads, "seed": 1,
            "out": os.path.join(work, "trl.json"), "work": os.path.join(work, "trl"),
            "gradient_checkpointing": args.trl_checkpointing}  # fmt: skip
    with open(os.path.join(work, "trl_spec.json"), "w") as f:
        json.dump(spec, f)
    site = os.path.abspath(args.trl_site)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join([site, ROOT])}
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", os.path.join(work, "trl_spec.json")]
    wall, peak, pss, parts = _run(cmd, env, os.path.join(work, "trl.log"))
    with open(spec["out"]) as f:
        out = json.load(f)
    mem = {"peak_gb": peak, "pss_gb": pss, "pss_parts": parts}
    return {"records": out["records"], "settings": out["settings"], **mem, "wall": wall}


def run_hybridrl(paths: dict, args, work: str, nproc: int, threads: int) -> dict:
    out = os.path.join(work, "hybridrl")
    shutil.rmtree(out, ignore_errors=True)
    micro = PROMPTS * N // nproc  # one micro-batch per pass: every response of a rank at once, as the baseline
    overrides = [
        f"model.path={paths['model']}", f"model.tokenizer_path={paths['tokenizer']}", "model.dtype=float32",
        "model.architecture.model_type=null", "model.architecture.vocab_size=null",
        "model.architecture.hidden_size=null", "model.architecture.intermediate_size=null",
        "model.architecture.num_hidden_layers=null", "model.architecture.num_attention_heads=null",
        "model.architecture.num_key_value_heads=null", "model.architecture.max_position_embeddings=null",
        "model.architecture.tie_word_embeddings=null",
        "data.demo_task=false", f"data.train_files=[{paths['data']}]", "data.shuffle=false",
        "data.max_prompt_length=16", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={PROMPTS}", f"reward.custom.path={paths['scorer']}",
        "actor.megatron.tp_size=1", f"actor.optim.lr={LR}", "actor.optim.weight_decay=0.0",
        f"actor.ppo_mini_batch_size={PROMPTS}", f"actor.ppo_micro_batch_size_per_gpu={micro}",
        "actor.use_kl_loss=true", f"actor.kl_loss_coef={KL_COEF}", "actor.kl_loss_type=low_var_kl",
        f"rollout.n={N}", "rollout.temperature=1.0", f"trainer.n_gpus_per_node={nproc}",
        f"trainer.total_steps={args.steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.loggers=[jsonl]", f"trainer.default_local_dir={out}", *args.hybridrl_override,
    ]  # fmt: skip
    # One process is a plain `python -m hybridrl train` (a single rank needs no launcher: torchrun's agent would be
    # one more process holding torch); more go through torchrun, as the launch scripts start them.
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone", "--nproc-per-node"]
    launcher = [sys.executable] if nproc == 1 else [*torchrun, str(nproc)]
    cmd = [*launcher, "-m", "hybridrl", "train", "tiny_cpu_grpo.yaml"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    wall, peak, pss, parts = _run(cmd + overrides, env, os.path.join(work, "hybridrl.log"))
    with open(os.path.join(out, "logs", "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "timing_s/step" in r]
    return {"records": records, "peak_gb": peak, "pss_gb": pss, "pss_parts": parts, "wall": wall}


WARMUP = 1
"""Steps dropped from each side's mean (``--warmup``)."""


def _mean(records: list[dict], key: str) -> float | None:
    kept = [r[key] for r in (records[WARMUP:] or records) if key in r]
    return sum(kept) / len(kept) if kept else None


def forward_flops(model: str, tokens: float, sequences: int) -> float:
    """Model FLOPs of one forward over ``tokens`` tokens in ``sequences`` causal rows: 2 x (matmul params) per token
    (the output layer included, the embedding lookup not) + 2 * h * L^2 per layer and row for the attention
    scores and their values (causal: half of 4 h L^2), L the mean row length. Backward is twice this."""
    c = MODELS[model]
    h, i, layers, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    per_token = 2 * (layers * (2 * h * h + 2 * h * kv + 3 * h * i) + h * v)
    length = tokens / max(sequences, 1)
    return per_token * tokens + layers * 2 * h * length**2 * sequences


PASSES = {"rollout": 1, "generate": 1, "old_log_prob": 1, "ref": 1, "update_actor": 3, "update": 3}
"""Forward-equivalents of each stage's model FLOPs (generation: each token once, with the KV cache)."""


def table(sides: dict[str, dict], model: str, peak: float) -> list[str]:
    """Per stage: each side's seconds, hybridrl's time ratio to each baseline and its share of the GEMM peak."""
    bases = [k for k in sides if k != "hybridrl"]
    hyb = sides["hybridrl"]
    cols = "".join(f" {k + ' s':>9s}" for k in sides) + "".join(f" {'hyb/' + k:>9s}" for k in bases)
    lines = [f"{'stage':14s}{cols}   share of the {peak:.0f} GFLOP/s fp32 GEMM peak (" + ", ".join(sides)
             + "); hybridrl's busy cores per process"]  # fmt: skip
    tokens = {k: _mean(r["records"], "tokens") for k, r in sides.items() if k != "hybridrl"}
    tokens["hybridrl"] = _mean(hyb["records"], "perf/tokens_per_s") * _mean(hyb["records"], "timing_s/step")
    step_flops = {k: 0.0 for k in sides}
    for ours, theirs in STAGES:
        secs = {k: _mean(r["records"], f"timing_s/{ours}" if k == "hybridrl" else theirs) if (k == "hybridrl" or theirs)
                else None for k, r in sides.items()}  # fmt: skip
        row = "".join(f" {secs[k]:9.3f}" if secs[k] is not None else f" {'-':>9s}" for k in sides)
        row += "".join(f" {secs['hybridrl'] / secs[k]:8.2f}x" if secs[k] and secs["hybridrl"] is not None
                       else f" {'-':>9s}" for k in bases)  # fmt: skip
        shares = []
        for k in sides:
            name = ours if k == "hybridrl" else theirs
            t = secs[k]
            if ours == "step":
                flops = step_flops[k]
            else:
                flops = PASSES.get(name, 0) * forward_flops(model, tokens[k], PROMPTS * N) if t else 0.0
                step_flops[k] += flops
            shares.append(f"{100 * flops / 1e9 / t / peak:3.0f}%" if t and flops else "  -")
        cores = _mean(hyb["records"], f"perf/cpu_cores/{ours}")
        lines.append(f"{ours:14s}{row}   {' '.join(shares)}" + (f"  {cores:4.2f}" if cores is not None else ""))
    tps = {k: tokens[k] / _mean(r["records"], "timing_s/step" if k == "hybridrl" else "step") for k, r in sides.items()}
    lines.append(f"{'tokens/s':14s}" + "".join(f" {tps[k]:9.1f}" for k in sides)
                 + "".join(f" {tps['hybridrl'] / tps[k]:8.2f}x" for k in bases) + "   (speed-up)")  # fmt: skip
    # hybridrl's step FLOPs take at least flops / peak: the largest tokens/s ratio that running faster can reach.
    floor = step_flops["hybridrl"] / 1e9 / peak
    lines.append(f"{'ceiling':14s}" + " " * 10 * len(sides)
                 + "".join(f" {tokens['hybridrl'] / floor / tps[k]:8.2f}x" for k in bases)
                 + "   (hybridrl's step FLOPs at 100% of the peak, no other cost)")  # fmt: skip
    for label, key in (("peak RSS GiB", "peak_gb"), ("peak PSS GiB", "pss_gb")):
        lines.append(f"{label:14s}" + "".join(f" {r[key]:9.2f}" for r in sides.values())
                     + "".join(f" {hyb[key] / sides[k][key]:8.2f}x" for k in bases))  # fmt: skip
    lines.append("(peak PSS GiB by process: " + "; ".join(f"{k}: {r['pss_parts']}" for k, r in sides.items()) + ")")
    if "trl" in sides:
        lines.append(f"(TRL settings: {sides['trl']['settings']})")
    return lines


def machine_peak(threads: int) -> float:
    """This CPU's fp32 GEMM GFLOP/s on ``threads`` threads in this process, measured now."""
    import torch
    from tp_scaling import gemm_peak

    torch.set_num_threads(threads)
    return gemm_peak()


def compare(args) -> None:
    base = args.keep or tempfile.mkdtemp(prefix="hybridrl_step_vs_hf_")
    cores = os.cpu_count() or 1
    names = ["hf", "trl", "hybridrl"] if args.trl_site else ["hf", "hybridrl"]
    for model in ("tiny", "small") if args.model == "both" else (args.model,):
        work = os.path.join(base, model)
        paths = make_assets(work, model)
        nproc = args.nproc or NPROC[model]
        threads = max(1, cores // nproc)
        print(f"\n{model} Llama ({paths['params'] / 1e6:.2f}M params), {PROMPTS} prompts x {N}, responses <= "
              f"{args.response_length} tokens; HF and TRL: 1 process x {cores} threads; hybridrl: {nproc} process(es) "
              f"x {threads} thread(s); mean of steps {WARMUP + 1}..{args.steps}", flush=True)  # fmt: skip
        for rnd in range(args.rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            peak = machine_peak(cores)
            res = {}
            for side in order:
                res[side] = (run_hf(paths, args, work, cores) if side == "hf"
                             else run_trl(paths, args, work, cores) if side == "trl"
                             else run_hybridrl(paths, args, work, nproc, threads))  # fmt: skip
            print(f"round {rnd + 1} ({' then '.join(order)}; load {os.getloadavg()[0]:.2f}):")
            print("\n".join(table({k: res[k] for k in names}, model, peak)), flush=True)
    if not args.keep:
        print(f"(work folders: {base})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "small", "both"), default="both")
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3, help="steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of the means")
    ap.add_argument("--rounds", type=int, default=1, help="HF / hybridrl pairs, alternating which goes first")
    ap.add_argument("--nproc", type=int, default=0, help="hybridrl processes (0: 2 for tiny, 1 for small)")
    ap.add_argument("--keep", default=None, help="write the work folders here")
    ap.add_argument("--profile", action="store_true", help="profile hybridrl's passes in-process instead")
    ap.add_argument("--hybridrl-override", action="append", default=[], help="extra key=value for hybridrl train")
    ap.add_argument("--trl-site", default=None, help="a folder with TRL installed: also run TRL's GRPOTrainer")
    ap.add_argument("--trl-checkpointing", action="store_true", help="TRL with its default gradient checkpointing")
    ap.add_argument("--hf-worker", help=argparse.SUPPRESS)
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global WARMUP
    WARMUP = args.warmup
    if args.warmup >= args.steps and not (args.hf_worker or args.trl_worker or args.profile):
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps}): no step would be measured")
    if args.hf_worker:
        with open(args.hf_worker) as f:
            return hf_worker(json.load(f))
    if args.trl_worker:
        from trl_baseline import trl_worker

        with open(args.trl_worker) as f:
            return trl_worker(json.load(f), SCORER, PROMPTS, N, KL_COEF, LR)
    if args.profile:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from step_profile import profile

        return profile(args, make_assets)
    compare(args)


if __name__ == "__main__":
    main()

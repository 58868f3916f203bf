"""Where a launch's time goes before its first step and after its last: a per-rank timeline of ``hybridrl train``.

    python bench/startup_timeline.py [CONFIG [key=value ...]]      (default: tiny_cpu.yaml, 2 steps, 2 ranks)

It starts ``torchrun --nproc-per-node 2`` on this script. Each rank runs the real command line in a child process
(``hybridrl.cli.main`` as ``python -m hybridrl`` runs it) with time stamps, wall and the process's CPU, around the
start-up items: the imports of torch, Megatron, vLLM and transformers, every ``new_group`` call (Megatron's and
vLLM's process groups), the demo assets, the vLLM engine start and its parts, the first generation, the garbage
collector's passes per generation (``gc.callbacks``) and the exit hooks. The rank's wrapper adds the child's whole
CPU time (with its own children: compilers, probes) and the moment it ended, so the interpreter's teardown after
the hooks shows too. The items are found by name when their modules load; one that a library renames is left out.

On a loaded machine wall times say little: compare the CPU columns of old and new code launched back to back.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib.abc
import json
import os
import resource
import subprocess
import sys
import time

WATCHED = {  # module -> functions ("Class.method") whose calls are timed
    "hybridrl.trainer.main": ["init_model_parallel", "_data", "check_model_folders"],
    "hybridrl.trainer.rl_trainer": ["RLTrainer.__init__", "RLTrainer.fit", "RLTrainer.validate"],
    "hybridrl.trainer.demo_assets": ["make_demo_assets", "warm_up"],
    "hybridrl.rollout.vllm_engine": ["VLLMRolloutEngine.__init__"],
    "vllm.entrypoints.llm": ["LLM.__init__"],
    "vllm.v1.worker.cpu_worker": ["CPUWorker.init_device", "CPUWorker.load_model"],
    "vllm.v1.engine.core": ["EngineCore._initialize_kv_caches", "freeze_gc_heap"],
    "vllm.triton_utils.dispatcher": ["register_kernels"],
}
IMPORTS = {"torch", "megatron.core", "vllm.entrypoints.llm", "transformers", "torch._inductor.compile_fx"}
T0 = time.time()
RECORDS: list[tuple[str, float, float, float]] = []  # (name, start s, wall s, cpu s)


def _timed(fn, name: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t, c = time.time(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            RECORDS.append((name, t - T0, time.time() - t, time.process_time() - c))

    return wrapper


class _Watch(importlib.abc.MetaPathFinder):
    """Times the watched imports and wraps the watched functions once their module has loaded."""

    def find_spec(self, name, path, target=None):
        if name not in WATCHED and name not in IMPORTS:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            _timed(run, f"import {name}")(module)
            for item in WATCHED.get(name, []):
                owner, _, attr = item.rpartition(".")
                holder = getattr(module, owner) if owner else module
                setattr(holder, attr, _timed(getattr(holder, attr), f"{name.rsplit('.', 1)[-1]}.{item}"))

        spec.loader.exec_module = exec_module
        return spec


def _gc_passes() -> dict[int, list[float]]:
    passes: dict[int, list[float]] = {}
    start = [0.0]

    def callback(phase, info):
        if phase == "start":
            start[0] = time.process_time()
        else:
            entry = passes.setdefault(info["generation"], [0, 0.0])
            entry[0] += 1
            entry[1] += time.process_time() - start[0]

    gc.callbacks.append(callback)
    return passes


def inner(argv: list[str], out: str) -> None:
    """One rank's command line, timed; the records go to ``out`` when the exit hooks run."""
    sys.meta_path.insert(0, _Watch())
    passes = _gc_passes()

    def dump():
        RECORDS.append(("exit hooks", time.time() - T0, 0.0, time.process_time()))
        for generation, (n, cpu) in sorted(passes.items()):
            RECORDS.append((f"gc generation {generation}: {n} passes", 0.0, 0.0, cpu))
        with open(out, "w") as f:
            json.dump({"t0": T0, "records": RECORDS}, f)

    atexit.register(dump)
    import torch.distributed as dist

    dist.new_group = _timed(dist.new_group, "new_group")
    sys.argv = ["hybridrl", *argv]
    from hybridrl.cli import main

    sys.exit(main())


def rank(argv: list[str], folder: str) -> int:
    """The rank's wrapper: runs :func:`inner` in a child and adds its whole CPU time and its end."""
    out = os.path.join(folder, f"rank{os.environ['RANK']}.json")
    code = subprocess.call([sys.executable, __file__, "--inner", out, *argv])
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(out) as f:
        data = json.load(f)
    data.update(ended=time.time(), cpu=usage.ru_utime + usage.ru_stime)
    with open(out, "w") as f:
        json.dump(data, f)
    return code


def report(folder: str, started: float) -> None:
    for path in sorted(p for p in os.listdir(folder) if p.endswith(".json")):
        with open(os.path.join(folder, path)) as f:
            data = json.load(f)
        print(f"--- {path[:-5]}: started +{data['t0'] - started:.2f} s, ended +{data['ended'] - started:.2f} s, "
              f"CPU {data['cpu']:.2f} s (with children)")  # fmt: skip
        groups = [r for r in data["records"] if r[0] == "new_group"]
        wall, cpu = sum(r[2] for r in groups), sum(r[3] for r in groups)
        print(f"  {len(groups)} new_group calls: {wall:.2f} s wall, {cpu:.2f} s CPU")
        print(f"  {'start':>7} {'wall':>6} {'CPU':>6}  item")
        for name, start, wall, cpu in sorted(data["records"], key=lambda r: r[1]):
            if name != "new_group" and (wall >= 0.05 or cpu >= 0.05 or name == "exit hooks"):
                print(f"  {start:7.2f} {wall:6.2f} {cpu:6.2f}  {name}")


def main() -> None:
    if sys.argv[1:2] == ["--inner"]:
        return inner(sys.argv[3:], sys.argv[2])
    if sys.argv[1:2] == ["--rank"]:
        sys.exit(rank(sys.argv[3:], sys.argv[2]))
    import tempfile

    args = sys.argv[1:] or ["tiny_cpu.yaml", "trainer.total_steps=2", "trainer.test_freq=2"]
    with tempfile.TemporaryDirectory(prefix="hybridrl_startup_") as folder:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, "--standalone", "--nproc-per-node", "2", __file__, "--rank", folder, "train", *args]
        cmd += ["trainer.n_gpus_per_node=2", "trainer.loggers=[jsonl]", f"trainer.default_local_dir={folder}/run"]
        started = time.time()
        code = subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        print(f"torchrun: {time.time() - started:.2f} s wall, exit {code}; load {os.getloadavg()[0]:.1f}")
        report(folder, started)


if __name__ == "__main__":
    main()

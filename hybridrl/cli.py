"""The ``hybridrl`` command line (also ``python -m hybridrl``).

    hybridrl train CONFIG [key=value ...]          (under torchrun / srun: one process per device)
    hybridrl sft CONFIG [key=value ...]            (supervised fine-tuning; under torchrun / srun)
    hybridrl dpo CONFIG [key=value ...]            (preference pairs; under torchrun / srun)
    hybridrl validate-config CONFIG [key=value ...] [--world-size N] [--device-gib G] [--get KEY] [--inputs]
                             [--recipe sft|dpo]
    hybridrl export CHECKPOINT OUT [--role actor] [--tp 1] [--pp 1]   (under torchrun, any number of processes)
    hybridrl version

``validate-config`` loads a config exactly as a run would (packaged name or path, overrides, every
cross-field check), prints the resolved YAML and, per role, the parallel layout: which ranks are
tensor/pipeline/data-parallel peers, and a memory estimate; ``--get KEY`` prints only one resolved value (the
launch scripts read trainer.n_gpus_per_node so); ``--inputs`` also opens every input the run reads before its
models (:mod:`hybridrl.trainer.preflight`), as the launch scripts do before starting torchrun; ``--recipe``
checks a ``hybridrl sft`` / ``dpo`` config instead of an RL one. ``export`` writes a
checkpoint's actor (or critic) as an HF folder:

    torchrun --nproc-per-node N -m hybridrl export ckpts/global_step_100 hf_out [--tp N]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import hybridrl
from hybridrl import distributed
from hybridrl.errors import InputError, is_peer_failure, report_input_error, report_peer_failure
from hybridrl.trainer import startup

USAGE = """hybridrl <command> [args]

commands:
  train CONFIG [key=value ...]             run PPO/GRPO (launch with torchrun --nproc-per-node N -m hybridrl train)
  sft CONFIG [key=value ...]               supervised fine-tuning on chat data (tiny_cpu_sft.yaml; under torchrun)
  dpo CONFIG [key=value ...]               DPO / IPO / SimPO on preference pairs (tiny_cpu_dpo.yaml; under torchrun)
  validate-config CONFIG [key=value ...]   check a config, print it resolved, its parallel layouts and memory
                                           (--get KEY: print only that resolved value; --inputs: also open the
                                           data, tokenizer, model folders and scorer the run reads)
  export CHECKPOINT OUT [--role R] [--tp N]  write a global_step_N checkpoint's model as an HF folder
                                           (launch with torchrun --nproc-per-node N -m hybridrl export)
  version                                   print the version
"""


def _format_groups(groups: list[list[int]], limit: int = 4) -> str:
    shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")


def layout_report(layout, roles: list[str], backend: str | None = "vllm") -> str:
    """The run's layout (:func:`hybridrl.config.layout.run_layout`): the training groups, shared by ``roles``,
    and the generation groups (vLLM engines and the replica groups over which prompts are split; none when
    ``backend`` is None: an offline recipe)."""
    lines = [f"train   {layout.describe()}, shared by {', '.join(roles)}"]
    for axis in ("tp", "pp", "dp"):
        lines.append(f"        {axis} peers: {_format_groups(layout.groups(axis))}")
    if layout.ep > 1:  # MoE: the data-parallel ranks that split the experts
        from hybridrl.config.checks_moe import ep_groups

        lines.append(f"        ep peers: {_format_groups(ep_groups(layout))}")
    if backend is None:
        return "\n".join(lines)
    lines.append(f"rollout {backend} tp={layout.rollout_tp} replicas={layout.rollout_replicas}")
    lines.append(f"        engines: {_format_groups(layout.groups('rollout_tp'))}")
    lines.append(f"        replica groups: {_format_groups(layout.groups('rollout_dp'))}")
    return "\n".join(lines)


def config_value(cfg, key: str) -> str:
    """A resolved config value as the shell wants it: scalars plain (null / true / false as in YAML), sections
    and lists as YAML."""
    import dataclasses

    import yaml

    from hybridrl.config.loader import _unknown_key  # the loader's own "did you mean" for a key

    value = cfg
    for part in key.split("."):
        if not dataclasses.is_dataclass(value) or part not in {f.name for f in dataclasses.fields(value)}:
            raise _unknown_key(key, " (--get)")
        value = getattr(value, part)
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    if isinstance(value, str):
        return value
    return (
        yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=float("inf"))
        .strip()
        .removesuffix("\n...")
        .strip()
    )


def cmd_validate_config(argv: list[str]) -> int:
    from hybridrl.config import load_config, run_layout, to_yaml, world_size_of

    parser = argparse.ArgumentParser(prog="hybridrl validate-config", description="Check and print a run config.")
    parser.add_argument("config", help="packaged config name (e.g. ppo_llama2_7b.yaml) or path")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. actor.megatron.tp_size=4")
    parser.add_argument("--world-size", type=int, default=None, help="default: trainer.nnodes * n_gpus_per_node")
    parser.add_argument("--quiet", action="store_true", help="print only the layouts and the memory estimate")
    parser.add_argument("--get", metavar="KEY", help="print only this resolved value, e.g. trainer.n_gpus_per_node")
    parser.add_argument(
        "--device-gib",
        type=float,
        default=None,
        help="memory of one GPU for the estimate (H100: 80, H200: 141); default: none (CPU, or GPU of unknown size)",
    )
    parser.add_argument(
        "--inputs",
        action="store_true",
        help="also open what the run reads before building models (data files, tokenizer, local model folders, "
        "the scorer, the loggers' packages, the run folder), as on the machine that runs it; the launch scripts do",
    )
    parser.add_argument("--recipe", choices=("sft", "dpo"), help="check a hybridrl sft / dpo config (the run's checks)")
    args = parser.parse_intermixed_args(argv)  # options before or after the overrides
    if args.device_gib is not None and args.device_gib <= 0:
        print(
            f"--device-gib ({args.device_gib:g}) must be > 0: one GPU's memory in GiB; omit it for CPU", file=sys.stderr
        )
        return 2
    if args.recipe is not None:
        return _validate_recipe_config(args)
    cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    if args.get is not None:
        print(config_value(cfg, args.get))
        return 0
    if args.inputs:  # before the report: a bad input is the only line printed
        from hybridrl.trainer.preflight import check_inputs

        notes = check_inputs(cfg)
    else:
        notes = missing_data_files(cfg)
    world = args.world_size or world_size_of(cfg)
    layout = run_layout(cfg, world)
    if not args.quiet:
        print(to_yaml(cfg))
    print(f"# world size {world} = {cfg.trainer.nnodes} node(s) x {cfg.trainer.n_gpus_per_node} process(es)")
    enabled = [name for name in ("ref", "critic") if getattr(cfg, name).enable]
    fsdp = [name for name in enabled if getattr(cfg, name).backend == "fsdp"]
    print(layout_report(layout, ["actor"] + [name for name in enabled if name not in fsdp], cfg.rollout.backend))
    if fsdp:
        print(f"fsdp    {', '.join(fsdp)}: HF model sharded over all {world} ranks (one mesh, colocated)")
    from hybridrl.config.checks import update_schedule
    from hybridrl.config.memory import report

    for role in ("actor", "critic")[: 1 + bool(cfg.critic.enable)]:
        print(f"# {update_schedule(cfg, role)}")

    print(report(cfg, device_gib=args.device_gib, layout=layout))
    for line in notes:
        print(line)
    return 0


def _validate_recipe_config(args: argparse.Namespace) -> int:
    """``validate-config --recipe R``: the recipe's own config checks (:func:`load_recipe_config`), its layout and,
    with ``--inputs``, what the recipe run opens before its models."""
    from hybridrl.config import run_layout, to_yaml, world_size_of
    from hybridrl.config.checks_recipes import load_recipe_config, sequences_per_step

    cfg = load_recipe_config(args.recipe, args.config, args.overrides, world_size=args.world_size)
    if args.get is not None:
        print(config_value(cfg, args.get))
        return 0
    if args.inputs:
        from hybridrl.trainer.recipes import check_recipe_inputs

        check_recipe_inputs(cfg, args.recipe)
    world = args.world_size or world_size_of(cfg)
    if not args.quiet:
        print(to_yaml(cfg))
    print(f"# world size {world} = {cfg.trainer.nnodes} node(s) x {cfg.trainer.n_gpus_per_node} process(es)")
    print(layout_report(run_layout(cfg, world), ["actor"] + ["ref"] * bool(cfg.ref.enable), None))
    print(f"# {args.recipe}: {sequences_per_step(cfg, args.recipe)} sequences per optimizer step over all DP ranks")
    return 0


def missing_data_files(cfg) -> list[str]:
    """One note per data file the run's start-up check (``check_data_file``) would refuse on this machine.

    A note, not an error: validate-config may run on a login node whose file system differs from the compute
    nodes'."""
    from hybridrl.data.files import DataError, check_data_file

    if cfg.data.demo_task:
        return []
    out = []
    for name in [*cfg.data.train_files, *cfg.data.val_files]:
        try:
            check_data_file(name)
        except DataError as err:
            out.append(f"# note: on this machine, {err} (see README 'Your data')")
    return out


def cmd_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hybridrl export", description="Write a checkpoint's model as an HF folder.")
    parser.add_argument("checkpoint", help="a global_step_N folder written by hybridrl train")
    parser.add_argument("out", help="the HF folder to write (config.json + safetensors)")
    parser.add_argument("--role", default="actor", choices=("actor", "critic"))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of this launch (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of this launch (default 1)")
    args = parser.parse_args(argv)
    from hybridrl.trainer.main import export

    export(args.checkpoint, args.out, role=args.role, tp=args.tp, pp=args.pp)
    return 0


def cmd_train(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        usage = (
            "usage: hybridrl train CONFIG [key=value ...]   (under torchrun / srun: one process per device)\n"
            "  CONFIG: a packaged config name (configs/) or a YAML path; key=value overrides any field, e.g.\n"
            "  trainer.total_steps=5 'data.train_files=[train.parquet]'. Check first: hybridrl validate-config"
        )
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(usage, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    from hybridrl.trainer.main import train

    train(argv[0], argv[1:])
    return 0


def cmd_recipe(recipe: str, argv: list[str]) -> int:
    """``hybridrl sft`` / ``hybridrl dpo`` (:mod:`hybridrl.trainer.recipes`)."""
    if not argv or argv[0].startswith("-"):
        usage = (f"usage: hybridrl {recipe} CONFIG [key=value ...]   (under torchrun / srun: one process per device)\n"
                 f"  CONFIG: a packaged config name (tiny_cpu_{recipe}.yaml) or a YAML path; key=value overrides any "
                 "field, e.g. trainer.total_steps=5")  # fmt: skip
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(usage, file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    from hybridrl.trainer.recipes import run

    run(recipe, argv[0], argv[1:])
    return 0


RECIPE_COMMANDS = ("sft", "dpo")
COMMANDS = {"validate-config": cmd_validate_config, "export": cmd_export, "train": cmd_train,
            "sft": lambda argv: cmd_recipe("sft", argv), "dpo": lambda argv: cmd_recipe("dpo", argv)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run one command, through :func:`funnel`. ``argv`` None: this process's own command line (``hybridrl ...``,
    ``python -m hybridrl ...``), whose launched commands also pause the garbage collector through start-up and end
    the process quickly (:mod:`hybridrl.trainer.startup`); a list: a call from Python, which leaves both alone."""
    launched = argv is None and len(sys.argv) > 1 and sys.argv[1] in ("train", "export", *RECIPE_COMMANDS)
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("version", "--version"):
        print(hybridrl.__version__)
        return 0
    if command not in COMMANDS:
        print(f"unknown command {command!r}; run 'hybridrl --help' for the list", file=sys.stderr)
        return 2
    if launched and command != "export":  # export never reaches a training loop to turn the collector back on
        startup.pause_collection()  # until training starts (hybridrl.trainer.startup)
    if command in ("train", "export", *RECIPE_COMMANDS) or "--inputs" in rest:  # --inputs: Megatron opens model folders
        from hybridrl import console

        console.install()  # before Megatron / vLLM load: their known-harmless warnings stay off the console
    if launched:
        startup.keep_freed_memory()  # CPU runs: tensors reuse the heap instead of fresh pages every pass
    code = funnel(lambda: COMMANDS[command](rest))
    if launched and code == 0:  # every rank done, the exit hooks, then the groups left down (end_distributed)
        code = funnel(lambda: distributed.end_distributed(exit_hooks=startup.finish_quickly))
    elif launched:
        startup.finish_quickly()
    return code


def funnel(command: Callable[[], int | None]) -> int:
    """Run ``command``; every command of the CLI ends here, and so what a user sees of an error is decided here.

    An :class:`~hybridrl.errors.InputError` (bad config, data, checkpoint, launch environment, scorer) is one
    line, printed once per job (rank 0), exit status 2. A collective that a stopped or dead peer never answers
    is one line naming that rank, and the process ends at once with status 1. Anything else is a bug: its
    traceback is kept.
    """
    try:
        return command() or 0
    except InputError as err:
        return report_input_error(err)
    except Exception as err:
        if not is_peer_failure(err):
            raise
        from hybridrl.distributed.env import collective_timeout_s

        code = report_peer_failure(err, collective_timeout_s())
        # now: a normal interpreter exit runs the libraries' exit hooks, which may wait on that same peer
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

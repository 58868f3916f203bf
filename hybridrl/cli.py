"""The ``hybridrl`` command line (also ``python -m hybridrl``).

    hybridrl train CONFIG [key=value ...]          (under torchrun / srun: one process per device)
    hybridrl validate-config CONFIG [key=value ...] [--world-size N] [--device-gib G] [--get KEY]
    hybridrl export CHECKPOINT OUT [--role actor] [--tp 1] [--pp 1]   (under torchrun, any number of processes)
    hybridrl version

``validate-config`` loads a config exactly as a run would (packaged name or path, overrides, every
cross-field check), prints the resolved YAML and, per role, the parallel layout: which ranks are
tensor/pipeline/data-parallel peers, and a memory estimate; ``--get KEY`` prints only one resolved value (the
launch scripts read trainer.n_gpus_per_node so). ``export`` writes a checkpoint's actor (or critic) as an HF folder:

    torchrun --nproc-per-node N -m hybridrl export ckpts/global_step_100 hf_out [--tp N]
"""

from __future__ import annotations

import argparse
import sys

import hybridrl

USAGE = """hybridrl <command> [args]

commands:
  train CONFIG [key=value ...]             run PPO/GRPO (launch with torchrun --nproc-per-node N -m hybridrl train)
  validate-config CONFIG [key=value ...]   check a config, print it resolved, its parallel layouts and memory
                                           (--get KEY: print only that resolved value)
  export CHECKPOINT OUT [--role R] [--tp N]  write a global_step_N checkpoint's model as an HF folder
                                           (launch with torchrun --nproc-per-node N -m hybridrl export)
  version                                   print the version
"""


def _format_groups(groups: list[list[int]], limit: int = 4) -> str:
    shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")


def layout_report(cfg, world_size: int) -> str:
    """Per-role parallel layout lines for a validated config."""
    from hybridrl.distributed.layout import ParallelLayout

    lines = []
    roles = [("actor", cfg.actor.megatron)]
    if cfg.ref.enable:
        roles.append(("ref", cfg.ref.megatron))
    if cfg.critic.enable:
        roles.append(("critic", cfg.critic.megatron))
    for name, m in roles:
        layout = ParallelLayout.from_world(world_size, tp=m.tp_size, pp=m.pp_size, cp=m.cp_size, vpp=m.vpp_size)
        lines.append(f"{name:7s} {layout.describe()}")
        for axis in ("tp", "pp", "dp"):
            lines.append(f"        {axis} peers: {_format_groups(layout.groups(axis))}")
    rtp = cfg.rollout.tp_size
    engines = [list(range(i, i + rtp)) for i in range(0, world_size, rtp)]
    lines.append(f"rollout {cfg.rollout.backend} tp={rtp} replicas={world_size // rtp}")
    lines.append(f"        engines: {_format_groups(engines)}")
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
    from hybridrl.config import ConfigError, load_config, to_yaml, world_size_of

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
    args = parser.parse_intermixed_args(argv)  # options before or after the overrides
    if args.device_gib is not None and args.device_gib <= 0:
        print(
            f"--device-gib ({args.device_gib:g}) must be > 0: one GPU's memory in GiB; omit it for CPU", file=sys.stderr
        )
        return 2
    try:
        cfg = load_config(args.config, args.overrides, world_size=args.world_size)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    if args.get is not None:
        try:
            print(config_value(cfg, args.get))
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        return 0
    world = args.world_size or world_size_of(cfg)
    if not args.quiet:
        print(to_yaml(cfg))
    print(f"# world size {world} = {cfg.trainer.nnodes} node(s) x {cfg.trainer.n_gpus_per_node} process(es)")
    print(layout_report(cfg, world))
    from hybridrl.config.memory import report

    print(report(cfg, device_gib=args.device_gib))
    for line in missing_data_files(cfg):
        print(line)
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

    try:
        export(args.checkpoint, args.out, role=args.role, tp=args.tp, pp=args.pp)
    except FileNotFoundError as err:  # a wrong folder: one line per rank, not a traceback
        print(f"export error: {err}", file=sys.stderr)
        return 2
    return 0


def _input_error_kind(err: BaseException) -> str | None:
    """'config' / 'launch' / 'data' / 'checkpoint' for the errors of bad input (their message is one line naming
    the key or file and the fix); None for anything else (a bug: keep its traceback)."""
    from hybridrl.config import ConfigError
    from hybridrl.data.files import DataError
    from hybridrl.distributed.env import LaunchError

    kinds: list[tuple[type, str]] = [(ConfigError, "config"), (LaunchError, "launch"), (DataError, "data")]
    ckpt = sys.modules.get("hybridrl.trainer.checkpoint")  # not imported yet: the error cannot come from it
    if ckpt is not None:
        kinds.append((ckpt.ResumeError, "checkpoint"))
    return next((name for cls, name in kinds if isinstance(err, cls)), None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command, rest = argv[0], argv[1:]
    if command in ("version", "--version"):
        print(hybridrl.__version__)
        return 0
    if command == "validate-config":
        return cmd_validate_config(rest)
    if command == "export":
        return cmd_export(rest)
    if command == "train":
        if not rest or rest[0].startswith("-"):
            usage = (
                "usage: hybridrl train CONFIG [key=value ...]   (under torchrun / srun: one process per device)\n"
                "  CONFIG: a packaged config name (configs/) or a YAML path; key=value overrides any field, e.g.\n"
                "  trainer.total_steps=5 'data.train_files=[train.parquet]'. Check first: hybridrl validate-config"
            )
            asked = bool(rest) and rest[0] in ("-h", "--help")
            print(usage, file=sys.stdout if asked else sys.stderr)
            return 0 if asked else 2
        from hybridrl.trainer.main import train

        try:
            train(rest[0], rest[1:])
        except Exception as err:  # every rank would print the same traceback; the one-line message says it all
            kind = _input_error_kind(err)
            if kind is None:
                raise
            print(f"{kind} error: {err}", file=sys.stderr)
            return 2
        return 0
    print(f"unknown command {command!r}; run 'hybridrl --help' for the list", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

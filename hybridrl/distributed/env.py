"""Process launch environment: who am I, how many of us, where is the rendezvous.

Two launchers are understood:
- ``torchrun`` (or any launcher that sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT);
- ``srun`` under Slurm without torchrun (SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_JOB_NODELIST);
  the rendezvous host is the first node of the job's node list.
With neither, the process is a single rank (world size 1) on localhost, its rendezvous on a port that was free
when it started (``MASTER_PORT`` if set), so single-process runs side by side do not collide.

Collective timeout: :func:`init_distributed` gives the default group ``trainer.collective_timeout_s``, and every
group made later must wait no longer (a stopped or dead peer then ends the job in that time, not in torch's 30
minutes): Megatron's groups and the rollout replica groups are created with :func:`collective_timeout_s`, vLLM's
get it as engine arguments, and :func:`apply_collective_timeout` sets it on every group that exists once the
workers are built (a group made without an explicit timeout, e.g. by a library, gets torch's default).
"""

from __future__ import annotations

import datetime
import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridrl.errors import InputError

DEFAULT_PORT = 29500
_timeout_s: float | None = None  # the default group's collective timeout, once init_distributed has set it


class LaunchError(InputError, RuntimeError):
    """The launch environment is inconsistent; the message names the variable and the fix."""


@dataclass(frozen=True)
class ProcessEnv:
    """Identity of this process in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list such as ``gpu[01-03,07],login1`` into host names.

    Handles comma-separated entries, bracketed ranges and lists with zero padding, and several bracket
    groups in one name (``rack[1-2]-n[1-2]``).
    """
    hosts: list[str] = []
    for entry in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", nodelist):
        parts = re.split(r"\[([^\]]*)\]", entry)
        expanded = [""]
        for i, part in enumerate(parts):
            if i % 2 == 0:
                expanded = [e + part for e in expanded]
                continue
            choices = []
            for item in part.split(","):
                if "-" in item:
                    lo, hi = item.split("-", 1)
                    choices += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
                else:
                    choices.append(item)
            expanded = [e + c for e in expanded for c in choices]
        hosts += [h for h in expanded if h]
    return hosts


def free_port() -> int:
    """A TCP port that was free a moment ago on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _int(environ: Mapping[str, str], key: str) -> int:
    value = environ[key]
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"environment variable {key}={value!r} is not an integer; check the launcher") from None


def detect_env(environ: Mapping[str, str] | None = None) -> ProcessEnv:
    """Read this process's rank, world and rendezvous from torchrun or Slurm variables."""
    env = os.environ if environ is None else environ
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else DEFAULT_PORT
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        # without LOCAL_RANK (a hand-rolled launcher): ranks fill nodes in order, as torchrun and srun place them
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank % max(1, local_world)
        addr, launcher = env.get("MASTER_ADDR", "127.0.0.1"), "torchrun"
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        local_world = int(per_node) if per_node.isdigit() else max(1, world // max(1, int(env.get("SLURM_NNODES", 1))))
        if "MASTER_ADDR" in env:
            addr = env["MASTER_ADDR"]
        elif env.get("SLURM_JOB_NODELIST"):
            addr = expand_nodelist(env["SLURM_JOB_NODELIST"])[0]
        else:
            raise LaunchError("SLURM_JOB_NODELIST is empty and MASTER_ADDR is unset; export MASTER_ADDR=<first node>")
        launcher = "slurm"
    else:
        rank, world, local_rank, local_world, addr, launcher = 0, 1, 0, 1, "127.0.0.1", "single"
        if "MASTER_PORT" not in env:  # nobody else joins: any free port (init_distributed exports the one chosen)
            port = free_port()
    if not 0 <= rank < world:
        raise LaunchError(f"rank ({rank}) must lie in [0, world_size={world}); check RANK/SLURM_PROCID")
    return ProcessEnv(rank, world, local_rank, local_world, addr, port, launcher)


def default_backend() -> str:
    """NCCL where CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> ProcessEnv:
    """Initialise ``torch.distributed`` from the launch environment (idempotent).

    Collectives get ``timeout_s`` so that a dead peer turns into an error instead of a silent hang.
    On CUDA, the process binds to GPU ``local_rank``.
    """
    global _timeout_s
    penv = detect_env()
    if dist.is_initialized():
        return penv
    if not timeout_s > 0:  # also NaN; the config checks refuse it first, this guards direct callers
        raise LaunchError(f"collective timeout ({timeout_s}) must be a positive number of seconds")
    backend = backend or default_backend()
    if backend == "nccl":
        gpus = torch.cuda.device_count()
        if penv.local_rank >= gpus:
            raise LaunchError(
                f"local rank {penv.local_rank} but this node has {gpus} GPU(s); launch at most {gpus} processes per "
                "node (torchrun.sh: NPROC=auto, or trainer.n_gpus_per_node to match)"
            )
        torch.cuda.set_device(penv.local_rank)
    # torchrun's variables for a plain srun launch too: vLLM's external_launcher executor reads RANK,
    # LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment
    for key, value in (("RANK", penv.rank), ("LOCAL_RANK", penv.local_rank), ("WORLD_SIZE", penv.world_size),
                       ("LOCAL_WORLD_SIZE", penv.local_world_size), ("MASTER_ADDR", penv.master_addr),
                       ("MASTER_PORT", penv.master_port)):  # fmt: skip
        os.environ.setdefault(key, str(value))
    try:
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{penv.master_addr}:{penv.master_port}",
            rank=penv.rank,
            world_size=penv.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except RuntimeError as err:  # DistNetworkError / DistStoreError: a port in use, a host not reached, a no-show
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise LaunchError(
            f"rank {penv.rank} of {penv.world_size} could not join the job's rendezvous at {penv.master_addr}:"
            f"{penv.master_port} within {timeout_s:g} s ({type(err).__name__}: {first[:200]}); check MASTER_ADDR / "
            "MASTER_PORT (a port in use?) and that every rank was started"
        ) from err
    _timeout_s = float(timeout_s)
    return penv


def end_distributed(exit_hooks: Callable[[], None] | None = None) -> None:
    """Wait for every rank, run ``exit_hooks``, then take every process group left down.

    A launched command calls it when it has succeeded, after its last collective: a rank that leaves with gloo's
    threads still up can abort in its C++ teardown at interpreter exit ("terminate called without an active
    exception", exit -6) after all its work is written, and the launcher then reports the whole job failed. The
    hooks run between the two (vLLM's engine shutdown destroys its own groups and then the default group: with
    no group left first, it would fail on its first). Without ``torch.distributed`` only the hooks run."""
    if dist.is_initialized():
        dist.barrier()
    if exit_hooks is not None:
        exit_hooks()
    if dist.is_initialized():
        dist.destroy_process_group()


def collective_timeout_s(default: float = 600.0) -> float:
    """The collective timeout :func:`init_distributed` gave the default group (``default`` if it did not run)."""
    return _timeout_s if _timeout_s is not None else default


def apply_collective_timeout(timeout_s: float | None = None) -> int:
    """Set ``timeout_s`` (default: :func:`collective_timeout_s`) on every process group of this process; returns
    how many. Local (no collective); groups created afterwards are not touched."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s or collective_timeout_s())
    groups = list(c10d._world.pg_map)
    for group in groups:
        c10d._set_pg_timeout(timeout, group)
    return len(groups)

"""Bad input vs. bugs: the error taxonomy of hybridrl and the one funnel that reports what a run stopped on.

Every error whose cause is the user's input (a config key, the launch environment, a data file, a model or
trainer checkpoint, a scorer file) derives from :class:`InputError`; its message is one line naming the key,
file or value and the fix. The subclasses live next to the code that raises them:

======================  ======================================  ==========
class                   module                                  printed as
======================  ======================================  ==========
ConfigError             hybridrl.config.schema                  config
LayoutError             hybridrl.distributed.layout             config
PlanError               hybridrl.hybrid_engine.vllm_layout      config
KVCacheError            hybridrl.config.kv_cache                config
ResourceError           hybridrl.workers.group                  config
LaunchError             hybridrl.distributed.env                launch
DataError               hybridrl.data.files                     data
HFConfigError           hybridrl.mcore.hf_config                model
CheckpointError         hybridrl.mcore.bridge_checkpoint        model
ModelPathError          hybridrl.trainer.preflight              model
ScorerError             hybridrl.rewards.manager                reward
AgentError              hybridrl.rollout.agent.interface        agent
ResumeError             hybridrl.trainer.checkpoint             checkpoint
UnsafeCheckpointError   hybridrl.mcore.checkpoint_safety        checkpoint
CorruptCheckpointError  hybridrl.mcore.checkpoint_safety        checkpoint
TrainingStoppedError    hybridrl.trainer.rl_trainer             training
======================  ======================================  ==========

The funnel (:func:`report_input_error`, used by the command line for every command) prints
``<kind> error: <message>`` ONCE per job, on rank 0 (a rank whose error differs from rank 0's prints it too,
prefixed with its rank), and the process exits 2. Anything else is a bug and keeps its traceback;
``HYBRIDRL_VERBOSE=1`` adds the traceback to input errors as well.

A collective that fails because a peer stopped answering (a stopped, swapped-out or dead process) is neither:
:func:`report_peer_failure` names the ranks that did not answer, in one line, and the process exits 1 at once
(a clean interpreter exit could wait on the same dead peer).

This module imports nothing heavy: the config checks use it before torch is loaded.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import traceback
from typing import Any

INPUT_ERROR_EXIT = 2
"""Exit status of a run stopped by bad input (the launch scripts keep it through torchrun / srun)."""
PEER_FAILURE_EXIT = 1
"""Exit status of a rank whose collective failed because a peer stopped answering."""

_KINDS = {
    "ConfigError": "config",
    "LayoutError": "config",
    "PlanError": "config",
    "KVCacheError": "config",
    "ResourceError": "config",
    "LaunchError": "launch",
    "DataError": "data",
    "HFConfigError": "model",
    "CheckpointError": "model",
    "ModelPathError": "model",
    "ScorerError": "reward",
    "AgentError": "agent",
    "ResumeError": "checkpoint",
    "UnsafeCheckpointError": "checkpoint",
    "CorruptCheckpointError": "checkpoint",
    "TrainingStoppedError": "training",
}
KINDS = (*dict.fromkeys(_KINDS.values()), "input")
"""The words an input error line starts with (``<kind> error: ...``); the launchers' console filter keys on them."""


class InputError(Exception):
    """Base of every error caused by the user's input; its message is one line naming the key/file and the fix."""


def kind_of(err: BaseException) -> str:
    """``config`` / ``data`` / ... for an :class:`InputError` (the first known class in its MRO), else ``input``."""
    return next((_KINDS[c.__name__] for c in type(err).__mro__ if c.__name__ in _KINDS), "input")


def verbose() -> bool:
    """``HYBRIDRL_VERBOSE=1``: show everything (tracebacks of input errors, every library warning)."""
    return os.environ.get("HYBRIDRL_VERBOSE", "0").lower() not in ("", "0", "false", "no")


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).strip().splitlines()) or "(no message)"


def _rank() -> int:
    for key in ("RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0


def _store():
    """The default process group's store when torch.distributed is up (imported only if torch already is)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a group torn down or never finished: nothing to agree through
        return None


def report_input_error(err: BaseException, stream: Any = None) -> int:
    """Print ``<kind> error: <message>`` once per job and return the exit status (2).

    Before torch.distributed is initialised every rank checked the same inputs: only rank 0 prints (an
    unparsable launch environment prints on every rank: each process reads its own). Afterwards a rank's error
    may be its own: each failing rank posts its line in the job's store; rank 0 prints its own, another rank
    prints (with its rank) unless rank 0 posted the same line within a few seconds.
    """
    stream = stream or sys.stderr
    line = f"{kind_of(err)} error: {_one_line(err)}"
    rank, store = _rank(), _store()
    if store is None:
        show = rank == 0 or kind_of(err) == "launch"
    else:
        show = _differs_from_rank0(store, rank, line)
        line = line if rank == 0 or not show else f"[rank {rank}] {line}"
    if show:
        if verbose():
            traceback.print_exception(err, file=stream)
        print(line, file=stream, flush=True)
    return INPUT_ERROR_EXIT


def _differs_from_rank0(store: Any, rank: int, line: str, wait_s: float = 3.0) -> bool:
    key = "hybridrl/input_error/{}"
    try:
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        store.set(key.format(rank), line)
        if rank == 0:
            return True
        store.wait([key.format(0)], datetime.timedelta(seconds=wait_s))
        return store.get(key.format(0)).decode() != line
    except Exception as exc:  # rank 0 gone (it printed its own line) or silent (no error there: print ours)
        return "timeout" in str(exc).lower() or "timed out" in str(exc).lower()


# ---- collectives that fail because a peer stopped answering ------------------------------------------------
_PEER_PATTERNS = re.compile(
    r"Timed out waiting \d+ms|Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"collective operation timeout|NCCL communicator was aborted|ProcessGroupNCCL.*(timeout|abort)|"
    r"Socket Timeout|Connection refused|failed to recv|Read error|Unexpected EOF",
    re.IGNORECASE,
)


def is_peer_failure(err: BaseException) -> bool:
    """A collective (or the job's store) failed because another rank did not answer: ``torch.distributed``'s
    DistError family, or the gloo / NCCL messages of a timed-out or broken connection."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return False
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    return isinstance(err, RuntimeError) and bool(_PEER_PATTERNS.search(str(err)))


def silent_ranks(store: Any, rank: int, world: int, window_s: float = 3.0) -> list[int] | None:
    """Ranks that did not check in within ``window_s`` after this rank's collective failed (each failing rank
    checks in); None when the store itself does not answer (it lives in rank 0's process)."""
    import time

    key = "hybridrl/peer_failure/{}"
    try:
        store.set_timeout(datetime.timedelta(seconds=window_s))
        store.set(key.format(rank), "1")
        deadline = time.monotonic() + window_s
        missing = [r for r in range(world) if r != rank]
        while missing and time.monotonic() < deadline:
            missing = [r for r in missing if not store.check([key.format(r)])]
            if missing:
                time.sleep(0.2)
        return missing
    except Exception:
        return None


def report_peer_failure(err: BaseException, timeout_s: float | None, stream: Any = None) -> int:
    """One line naming the rank(s) that stopped answering; printed by the lowest rank that still answers."""
    stream = stream or sys.stderr
    dist = sys.modules["torch.distributed"]
    rank, world = dist.get_rank(), dist.get_world_size()
    missing = silent_ranks(_store(), rank, world)
    waited = f" within trainer.collective_timeout_s={timeout_s:g}s" if timeout_s else ""
    cause = _one_line(re.sub(r"\[[^\]]*third_party[^\]]*\]\s*", "", str(err)))[:200]
    if missing is None:  # the store lives in rank 0's process
        who, printer = "rank 0 (it also hosts the job's rendezvous store)", rank == min(1, world - 1)
    else:
        alive = sorted(set(range(world)) - set(missing))
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        printer = rank == alive[0] if alive else True
        if not missing:
            who = "a peer"
    if printer:
        if verbose():
            traceback.print_exception(err, file=stream)
        print(
            f"distributed error: {who} stopped answering: a collective got no reply{waited} ({cause}); "
            f"the other ranks stop too. Look at {who.split(' (')[0]}'s node and log (a stopped, swapped-out or "
            "crashed process)",
            file=stream,
            flush=True,
        )
    return PEER_FAILURE_EXIT

"""Trainer checkpoints: when to save, the folder's layout, atomic completion, keep-last-K and resume.

    <default_local_dir>/global_step_N/
        actor/  critic/       model, optimizer, LR position, HF config (hybridrl.mcore.checkpoint)
        rng_rank{r}.pt        Python / NumPy / torch / Megatron-tracker RNG states of rank r
        trainer.pt            step, data-loader position, KL controller, worker versions, tracker state
        meta.json             written last: step, layout (its presence marks a complete checkpoint)
    <default_local_dir>/latest_checkpoint.txt    the folder name of the newest save (rewritten after each)

A save goes to ``global_step_N.tmp/`` and is renamed to ``global_step_N/`` by rank 0 only after every rank
has finished writing (barrier), so a crash mid-save leaves a ``.tmp`` folder that resume ignores and the
last good checkpoint untouched. The reference policy is not saved (it is frozen: rebuilt from the model
path). The folder must be visible to every rank (one node, or a shared file system).

Resume (``trainer.resume_mode``): ``auto`` takes the newest save in ``default_local_dir`` (the one
``latest_checkpoint.txt`` names, else the highest complete ``global_step_N``; none: start fresh), ``path`` takes
``resume_from_path``, ``disable`` never resumes.

A run that starts below the folder's highest step (``disable``, or ``path`` to an older step) leaves the higher
``global_step_N`` of the earlier run alone, overwrites the steps it reaches itself, and prunes (``max_ckpt_to_keep``)
only among steps up to its own: keep-last-K never deletes the save just written.
Under the same layout the run continues bit-exactly; under another one the weights load exactly and the
optimizer moments restart (see :mod:`hybridrl.mcore.checkpoint`).

Test hook: ``HYBRIDRL_TEST_KILL_AT_STEP=N`` makes rank 1 SIGKILL itself in the middle of step N
(:func:`crash_for_test`), for the exact-resume test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.config.schema import TrainerConfig
from hybridrl.errors import InputError
from hybridrl.mcore import checkpoint as mckpt

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
RESUME_MODES = ("auto", "disable", "path")
LATEST = "latest_checkpoint.txt"


class ResumeError(InputError, ValueError):
    """A checkpoint that cannot resume this run (one line: what differs and what to do)."""


def crash_for_test(step: int) -> None:
    """Test hook: rank 1 kills itself with SIGKILL when ``HYBRIDRL_TEST_KILL_AT_STEP`` equals ``step``."""
    at = os.environ.get("HYBRIDRL_TEST_KILL_AT_STEP")
    if at is not None and int(at) == step and dist.get_rank() == min(1, dist.get_world_size() - 1):
        os.kill(os.getpid(), signal.SIGKILL)


def complete_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, folder) of the complete checkpoints under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(root, name, "meta.json")):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def newest_checkpoint(root: str) -> str | None:
    """The folder of the newest save under ``root``: the one ``latest_checkpoint.txt`` names when it is complete
    (a run restarted from an older step saves below an earlier run's highest step), else the highest step."""
    found = complete_checkpoints(root)
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as f:
            name = f.read().strip()
        written = os.path.getmtime(os.path.join(root, LATEST))
    except OSError:
        name, written = "", 0.0
    if not (_STEP_DIR.match(name) and os.path.isfile(os.path.join(root, name, "meta.json"))):
        return found[-1][1] if found else None
    # a save completed after the marker was written (a crash between the rename and the marker) is newer still
    later = [f for _, f in found if os.path.getmtime(os.path.join(f, "meta.json")) > written]
    return later[-1] if later else os.path.join(root, name)


def _write_latest(root: str, folder: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(os.path.basename(folder) + "\n")
    os.replace(tmp, os.path.join(root, LATEST))


class CheckpointManager:
    """Saves and restores an :class:`~hybridrl.trainer.rl_trainer.RLTrainer`'s state (see the module docs)."""

    def __init__(self, cfg: TrainerConfig) -> None:
        if cfg.resume_mode not in RESUME_MODES:
            raise ResumeError(f"trainer.resume_mode ({cfg.resume_mode!r}) must be one of {RESUME_MODES}")
        if cfg.resume_mode == "path" and not cfg.resume_from_path:
            raise ResumeError("trainer.resume_mode is 'path' but trainer.resume_from_path is null; set it")
        self.cfg = cfg
        self.root = cfg.default_local_dir
        self.resumed_from: str | None = None

    # ---- save ----------------------------------------------------------------------------------------------
    def maybe_save(self, trainer: Any) -> str | None:
        """Save after step ``trainer.step`` when it is a multiple of ``save_freq`` or the last step."""
        freq, step = self.cfg.save_freq, trainer.step
        if freq <= 0 or not (step % freq == 0 or step == self.cfg.total_steps):
            return None
        return self.save(trainer)

    def save(self, trainer: Any) -> str:
        """Write ``global_step_<step>`` atomically (collective); returns its folder."""
        rank = dist.get_rank()
        final = os.path.join(self.root, f"global_step_{trainer.step}")
        tmp = final + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        for name, group in self._roles(trainer):
            with group.worker.resident():  # an offloaded critic is parked between its updates
                mckpt.save_role(group.worker.model, group.worker.optimizer, os.path.join(tmp, name))
        torch.save(mckpt.rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
        dist.barrier()  # every rank's files are written
        if rank == 0:
            torch.save(self._trainer_state(trainer), os.path.join(tmp, "trainer.pt"))
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump({"step": trainer.step, "layout": mckpt.layout_signature()}, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _write_latest(self.root, final)
            self._prune(trainer.step)
            print(f"[hybridrl] checkpoint saved: {final}", flush=True)
        dist.barrier()
        return final

    def _prune(self, step: int) -> None:
        # half-written saves of crashed runs (never resumed from): a complete, newer checkpoint now exists
        for name in os.listdir(self.root):
            if re.fullmatch(r"global_step_\d+\.tmp", name):
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        keep = self.cfg.max_ckpt_to_keep
        if keep is None or keep <= 0:
            return
        # this run's steps only: higher ones belong to an earlier run this one restarted below (left alone)
        ours = [folder for s, folder in complete_checkpoints(self.root) if s <= step]
        for folder in ours[:-keep]:
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _roles(trainer: Any) -> list[tuple[str, Any]]:
        return [(n, g) for n, g in (("actor", trainer.actor), ("critic", trainer.critic)) if g is not None]

    def _trainer_state(self, trainer: Any) -> dict[str, Any]:
        tracker = trainer.tracker.state_dict() if hasattr(trainer.tracker, "state_dict") else None
        return {
            "step": trainer.step,
            "loader": trainer.loader.state_dict(),
            "kl_ctrl": dict(vars(trainer.kl_ctrl)),
            "versions": {name: group.worker.version for name, group in self._roles(trainer)},
            "tracker": tracker,
            "bad_steps": trainer.bad_steps,  # consecutive NaN/Inf steps: a resume must not reset the count
        }

    # ---- resume --------------------------------------------------------------------------------------------
    def resume_path(self) -> str | None:
        """The checkpoint ``resume_mode`` selects (None: start fresh)."""
        if self.cfg.resume_mode == "disable":
            return None
        if self.cfg.resume_mode == "path":
            path = self.cfg.resume_from_path
            if not os.path.isfile(os.path.join(path, "meta.json")):
                raise ResumeError(
                    f"trainer.resume_from_path ({path!r}) is not a complete checkpoint folder (no meta.json); "
                    f"point it at a global_step_N folder, or set trainer.resume_mode=auto"
                )
            return path
        return newest_checkpoint(self.root)

    def maybe_resume(self, trainer: Any) -> bool:
        """Restore ``trainer`` from the selected checkpoint, if any (collective); True when it resumed."""
        path = self.resume_path()
        self._note_other_runs(0 if path is None else _step_of(path))
        if path is None:
            return False
        for name, _ in self._roles(trainer):
            if not os.path.isdir(os.path.join(path, name)):
                raise ResumeError(
                    f"checkpoint {path} has no {name} (saved by a run without one); resume it with the same roles "
                    f"({name}.enable=false), or start fresh: trainer.resume_mode=disable or another default_local_dir"
                )
        for name, group in self._roles(trainer):
            mckpt.load_role(group.worker.model, group.worker.optimizer, os.path.join(path, name))
        state = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
        trainer.step = int(state["step"])
        trainer.loader.load_state_dict(state["loader"])
        saved_kl = state["kl_ctrl"]
        if "horizon" in saved_kl and hasattr(trainer.kl_ctrl, "horizon"):  # adaptive: only its coefficient moves;
            trainer.kl_ctrl.value = float(saved_kl["value"])  # target and horizon come from this run's config
        trainer.bad_steps = int(state.get("bad_steps", 0))
        for name, group in self._roles(trainer):
            group.worker.version = state["versions"].get(name, trainer.step)
        if state.get("tracker") is not None and hasattr(trainer.tracker, "load_state_dict"):
            trainer.tracker.load_state_dict(state["tracker"])
        rng_file = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
        with open(os.path.join(path, "meta.json")) as f:
            same_layout = json.load(f)["layout"] == mckpt.layout_signature()
        if same_layout and os.path.isfile(rng_file):
            mckpt.set_rng_state(torch.load(rng_file, weights_only=False))
        self.resumed_from = path
        if dist.get_rank() == 0:
            print(f"[hybridrl] resumed from {path} (step {trainer.step})", flush=True)
        return True

    def _note_other_runs(self, start: int) -> None:
        """Say so when this run starts below checkpoints of an earlier run in its folder (they are kept)."""
        higher = [s for s, _ in complete_checkpoints(self.root) if s > start]
        if higher and dist.get_rank() == 0:
            print(f"[hybridrl] note: {self.root} holds an earlier run's checkpoints up to global_step_{higher[-1]}; "
                  f"this run (from step {start}) keeps them, overwrites the steps it saves itself, and "
                  f"resume_mode=auto will follow its newest save ({LATEST})", flush=True)  # fmt: skip


def _step_of(path: str) -> int:
    with open(os.path.join(path, "meta.json")) as f:
        return int(json.load(f)["step"])

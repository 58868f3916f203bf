"""Trainer checkpoints: when to save, the folder's layout, atomic completion, keep-last-K and resume.

The manager owns the folder; what goes in it comes from the parts the trainer hands over,
``CheckpointManager(cfg, states={"loader": loader, "actor": actor_group, ...})`` (as torchtitan's manager takes
``states``). A part is one of two kinds, told apart by its methods:

- :class:`Stateful` (``state_dict()`` / ``load_state_dict(state)``): small, JSON-able, the same on every rank;
  rank 0 writes it to ``trainer_state.json`` under the part's name (the data loader, the KL controller, the
  tracker), the ``trainer`` part's keys at the top level (the loop's counters: step, bad steps);
- :class:`FolderStateful` (``save_checkpoint`` / ``check_checkpoint`` / ``load_checkpoint`` of a path): a part
  that writes its own folder ``<name>/``, collectively (a trained role: Megatron's sharded model, the optimizer,
  the LR position). A folder part may be Stateful too: its state (a role's update count, ``{"version"}``) is
  kept in ``trainer_state.json``'s ``versions``.

Parts load in the order of ``states``: first a part that may refuse the checkpoint (the loader refuses another
data order, ValueError: a one-line :class:`ResumeError` before anything is loaded), last a part whose loading
reaches outside the process (the tracker rewrites ``metrics.jsonl``). The RNG streams (Python, NumPy, torch and
Megatron's tracker) belong to the process, not to a part: the manager saves each rank's and restores them last,
under the layout they were saved with only.

    <default_local_dir>/global_step_N/
        actor/  critic/              model, optimizer, LR position, HF config (hybridrl.mcore.checkpoint)
        rng_rank{r}.safetensors      Python / NumPy / torch / Megatron-tracker RNG states of rank r
        trainer_state.json           step, data-loader position, KL controller, role versions, tracker, bad steps
        manifest.json                size and hash of every file above (hybridrl.trainer.manifest)
        meta.json                    written last: step, layout (its presence marks a complete checkpoint)
    <default_local_dir>/latest_checkpoint.txt    the folder name of the newest save (rewritten after each)

A save goes to ``global_step_N.tmp/`` and is renamed to ``global_step_N/`` by rank 0 only after every rank
has finished writing (barrier), so a crash mid-save leaves a ``.tmp`` folder that resume ignores and the
last good checkpoint untouched. The reference policy is not saved (it is frozen: rebuilt from the model
path). The folder must be visible to every rank (one node, or a shared file system).

Resume (``trainer.resume_mode``): ``auto`` takes the newest save in ``default_local_dir`` (the one
``latest_checkpoint.txt`` names, else the highest complete ``global_step_N``; none: start fresh), ``path`` takes
``resume_from_path``, ``disable`` never resumes.

Before anything is loaded, every rank checks the checkpoint (collectively, so all ranks decide alike): its
share of the manifest's sizes and hashes, and every file it will read through readers that cannot run code
(JSON, safetensors, and for ``.pt`` files and DCP folders the readers of :mod:`hybridrl.mcore.checkpoint_safety`,
which never unpickle). A corrupt checkpoint (a file missing, cut short, changed or unparsable) is named in one
line and resume falls back to the next older complete checkpoint of the same folder; when none is intact, or a
file holds code (a planted pickle is no accident), resume stops with a one-line :class:`ResumeError`.

A run that starts below the folder's highest step (``disable``, or ``path`` to an older step) leaves the higher
``global_step_N`` of the earlier run alone, overwrites the steps it reaches itself, and prunes (``max_ckpt_to_keep``)
only among steps up to its own: keep-last-K never deletes the save just written.
Under the same layout the run continues bit-exactly; under another one the weights load exactly and the
optimizer moments restart (see :mod:`hybridrl.mcore.checkpoint`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from typing import Any, Protocol

import torch.distributed as dist

from hybridrl.config.schema import TrainerConfig
from hybridrl.errors import InputError
from hybridrl.mcore import checkpoint as mckpt
from hybridrl.mcore.checkpoint_safety import CorruptCheckpointError, UnsafeCheckpointError
from hybridrl.mcore.torch_file import load_torch_file
from hybridrl.trainer.manifest import can_hash, check_files, gather, read_manifest, write_manifest

_STEP_DIR = re.compile(r"^global_step_(\d+)$")
RESUME_MODES = ("auto", "disable", "path")
LATEST = "latest_checkpoint.txt"
STATE = "trainer_state.json"
TOP = "trainer"  # the part whose keys sit at the top level of trainer_state.json
# parts that earlier hybridrl versions saved as null, and the state they resume with
_SAVED_AS_NULL = {"tracker": lambda doc: {"step": int(doc["step"])}}  # the history ends at the checkpoint's step


class ResumeError(InputError, ValueError):
    """A checkpoint that cannot resume this run (one line: what differs and what to do)."""


class Stateful(Protocol):
    """A checkpoint part whose state is small, JSON-able and the same on every rank."""

    def state_dict(self) -> dict[str, Any]:
        """The state to save (JSON types only)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; ValueError (one line) when ``state`` cannot resume this part."""
        ...


class FolderStateful(Protocol):
    """A checkpoint part that writes its own folder; each method is collective (every rank calls it)."""

    def save_checkpoint(self, path: str) -> None:
        """Write the part's files under the new folder ``path``."""
        ...

    def check_checkpoint(self, path: str) -> None:
        """Pass every file of ``path`` this rank will load through readers that cannot run code; load nothing.
        Raises UnsafeCheckpointError / CorruptCheckpointError (hybridrl.mcore.checkpoint_safety) or OSError."""
        ...

    def load_checkpoint(self, path: str) -> None:
        """Load the part from ``path`` (checked by :meth:`check_checkpoint` first)."""
        ...


def _is_folder(part: Any) -> bool:
    return callable(getattr(part, "save_checkpoint", None))


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
    """Saves and restores the parts of a trainer (see the module docs).

    Args:
        cfg: the ``trainer`` section (folder, frequency, keep-last-K, resume mode).
        states: the parts by name, in load order (:class:`Stateful` or :class:`FolderStateful`); a folder part is
            saved under its name. None: the manager only finds checkpoints (:meth:`resume_path`).
    """

    def __init__(self, cfg: TrainerConfig, states: Mapping[str, Any] | None = None) -> None:
        if cfg.resume_mode not in RESUME_MODES:
            raise ResumeError(f"trainer.resume_mode ({cfg.resume_mode!r}) must be one of {RESUME_MODES}")
        if cfg.resume_mode == "path" and not cfg.resume_from_path:
            raise ResumeError("trainer.resume_mode is 'path' but trainer.resume_from_path is null; set it")
        self.cfg = cfg
        self.root = cfg.default_local_dir
        self.states = dict(states or {})
        self.resumed_from: str | None = None

    # ---- save ----------------------------------------------------------------------------------------------
    def maybe_save(self, step: int) -> str | None:
        """Save after ``step`` when it is a multiple of ``save_freq`` or the last step."""
        freq = self.cfg.save_freq
        if freq <= 0 or not (step % freq == 0 or step == self.cfg.total_steps):
            return None
        return self.save(step)

    def save(self, step: int) -> str:
        """Write ``global_step_<step>`` atomically (collective); returns its folder."""
        rank = dist.get_rank()
        final = os.path.join(self.root, f"global_step_{step}")
        tmp = final + ".tmp"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        for name, part in self._folders():
            part.save_checkpoint(os.path.join(tmp, name))
        mckpt.save_rng_state(os.path.join(tmp, f"rng_rank{rank}.safetensors"))
        if rank == 0:
            with open(os.path.join(tmp, STATE), "w", encoding="utf-8") as f:
                json.dump(self._trainer_state(), f, indent=1)
        dist.barrier()  # every rank's files are written
        write_manifest(tmp)
        if rank == 0:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump({"step": step, "layout": mckpt.layout_signature()}, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            _write_latest(self.root, final)
            self._prune(step)
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

    def _folders(self) -> list[tuple[str, Any]]:
        return [(name, part) for name, part in self.states.items() if _is_folder(part)]

    def _stateful(self) -> list[tuple[str, Any]]:
        return [(name, part) for name, part in self.states.items() if hasattr(part, "state_dict")]

    def _trainer_state(self) -> dict[str, Any]:
        """trainer_state.json: the ``trainer`` part's keys at the top level, every other Stateful part under its
        name, the folder parts' update counts under ``versions``."""
        doc: dict[str, Any] = {}
        versions: dict[str, int] = {}
        for name, part in self._stateful():
            state = part.state_dict()
            if _is_folder(part):
                versions[name] = state["version"]
            elif name == TOP:
                doc.update(state)
            else:
                doc[name] = state
        return {**doc, "versions": versions}

    def _part_states(self, doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Each Stateful part's state in ``doc`` (what :meth:`_trainer_state` wrote, or an earlier hybridrl)."""
        out = {}
        for name, part in self._stateful():
            if _is_folder(part):
                out[name] = {"version": doc["versions"].get(name, int(doc["step"]))}
            elif name == TOP:
                out[name] = {k: v for k, v in doc.items() if k not in self.states and k != "versions"}
            elif doc.get(name) is None and name in _SAVED_AS_NULL:
                out[name] = _SAVED_AS_NULL[name](doc)
            else:
                out[name] = doc[name]
        return out

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

    def maybe_resume(self) -> bool:
        """Restore the parts from the selected checkpoint, or the newest intact one older than it (collective);
        True when it resumed."""
        path, read = self._first_intact(self._candidates())
        self._note_other_runs(0 if path is None else _step_of(path))
        if path is None:
            return False
        for name, part in self.states.items():
            if _is_folder(part):
                part.load_checkpoint(os.path.join(path, name))
            if name in read["parts"]:
                try:  # the same state on every rank: all ranks refuse alike
                    part.load_state_dict(read["parts"][name])
                except ValueError as err:
                    raise ResumeError(f"checkpoint {path}: {err}") from None
        if read["rng"] is not None:
            mckpt.set_rng_state(read["rng"])
        self.resumed_from = path
        if dist.get_rank() == 0:
            print(f"[hybridrl] resumed from {path} (step {read['step']})", flush=True)
        return True

    def _candidates(self) -> list[str]:
        """The selected checkpoint, then the older complete ones of its folder, newest step first."""
        first = self.resume_path()
        if first is None:
            return []
        first = os.path.normpath(first)
        step = _step_of(first)
        older = [f for s, f in reversed(complete_checkpoints(os.path.dirname(first))) if s < step]
        return [first, *older]

    def _first_intact(self, candidates: list[str]) -> tuple[str | None, dict[str, Any]]:
        """The first candidate that passes :meth:`_check` and what it read; one line per corrupt one skipped."""
        for i, path in enumerate(candidates):
            problem, read = self._check(path)
            if problem is None:
                return path, read
            kind, message = problem
            if kind == "unsafe":
                raise ResumeError(message)
            if i + 1 == len(candidates):
                newer = f" (the {i} newer one(s) are corrupt too)" if i else ""
                raise ResumeError(
                    f"no intact checkpoint to resume from: {message}{newer}; restore the file, or start fresh: "
                    "trainer.resume_mode=disable or another trainer.default_local_dir"
                )
            if dist.get_rank() == 0:
                print(f"[hybridrl] warning: checkpoint {path} is corrupt: {message}; falling back to "
                      f"{candidates[i + 1]}", flush=True)  # fmt: skip
        return None, {}

    def _check(self, path: str) -> tuple[tuple[str, str] | None, dict[str, Any]]:
        """Check ``path`` on every rank: this rank's share of the manifest, then every file this rank will read,
        through readers that cannot run code. Collective: all ranks get the same verdict, ``("unsafe" |
        "corrupt", message)`` or None, and what this rank read (:meth:`_read`)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        problems: list[tuple[str, str]] = []
        read: dict[str, Any] = {}
        try:
            manifest = read_manifest(path)
            if manifest is None or not can_hash(manifest):
                what = "has no manifest.json (saved by an earlier hybridrl)" if manifest is None else (
                    f"was hashed with {manifest['hash']}, not importable here")  # fmt: skip
                if rank == 0:
                    print(f"[hybridrl] note: checkpoint {path} {what}: sizes and hashes not checked", flush=True)
            problem = None if manifest is None else check_files(path, manifest, rank, world)
            if problem:
                problems.append(("corrupt", problem))
        except ValueError as err:
            problems.append(("corrupt", str(err)))
        n_manifest = len(problems)
        try:
            self._check_folders(path)
            read = self._read(path)
        except ResumeError:
            raise  # the same on every rank (a part the checkpoint lacks): no verdict to agree on
        except UnsafeCheckpointError as err:
            problems.append(("unsafe", str(err)))
        except CorruptCheckpointError as err:
            problems.append(("corrupt", str(err)))
        except (OSError, ValueError, KeyError, TypeError) as err:  # a file missing, a field missing or mistyped
            problems.append(("corrupt", f"{path} cannot be read ({type(err).__name__}: {err})"))
        # a rank's manifest finding (sizes, hashes) names the damage better than another rank's parse error of it
        gathered = gather((n_manifest, problems))
        verdicts = [p for n, found in gathered for p in found[:n]] + [p for n, found in gathered for p in found[n:]]
        return next((p for p in verdicts if p[0] == "unsafe"), verdicts[0] if verdicts else None), read

    def _check_folders(self, path: str) -> None:
        """Every folder part of this run is in ``path`` and its files pass the safe readers (this rank's share)."""
        for name, part in self._folders():
            folder = os.path.join(path, name)
            if not os.path.isdir(folder):
                raise ResumeError(
                    f"checkpoint {path} has no {name} (saved by a run without one); resume it with the same roles "
                    f"({name}.enable=false), or start fresh: trainer.resume_mode=disable or another default_local_dir"
                )
            part.check_checkpoint(folder)

    def _read(self, path: str) -> dict[str, Any]:
        """``{"step", "parts", "rng"}`` of ``path``: its step, the Stateful parts' states, this rank's RNG states
        (None under another layout)."""
        if os.path.isfile(os.path.join(path, STATE)):
            doc = _read_json(os.path.join(path, STATE))
        else:  # an earlier hybridrl's torch.save of the same dict (numbers, strings, containers)
            doc = load_torch_file(os.path.join(path, "trainer.pt"))
        same_layout = _read_json(os.path.join(path, "meta.json"))["layout"] == mckpt.layout_signature()
        rng = None
        for name in (f"rng_rank{dist.get_rank()}.safetensors", f"rng_rank{dist.get_rank()}.pt"):
            if same_layout and rng is None and os.path.isfile(os.path.join(path, name)):
                rng = mckpt.read_rng_state(os.path.join(path, name))
        return {"step": int(doc["step"]), "parts": self._part_states(doc), "rng": rng}

    def _note_other_runs(self, start: int) -> None:
        """Say so when this run starts below checkpoints of an earlier run in its folder (they are kept)."""
        higher = [s for s, _ in complete_checkpoints(self.root) if s > start]
        if higher and dist.get_rank() == 0:
            print(f"[hybridrl] note: {self.root} holds an earlier run's checkpoints up to global_step_{higher[-1]}; "
                  f"this run (from step {start}) keeps them, overwrites the steps it saves itself, and "
                  f"resume_mode=auto will follow its newest save ({LATEST})", flush=True)  # fmt: skip


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except ValueError as err:  # cut short or overwritten
        raise CorruptCheckpointError(f"{path} cannot be read ({err}); the file is corrupt") from None


def _step_of(path: str) -> int:
    """The step of a checkpoint folder: from its name (global_step_N), else from its meta.json."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    if m:
        return int(m.group(1))
    with open(os.path.join(path, "meta.json")) as f:
        return int(json.load(f)["step"])

"""Resume runs no code from a checkpoint, and a corrupt checkpoint is named and skipped; 2 CPU ranks, tiny_cpu.yaml.

A ``torchrun ... hybridrl train`` launch saves one step. A ``run_ranks`` launch then starts the same run
through the CLI's own ``main`` (it resumes that checkpoint; its trainer is kept) and resumes the real trainer
(``CheckpointManager.maybe_resume``, what ``RLTrainer`` calls at start-up) from tampered copies of the
checkpoint (``run_ranks`` children cannot save: Megatron's writer starts processes, which daemons may not):

- a pickle payload (it would create a marker file) in each file type resume reads: one rank's optimizer state
  (rank 1 only: both ranks must refuse together, or rank 0 would wait in a collective), the trainer and RNG
  states in the format of earlier versions (``trainer.pt``, ``rng_rank0.pt``, still read when present), and
  Megatron's folder (``.metadata``, a non-tensor item inside a ``.distcp`` file, ``common.pt``), each with the
  manifest rewritten to match (whoever can plant a file can rewrite it): a one-line ResumeError that names the
  file, the CLI's funnel kind "checkpoint", and no marker;
- the same payload without the manifest rewritten (the hash check fails too): still a refusal, not a fall back
  to an older checkpoint (planted code is no accident), no marker;
- a shard cut short in the newer of two checkpoints, by explicit path and by ``resume_mode=auto``: one line
  naming the file, resumed from the older one; both cut: a one-line ResumeError; an untouched copy resumes;
  a trainer state of another data seed: a one-line ResumeError;
- an untouched copy resumed with every unpickler unreachable (``pickle.load``/``loads``/``Unpickler``,
  ``torch.load`` and torch's weights-only unpickler raise): resume reads nothing through one;
- the readers against torch's own on the files the trainer wrote: every ``.pt`` file equals ``torch.load``'s
  (weights-only) and every DCP folder (``actor/model``, ``critic/model``) equals torch's ``FileSystemReader``'s,
  bitwise, with the same dtypes, strides and structure; so do the ``trainer.pt`` and ``rng_rank{r}.pt`` files of
  earlier versions, written from the resumed run's own state.

Then one ``torchrun ... hybridrl train`` launch on the rank-1 payload shows what a user sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mcore.no_unpickler import assert_same, plant_as_item, plant_in_metadata, unpickler_unreachable
from tests.multirank import run_ranks

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.multirank
RUN = ["tiny_cpu.yaml", "trainer.n_gpus_per_node=2", "trainer.loggers=[jsonl]", "trainer.test_freq=-1"]
MARKER = "payload_ran"


class _Payload:
    """Unpickled in full, it creates ``marker``: what a planted pickle could do instead is anything."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _digest(path: Path, algorithm: str) -> str:
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(path.read_bytes()).hexdigest()
    return hashlib.blake2b(path.read_bytes()).hexdigest()


def _rehash(step: Path) -> None:
    """Rewrite the manifest of ``step`` to match its files, as someone who planted a file could."""
    file = step / "manifest.json"
    if not file.exists():
        return
    manifest = json.loads(file.read_text())
    found = [p for p in step.rglob("*") if p.is_file() and p.name not in ("manifest.json", "meta.json")]
    manifest["files"] = {str(p.relative_to(step)): [p.stat().st_size, _digest(p, manifest["hash"])] for p in found}
    file.write_text(json.dumps(manifest))


def _plant_pt(target: str, replaces: str | None = None):
    """A planter of a ``.pt`` payload at ``target`` (removing ``replaces``: the earlier format is read when alone)."""

    def plant(step: Path, marker: str) -> None:
        import torch

        if replaces:
            (step / replaces).unlink()
        torch.save({"state": _Payload(marker)}, step / target)

    return plant


def _plant_metadata(step: Path, marker: str) -> None:
    plant_in_metadata(step / "actor" / "model", _Payload(marker))


def _plant_item(step: Path, marker: str) -> None:
    """Append a payload to a .distcp file and point a non-tensor item (a layer's _extra_state) at it."""
    plant_as_item(step / "critic" / "model", _Payload(marker))


def _cut(*steps: str):
    def cut(case: Path, marker: str) -> None:
        for step in steps:
            shard = case / step / "actor" / "model" / "__0_1.distcp"
            os.truncate(shard, shard.stat().st_size // 2)

    return cut


# payload cases: (planter, the file it plants, relative to the checkpoint folder)
PAYLOADS = {
    "optim_rank1": (_plant_pt("actor/optim_rank1.pt"), "actor/optim_rank1.pt"),
    "trainer_pt": (_plant_pt("trainer.pt", replaces="trainer_state.json"), "trainer.pt"),
    "rng_pt": (_plant_pt("rng_rank0.pt", replaces="rng_rank0.safetensors"), "rng_rank0.pt"),
    "metadata": (_plant_metadata, "actor/model/.metadata"),
    "distcp_item": (_plant_item, "critic/model/__0_0.distcp"),
    "common_pt": (_plant_pt("actor/model/common.pt"), "actor/model/common.pt"),
}


def _payload_case(plant, rehash: bool = True) -> tuple[list[str], str, object]:
    def tamper(case: Path, marker: str) -> None:
        plant(case / "global_step_1", marker)
        if rehash:
            _rehash(case / "global_step_1")

    return ["global_step_1"], "path", tamper


def _other_seed(case: Path, marker: str) -> None:
    """Trainer state of a run with another data seed: its loader position means other prompts here."""
    file = case / "global_step_1" / "trainer_state.json"
    state = json.loads(file.read_text())
    state["loader"]["seed"] = 999
    file.write_text(json.dumps(state))
    _rehash(case / "global_step_1")


TWO = ["global_step_1", "global_step_2"]
BLOCKED = "no_unpickler"  # the case resumed with every unpickler unreachable
# name: (the checkpoint's copies in the case folder, resume mode, how to tamper with them)
CASES = {
    **{name: _payload_case(plant) for name, (plant, _) in PAYLOADS.items()},
    "no_rehash": _payload_case(_plant_pt("actor/optim_rank0.pt"), rehash=False),
    "intact": (["global_step_1"], "path", lambda case, marker: None),
    BLOCKED: (["global_step_1"], "path", lambda case, marker: None),
    "other_data": (["global_step_1"], "path", _other_seed),
    "cut_path": (TWO, "path", _cut("global_step_2")),
    "cut_auto": (TWO, "auto", _cut("global_step_2")),
    "cut_both": (TWO, "path", _cut(*TWO)),
}


def _body(rank: int, world: int, root: str) -> dict:
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import torch.distributed as dist

    from hybridrl import cli, errors
    from hybridrl.trainer import rl_trainer
    from hybridrl.trainer.checkpoint import CheckpointManager, ResumeError

    kept, fit = {}, rl_trainer.RLTrainer.fit

    def keep_and_fit(self):
        kept["trainer"] = self
        return fit(self)

    rl_trainer.RLTrainer.fit = keep_and_fit
    run = os.path.join(root, "run")
    args = ["train", *RUN, "trainer.total_steps=1", "trainer.resume_mode=auto", f"trainer.default_local_dir={run}"]
    assert cli.main(args) == 0 and kept["trainer"].ckpt.resumed_from == os.path.join(run, "global_step_1")
    trainer, out = kept["trainer"], {}
    for name, (steps, mode, tamper) in CASES.items():
        case = Path(root) / "cases" / name
        if rank == 0:
            for step in steps:
                shutil.copytree(Path(run) / "global_step_1", case / step)
            tamper(case, str(case / MARKER))
        dist.barrier()
        where = {"resume_mode": "auto", "default_local_dir": str(case)} if mode == "auto" else {
            "resume_mode": "path", "resume_from_path": str(case / steps[-1])}  # fmt: skip
        manager = CheckpointManager(dataclasses.replace(trainer.cfg.trainer, **where), states=trainer.ckpt.states)
        console = io.StringIO()
        try:
            blocked = unpickler_unreachable() if name == BLOCKED else contextlib.nullcontext()
            with contextlib.redirect_stdout(console), blocked:
                manager.maybe_resume()
            result = {"resumed": manager.resumed_from}
        except ResumeError as err:
            result = {"error": str(err), "kind": errors.kind_of(err)}
        dist.barrier()
        out[name] = {**result, "console": console.getvalue(), "ran": (case / MARKER).exists()}
    out["earlier_formats"] = _earlier_formats(rank, Path(root) / "earlier")
    return out


def _earlier_formats(rank: int, folder: Path) -> list[str]:
    """``rng_rank{r}.pt`` and ``trainer.pt`` as earlier versions wrote them (``torch.save`` of this rank's RNG
    states, of the trainer state): the safe readers give what ``torch.load`` gives; returns what was compared."""
    import numpy as np
    import torch

    from hybridrl.mcore import checkpoint as mckpt
    from hybridrl.mcore.torch_file import load_torch_file

    folder.mkdir(exist_ok=True)
    rng, trainer = folder / f"rng_rank{rank}.pt", folder / f"trainer{rank}.pt"
    torch.save(mckpt.rng_state(), rng)
    torch.save({"step": 1, "loader": {"seed": 1, "epoch": 0}, "versions": {"actor": 1}}, trainer)
    rebuild = np.empty(0).__reduce__()[0]
    with torch.serialization.safe_globals([np.ndarray, np.dtype, type(np.dtype(np.uint32)), rebuild]):
        want_rng = torch.load(rng, weights_only=True)
    assert_same(mckpt.read_rng_state(str(rng)), want_rng, "rng")
    assert_same(load_torch_file(str(trainer)), torch.load(trainer, weights_only=True), "trainer")
    return sorted(want_rng)


def _same_as_torch_readers(step: Path) -> list[str]:
    """Every ``.pt`` file and DCP folder of a saved checkpoint, read by hybridrl and by torch: the same data."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from hybridrl.mcore.safe_dcp import load_full_state, read_dcp_metadata
    from hybridrl.mcore.torch_file import load_torch_file

    compared = []
    for file in sorted(step.rglob("*.pt")):
        assert_same(load_torch_file(str(file)), torch.load(file, map_location="cpu", weights_only=True), str(file))
        compared.append(str(file.relative_to(step)))
    for meta in sorted(step.rglob(".metadata")):
        want: dict = {}
        _load_state_dict(want, FileSystemReader(meta.parent), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        assert_same(load_full_state(str(meta.parent)), want, str(meta.parent))
        assert read_dcp_metadata(str(meta)) == pickle.loads(meta.read_bytes())
        compared.append(str(meta.parent.relative_to(step)))
    return compared


def _refusal(path: Path, what: str) -> str:
    return f"{path} holds {what}, which loading could run as code; refusing to load it."


def _torchrun(*overrides: str) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "hybridrl", "train", *RUN, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)


def test_resume_refuses_planted_code_and_skips_corrupt_checkpoints(tmp_path):
    saved = _torchrun("trainer.total_steps=1", "trainer.save_freq=1", f"trainer.default_local_dir={tmp_path / 'run'}")
    assert saved.returncode == 0, (saved.stdout + saved.stderr)[-3000:]
    out = run_ranks(_body, 2, str(tmp_path), timeout=900)
    cases = tmp_path / "cases"
    for name, (_, planted) in PAYLOADS.items():
        for rank in (0, 1):  # both ranks refuse, with the same line
            r = out[rank][name]
            assert not r["ran"], f"{name}: the payload ran"
            assert r.get("kind") == "checkpoint", (name, r)
            assert "\n" not in r["error"]
            file = cases / name / "global_step_1" / planted
            what = ("the global builtins.exec (not a torch checkpoint-metadata class)" if name == "metadata" else
                    "a Python object beyond tensors and builtins (builtins.exec)")  # fmt: skip
            if name == "distcp_item":
                assert r["error"].startswith(f"{file} holds in its item "), r["error"]
                assert "a Python object beyond tensors and builtins (builtins.exec)" in r["error"]
            else:
                assert r["error"].startswith(_refusal(file, what)), (name, r["error"])
    changed = cases / "no_rehash" / "global_step_1" / "actor" / "optim_rank0.pt"
    r = out[1]["no_rehash"]
    assert not r["ran"] and r["kind"] == "checkpoint"
    assert r["error"].startswith(_refusal(changed, "a Python object beyond tensors and builtins (builtins.exec)"))
    assert out[0]["intact"]["resumed"] == str(cases / "intact" / "global_step_1")
    for rank in (0, 1):  # resumed with no unpickler reachable: nothing it read went through one
        assert out[rank][BLOCKED]["resumed"] == str(cases / BLOCKED / "global_step_1"), out[rank][BLOCKED]
        assert out[rank]["earlier_formats"] == ["numpy", "python", "torch", "tracker"]
    compared = _same_as_torch_readers(tmp_path / "run" / "global_step_1")
    assert {"actor/optim_rank0.pt", "actor/optim_rank1.pt", "critic/optim_rank1.pt", "actor/model/common.pt",
            "actor/model", "critic/model"} <= set(compared), compared  # fmt: skip
    assert out[0]["other_data"]["error"] == (
        f"checkpoint {cases / 'other_data' / 'global_step_1'}: data loader state: seed was 999 at save time but is "
        "1 now; restore with the same data config and files"
    )
    size = (tmp_path / "run" / "global_step_1" / "actor" / "model" / "__0_1.distcp").stat().st_size

    def fallback_line(name: str, step: int) -> str:
        newer, older = cases / name / f"global_step_{step}", cases / name / f"global_step_{step - 1}"
        shard = newer / "actor" / "model" / "__0_1.distcp"
        return (f"[hybridrl] warning: checkpoint {newer} is corrupt: {shard} is {size // 2} bytes, {size} at save "
                f"(cut short or overwritten); falling back to {older}")  # fmt: skip

    for name in ("cut_path", "cut_auto"):
        older = str(cases / name / "global_step_1")
        assert out[0][name]["resumed"] == older and out[1][name]["resumed"] == older
        assert [x for x in out[0][name]["console"].splitlines() if "corrupt" in x] == [fallback_line(name, 2)]
        assert "corrupt" not in out[1][name]["console"]  # rank 0 says it, once
    r = out[1]["cut_both"]
    shard = cases / "cut_both" / "global_step_1" / "actor" / "model" / "__0_1.distcp"
    assert r["error"].startswith(f"no intact checkpoint to resume from: {shard} is {size // 2} bytes, "), r["error"]
    assert "(the 1 newer one(s) are corrupt too)" in r["error"] and "\n" not in r["error"]
    assert [x for x in out[0]["cut_both"]["console"].splitlines() if "corrupt" in x] == [fallback_line("cut_both", 2)]

    # what a user sees: the rank-1 payload through torchrun and the CLI
    planted = cases / "optim_rank1" / "global_step_1"
    done = _torchrun("trainer.resume_mode=path", f"trainer.resume_from_path={planted}",
                     f"trainer.default_local_dir={tmp_path / 'cli'}")  # fmt: skip
    assert done.returncode != 0
    what = "a Python object beyond tensors and builtins (builtins.exec)"
    line = f"checkpoint error: {_refusal(planted / 'actor' / 'optim_rank1.pt', what)}"
    assert line in done.stderr, done.stderr[-3000:]
    assert not (cases / "optim_rank1" / MARKER).exists()

"""The checkpoint parts of a trainer, one at a time: each saves its state and a fresh one loaded from it behaves
as the original does (:mod:`hybridrl.trainer.checkpoint`'s Stateful protocol, JSON round trip included).

- data loader: the same next batches, mid-epoch and across the epoch's end;
- KL controllers: an adaptive one continues with the same coefficient (target and horizon from the new config),
  a fixed one keeps its config's;
- tracker: a resume after a crash leaves the history an uninterrupted run writes;
- a trained role (critic, 2 ranks, through the worker group's declared methods): the next update and values equal
  the uninterrupted group's bit for bit, a fresh group's differ;
- and the house rules: the manager reaches no role's worker, model or optimizer; no test hook in the package.
The loop counters (step, bad steps) are checked by the relaunch in test_failures.py, a trainer's whole state by
test_resume.py.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ROLE_INTERNALS = ("worker", "model", "optimizer")


def _json(state: dict) -> dict:
    return json.loads(json.dumps(state))  # what trainer_state.json gives back


def _reached(tree: ast.AST) -> list[str]:
    """``x.worker`` / ``x.model`` / ``x.optimizer`` attribute accesses in ``tree``, as ``line:name``."""
    return [f"{n.lineno}:{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in ROLE_INTERNALS]


def test_manager_reaches_no_role_internals():
    snippet = _reached(ast.parse("a = trainer.actor.worker.model\nb = group.optimizer\n"))
    assert sorted(snippet) == ["1:model", "1:worker", "2:optimizer"], snippet
    source = (ROOT / "hybridrl" / "trainer" / "checkpoint.py").read_text()
    assert _reached(ast.parse(source)) == [], "the checkpoint manager must get parts, not reach into the roles"


def _test_hooks(tree: ast.AST, source: str) -> list[str]:
    hooks = [f"def {n.name}" for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.endswith("_for_test")]
    return hooks + (["HYBRIDRL_TEST_"] if "HYBRIDRL_TEST_" in source else [])


def test_no_test_hooks_in_the_package():
    """Faults are injected by the tests (a custom scorer, a custom policy-loss file), not by hooks in the loop."""
    bad = 'def crash_for_test():\n    pass\nif os.environ.get("HYBRIDRL_TEST_NAN_LOSS"):\n    pass\n'
    assert _test_hooks(ast.parse(bad), bad) == ["def crash_for_test", "HYBRIDRL_TEST_"]
    found = {}
    for path in sorted((ROOT / "hybridrl").rglob("*.py")):
        source = path.read_text()
        if hooks := _test_hooks(ast.parse(source), source):
            found[str(path.relative_to(ROOT))] = hooks
    assert not found, f"test hooks in the package: {found}"


def _truths(batches) -> list[list[str]]:
    return [list(b.non_tensor_batch["ground_truth"]) for b in batches]


def test_loader_part_gives_the_same_next_batches(tmp_path):
    from hybridrl.data import PromptLoader, RLHFDataset, write_rows
    from tests.data.tiny_tokenizers import hf_tokenizer

    rows = [{"prompt": [{"role": "user", "content": f"Copy: {i}"}], "data_source": "gsm8k",
             "reward_model": {"ground_truth": str(i)}} for i in range(7)]  # fmt: skip
    ds = RLHFDataset([write_rows(rows, tmp_path / "t.parquet")], hf_tokenizer(), {"max_prompt_length": 32})
    reference = PromptLoader(ds, 2, seed=3)
    expected = [b for _ in range(3) for b in _truths(reference)]  # 3 epochs of 3 batches
    for stop in (2, 3, 5):  # mid-epoch, at the epoch's end, in the second epoch
        loader, seen = PromptLoader(ds, 2, seed=3), []
        batches = iter(loader)
        while len(seen) < stop:  # the trainer's loop: next() on an iterator, a new one after each epoch
            try:
                seen.append(_truths([next(batches)])[0])
            except StopIteration:
                batches = iter(loader)
        restored = PromptLoader(ds, 2, seed=3)
        restored.load_state_dict(_json(loader.state_dict()))
        rest = []
        while len(seen) + len(rest) < len(expected):
            rest += _truths(restored)
        assert seen + rest == expected, stop


def test_kl_controller_parts():
    from hybridrl.algos.kl import make_kl_controller
    from hybridrl.config.schema import KLControlConfig

    adaptive = KLControlConfig(type="adaptive", kl_coef=0.2, target_kl=0.05, horizon=100)
    kls = [0.01, 0.3, 0.07, 0.2, 0.0, 0.11]
    reference = make_kl_controller(adaptive)
    for kl in kls:
        reference.update(kl, n_steps=8)
    saved = make_kl_controller(adaptive)
    for kl in kls[:3]:
        saved.update(kl, n_steps=8)
    resumed = make_kl_controller(adaptive)
    resumed.load_state_dict(_json(saved.state_dict()))
    for kl in kls[3:]:
        resumed.update(kl, n_steps=8)
    assert resumed.value == reference.value != 0.2  # bit for bit the uninterrupted coefficient
    # target and horizon are this run's config, whatever the checkpoint holds
    other = make_kl_controller(KLControlConfig(type="adaptive", kl_coef=0.5, target_kl=6.0, horizon=500))
    other.load_state_dict(_json(saved.state_dict()))
    assert (other.value, other.target, other.horizon) == (saved.value, 6.0, 500)
    fixed = make_kl_controller(KLControlConfig(type="fixed", kl_coef=0.3))
    fixed.load_state_dict(_json(saved.state_dict()))  # a fixed coefficient is the config's
    assert fixed.value == 0.3 and fixed.state_dict() == {"value": 0.3}
    from_fixed = make_kl_controller(adaptive)  # a fixed controller's state was never steered: the config's start
    from_fixed.load_state_dict(_json(fixed.state_dict()))
    assert from_fixed.value == 0.2


def test_tracker_part_resumes_the_uninterrupted_history(tmp_path):
    from hybridrl.trainer.tracking import Tracker

    def run(folder: Path, steps, resume: dict | None = None) -> Tracker:
        tracker = Tracker(["jsonl"], str(folder), total_steps=5)
        if resume is None:
            tracker.start_fresh()
        else:
            tracker.load_state_dict(resume)
        for step in steps:
            tracker.log({"x": float(step)}, step=step)
        return tracker

    run(tmp_path / "ref", range(1, 6)).close()
    crashed = run(tmp_path / "run", range(1, 4))
    saved = _json(crashed.state_dict())  # the checkpoint after step 3
    for step in (4, 5):  # logged after the checkpoint, then the crash
        crashed.log({"x": -1.0}, step=step)
    crashed.close()
    run(tmp_path / "run", (4, 5), resume=saved).close()
    assert saved == {"step": 3}
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == (tmp_path / "ref" / "metrics.jsonl").read_text()
    assert [json.loads(x)["x"] for x in (tmp_path / "run" / "metrics.1.jsonl").read_text().splitlines()][-2:] == [
        -1.0, -1.0]  # fmt: skip


@pytest.mark.multirank
def test_trained_role_part_round_trip(tmp_path):
    from tests.mcore import hf_tiny

    path = hf_tiny.make_checkpoint("llama", str(tmp_path / "critic"), seed=4, score=True)  # a nonzero value head
    result = tmp_path / "result.pt"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "tests.trainer.parts_worker", path,
           str(tmp_path / "ckpt"), str(result)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    r = torch.load(result, weights_only=True)
    assert r["state"] == {"version": 1}
    trained, restored, fresh = r["trained"], r["restored"], r["fresh"]
    assert restored["version"] == trained["version"] == 2
    assert restored["metrics"] == trained["metrics"]  # loss, grad norm, lr: the same floats
    assert torch.equal(restored["values"], trained["values"])
    assert fresh["metrics"]["critic/loss"] != trained["metrics"]["critic/loss"]  # the round trip is what matters
    assert not torch.equal(fresh["values"], trained["values"])

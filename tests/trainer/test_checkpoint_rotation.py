"""CheckpointManager on one gloo rank with stand-in parts (no models): rotation, the newest-save marker,
what a resume restores from the KL controller, a checkpoint that lacks a role this run has, and one in the layout
of earlier versions.

A run restarted below an earlier run's highest step (resume_mode=disable into the same folder) used to have its
own new checkpoint deleted by keep-last-K, which ranked folders by step, and resume_mode=auto then went back to
the earlier run. A resumed adaptive KL controller took the checkpoint's target and horizon over the new config's.
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest

from tests.multirank import run_ranks

pytestmark = pytest.mark.multirank


def _states(step: int, kl_ctrl, critic=None) -> dict:
    """The parts of a trainer at ``step``: a stand-in loader and loop counters, a real KL controller, and, when
    given, a stand-in critic (a folder part)."""
    loader = SimpleNamespace(state_dict=lambda: {"epoch": 0, "position": step}, load_state_dict=lambda s: None)
    counters = SimpleNamespace(state_dict=lambda: {"step": step, "bad_steps": 0}, load_state_dict=lambda s: None)
    states = {"loader": loader, "trainer": counters, "kl_ctrl": kl_ctrl}
    return {**states, "critic": critic} if critic is not None else states


def _body(rank: int, world: int, root: str) -> dict:
    from hybridrl.algos.kl import AdaptiveKLController, FixedKLController
    from hybridrl.config.schema import TrainerConfig
    from hybridrl.distributed import ParallelLayout, init_model_parallel
    from hybridrl.trainer.checkpoint import LATEST, CheckpointManager, ResumeError
    from hybridrl.trainer.tracking import Tracker

    init_model_parallel(ParallelLayout.from_world(world), seed=0)
    out = {}

    def manager(mode: str, states: dict | None = None, **kw) -> CheckpointManager:
        cfg = TrainerConfig(default_local_dir=root, resume_mode=mode, max_ckpt_to_keep=2, **kw)
        return CheckpointManager(cfg, states=states)

    kl = AdaptiveKLController(init_kl_coef=0.1, target_kl=0.1, horizon=10000)
    for step in range(1, 11):  # an earlier run: steps 1..10, keep 2
        kl.value = 0.1 + step / 1000
        manager("disable", _states(step, kl)).save(step)
    out["first"] = sorted(os.listdir(root))

    for step in (1, 2, 3):  # a new run into the same folder, from step 0
        manager("disable", _states(step, FixedKLController(0.05))).save(step)
    out["second"] = sorted(os.listdir(root))
    with open(os.path.join(root, LATEST)) as f:
        out["latest"] = f.read().strip()
    out["auto"] = os.path.basename(manager("auto").resume_path())

    # resume the earlier run's step 10 under a new adaptive config: coefficient restored, target/horizon new
    step_10 = os.path.join(root, "global_step_10")
    resumed = AdaptiveKLController(init_kl_coef=0.001, target_kl=6.0, horizon=500)
    assert manager("path", _states(0, resumed), resume_from_path=step_10).maybe_resume()
    out["kl"] = (resumed.value, resumed.target, resumed.horizon)
    fixed = FixedKLController(0.2)  # a fixed coefficient is the config's, whatever was saved
    manager("path", _states(0, fixed), resume_from_path=step_10).maybe_resume()
    out["fixed"] = fixed.value

    nothing = lambda path: None  # noqa: E731 (never reached: the checkpoint has no critic/ folder)
    critic = SimpleNamespace(save_checkpoint=nothing, check_checkpoint=nothing, load_checkpoint=nothing)
    try:
        manager("auto", _states(0, FixedKLController(0.2), critic=critic)).maybe_resume()
    except ResumeError as err:
        out["no_critic"] = str(err)

    # trainer_state.json as earlier versions wrote it (tracker null, no bad-step count; no manifest): the
    # tracker's history ends at the checkpoint's step, the loop counters get what the file has
    legacy = os.path.join(root, "legacy", "global_step_3")
    shutil.copytree(os.path.join(root, "global_step_3"), legacy)
    os.remove(os.path.join(legacy, "manifest.json"))
    with open(os.path.join(legacy, "trainer_state.json"), "w") as f:
        json.dump({"step": 3, "loader": {"epoch": 0, "position": 3}, "kl_ctrl": {"value": 0.05}, "versions": {},
                   "tracker": None}, f)  # fmt: skip
    tracker = Tracker(["jsonl"], os.path.join(root, "logs"))
    for step in range(1, 6):  # steps 4 and 5 were logged after the checkpoint
        tracker.log({"x": float(step)}, step=step)
    counters: dict = {}
    states = {**_states(0, FixedKLController(0.2)), "tracker": tracker}
    states["trainer"] = SimpleNamespace(state_dict=dict, load_state_dict=counters.update)
    assert manager("path", states, resume_from_path=legacy).maybe_resume()
    tracker.close()
    with open(os.path.join(root, "logs", "metrics.jsonl")) as f:
        out["legacy"] = (counters, [json.loads(line)["step"] for line in f])
    return out


def test_rotation_latest_and_resume_state(tmp_path):
    root = str(tmp_path / "run")
    (out,) = run_ranks(_body, 1, root, timeout=240)
    assert out["first"] == ["global_step_10", "global_step_9", "latest_checkpoint.txt"]
    # the new run keeps its own newest 2 and leaves the earlier run's higher steps alone
    assert out["second"] == ["global_step_10", "global_step_2", "global_step_3", "global_step_9",
                             "latest_checkpoint.txt"]  # fmt: skip
    assert out["latest"] == "global_step_3" and out["auto"] == "global_step_3"
    assert out["kl"] == (pytest.approx(0.11), 6.0, 500)
    assert out["fixed"] == 0.2
    assert out["no_critic"].startswith(f"checkpoint {root}/global_step_3 has no critic (saved by a run without one)")
    assert out["legacy"] == ({"step": 3}, [1, 2, 3])

    # a crash between a save's rename and its marker: the complete folder newer than the marker wins
    from hybridrl.config.schema import TrainerConfig
    from hybridrl.trainer.checkpoint import LATEST, CheckpointManager

    shutil.copytree(f"{root}/global_step_3", f"{root}/global_step_4")
    marker = os.path.getmtime(f"{root}/{LATEST}")
    os.utime(f"{root}/global_step_4/meta.json", (marker + 5, marker + 5))
    auto = CheckpointManager(TrainerConfig(default_local_dir=root, resume_mode="auto"))
    assert auto.resume_path() == f"{root}/global_step_4"

"""``RayRun.prepare`` (the Ray driver's setup) makes the files the host actors load again absolute: the custom
scorer (``reward.custom.path``, rebuilt on the hosts with ``reward.overlap_generation``) and the agent environment
(``rollout.agent.path``), given relative to the driver's working folder (the hosts may run in another one). A path
that names no file is left as given (the config checks name it)."""

from __future__ import annotations

import os
from pathlib import Path

from hybridrl.config import load_config
from hybridrl.trainer.ray_launch import RayRun

ENV = (
    "from hybridrl.rollout.agent.envs.guess_number import GuessNumberEnvironment\n\n\n"
    "class Guess(GuessNumberEnvironment):\n    pass\n"
)


def test_prepare_makes_the_hosts_files_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("scorer.py").write_text(Path(__file__).with_name("overlap_scorer.py").read_text())
    Path("env.py").write_text(ENV)
    cfg = load_config("tiny_cpu_agent.yaml", ["reward.scorer=auto", "reward.custom.path=scorer.py",
                                              "rollout.agent.path=env.py", "rollout.agent.env=Guess",
                                              f"trainer.default_local_dir={tmp_path / 'run'}"])  # fmt: skip
    run, _, _ = RayRun.prepare(cfg)
    try:
        assert cfg.reward.custom.path == str(tmp_path / "scorer.py") and os.path.isabs(cfg.rollout.agent.path)
        assert cfg.rollout.agent.path == str(tmp_path / "env.py")
    finally:
        run.close()

"""Ray mode's bad input through the command line's funnel, without a Ray cluster: one line each, exit 2.

``trainer.launcher`` values, what Ray mode does not do yet (checkpoints), a Ray that is not installed, and a
Ray driver started under torchrun.
"""

from __future__ import annotations

import sys

import pytest

from hybridrl.cli import cmd_train, funnel
from hybridrl.config import ConfigError, load_config


def _line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_launcher_key():
    assert load_config("tiny_cpu.yaml").trainer.launcher == "spmd"
    assert load_config("tiny_cpu.yaml", ["trainer.launcher=ray"]).trainer.launcher == "ray"
    with pytest.raises(ConfigError, match=r"trainer.launcher \('mpi'\) must be one of \('spmd', 'ray'\)"):
        load_config("tiny_cpu.yaml", ["trainer.launcher=mpi"])
    with pytest.raises(ConfigError, match=r"trainer.save_freq \(1\): Ray mode does not write checkpoints yet"):
        load_config("tiny_cpu.yaml", ["trainer.launcher=ray", "trainer.save_freq=1"])
    with pytest.raises(ConfigError, match=r"trainer.resume_mode \(path\): Ray mode does not resume"):
        load_config("tiny_cpu.yaml", ["trainer.launcher=ray", "trainer.resume_mode=path",
                                      "trainer.resume_from_path=/tmp/x"])  # fmt: skip
    assert load_config("tiny_cpu.yaml", ["trainer.save_freq=1"]).trainer.save_freq == 1  # SPMD saves


def test_missing_ray_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    rc = funnel(lambda: cmd_train(["tiny_cpu.yaml", "trainer.launcher=ray", f"trainer.default_local_dir={tmp_path}"]))
    assert rc == 2
    line = _line(capsys)
    assert line.startswith("input error: trainer.launcher=ray needs Ray") and "pip install 'hybridrl[ray]'" in line


def test_ray_driver_under_torchrun_is_refused(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    rc = funnel(lambda: cmd_train(["tiny_cpu.yaml", "trainer.launcher=ray", f"trainer.default_local_dir={tmp_path}"]))
    assert rc == 2
    assert _line(capsys).startswith("launch error: trainer.launcher=ray runs one driver process, but this is rank 0")

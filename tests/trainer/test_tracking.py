"""Metrics sinks: JSONL lines, TensorBoard event files, console line, bad logger names."""

from __future__ import annotations

import json

import pytest

from hybridrl.trainer.tracking import StageTimer, Tracker


def test_jsonl_and_tensorboard(tmp_path, capsys):
    tracker = Tracker(["console", "jsonl", "tensorboard"], str(tmp_path), total_steps=4)
    timer = StageTimer()
    with timer("rollout"):
        pass
    tracker.log({"reward/mean": 0.5, "actor/kl": float("nan"), "note": "text", **timer.metrics()}, step=1)
    tracker.log({"reward/mean": 0.75}, step=2)
    tracker.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 1 and lines[0]["reward/mean"] == 0.5 and lines[0]["actor/kl"] == "nan"
    assert "note" not in lines[0] and "timing_s/rollout" in lines[0]
    assert lines[1] == {"step": 2, "reward/mean": 0.75}
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    out = capsys.readouterr().out
    assert "2/4" in out and "mean=0.75" in out


def test_non_zero_rank_writes_nothing(tmp_path):
    tracker = Tracker(["jsonl"], str(tmp_path / "r1"), rank=1)
    tracker.log({"x": 1.0}, step=1)
    assert not (tmp_path / "r1").exists()


def test_unknown_logger():
    with pytest.raises(ValueError, match=r"trainer.loggers has \['mlflow'\]; valid: console, jsonl"):
        Tracker(["mlflow"], "/tmp/unused")


def test_resume_drops_rows_after_the_checkpoint(tmp_path):
    """Steps logged after the last checkpoint (and before a crash) are logged again by the resumed run: their old
    rows go, so every step has one row."""
    first = Tracker(["jsonl"], str(tmp_path), total_steps=6)
    for step in range(6):
        first.log({"x": float(step)}, step=step)
    first.close()
    resumed = Tracker(["jsonl"], str(tmp_path), total_steps=6)
    resumed.resumed_at(3)
    resumed.log({"x": 40.0}, step=4)
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_resume_survives_a_line_cut_by_the_crash(tmp_path, capsys):
    """A crash mid-write (disk full, a killed rank 0) leaves a cut last line: the resume drops it, says so, and the
    file stays one JSON object per line."""
    first = Tracker(["jsonl"], str(tmp_path), total_steps=6)
    for step in range(3):
        first.log({"x": float(step)}, step=step)
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "x": 3.')  # no newline, no closing brace
    resumed = Tracker(["jsonl"], str(tmp_path), total_steps=6)
    resumed.resumed_at(2)
    resumed.log({"x": 30.0}, step=3)
    resumed.close()
    assert "dropped 1 unreadable line(s)" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0)]

"""Metrics sinks: JSONL lines, TensorBoard event files, console line, bad logger names; and that no run ever
empties an earlier history in ``metrics.jsonl`` (a new run into an old folder, a resume)."""

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


def test_resume_drops_rows_after_the_checkpoint(tmp_path, capsys):
    """Steps logged after the last checkpoint (and before a crash) are logged again by the resumed run: their old
    rows go, so every step has one row."""
    first = Tracker(["jsonl"], str(tmp_path), total_steps=6)
    for step in range(6):
        first.log({"x": float(step)}, step=step)
    first.close()
    before = (tmp_path / "metrics.jsonl").read_text()
    resumed = Tracker(["jsonl"], str(tmp_path), total_steps=6)
    resumed.resumed_at(3)
    resumed.log({"x": 40.0}, step=4)
    resumed.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["x"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    assert (tmp_path / "metrics.1.jsonl").read_text() == before  # the rows of steps 4, 5 are kept, not erased
    assert "2 row(s) past step 3 moved out" in capsys.readouterr().out


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
    assert (tmp_path / "metrics.1.jsonl").read_text().endswith('{"step": 3, "x": 3.')  # the cut line, as it was


def _history(tmp_path, name: str = "metrics.jsonl") -> list[tuple[int, float]]:
    return [(r["step"], r["x"]) for r in map(json.loads, (tmp_path / name).read_text().splitlines())]


def test_a_new_run_into_an_old_folder_keeps_the_earlier_history(tmp_path, capsys):
    """A run that does not resume (resume_mode=disable, or a finished run's folder without checkpoints) sets the
    earlier metrics.jsonl aside whole and says so; each further run gets the next number."""
    for run in range(3):
        tracker = Tracker(["jsonl"], str(tmp_path), total_steps=2)
        tracker.start_fresh()
        for step in (1, 2):
            tracker.log({"x": float(10 * run + step)}, step=step)
        tracker.close()
    assert _history(tmp_path) == [(1, 21.0), (2, 22.0)]
    assert _history(tmp_path, "metrics.1.jsonl") == [(1, 1.0), (2, 2.0)]
    assert _history(tmp_path, "metrics.2.jsonl") == [(1, 11.0), (2, 12.0)]
    out = capsys.readouterr().out
    assert f"{tmp_path / 'metrics.jsonl'} of an earlier run in this folder is kept as metrics.2.jsonl" in out


def test_resume_at_the_last_row_rewrites_nothing(tmp_path, capsys):
    """Nothing past the resumed step: the file is left as it is (no copy, no rewrite), the new rows append."""
    first = Tracker(["jsonl"], str(tmp_path), total_steps=4)
    for step in (1, 2):
        first.log({"x": float(step)}, step=step)
    first.close()
    inode = (tmp_path / "metrics.jsonl").stat().st_ino
    resumed = Tracker(["jsonl"], str(tmp_path), total_steps=4)
    resumed.resumed_at(2)
    resumed.log({"x": 3.0}, step=3)
    resumed.close()
    assert _history(tmp_path) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert (tmp_path / "metrics.jsonl").stat().st_ino == inode and not (tmp_path / "metrics.1.jsonl").exists()
    assert "note" not in capsys.readouterr().out


def test_stage_timer_counts_busy_cores():
    import time

    timer = StageTimer()
    with timer("spin"):  # busy on one core
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            pass
    with timer("sleep"):  # waiting: no core busy
        time.sleep(0.2)
    m = timer.metrics()
    assert m["timing_s/spin"] >= 0.2 and m["timing_s/sleep"] >= 0.2
    # one thread: at most one core (less on a loaded machine, which deschedules it); a sleep keeps none busy
    assert m["perf/cpu_cores/sleep"] < 0.05 < m["perf/cpu_cores/spin"] <= 1.1


def test_stage_timer_counts_page_faults():
    import mmap

    timer = StageTimer()
    pages = 4096  # 16 MiB of fresh anonymous memory, in 4 KiB pages (no huge pages for it)
    memory = mmap.mmap(-1, pages * mmap.PAGESIZE)
    memory.madvise(mmap.MADV_NOHUGEPAGE)
    with timer("touch"):
        for page in range(pages):
            memory[page * mmap.PAGESIZE] = 1
    with timer("again"):  # the same pages: already there
        for page in range(pages):
            memory[page * mmap.PAGESIZE] = 2
    m = timer.metrics()
    assert pages <= m["perf/page_faults/touch"] < pages + 500, m
    assert m["perf/page_faults/again"] < 100, m

"""``run_ranks`` with the suite's fork server (``tests/conftest.py``: :func:`hybridrl.distributed.spawn.preload`):
each rank sees the caller's environment at the launch (not the server's), what the preloaded imports set, runs its
exit hooks, and uses OpenMP threads after the fork; the environment rule itself on plain dicts."""

from __future__ import annotations

import os
import sys

from hybridrl.distributed import spawn
from tests.multirank import run_ranks


def _body(rank: int, world: int, folder: str) -> dict:
    import atexit

    import torch

    preloaded = "vllm.entrypoints.llm" in sys.modules  # before this body imported anything
    atexit.register(lambda: open(os.path.join(folder, f"exit{rank}"), "w").close())
    torch.set_num_threads(2)
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(rank))
    err = float((a @ a - (a.double() @ a.double()).float()).abs().max())
    return {"probe": os.environ.get("HYBRIDRL_SPAWN_PROBE"), "rank_env": os.environ["RANK"], "preloaded": preloaded,
            "mm_error": err}  # fmt: skip


def test_ranks_see_the_callers_environment_and_run_exit_hooks(tmp_path, monkeypatch):
    run_ranks(_body, 1, str(tmp_path))  # the server (if any) is running from here on
    monkeypatch.setenv("HYBRIDRL_SPAWN_PROBE", "set after the server started")
    out = run_ranks(_body, 2, str(tmp_path))
    for rank, r in enumerate(out):
        assert r["probe"] == "set after the server started" and r["rank_env"] == str(rank), r
        assert r["preloaded"] == bool(spawn._PRELOAD), r  # the suite's ranks come from the preloaded server
        assert r["mm_error"] < 1e-3, r  # 2 OpenMP threads after the fork give the right product
        assert (tmp_path / f"exit{rank}").exists(), f"rank {rank}'s exit hook did not run"
    monkeypatch.delenv("HYBRIDRL_SPAWN_PROBE")
    assert [r["probe"] for r in run_ranks(_body, 2, str(tmp_path))] == [None, None]


def test_fresh_environment_is_the_callers_plus_what_imports_set():
    server = {"KEPT": "1", "CHANGED": "old", "DROPPED": "x", "UNSET_BY_IMPORT": "y"}
    forked = {"KEPT": "1", "CHANGED": "old", "DROPPED": "x", "SET_BY_IMPORT": "z"}  # the server after its imports
    caller = {"KEPT": "1", "CHANGED": "new", "ADDED": "a", "UNSET_BY_IMPORT": "y"}  # the caller at the launch
    spawn._fresh_environment(forked, server, caller)
    assert forked == {"KEPT": "1", "CHANGED": "new", "ADDED": "a", "SET_BY_IMPORT": "z"}

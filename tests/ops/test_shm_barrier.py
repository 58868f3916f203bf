"""The native barrier of the shared-memory all-reduce (``csrc/shm_barrier.cpp``), called directly in one process.

Its ordering of the slots is checked where it is used, by ``tests/distributed/test_shm_allreduce.py`` (sums equal to
independent gathers over back-to-back rounds with random delays). Here: the ways a wait ends. Every peer has arrived
(at once); a peer whose process has exited, a zombie its parent has not reaped and a reaped one (a dead peer never
arrives: code 2, well before the timeout); a live peer that does not arrive (code 1 after the timeout); an unknown
pid (only the timeout applies). Timeouts are short and loose: the codes say which way the wait ended.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import psutil
import pytest
import torch

from hybridrl.ops import _native

OK, TIMEOUT, GONE = 0, 1, 2
STRIDE = 8


@pytest.fixture(scope="module")
def ext():
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on PATH: the native barrier cannot be built")
    return _native.load()  # raises (the test fails) when the build fails


def _counters(*rounds: int) -> torch.Tensor:
    c = torch.zeros(len(rounds) * STRIDE, dtype=torch.int64)
    c[::STRIDE] = torch.tensor(rounds)
    return c


@pytest.mark.parametrize("spin_us", [20.0, 0.0])
def test_arrived_peers_pass_and_the_own_counter_is_published(ext, spin_us):
    counters = _counters(0, 3, 5)  # rank 0 at round 3: peer 1 has reached it, peer 2 is past it
    me = os.getpid()
    assert ext.shm_barrier(counters, STRIDE, 0, 3, 5.0, spin_us, [me, me, me]) == (OK, -1)
    assert counters[0].item() == 3
    assert ext.shm_barrier(counters, STRIDE, 1, 3, 5.0, spin_us, [me, me, me]) == (OK, -1)


def test_a_live_peer_that_does_not_arrive_times_out(ext):
    counters = _counters(0, 0)
    start = time.monotonic()
    assert ext.shm_barrier(counters, STRIDE, 0, 1, 0.2, 20.0, [os.getpid(), os.getpid()]) == (TIMEOUT, 1)
    assert time.monotonic() - start >= 0.2


def test_an_unknown_pid_waits_for_the_timeout(ext):
    assert ext.shm_barrier(_counters(0, 0), STRIDE, 0, 1, 0.2, 0.0, [os.getpid(), 0]) == (TIMEOUT, 1)


def test_a_peer_whose_process_exited_ends_the_wait(ext):
    child = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 30
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:  # exited, not reaped: its pid exists
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert ext.shm_barrier(_counters(0, 0), STRIDE, 0, 1, 60.0, 20.0, [os.getpid(), child.pid]) == (GONE, 1)
    finally:
        child.wait()
    # reaped: no such process (a pid is reused only after the kernel's whole range has been handed out)
    assert ext.shm_barrier(_counters(0, 0), STRIDE, 0, 1, 60.0, 0.0, [os.getpid(), child.pid]) == (GONE, 1)

"""A :class:`~hybridrl.rewards.pool.ScorerPool` polled with nothing queued wakes none of its idle threads: the
reward stream polls it after every engine step, and each wake-up would take the GIL from the generating thread."""

from __future__ import annotations

import threading
import time

from hybridrl.rewards.pool import ScorerPool


class CountingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__()
        self.notified = 0

    def notify_all(self) -> None:
        self.notified += 1
        super().notify_all()


def test_polling_an_idle_pool_wakes_no_thread():
    pool = ScorerPool(timeout_s=5.0, max_workers=4)
    pool._lock = CountingCondition()
    for i in range(4):
        pool.submit(i, lambda i=i: time.sleep(0.01) or i)
    deadline = time.monotonic() + 5
    while len(pool.outcomes) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pool.outcomes) == 4  # the threads are idle now, waiting for the next call
    before = pool._lock.notified
    for _ in range(100):  # what 100 engine steps without a finished response do
        pool.poll()
    assert pool._lock.notified == before
    pool.submit(4, lambda: 4)  # a queued call still wakes one
    assert pool.wait()[4] == ("ok", 4)

"""ScorerPool: calls submitted while earlier ones run (how rewards are computed during generation), each with its
own timeout from its start, on a few reused threads; inline without a timeout."""

from __future__ import annotations

import threading
import time

from hybridrl.rewards.pool import ERROR, OK, TIMEOUT, ScorerPool


def test_calls_submitted_over_time_settle_in_the_background_on_reused_threads():
    pool, threads, lock = ScorerPool(timeout_s=5.0, max_workers=3), set(), threading.Lock()

    def call(i):
        with lock:
            threads.add(threading.current_thread())
        if i == 7:
            raise ValueError("bad response")
        return i * i

    pool.submit(0, lambda: call(0))
    while 0 not in pool.outcomes:  # the first call settles in the background, before anything else is submitted
        time.sleep(0.001)
    for i in range(1, 12):  # as an engine hands finished responses over, step by step
        pool.submit(i, lambda i=i: call(i))
        pool.poll()
    outcomes = pool.wait()
    assert {k: v for k, v in outcomes.items() if k != 7} == {i: (OK, i * i) for i in range(12) if i != 7}
    assert outcomes[7][0] == ERROR and isinstance(outcomes[7][1], ValueError)
    assert len(threads) <= 3 and threading.current_thread() not in threads
    assert set(pool.settled_at) == set(range(12))


def test_each_call_gets_its_timeout_from_its_own_start():
    pool = ScorerPool(timeout_s=0.3, max_workers=1)
    pool.submit("slow", lambda: time.sleep(0.6) or 1)  # returns past its deadline, before anyone polls
    pool.submit("queued", lambda: 2)  # waits behind it; its own 0.3 s start when a thread takes it
    outcomes = pool.wait()
    assert outcomes == {"slow": (TIMEOUT, None), "queued": (OK, 2)}


def test_a_stuck_call_is_replaced_and_the_rest_still_run():
    pool, release = ScorerPool(timeout_s=0.2, max_workers=1), threading.Event()
    pool.submit(0, lambda: release.wait(5.0))
    for i in range(1, 4):
        pool.submit(i, lambda i=i: i)
    outcomes = pool.wait()
    release.set()
    assert outcomes == {0: (TIMEOUT, None), 1: (OK, 1), 2: (OK, 2), 3: (OK, 3)}


def test_without_timeout_calls_run_inline_at_submit():
    pool, where = ScorerPool(timeout_s=None), []
    pool.submit("a", lambda: where.append(threading.current_thread()) or 1)
    assert pool.outcomes == {"a": (OK, 1)} and where == [threading.current_thread()]
    pool.submit("b", lambda: 1 / 0)
    assert pool.wait()["b"][0] == ERROR


def test_wait_gives_up_at_the_timeout_when_every_call_hangs():
    """wait() may start before any thread took a call (no deadline to sleep to yet): it must still wake at the
    deadline of the call a thread then takes, not when the hung call returns."""
    for _ in range(20):  # the race between wait() and a thread taking the call goes both ways; try it often
        pool, release, result = ScorerPool(timeout_s=0.05, max_workers=1), threading.Event(), []
        pool.submit(0, lambda release=release: release.wait(60.0))
        waiter = threading.Thread(target=lambda pool=pool, result=result: result.append(pool.wait()), daemon=True)
        waiter.start()
        waiter.join(30.0)
        returned_first = not release.is_set() and bool(result)
        release.set()
        assert returned_first, "wait() waited for the hung call instead of giving up at its timeout"
        assert result[0] == {0: (TIMEOUT, None)}

"""Scorer calls with timeouts on a few reused threads: :class:`ScorerPool` and :func:`run_with_timeouts`.

This module owns running untrusted scorer (and tool) calls so that none of them can stop the trainer: a call that
raises is an ``"error"`` outcome, one that runs past ``timeout_s`` from its start a ``"timeout"``, and ``os._exit``
(or ``sys.exit``) inside a call raises in the call's thread instead of ending the rank (:func:`guard_exit`).

Timeouts without signals: at most ``max_workers`` daemon threads take the calls in turn (a thread per call would
cost more than a typical scorer), and the caller stops waiting for a call ``timeout_s`` seconds after it started.
This works from any thread (signals only work in the main thread) and never blocks interpreter exit. Python cannot
kill a thread: a timed-out call's thread is abandoned (its late result ignored) and a new thread takes the
remaining calls in its place; a call that never returns keeps a thread (and some CPU) for the life of the process,
and one stuck inside C code that holds the GIL delays everything until it returns. A call counts as on time when
it returned within ``timeout_s`` of its start, however late the caller looks. ``timeout_s=None`` runs each call
inline, in the submitting thread (errors still caught, no timeouts).

Calls may be submitted while earlier ones run (:meth:`ScorerPool.submit`), which is how rewards are computed while
vLLM still generates (:mod:`hybridrl.rewards.stream`); :func:`run_with_timeouts` submits a whole batch at once.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

OK, ERROR, TIMEOUT = "ok", "error", "timeout"
IDLE_S = 30.0
"""Seconds a pool thread waits for the next call before it ends (a pool that is never waited for frees them)."""


class ScorerExited(BaseException):
    """A scorer called ``os._exit`` during a call (a BaseException: a scorer's ``except Exception`` keeps it)."""


_in_scorer = threading.local()
_real_exit = os._exit


def _guarded_exit(code: int) -> None:
    """``os._exit`` while hybridrl runs scorers: in a scorer call it raises :class:`ScorerExited` (reward 0, the
    warning names the scorer), anywhere else it exits as usual."""
    if getattr(_in_scorer, "active", False):
        raise ScorerExited(f"the scorer called os._exit({code}), which would have ended this rank")
    _real_exit(code)


def guard_exit() -> None:
    """Install :func:`_guarded_exit` (idempotent); before a custom scorer's file is imported, so that a
    ``from os import _exit`` in it gets the guarded one too."""
    os._exit = _guarded_exit


_INLINE_CATCH = (Exception, SystemExit, ScorerExited)  # inline, a Ctrl-C still stops the run


def _scorer_call(call: Callable[[], Any], catch: tuple[type[BaseException], ...] = _INLINE_CATCH) -> tuple[str, Any]:
    _in_scorer.active = True
    try:
        return OK, call()
    except catch as err:
        return ERROR, err
    finally:
        _in_scorer.active = False


class ScorerPool:
    """Calls submitted one by one (also while earlier ones run), each with ``timeout_s`` seconds from its start.

    Args:
        timeout_s: seconds one call may take; None = run each call inline in :meth:`submit`.
        max_workers: calls in flight at once (threads, besides the replacements of abandoned ones).
    """

    def __init__(self, timeout_s: float | None, max_workers: int = 8) -> None:
        guard_exit()
        self.timeout_s, self.max_workers = timeout_s, max(1, max_workers)
        self.outcomes: dict[Hashable, tuple[str, Any]] = {}
        """key -> ``("ok", result)``, ``("error", exception)`` or ``("timeout", None)``, as calls settle."""
        self.settled_at: dict[Hashable, float] = {}
        """key -> ``time.monotonic()`` when its call returned (or was given up on)."""
        self._lock = threading.Condition()
        self._pending: deque[tuple[Hashable, Callable[[], Any]]] = deque()
        self._running: dict[Hashable, float] = {}  # key -> deadline
        self._submitted = 0
        self._live = 0  # threads not abandoned
        self._closed = False  # wait() returned: idle threads end

    def submit(self, key: Hashable, call: Callable[[], Any]) -> None:
        """Queue ``call`` under ``key`` (unique within this pool)."""
        if self.timeout_s is None:
            self._settle(key, _scorer_call(call))
            self._submitted += 1
            return
        with self._lock:
            self._pending.append((key, call))
            self._submitted += 1
            self._start_threads()

    def poll(self) -> None:
        """Give up on calls past their deadline and start threads in their place (cheap; call it now and then
        while submitting, so that stuck calls do not hold the threads until :meth:`wait`)."""
        if self.timeout_s is None:
            return
        with self._lock:
            now = time.monotonic()
            for key in [k for k, deadline in self._running.items() if deadline <= now]:
                del self._running[key]
                self.outcomes[key], self.settled_at[key] = (TIMEOUT, None), now
                self._live -= 1  # its thread is abandoned: it exits when (if) the call returns
            self._start_threads()

    def wait(self) -> dict[Hashable, tuple[str, Any]]:
        """Block until every submitted call settled; returns :attr:`outcomes`. The pool's idle threads then end."""
        while True:
            self.poll()
            with self._lock:
                if len(self.outcomes) == self._submitted:
                    self._closed = True
                    self._lock.notify_all()
                    return self.outcomes
                deadline = min(self._running.values(), default=None)
                # calls queued but not started yet wake us when they start; the bound is a second guard
                self._lock.wait(self.timeout_s if deadline is None else max(0.0, deadline - time.monotonic()) + 1e-3)

    # ---- internals (under self._lock) ---------------------------------------------------------------------

    def _start_threads(self) -> None:
        free = self._live - len(self._running)  # threads waiting for a call (or starting): each takes one
        while self._live < self.max_workers and len(self._pending) > free:
            threading.Thread(target=self._work, daemon=True, name="hybridrl-scorer").start()
            self._live += 1
            free += 1
        if self._pending:  # idle threads take the queued calls; waking them for nothing costs the generating thread
            self._lock.notify_all()  # the GIL, at every engine step (poll)

    def _work(self) -> None:
        assert self.timeout_s is not None
        while True:
            with self._lock:
                while not self._pending and not self._closed:  # between calls: wait for the next submission
                    if not self._lock.wait(IDLE_S) and not self._pending:
                        break
                if not self._pending:
                    self._live -= 1
                    return
                key, call = self._pending.popleft()
                deadline = time.monotonic() + self.timeout_s
                self._running[key] = deadline
                self._lock.notify_all()  # a wait() with no call running yet now has a deadline to wake at
            outcome = _scorer_call(call, (BaseException,))  # in a thread, nothing a scorer raises may escape
            with self._lock:
                if key not in self._running:  # given up on by poll(): this thread was replaced
                    return
                del self._running[key]
                on_time = time.monotonic() <= deadline
                self._settle(key, outcome if on_time else (TIMEOUT, None))

    def _settle(self, key: Hashable, outcome: tuple[str, Any]) -> None:
        self.outcomes[key], self.settled_at[key] = outcome, time.monotonic()
        if self.timeout_s is not None:
            self._lock.notify_all()


def run_with_timeouts(
    calls: Sequence[Callable[[], Any]], timeout_s: float | None, max_workers: int = 8
) -> list[tuple[str, Any]]:
    """Run ``calls`` with at most ``max_workers`` at once; each gets ``timeout_s`` seconds from its start
    (:class:`ScorerPool`).

    Returns:
        One ``(status, value)`` per call, in order: ``("ok", result)``, ``("error", exception)`` or
        ``("timeout", None)``.
    """
    pool = ScorerPool(timeout_s, max_workers)
    for i, call in enumerate(calls):
        pool.submit(i, call)
    outcomes = pool.wait()
    return [outcomes[i] for i in range(len(calls))]

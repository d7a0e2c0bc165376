"""Run a piece of work on this thread, or hand it to another: decided from what is measured.

A thread hand-off (a queue, a wake-up, the other thread's start) costs CPU and latency; it
pays off when the work is long enough for another core to take it in parallel. On small chunks
it costs more than the work itself (``benchmarks/per_chunk.py``). :class:`HandOff` keeps
running averages, all measured by the engine as it goes: the seconds per byte of each kind of
work (per codec: decoding fp32 is much quicker per byte than decoding one-bit signs; measured
every time it runs, here or there) and the latency of a hand-off (from handing a job over to
a thread starting it). The work runs here when its predicted time is below that latency: then
waiting for another thread would take longer than doing it.

Used by the worker's receiver (decode a reply itself, or hand it to the pool) and the server's
control threads (reduce a key whose pushes all came inline, or hand it to its engine thread).

:class:`TaskPool` is where those hand-offs go: fixed threads taking calls from one queue (the
worker's compress/decompress pool, its dispatcher and receiver, the hierarchical engine's two
threads). Its tasks report their own outcome (the engines' guards), so it keeps no futures: a
``concurrent.futures`` executor makes a future, a work item and their locks for every task,
which costs more than a small chunk's decode (``benchmarks/per_chunk.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HandOff", "TaskPool"]

log = logging.getLogger(__name__)

#: weight of a new measurement in the running averages
_ALPHA = 0.1


class HandOff:
    """The decision and its measurements: the hand-off latency, and seconds per byte by kind
    of work (thread-safe enough: each update is one float or dict-item store; a lost update
    only delays the averages).

    Args:
        latency_s: the hand-off latency assumed before one was measured.
    """

    def __init__(self, latency_s: float = 50e-6) -> None:
        if not latency_s > 0:
            raise ValueError(f"latency_s must be > 0, got {latency_s!r}")
        self.latency_s = latency_s
        self.per_byte_s: dict[str, float] = {}  # by kind; unknown: the first run is here

    def here(self, nbytes: int, kind: str = "") -> bool:
        """Whether work of ``kind`` (e.g. its codec) on ``nbytes`` should run on the calling
        thread."""
        return self.per_byte_s.get(kind, 0.0) * nbytes < self.latency_s

    def ran(self, nbytes: int, seconds: float, kind: str = "") -> None:
        """Record that work of ``kind`` on ``nbytes`` took ``seconds`` (on whichever thread)."""
        if nbytes <= 0:
            return
        old = self.per_byte_s.get(kind)
        new = seconds / nbytes
        self.per_byte_s[kind] = new if old is None else old + _ALPHA * (new - old)

    def started(self, handed_at: float) -> None:
        """Record that a job handed over at ``handed_at`` (``time.perf_counter()``) starts now."""
        self.latency_s += _ALPHA * (time.perf_counter() - handed_at - self.latency_s)


class TaskPool:
    """``threads`` daemon threads named ``{name}_{i}`` running submitted calls in order of
    submission; a call's result is dropped. The engine's tasks catch their own exceptions and
    fail the engine (``WorkerEngine._guard``); one that escapes a task anyway goes to
    ``on_error`` (the engine's ``fail``: every pending and later call raises it) and is logged
    as an error, with its traceback.

    Args:
        threads: number of threads (at least 1).
        name: thread name prefix.
        on_error: called with an exception a task let out (None: logged only).
    """

    def __init__(self, threads: int, name: str,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self._name = name
        self._on_error = on_error
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn(*args)`` for the next free thread (RuntimeError after :meth:`shutdown`)."""
        if self._closed:
            raise RuntimeError("the gradpress worker pool was shut down; no new task runs")
        self._q.put((fn, args))

    def shutdown(self, wait: bool = True, timeout: float | None = None) -> None:
        """Let every thread finish the calls queued so far, then stop; with ``wait``, join them
        (each for at most ``timeout`` seconds; None: until it stopped)."""
        self._closed = True
        for _ in self._threads:
            self._q.put(None)
        if wait:
            for t in self._threads:
                t.join(timeout)

    def _run(self) -> None:
        while (task := self._q.get()) is not None:
            fn, args = task
            try:
                fn(*args)
            except BaseException as e:  # the pool outlives a task's signal or exit, loudly
                log.error("gradpress %s task %r raised %s", self._name, fn,
                          type(e).__name__, exc_info=True)
                if self._on_error is not None:
                    self._on_error(e)

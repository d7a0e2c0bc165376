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
"""

from __future__ import annotations

import time

__all__ = ["HandOff"]

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

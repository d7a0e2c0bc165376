"""Chrome-trace recording of the per-chunk stages (``GRADPRESS_TRACE=path``).

Each process writes its own file: ``path`` with ``.<role><index>`` inserted before the
extension (``trace.json`` -> ``trace.worker0.json``, ``trace.server1.json``), or ``path`` with
``{role}``/``{rank}`` placeholders filled when it has them. Open it in ``chrome://tracing`` or
Perfetto; events are complete events (``"ph": "X"``) with the key as an argument. A metadata
event ``clock`` gives the ``time.perf_counter()`` seconds of ``ts == 0`` (``args.t0_s``), so the
files of processes on one machine can be put on one time line (``t0_s + ts / 1e6``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Tracer", "trace_path"]


def trace_path(path: str, role: str, index: int, rank: int) -> str:
    """Per-process trace file name for ``path`` (see the module docstring)."""
    if "{role}" in path or "{rank}" in path:
        return path.replace("{role}", f"{role}{index}").replace("{rank}", str(rank))
    root, ext = os.path.splitext(path)
    return f"{root}.{role}{index}{ext or '.json'}"


class Tracer:
    """Collects stage spans; a disabled tracer (``path=None``) costs one attribute test."""

    def __init__(self, path: str | None, pid: int, process_name: str) -> None:
        self.path = path
        self.enabled = path is not None
        self._pid = pid
        self._lock = threading.Lock()
        self._t0 = time.perf_counter()
        self._events: list[dict] = [{"name": "process_name", "ph": "M", "pid": pid,
                                     "args": {"name": process_name}},
                                    {"name": "clock", "ph": "M", "pid": pid,
                                     "args": {"t0_s": self._t0}}]

    def add(self, stage: str, start: float, end: float, /, **args: object) -> None:
        """Record a span from ``start`` to ``end`` (``time.perf_counter()`` seconds)."""
        if not self.enabled:
            return
        ev = {"name": stage, "ph": "X", "pid": self._pid, "tid": threading.get_ident() % 100000,
              "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6, "args": args}
        with self._lock:
            self._events.append(ev)

    @contextmanager
    def span(self, stage: str, /, **args: object) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, t, time.perf_counter(), **args)

    def write(self) -> str | None:
        """Write the trace file (once); returns its path, or None when disabled."""
        if not self.enabled or self.path is None:
            return None
        with self._lock:
            events, self._events = self._events, []
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        self.enabled = False
        return self.path

"""Per-stage profile of a training step from the gradpress Chrome traces (``--profile`` of
``benchmarks/cluster.py``).

Inputs: the trace files of one job (``GRADPRESS_TRACE``: one per worker and server, see
``gradpress.ps.trace``) and, from one worker, the ``time.perf_counter()`` marks of every timed
step: start, end of backward, end of ``synchronize()`` (every reply decoded into ``p.grad``),
end of the optimizer update. All processes run on one machine, so ``perf_counter`` is one
clock; the ``clock`` metadata event of each file maps its ``ts`` onto it.

:func:`spans_of` turns one file's events into :class:`Span` s; :func:`profile_step`
aggregates the spans of one step into a :class:`StepProfile` (seconds); :func:`profile`
takes the median of each field over the steps. All three are pure.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import NamedTuple

from push_pull import _union  # seconds covered by a set of intervals (benchmarks/ is on the path)

__all__ = ["Span", "StepProfile", "Window", "marks", "profile", "profile_step", "profile_rows",
           "spans_of"]

WORKER_STAGES = ("compress", "push+pull", "decompress")
SERVER_STAGES = ("server.recv+decode_add", "server.compress")


class Span(NamedTuple):
    """One stage of one chunk on the common clock (seconds)."""

    name: str
    start: float
    end: float
    key: int
    wait: float = 0.0  # server.recv+decode_add: the part spent waiting for pushes


class Window(NamedTuple):
    """``perf_counter`` marks of one step of one worker."""

    start: float
    backward_end: float
    sync_end: float
    end: float


@dataclass(frozen=True)
class StepProfile:
    """Where one step's time goes (seconds; ``*_thread_s`` are sums over threads/chunks)."""

    step_s: float
    forward_backward_s: float  # main thread; the hooks push gradients meanwhile
    sync_s: float  # after backward: waiting for the last replies to be decoded
    update_s: float  # optimizer update
    compress_thread_s: float  # worker compression, all chunks
    in_flight_s: float  # wall time with >= 1 chunk pushed and its reply not yet received
    in_flight_chunk_s: float  # the same, summed over chunks
    server_busy_s: float  # servers' decode+add+recompress of this step's chunks (sum)
    server_wait_s: float  # servers waiting for pushes (and for step - 2 replies to leave)
    decompress_thread_s: float  # worker decompression, all chunks
    last_compress_after_backward_s: float  # when the last chunk was compressed
    last_reply_after_backward_s: float  # when the last reply arrived
    last_decompress_after_backward_s: float  # when the last reply was decoded
    last_to_server_s: float  # last reply's chunk: push wire, queues, the other pushes' wait
    last_at_server_s: float  # its decode + add + recompress at the server
    last_from_server_s: float  # its reply on the wire and into the receive thread
    backward_skew_s: float  # the slowest other worker's backward end minus this one's
    tail_after_slowest_backward_s: float  # last reply decoded, after the last backward end
    chunks: int  # chunks this worker pushed in the step
    keys: int  # distinct keys among them


def spans_of(trace: dict) -> list[Span]:
    """The complete events of one trace file (``{"traceEvents": [...]}``) as :class:`Span` s on
    the ``perf_counter`` clock (``ts`` of 0 when the file has no ``clock`` event)."""
    events = trace["traceEvents"]
    t0 = next((e["args"]["t0_s"] for e in events if e.get("ph") == "M"
               and e.get("name") == "clock"), 0.0)
    out = []
    for e in events:
        if e.get("ph") != "X":
            continue
        start = t0 + e["ts"] / 1e6
        a = e.get("args", {})
        out.append(Span(e["name"], start, start + e["dur"] / 1e6, int(a.get("key", -1)),
                        float(a.get("wait", 0.0))))
    return out


def _inside(spans: list[Span], w: Window, names: tuple[str, ...]) -> list[Span]:
    """Spans of ``names`` that end within the step ``w`` (a server's span may start before it:
    it begins with the wait for the pushes)."""
    return [s for s in spans if s.name in names and w.start < s.end <= w.end]


def _last(spans: list[Span], name: str, after: float) -> float:
    ends = [s.end for s in spans if s.name == name]
    return max(ends) - after if ends else 0.0


def _last_chunk(mine: list[Span], srv: list[Span]) -> tuple[float, float, float]:
    """The flight of the last reply split at the server: before, at, after (0s if unknown)."""
    flights = [s for s in mine if s.name == "push+pull"]
    if not flights:
        return 0.0, 0.0, 0.0
    last = max(flights, key=lambda s: s.end)
    dec = [s for s in srv if s.key == last.key and s.name == SERVER_STAGES[0]]
    enc = [s for s in srv if s.key == last.key and s.name == SERVER_STAGES[1]]
    if not dec or not enc:
        return 0.0, 0.0, 0.0
    d, e = max(dec, key=lambda s: s.end), max(enc, key=lambda s: s.end)
    busy = d.end - d.start - d.wait
    return d.end - busy - last.start, busy + e.end - e.start, last.end - e.end


def profile_step(worker: list[Span], servers: list[Span], w: Window,
                 others: tuple[Window, ...] = ()) -> StepProfile:
    """Aggregate one worker's spans and all servers' spans of the step ``w``; ``others``: the
    same step of the other workers (for the skew of their backward ends)."""
    mine = _inside(worker, w, WORKER_STAGES)
    srv = _inside(servers, w, SERVER_STAGES)
    by = {n: [s for s in mine if s.name == n] for n in WORKER_STAGES}
    flight = [(s.start, s.end) for s in by["push+pull"]]
    compress = by["compress"]
    return StepProfile(
        step_s=w.end - w.start, forward_backward_s=w.backward_end - w.start,
        sync_s=w.sync_end - w.backward_end, update_s=w.end - w.sync_end,
        compress_thread_s=sum(s.end - s.start for s in compress),
        in_flight_s=_union(flight), in_flight_chunk_s=sum(e - s for s, e in flight),
        server_busy_s=sum(s.end - s.start - s.wait for s in srv),
        server_wait_s=sum(s.wait for s in srv),
        decompress_thread_s=sum(s.end - s.start for s in by["decompress"]),
        last_compress_after_backward_s=_last(mine, "compress", w.backward_end),
        last_reply_after_backward_s=_last(mine, "push+pull", w.backward_end),
        last_decompress_after_backward_s=_last(mine, "decompress", w.backward_end),
        **dict(zip(("last_to_server_s", "last_at_server_s", "last_from_server_s"),
                   _last_chunk(mine, srv), strict=True)),
        backward_skew_s=max((o.backward_end - w.backward_end for o in others), default=0.0),
        tail_after_slowest_backward_s=_last(mine, "decompress", max(
            [w.backward_end, *(o.backward_end for o in others)])),
        chunks=len(compress), keys=len({s.key for s in compress}))


def profile(worker: list[Span], servers: list[Span], windows: list[Window],
            others: list[list[Window]] | None = None) -> StepProfile:
    """Median of every field of :func:`profile_step` over ``windows`` (at least one);
    ``others``: the windows of each other worker, step by step."""
    if not windows:
        raise ValueError("profile needs at least one step window")
    per_step = list(zip(*others, strict=True)) if others else [()] * len(windows)
    steps = [profile_step(worker, servers, w, o) for w, o in zip(windows, per_step, strict=True)]
    med = {f.name: statistics.median(getattr(p, f.name) for p in steps)
           for f in fields(StepProfile)}
    med["chunks"], med["keys"] = int(med["chunks"]), int(med["keys"])
    return StepProfile(**med)


def marks(windows: list[Window]) -> dict[str, float]:
    """Medians of the fields that need only the step marks (systems without traces)."""
    return {"step_s": statistics.median(w.end - w.start for w in windows),
            "forward_backward_s": statistics.median(w.backward_end - w.start for w in windows),
            "sync_s": statistics.median(w.sync_end - w.backward_end for w in windows),
            "update_s": statistics.median(w.end - w.sync_end for w in windows)}


ROWS = (("step_s", "step (worker 0)"),
        ("forward_backward_s", "forward + backward (main thread; pushes start meanwhile)"),
        ("sync_s", "synchronize after backward (waiting for the last replies)"),
        ("update_s", "optimizer update"),
        ("compress_thread_s", "worker compression, sum over chunks (pool threads)"),
        ("in_flight_s", "chunks in flight, wall time (pushed, reply not yet received)"),
        ("in_flight_chunk_s", "chunks in flight, sum over chunks"),
        ("server_busy_s", "servers decode + add + recompress, sum over keys and servers"),
        ("server_wait_s", "servers waiting for pushes (idle between steps included), sum"),
        ("decompress_thread_s", "worker decompression, sum over chunks"),
        ("last_compress_after_backward_s", "last chunk compressed, after backward end"),
        ("last_reply_after_backward_s", "last reply received, after backward end"),
        ("last_decompress_after_backward_s", "last reply decoded, after backward end"),
        ("last_to_server_s", "last reply's chunk: push on the wire + waiting for the other push"),
        ("last_at_server_s", "last reply's chunk: at the server (decode, add, recompress)"),
        ("last_from_server_s", "last reply's chunk: reply on the wire + receive"),
        ("backward_skew_s", "other worker's backward end minus worker 0's"),
        ("tail_after_slowest_backward_s", "last reply decoded, after the slower backward end"),
        ("chunks", "chunks (keys) per step"))


def profile_rows(profiles: dict[str, dict], floor: dict | None = None) -> list[str]:
    """Markdown rows: one column per system (``asdict(StepProfile)`` or the marks-only fields
    of a system without traces); ``floor`` (the compute-floor system's fields) adds a column."""
    cols = ({"local": floor} if floor else {}) | profiles
    rows = ["| stage (median of the timed steps) | " + " | ".join(cols) + " |",
            "|---|" + "---|" * len(cols)]
    for field, label in ROWS:
        if field == "forward_backward_s" and floor:
            rows.append("| above the compute floor (step - local step) | " + " | ".join(
                f"{p['step_s'] - floor['step_s']:.4f}" for p in cols.values()) + " |")
        cells = []
        for p in cols.values():
            v = p.get(field)
            cells.append("-" if v is None else f"{v} ({p['keys']})" if field == "chunks"
                         else f"{v:.4f}")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return rows

"""benchmarks/profile_trace.py on synthetic traces, and the ``--profile`` flag of
benchmarks/cluster.py (no root, no network)."""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cluster
import profile_trace as pt
from gradpress.ps.trace import Tracer


def _ev(name: str, start: float, end: float, key: int, **args: float) -> dict:
    return {"name": name, "ph": "X", "pid": 0, "tid": 1, "ts": start * 1e6,
            "dur": (end - start) * 1e6, "args": {"key": key, "step": 0, **args}}


def _trace(t0: float, events: list[dict]) -> dict:
    return {"traceEvents": [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "w"}},
                            {"name": "clock", "ph": "M", "pid": 0, "args": {"t0_s": t0}},
                            *events]}


# step 0 of worker 0 runs 10.0 .. 11.0: backward ends at 10.6, synchronize at 10.9
WINDOW = pt.Window(10.0, 10.6, 10.9, 11.0)
WORKER = _trace(10.0, [  # ts relative to 10.0
    _ev("compress", 0.10, 0.15, 1), _ev("push+pull", 0.15, 0.40, 1),
    _ev("decompress", 0.40, 0.42, 1),
    _ev("compress", 0.55, 0.65, 2), _ev("push+pull", 0.65, 0.80, 2),
    _ev("decompress", 0.80, 0.85, 2),
    _ev("compress", 1.10, 1.20, 1)])  # the next step: outside the window
SERVER = _trace(9.0, [  # ts relative to 9.0; key 1's span starts before the step (waiting)
    _ev("server.recv+decode_add", 0.90, 1.30, 1, wait=0.35), _ev("server.compress", 1.30, 1.32, 1),
    _ev("server.recv+decode_add", 1.66, 1.72, 2, wait=0.02), _ev("server.compress", 1.72, 1.76, 2)])


def test_spans_are_put_on_the_common_clock() -> None:
    spans = pt.spans_of(WORKER)
    assert spans[0] == pt.Span("compress", 10.1, pytest.approx(10.15), 1, 0.0)
    srv = pt.spans_of(SERVER)
    assert srv[0].start == pytest.approx(9.9) and srv[0].wait == pytest.approx(0.35)
    no_clock = pt.spans_of({"traceEvents": [_ev("compress", 1.0, 2.0, 3)]})
    assert no_clock == [pt.Span("compress", 1.0, 2.0, 3, 0.0)]


def test_one_step_is_aggregated_by_stage() -> None:
    p = pt.profile_step(pt.spans_of(WORKER), pt.spans_of(SERVER), WINDOW)
    want = {"step_s": 1.0, "forward_backward_s": 0.6, "sync_s": 0.3, "update_s": 0.1,
            "compress_thread_s": 0.15, "in_flight_s": 0.40, "in_flight_chunk_s": 0.40,
            "server_busy_s": 0.05 + 0.02 + 0.04 + 0.04, "server_wait_s": 0.37,
            "decompress_thread_s": 0.07, "last_compress_after_backward_s": 0.05,
            "last_reply_after_backward_s": 0.2, "last_decompress_after_backward_s": 0.25,
            # key 2's flight 10.65 .. 10.80 split at the server (busy 0.04 + 0.04, done 10.76)
            "last_to_server_s": 0.03, "last_at_server_s": 0.08, "last_from_server_s": 0.04,
            "backward_skew_s": 0.05, "tail_after_slowest_backward_s": 0.20}
    p = pt.profile_step(pt.spans_of(WORKER), pt.spans_of(SERVER), WINDOW,
                        (pt.Window(10.0, 10.65, 10.9, 11.0),))
    for k, v in want.items():
        assert getattr(p, k) == pytest.approx(v), k
    assert (p.chunks, p.keys) == (2, 2)


def test_overlapping_flights_count_once_in_wall_time() -> None:
    tr = _trace(0.0, [_ev("push+pull", 0.1, 0.5, 1), _ev("push+pull", 0.3, 0.6, 2)])
    p = pt.profile_step(pt.spans_of(tr), [], pt.Window(0.0, 0.5, 0.7, 0.8))
    assert p.in_flight_s == pytest.approx(0.5) and p.in_flight_chunk_s == pytest.approx(0.7)
    assert (p.chunks, p.last_compress_after_backward_s) == (0, 0.0)


def test_median_over_steps_and_rows() -> None:
    spans = pt.spans_of(WORKER)
    w2, w3 = pt.Window(20.0, 20.5, 20.6, 21.0), pt.Window(30.0, 30.2, 30.3, 30.4)
    p = pt.profile(spans, [], [WINDOW, w2, w3])
    assert p.step_s == pytest.approx(1.0) and p.chunks == 0  # medians of 1.0, 1.0, 0.4; 2, 0, 0
    assert p.last_to_server_s == 0.0  # no server spans: the split is unknown
    skew = pt.profile(spans, [], [WINDOW, w2, w3], [[w._replace(backward_end=w.backward_end + d)
                                                      for w, d in zip((WINDOW, w2, w3),
                                                                      (0.1, 0.2, 0.3))]])
    assert skew.backward_skew_s == pytest.approx(0.2)
    with pytest.raises(ValueError):
        pt.profile(spans, [], [])
    floor = pt.marks([WINDOW, w2])
    assert floor["sync_s"] == pytest.approx(0.2)
    rows = pt.profile_rows({"gp-onebit": asdict(p)}, floor)
    assert rows[0] == "| stage (median of the timed steps) | local | gp-onebit |"
    assert len(rows) == 3 + len(pt.ROWS)
    assert rows[3] == "| above the compute floor (step - local step) | 0.0000 | 0.0000 |"
    assert len(pt.profile_rows({"gp-onebit": asdict(p)})) == 2 + len(pt.ROWS)
    assert rows[-1].endswith("| - | 0 (0) |")


def test_tracer_writes_the_clock(tmp_path: Path) -> None:
    t = Tracer(str(tmp_path / "t.json"), 0, "worker 0")
    t.add("compress", t._t0 + 1.0, t._t0 + 1.5, key=4)
    spans = pt.spans_of(json.loads(Path(t.write()).read_text()))
    assert spans == [pt.Span("compress", pytest.approx(t._t0 + 1.0), pytest.approx(t._t0 + 1.5),
                             4, 0.0)]


def test_profile_flag() -> None:
    assert not cluster.parse_args([]).profile
    assert cluster.parse_args(["--parts", "speed", "--profile"]).profile
    with pytest.raises(SystemExit):
        cluster.parse_args(["--parts", "loopback", "--profile"])


def test_profile_table_puts_the_floor_first() -> None:
    floor = {"step_s": 0.15, "forward_backward_s": 0.1, "sync_s": 0.0, "update_s": 0.05}
    res = {"local": {"profile": floor}, "gp-ddp-hook": {"profile": dict(floor, step_s=0.16)},
           "gp-onebit": {"median_s": 0.2}}
    rows = cluster.profile_table(res)
    assert rows[0].split("|")[2:4] == [" local ", " gp-ddp-hook "]
    assert "| step (worker 0) | 0.1500 | 0.1600 |" in rows


def test_driver_reads_the_job_traces(tmp_path: Path) -> None:
    (tmp_path / "j.trace.worker0.json").write_text(json.dumps(WORKER))
    (tmp_path / "j.trace.server0.json").write_text(json.dumps(SERVER))
    marks = [[list(WINDOW)], [[10.0, 10.65, 10.9, 11.0]]]
    p = cluster._profile(tmp_path, "j", marks)
    assert p["server_busy_s"] == pytest.approx(0.15) and p["backward_skew_s"] == pytest.approx(0.05)
    assert cluster._profile(tmp_path, "other", marks) == pt.marks([WINDOW])  # no traces

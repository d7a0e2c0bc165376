"""benchmarks/push_pull.py: the trace arithmetic of part (b) and one tiny real job."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load():
    spec = importlib.util.spec_from_file_location("_bench_push_pull", BENCH / "push_pull.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


pp = _load()


@pytest.mark.parametrize("intervals, expected", [
    ([], 0.0), ([(0, 1)], 1.0), ([(0, 1), (2, 3)], 2.0), ([(0, 2), (1, 3)], 3.0),
    ([(1, 3), (0, 2), (1.5, 2.5)], 3.0), ([(0, 5), (1, 2)], 5.0)])
def test_union(intervals, expected):
    assert pp._union(intervals) == pytest.approx(expected)


def _ev(name, step, t0, t1):
    return {"ph": "X", "name": name, "ts": t0 * 1e6, "dur": (t1 - t0) * 1e6,
            "args": {"step": step, "key": 1}}


def test_efficiencies_per_step_skips_warmup():
    events = [{"ph": "M", "name": "process_name", "args": {"name": "worker 0"}},
              _ev("compress", 0, 0, 1), _ev("push+pull", 0, 1, 2), _ev("decompress", 0, 2, 3),
              # step 1: span 0..10, wire = [1, 4] + [3, 9] = 8 s
              _ev("compress", 1, 0, 1), _ev("compress", 1, 1, 3),
              _ev("push+pull", 1, 1, 4), _ev("push+pull", 1, 3, 9),
              _ev("decompress", 1, 4, 5), _ev("decompress", 1, 9, 10)]
    [(eff, span)] = pp._efficiencies(events)
    assert span == pytest.approx(10.0) and eff == pytest.approx(0.8)


def test_tiny_job_speed_and_bytes(tmp_path):
    """A 2-worker job through the launcher: every worker reports identical byte counts."""
    args = argparse.Namespace(mib=1, tensors=2, steps=1, quick=True, job_env={})
    drv = pp.Driver(args, tmp_path)
    res = drv.launch("tiny", "speed", (pp.NONE, pp.ONEBIT), 2, 1)
    assert len(res) == 2
    for c in (pp.NONE, pp.ONEBIT):
        assert res[0][c]["bytes"] == res[1][c]["bytes"] > 0
        assert len(res[0][c]["seconds"]) == 1
    # none moves the fp32 bytes both ways (plus headers); onebit about 1/32 of them
    assert res[0][pp.NONE]["bytes"] >= 2 * drv.grad_bytes
    assert res[0][pp.ONEBIT]["bytes"] < res[0][pp.NONE]["bytes"] / 25


def test_per_chunk_tiny_job(capsys):
    """benchmarks/per_chunk.py end to end on a tiny job: every part of the split is reported
    (in clock ticks, so a tiny job may count 0) and the codec-only reference is positive."""
    spec = importlib.util.spec_from_file_location("_bench_per_chunk", BENCH / "per_chunk.py")
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    assert pc.main(["--tensors", "6", "--kib", "8", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    rows = {ln.split("|")[1].strip(): ln.split("|")[2].strip() for ln in out.splitlines()
            if ln.startswith("| ") and "us/chunk" not in ln}
    assert set(pc.PARTS) <= set(rows) and "worker total" in rows
    assert float(rows["worker total"]) >= 0
    machine = rows["whole machine: both workers, the server, the kernel"]
    assert float(machine.split()[0]) >= 0  # present and a number (ticks: a tiny job may be 0)
    assert float(rows["codec kernels alone (compress + decompress, same tensors)"]) > 0
    assert "engine threads / codec kernels:" in out

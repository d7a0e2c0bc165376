"""``gradpress demo --bandwidth RATE``: rate validation, the error without root, time to
accuracy on synthetic metrics, signal forwarding, and (as root only) a short demo inside a
rate-limited namespace."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gradpress.cli import main
from gradpress.train import netem, slowlink
from gradpress.train.netem import NetemError
from gradpress.train.report import format_table
from gradpress.train.slowlink import check_bandwidth, link_budget, run_forwarding_signals
from gradpress.train.tta import time_to_accuracy, time_to_target, tta_columns, tta_summary


def _usable() -> bool:
    try:
        netem.check_environment()
    except NetemError:
        return False
    return True


# -- --bandwidth: validation and the environment (no root needed) ------------------------------
@pytest.mark.parametrize("value", ["fast", "100", "0mbit", "-1gbit", "1 gbit", "100mb/s", ""])
def test_bad_rate_names_option_value_and_form(value: str) -> None:
    with pytest.raises(ValueError) as e:
        check_bandwidth(value)
    assert "--bandwidth" in str(e.value) and repr(value) in str(e.value)
    assert "100mbit" in str(e.value) and "1gbit" in str(e.value)


@pytest.mark.parametrize("value, rate", [("100mbit", "100mbit"), ("1Gbit", "1gbit"),
                                         ("2.5mbps", "2.5mbps")])
def test_good_rate_passes_when_namespaces_work(monkeypatch: pytest.MonkeyPatch, value: str,
                                               rate: str) -> None:
    monkeypatch.setattr(slowlink, "check_environment", lambda: None)
    assert check_bandwidth(value) == rate


def test_bandwidth_alone_means_the_default_rate() -> None:
    from gradpress.cli import build_parser
    from gradpress.train.cli import DEMO_BANDWIDTH

    parse = build_parser().parse_args
    assert DEMO_BANDWIDTH == "100mbit"
    assert parse(["demo", "--bandwidth", "--steps", "2"]).bandwidth == DEMO_BANDWIDTH
    assert parse(["demo", "--bandwidth", "1gbit"]).bandwidth == "1gbit"
    assert parse(["demo"]).bandwidth is None


def test_not_root_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    with pytest.raises(NetemError) as e:
        check_bandwidth("100mbit")
    msg = str(e.value)
    assert "--bandwidth 100mbit" in msg and "needs root" in msg and "uid 1000" in msg
    assert "sudo" in msg and "leave out --bandwidth" in msg


def test_missing_tc_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netem.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netem.shutil, "which", lambda tool: None if tool == "tc" else "/bin/x")
    with pytest.raises(NetemError, match="`tc` command"):
        check_bandwidth("1gbit")


def test_cli_without_root_exits_2_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    out = tmp_path / "demo"
    with pytest.raises(SystemExit) as e:
        main(["demo", "--bandwidth", "100mbit", "--out", str(out)])
    assert e.value.code == 2
    assert "gradpress demo: error: --bandwidth 100mbit" in capsys.readouterr().err
    assert not out.exists()


def test_rate_in_bits_per_second() -> None:
    assert netem.rate_bits_per_second("100mbit") == 1e8
    assert netem.rate_bits_per_second("1Gbit") == 1e9
    assert netem.rate_bits_per_second("10mbps") == 8e7  # tc's bps: bytes per second
    assert netem.rate_bits_per_second(5e5) == 5e5


def test_link_budget_counts_every_worker_both_ways() -> None:
    rep = {"steps": 10, "s_per_step": 0.2, "stages_s": {"compute_s": 0.3},
           "bytes_per_step": {"push": 500_000.0, "pull": 500_000.0}}
    b = link_budget(rep, "100mbit", workers=2)
    assert b is not None and b["link_bytes_per_step"] == 2_000_000
    assert math.isclose(b["link_s_per_step"], 0.16)
    assert math.isclose(b["compute_s_per_step"], 0.03) and b["s_per_step"] == 0.2
    assert link_budget({"steps": 0}, "100mbit", 2) is None


# -- time to accuracy (pure functions) ---------------------------------------------------------
def _run(accs: list[float], dt: float, primary: str = "acc", hib: bool = True) -> list[dict]:
    recs: list[dict] = [{"kind": "start"}]
    for i, a in enumerate(accs, 1):
        recs.append({"kind": "step", "step": 10 * i, "time_s": i * dt - 0.01, "loss": 1.0})
        recs.append({"kind": "eval", "step": 10 * i, "time_s": i * dt,
                     "metrics": {primary: a, "other": 0.0}, "primary": primary,
                     "higher_is_better": hib})
    return recs


def test_time_to_target_first_eval_reaching_it() -> None:
    recs = _run([0.5, 0.9, 0.8, 0.95], dt=2.0)
    assert time_to_target(recs, 0.9) == {"time_s": 4.0, "step": 20, "value": 0.9}
    assert time_to_target(recs, 0.96) is None
    assert time_to_target(recs, 0.85, higher_is_better=False) == {"time_s": 2.0, "step": 10,
                                                                  "value": 0.5}
    assert time_to_target([], 0.5) is None


@pytest.mark.parametrize("kw, err, words", [
    ({"target": "0.9"}, TypeError, ["target", "number", "'0.9'"]),
    ({"target": True}, TypeError, ["target", "number"]),
    ({"target": math.nan}, ValueError, ["target", "finite", "nan"]),
    ({"target": 0.9, "higher_is_better": 1}, TypeError, ["higher_is_better", "bool", "1"]),
])
def test_time_to_target_bad_arguments(kw: dict, err: type, words: list[str]) -> None:
    with pytest.raises(err) as e:
        time_to_target(_run([0.5], 1.0), **kw)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_time_to_accuracy_against_the_baseline() -> None:
    runs = {"uncompressed": _run([0.5, 0.9, 0.96, 0.97], dt=10.0),   # final 0.97 at 40 s
            "onebit": _run([0.6, 0.97, 0.98, 0.98], dt=4.0),           # reaches it at 8 s
            "topk": _run([0.4, 0.8, 0.9, 0.96], dt=2.0)}               # never
    tta = time_to_accuracy(runs, "uncompressed")
    assert tta is not None and tta["target"] == 0.97 and tta["metric"] == "acc"
    assert tta["runs"]["uncompressed"] == {"time_s": 40.0, "step": 40, "value": 0.97,
                                           "speedup": 1.0}
    assert tta["runs"]["onebit"]["time_s"] == 8.0 and tta["runs"]["onebit"]["speedup"] == 5.0
    assert tta["runs"]["topk"] is None
    names = ["uncompressed", "onebit", "topk"]
    assert tta_columns(tta, names) == [("to 0.9700", ["40.0 s", "8.0 s", "not reached"]),
                                       ("speed-up", ["1.00x", "5.00x", "-"])]
    text = tta_summary(tta)
    assert "acc 0.9700" in text and "first reached after 40.0 s" in text
    assert "onebit reached it 5.00x faster (8.0 s)" in text and "topk did not reach it" in text
    table = format_table([_report(n) for n in names], tta_columns(tta, names))
    head, *rows = table.splitlines()
    assert head.split()[:7] == ["run", "compression", "lr", "metric", "time", "to", "0.9700"]
    assert "not reached" in rows[2] and "5.00x" in rows[1]


def test_time_to_accuracy_lower_is_better_and_edge_cases() -> None:
    runs = {"base": _run([3.0, 2.5, 2.2], 1.0, "loss", hib=False),
            "fast": _run([2.4, 2.1], 0.5, "loss", hib=False)}
    tta = time_to_accuracy(runs, "base")
    assert tta is not None and tta["target"] == 2.2 and not tta["higher_is_better"]
    assert tta["runs"]["fast"]["time_s"] == 1.0 and tta["runs"]["fast"]["speedup"] == 3.0
    assert "2.00x slower" in tta_summary({**tta, "runs": {**tta["runs"], "fast": {
        **tta["runs"]["fast"], "speedup": 0.5}}})
    assert time_to_accuracy({"base": [{"kind": "start"}]}, "base") is None
    assert tta_columns(None, ["base"]) == []
    with pytest.raises(ValueError, match="baseline 'none' is not one of the runs"):
        time_to_accuracy(runs, "none")


def test_format_table_rejects_a_short_column() -> None:
    with pytest.raises(ValueError, match="column 'x' has 1 cells for 2 reports"):
        format_table([_report("a"), _report("b")], [("x", ["1"])])


def _report(name: str) -> dict:
    return {"run": name, "config": {"compression": "none"}, "hparams": {"lr": 0.004},
            "metric": {"name": "acc", "value": 0.9}, "wall_s": 1.0,
            "bytes_per_step": {"push": 1024.0, "pull": 1024.0}, "model_ratio_vs_fp32": 1.0,
            "model_ratio_vs_fp16": 0.5}


# -- signals reach the launcher in the namespace (no root needed) -------------------------------
_CHILD = """
import signal, sys, time
mode, ready = sys.argv[1], sys.argv[2]
if mode == "exit":
    signal.signal(signal.SIGINT, lambda *a: sys.exit(130))
else:
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
open(ready, "w").close()
time.sleep(60)
"""


def _interrupt_when(ready: Path, before: object) -> threading.Thread:
    """Press Ctrl-C once the child has set its handlers (``ready``) and the parent forwards
    signals (its SIGINT handler is no longer ``before``)."""
    def _go() -> None:
        deadline = time.monotonic() + 60
        while not (ready.exists() and signal.getsignal(signal.SIGINT) is not before) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=_go, daemon=True)
    t.start()
    return t


@pytest.mark.cluster
@pytest.mark.parametrize("mode, code", [("exit", 130), ("ignore", 128 + signal.SIGKILL)])
def test_ctrl_c_is_forwarded_then_the_child_killed(tmp_path: Path, mode: str, code: int) -> None:
    ready = tmp_path / "ready"
    before = signal.getsignal(signal.SIGINT)
    t = _interrupt_when(ready, before)
    t0 = time.monotonic()
    rc = run_forwarding_signals([sys.executable, "-c", _CHILD, mode, str(ready)],
                                dict(os.environ), grace_s=1.0)
    t.join(10)
    assert rc == code and time.monotonic() - t0 < 30
    assert signal.getsignal(signal.SIGINT) is before


# -- a short demo behind a real rate-limited link (root) ---------------------------------------
@pytest.mark.cluster
@pytest.mark.skipif(not _usable(), reason="needs root, ip netns and tc")
def test_demo_in_a_rate_limited_namespace(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "gradpress.cli", "demo", "--bandwidth", "20mbit", "--steps",
           "2", "--out", str(out), "--no-progress"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert not netem.list_namespaces(prefix=f"{netem.NAME_PREFIX}{p.pid}x")  # cleaned up
    rep = json.loads((out / "report.json").read_text())
    assert rep["bandwidth"] == "20mbit" and "limited to 20mbit" in stdout
    tta = rep["time_to_accuracy"]
    assert tta["baseline"] == "uncompressed" and tta["metric"] == "test_accuracy"
    assert tta["runs"]["uncompressed"]["speedup"] == 1.0
    assert rep["table"] in stdout and rep["summary"] in stdout and "speed-up" in rep["table"]
    # the link is really limited: no uncompressed step beats its bytes at 20 Mbit/s
    none = next(r for r in rep["runs"] if r["run"] == "uncompressed")
    link = rep["link"]["uncompressed"]
    assert link["link_s_per_step"] > 0.5 and none["s_per_step"] > 0.8 * link["link_s_per_step"]
    assert (out / "eval_vs_time.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "loss_vs_time.png").exists()

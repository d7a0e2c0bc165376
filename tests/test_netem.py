"""gradpress.train.netem and benchmarks/netem.py (its command line, re-exporting it): validation,
namespaces and emulated clusters, cleanup on failure.

Tests that create namespaces need root and ``ip netns``; they are skipped elsewhere. No timed
assertions: the rate limit is checked by reading the qdisc back, not by measuring throughput.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gradpress.train import netem as lib

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


netem = _load("netem")


def test_benchmarks_module_re_exports_the_package():
    assert netem.rate_limited_namespace is lib.rate_limited_namespace
    assert netem.NetemError is lib.NetemError and netem._LIVE is lib._LIVE


def _usable() -> bool:
    try:
        netem.check_environment()
    except netem.NetemError:
        return False
    return True


needs_root = pytest.mark.skipif(not _usable(), reason="needs root and `ip netns`")


def _exists(name: str) -> bool:
    return name in netem.list_namespaces(prefix=name)


# -- validation (no root needed) ----------------------------------------------------------------
@pytest.mark.parametrize("rate, expected", [("1gbit", "1gbit"), ("100Mbit", "100mbit"),
                                            (1e9, "1000000000bit"), ("2.5gbit", "2.5gbit")])
def test_parse_rate_accepts(rate, expected):
    assert netem.parse_rate(rate) == expected


@pytest.mark.parametrize("rate", ["fast", "1 gbit", "0gbit", "-5mbit", "10", 0, -1.0])
def test_parse_rate_rejects(rate):
    with pytest.raises(ValueError, match="rate"):
        netem.parse_rate(rate)


def test_parse_rate_type():
    with pytest.raises(TypeError, match="rate"):
        netem.parse_rate(None)


def test_run_ids_unique_and_owned():
    ids = {netem.new_run_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(i.startswith(f"{netem.NAME_PREFIX}{os.getpid()}x") for i in ids)


@pytest.mark.parametrize("name", ["default", "gpnet", "gpnetx12", "other-gpnet1x2", "gpnet1x2-a b"])
def test_refuses_foreign_namespaces(name):
    with pytest.raises(ValueError, match="refusing"):
        netem.destroy_namespace(name)
    with pytest.raises(ValueError, match="refusing"):
        netem.create_namespace(name)


def test_cluster_argument_errors():
    with pytest.raises(ValueError, match="hosts"):
        netem.create_cluster(0)
    with pytest.raises(ValueError, match="10.99"):
        netem.create_cluster(2, subnet="192.168.1")
    with pytest.raises(ValueError, match="burst"):
        netem.create_cluster(2, burst="lots")


def test_not_root_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(lib.os, "geteuid", lambda: 1000)
    with pytest.raises(netem.NetemError, match="needs root"):
        netem.check_environment()


def test_missing_ip_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(lib.os, "geteuid", lambda: 0)
    monkeypatch.setattr(lib.shutil, "which", lambda tool: None)
    with pytest.raises(netem.NetemError, match="`ip`"):
        netem.check_environment()


# -- namespaces (root) --------------------------------------------------------------------------
@pytest.mark.cluster
@needs_root
def test_rate_limited_namespace_lifecycle():
    with netem.rate_limited_namespace("200mbit") as ns:
        assert _exists(ns.name)
        qdisc = subprocess.run(ns.cmd(["tc", "qdisc", "show", "dev", "lo"]),
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdisc and "200Mbit" in qdisc
        up = subprocess.run(ns.cmd(["ip", "-o", "link", "show", "lo"]), capture_output=True,
                            text=True, check=True).stdout
        assert "UP" in up
    assert not _exists(ns.name)


@pytest.mark.cluster
@needs_root
def test_namespace_removed_on_exception_and_processes_killed():
    with pytest.raises(RuntimeError, match="boom"):
        with netem.rate_limited_namespace(None) as ns:
            sleeper = subprocess.Popen(ns.cmd(["sleep", "60"]))
            _wait_inside(ns.name, sleeper.pid)
            raise RuntimeError("boom")
    assert not _exists(ns.name)
    assert sleeper.wait(10) == -signal.SIGKILL


def _wait_inside(name: str, pid: int, timeout: float = 20.0) -> None:
    """Wait until process ``pid`` has entered namespace ``name`` (``ip netns exec`` joins it a
    moment after it starts; on a loaded machine the cleanup could otherwise run first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        if str(pid) in out.stdout.split():
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} did not enter namespace {name} within {timeout} s")


@pytest.mark.cluster
@needs_root
def test_namespace_removed_on_sigterm(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(BENCH)!r})
        import netem
        with netem.rate_limited_namespace("1gbit") as ns:
            print(ns.name, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            signal.pause()
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    name = res.stdout.strip()
    assert name.startswith(netem.NAME_PREFIX) and res.returncode == 128 + signal.SIGTERM
    assert not _exists(name)


@pytest.mark.cluster
@needs_root
def test_cluster_hosts_reach_each_other_only_inside():
    code = "import socket, sys; socket.create_connection((sys.argv[1], 9), 5)"
    with netem.emulated_cluster(2, "1gbit") as cl:
        assert cl.addresses == ("10.99.0.1", "10.99.0.2")
        assert all(_exists(ns.name) for ns in cl.namespaces)
        for ns, dev in ((cl.hosts[0], "eth0"), (cl.hub, "v0"), (cl.hub, "v1")):
            out = subprocess.run(ns.cmd(["tc", "qdisc", "show", "dev", dev]),
                                 capture_output=True, text=True, check=True).stdout
            assert "tbf" in out and "1Gbit" in out, (ns.name, dev, out)
        # nobody listens on port 9 of host 1: a refused connection proves the path works
        res = subprocess.run(cl.hosts[0].cmd([sys.executable, "-c", code, cl.addresses[1]]),
                             capture_output=True, text=True, timeout=30)
        assert "ConnectionRefused" in res.stderr, res.stderr
        routes = subprocess.run(cl.hosts[0].cmd(["ip", "route"]), capture_output=True,
                                text=True, check=True).stdout
        assert "default" not in routes  # no way out of the emulated network
    assert not any(_exists(ns.name) for ns in cl.namespaces)


@pytest.mark.cluster
@needs_root
def test_throughput_helper_and_cli(capsys):
    assert netem.main(["check"]) == 0
    assert netem.main(["cluster", "destroy"]) == 2
    assert "run id" in capsys.readouterr().err
    with netem.rate_limited_namespace(None) as ns:
        assert netem.measure_throughput(ns, ns, mib=4) > 0


@pytest.mark.cluster
@needs_root
def test_cleanup_stale_removes_only_dead_creators():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = netem.create_namespace(f"{netem.NAME_PREFIX}{dead}xabc-t")
    mine = netem.create_namespace(f"{netem.new_run_id()}-t")
    try:
        removed = netem.cleanup_stale()
        assert stale.name in removed and mine.name not in removed
        assert _exists(mine.name) and not _exists(stale.name)
    finally:
        netem.destroy_namespace(stale.name)
        netem.destroy_namespace(mine.name)

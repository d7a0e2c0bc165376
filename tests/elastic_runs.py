"""What the elastic tests share (tests/test_elastic.py, tests/test_elastic_hosts.py): torchrun of
examples/torchrun_elastic.py on one machine (the uninterrupted run is conftest's fixture
``uninterrupted``), and emulated hosts
(network namespaces joined by veth pairs, gradpress.train.netem) with one torchrun agent each."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gradpress.train import netem
from helpers import ROOT, free_port, run_env

SCRIPT = ROOT / "examples" / "torchrun_elastic.py"
STEPS = 40
#: The c10d rendezvous of the host tests: a lost agent is dropped after its keep-alives fail.
RDZV_CONF = "last_call_timeout=2,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=2"


def elastic(nproc: int, ckpt: Path, out: Path, *args: str, restarts: int = 2,
            expect: int = 0, **env: str) -> str:
    """torchrun (c10d rendezvous, ``--max-restarts``) of the example; its output."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           str(nproc), "--max-restarts", str(restarts), "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(SCRIPT), "--steps", str(STEPS),
           "--ckpt", str(ckpt), "--out", str(out), *args]
    p = subprocess.run(cmd, env=run_env(GRADPRESS_TIMEOUT="30", **env), cwd=ROOT,
                       capture_output=True, text=True, timeout=150)
    text = p.stdout + p.stderr
    assert p.returncode == expect, f"exit {p.returncode}, expected {expect}:\n{text[-6000:]}"
    return text


@contextlib.contextmanager
def hosts(n: int = 2) -> Iterator[netem.EmulatedCluster]:
    """``n`` network namespaces ("nodes") joined by veth pairs to a bridge (no rate limit)."""
    try:
        netem.check_environment()
    except netem.NetemError as e:  # not a skip: the test needs what the sandbox must have
        pytest.fail(f"emulated hosts need root and `ip netns` (gradpress.train.netem): {e}")
    with netem.emulated_cluster(n, None) as cl:
        yield cl


def host_agent(cl: netem.EmulatedCluster, i: int, tmp: Path, nnodes: str, log: str,
               conf: str = RDZV_CONF, nproc: int = 1, rdzv: int = 0,
               **env: str) -> subprocess.Popen:
    """A torchrun agent (``nproc`` workers) on host ``i``, the c10d rendezvous (options
    ``conf``) on host ``rdzv``'s address (its agent hosts the store; see :func:`rdzv_store`
    for a host without an agent); its output goes to ``tmp/LOG``."""
    cmd = cl.hosts[i].cmd([
        sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes,
        "--nproc-per-node", str(nproc), "--max-restarts", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"{cl.addresses[rdzv]}:29400", "--local-addr", cl.addresses[i],
        "--rdzv-conf", f"{conf},is_host={'true' if i == rdzv else 'false'}",
        "--monitor-interval", "0.5", str(SCRIPT), "--steps", str(STEPS), "--ckpt",
        str(tmp / "ckpt"), "--out", str(tmp / "out")])
    with open(tmp / log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=run_env(
            GRADPRESS_TIMEOUT="30", GLOO_SOCKET_IFNAME=cl.device, **env))


STORE_SERVER = """
import datetime, pathlib, signal, sys
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], 29400, None, True, timeout=datetime.timedelta(seconds=120),
                      wait_for_workers=False)
pathlib.Path(sys.argv[2]).touch()
while True:  # until killed
    signal.pause()
"""


def rdzv_store(cl: netem.EmulatedCluster, i: int, tmp: Path) -> subprocess.Popen:
    """A TCP store alone on host ``i`` (port 29400) for the c10d rendezvous of agents on other
    hosts (a rendezvous host that outlives the job); returns once it listens."""
    ready = tmp / "store-ready"
    p = subprocess.Popen(cl.hosts[i].cmd([sys.executable, "-c", STORE_SERVER, cl.addresses[i],
                                          str(ready)]), cwd=ROOT, env=run_env())
    deadline = time.monotonic() + 60
    while not ready.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            kill_all([p])
            pytest.fail(f"the rendezvous store on host {i} did not start ({p.returncode})")
        time.sleep(0.05)
    return p


def kill_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL and reap every agent of ``procs`` still running."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def finish(procs: list[subprocess.Popen], tmp: Path, timeout: float = 120) -> list[str]:
    """Wait for every agent (killing what is left after ``timeout`` s); the logs of
    ``tmp/*.log``, sorted by name."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"an agent was still running after {timeout} s: "
                    f"{[f.read_text()[-2000:] for f in sorted(tmp.glob('*.log'))]}")
    finally:
        kill_all(procs)
    return [f.read_text() for f in sorted(tmp.glob("*.log"))]


def wait_held(procs: list[subprocess.Popen], tmp: Path, timeout: float = 90) -> Path:
    """Wait until a worker holds before its step (``GP_HOLD_AT``: ``tmp/out/held-rank<r>``,
    whichever rank the rendezvous gave it), every agent of ``procs`` still running."""
    out = tmp / "out"
    deadline = time.monotonic() + timeout
    while not (held := sorted(out.glob("held-rank*"))):
        assert all(p.poll() is None for p in procs), \
            f"an agent exited before a worker held: {[p.poll() for p in procs]}"
        assert time.monotonic() < deadline, f"no {out}/held-rank* after {timeout} s"
        time.sleep(0.05)
    return held[0]


def wait_log(log: Path, text: str, procs: list[subprocess.Popen], timeout: float = 90) -> None:
    """Wait until ``text`` appears in ``log``, every agent of ``procs`` still running."""
    deadline = time.monotonic() + timeout
    while text not in (log.read_text() if log.exists() else ""):
        assert all(p.poll() is None for p in procs), \
            f"an agent exited before {log.name} said {text!r}: {[p.poll() for p in procs]}"
        assert time.monotonic() < deadline, f"{log.name} did not say {text!r} in {timeout} s"
        time.sleep(0.05)


def lose_host(cl: netem.EmulatedCluster, i: int, procs: list[subprocess.Popen],
              tmp: Path) -> str:
    """Wait until host ``i``'s worker holds (``GP_HOLD_AT``), then SIGKILL every process of
    host ``i``, its agent ``procs[i]`` included; the name of the file it held on."""
    held = wait_held(procs, tmp).name
    pids = subprocess.run(["ip", "netns", "pids", cl.hosts[i].name], capture_output=True,
                          text=True, check=True).stdout.split()
    assert str(procs[i].pid) in pids and len(pids) >= 2, pids  # the agent, its worker
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    assert procs[i].wait(timeout=10) == -signal.SIGKILL
    return held

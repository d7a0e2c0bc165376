"""Reliability (docs/reliability.md): failure detection, hostile payloads, join authentication,
bounded soak. Every wait is bounded; multi-process jobs run on loopback with short timeouts.

* failures: a SIGKILLed worker (no launcher: each process must find out by itself, a worker that
  is busy computing is ended by the watchdog) and a SIGKILLed server (under the launcher);
* hostile payloads: crafted control messages and payloads sent with the transport API to a
  server engine and as replies to a worker engine, in-process; one truncated payload over gloo;
* join authentication: the handshake (threads on a local store) and real processes with a
  wrong, a missing and the right secret;
* soak: many mixed tensors for tens of steps: resident memory flat, no thread leaks, peak memory
  bounded; the launcher's secret travels in the environment, sockets listen on loopback only.
  The long versions are in ``benchmarks/soak.py``.
"""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradpress.compress import build
from gradpress.compress.header import HEADER_BYTES
from gradpress.ps.auth import authenticate, proof
from gradpress.ps.cluster import Cluster, Layout
from gradpress.ps.config import ClusterConfig, PSConfig
from gradpress.ps.errors import AuthError, CommTimeoutError, GradpressError, PayloadError
from gradpress.ps.partition import chunk_key
from gradpress.ps.protocol import (
    CTRL_BYTES,
    OP_PUSH,
    OP_PUSH_INLINE,
    OP_STOP,
    Control,
    KeyDescriptor,
    pack_control,
    unpack_control,
)
from gradpress.ps.server import ServerEngine
from gradpress.ps.transport import CTRL_TAG, INLINE_BYTES, Transport, inline_payload
from gradpress.ps.worker import WorkerEngine
from helpers import assert_no_leftovers, free_port

WAIT_S = 240  # bound of every wait for a whole job (generous: shared, loaded machines)


# == helpers ======================================================================================
def _manual_env(port: int, rank: int, role: str, **extra: str) -> dict[str, str]:
    """Environment of one process of a 2-worker, 1-server job started without a launcher."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3",
               RANK=str(rank), GRADPRESS_ROLE=role, GRADPRESS_NUM_WORKERS="2",
               GRADPRESS_NUM_SERVERS="1", GRADPRESS_COLOCATE="0", OMP_NUM_THREADS="1",
               GRADPRESS_COMPRESS_THREADS="1", GRADPRESS_ENGINE_THREADS="1")
    for var in ("GRADPRESS_SECRET", "GLOO_SOCKET_IFNAME"):
        env.pop(var, None)
    env.update(extra)
    return env


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)


def _finish_all(procs: list[subprocess.Popen], timeout: float = WAIT_S) -> list[int]:
    """Wait for every process (bounded); kill what is left and fail if any had to be killed."""
    deadline = time.monotonic() + timeout
    codes, late = [], []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            late.append(p.args)
            p.kill()
            codes.append(p.wait(10))
    assert not late, f"processes still running after {timeout} s: {late}"
    return codes


def _launch(args: list[str], script: Path, tmp: Path, marker: str,
            **env_vars: str) -> subprocess.Popen:
    env = dict(os.environ, GP_TEST_MARKER=marker, OMP_NUM_THREADS="1",
               GRADPRESS_COMPRESS_THREADS="1", GRADPRESS_ENGINE_THREADS="1", **env_vars)
    for var in ("GRADPRESS_SECRET", "GLOO_SOCKET_IFNAME"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--grace", "2", *args, "--",
           sys.executable, str(script), str(tmp)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _communicate(p: subprocess.Popen, marker: str) -> str:
    try:
        out = p.communicate(timeout=WAIT_S)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        out = p.communicate()[0]
        pytest.fail(f"launcher still running after {WAIT_S} s:\n{out}")
    assert_no_leftovers(marker, 10, out)
    return out


# == 1. failure detection ========================================================================
TRAIN = textwrap.dedent('''
    import os, signal, sys, time
    import torch
    import gradpress as gp

    gp.init()
    r = gp.rank()
    for step in range(100000):
        gp.push_pull(torch.full((5000,), float(r)), "w", compression="onebit", ef="vanilla",
                     min_compress_bytes=0)
        if step == 5 and r == int(os.environ.get("KILL_RANK", "-1")):
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 5 and r == int(os.environ.get("BUSY_RANK", "-1")):
            time.sleep(600)  # "computing": only the watchdog can end this process
        if step == 5 and r == 0 and os.environ.get("KILL_SERVER"):
            for pid in os.listdir("/proc"):  # the server started by the same launcher
                try:
                    env = open(f"/proc/{pid}/environ", "rb").read().split(b"\\0")
                except OSError:
                    continue
                if b"GRADPRESS_ROLE=server" in env and \\
                        f"MASTER_PORT={os.environ['MASTER_PORT']}".encode() in env:
                    os.kill(int(pid), signal.SIGKILL)
''')


@pytest.mark.cluster
def test_killed_worker_ends_every_process_naming_it(tmp_path: Path) -> None:
    """No launcher: the server sees worker 1's connection close and exits naming it; worker 0,
    busy computing, learns it from the watchdog and is ended within GRADPRESS_TIMEOUT."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    port = free_port()
    common = {"GRADPRESS_TIMEOUT": "8", "GRADPRESS_WATCHDOG_INTERVAL": "0.5",
              "KILL_RANK": "1", "BUSY_RANK": "0"}
    procs = [_start([sys.executable, str(script)], _manual_env(port, r, "worker", **common),
                    tmp_path / f"w{r}.log") for r in range(2)]
    procs.append(_start([sys.executable, "-m", "gradpress.ps.server"],
                        _manual_env(port, 2, "server", **common), tmp_path / "s.log"))
    codes = _finish_all(procs)
    w0, server = (tmp_path / "w0.log").read_text(), (tmp_path / "s.log").read_text()
    assert codes == [1, -signal.SIGKILL, 1], (codes, w0, server)
    assert "worker 1 (rank 1) is gone" in server, server
    assert "worker 0 (rank 0): the job failed" in w0 and "ending it" in w0, w0
    assert "worker 1 (rank 1)" in w0.split("ending it")[-1], w0


@pytest.mark.cluster
def test_killed_server_stops_the_launch_with_a_named_error(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    marker = uuid.uuid4().hex
    p = _launch(["--workers", "2", "--servers", "1", "--timeout", "20"], script, tmp_path,
                marker, GRADPRESS_TIMEOUT="20", KILL_SERVER="1")
    out = _communicate(p, marker)
    assert p.returncode == 128 + signal.SIGKILL, out
    assert "server 0 (rank 2" in out and "exited with code -9" in out, out


# == 2. hostile payloads, in-process: one rank hosting worker and server engines ===================
@pytest.fixture(scope="module")
def solo() -> Iterator[tuple[Cluster, PSConfig, Transport]]:
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    cfg = PSConfig(timeout=5.0, compress_threads=1, engine_threads=1, watchdog_interval=0.0)
    ccfg = ClusterConfig(role="worker", rank=0, num_workers=1, num_servers=1, colocate=True)
    cluster = Cluster.connect(ccfg, cfg.timeout)
    try:
        yield cluster, cfg, Transport(0, cluster.describe, cluster.reported_errors)
    finally:
        cluster.close()
        if saved is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)


def _declare(cluster: Cluster, name: str, spec: str, numel: int) -> int:
    key = chunk_key(name, 0)
    desc = KeyDescriptor(name, 0, 0, numel, numel, build(spec, numel).spec_text, None, 0, True, 0)
    cluster.store.set(f"k/{key}", desc.to_json())
    return key


def _set(payload: torch.Tensor, offset: int, fmt: str, value: object) -> torch.Tensor:
    """Overwrite the bytes at ``offset`` (negative: from the end) with ``struct`` ``fmt``."""
    offset %= payload.numel()
    payload[offset:offset + struct.calcsize(fmt)] = torch.frombuffer(
        bytearray(struct.pack(fmt, value)), dtype=torch.uint8)
    return payload


N = 64  # elements of every hostile key


def _payload(spec: str, key: int, step: int = 0, nan_policy: str = "raise",
             x: torch.Tensor | None = None) -> torch.Tensor:
    x = torch.randn(N) if x is None else x
    return build(spec, N, nan_policy=nan_policy).compress(x, key=key, step=step)


def _with_nan(key: int) -> torch.Tensor:
    x = torch.ones(N)
    x[3] = math.nan
    return _payload("none", key, nan_policy="allow", x=x)


# case -> (codec spec, control fields to override, payload(key) or None: a valid one, words
# the error must contain)
SERVER_CASES: dict[str, tuple[str, dict, Callable[[int], torch.Tensor] | None, str]] = {
    "unknown op": ("none", {"op": 9}, None, "unknown op 9"),
    "undeclared key": ("none", {"key": 12345}, None, "key 12345, which no worker declared"),
    "wrong size": ("none", {"nbytes": 7}, None, "pushes 7 bytes"),
    "wrong step": ("none", {"step": 3}, None, "at step 3, expected step 0"),
    "negative lr": ("none", {"lr": -1.0}, None, "learning rate -1.0"),
    "bad magic": ("none", {}, lambda k: _set(_payload("none", k), 0, "2s", b"XX"),
                  "not a gradpress payload"),
    "wrong numel": ("none", {}, lambda k: _set(_payload("none", k), 8, "<Q", N + 1),
                    f"numel {N + 1}, expected {N}"),
    "wrong header step": ("none", {}, lambda k: _payload("none", k, step=5),
                          "step 5, expected 0"),
    "wrong codec": ("none", {}, lambda k: _set(_payload("none", k), 2, "B", 99), "codec id 99"),
    "nan values": ("none", {}, _with_nan, "non-finite"),
    "inf onebit scale": ("onebit", {}, lambda k: _set(_payload("onebit", k), -4, "<f", math.inf),
                         "non-finite"),
    # N = 64 is a power of two: every 6-bit packed index is in range, so corrupt an int32 one
    "topk index": ("topk:k=4,indices=int32", {},
                   lambda k: _set(_payload("topk:k=4,indices=int32", k), HEADER_BYTES, "<i",
                                  10**6), "out of range"),
}


@pytest.mark.parametrize("case", list(SERVER_CASES))
def test_server_rejects_hostile_push_naming_sender_and_key(
        solo: tuple[Cluster, PSConfig, Transport], case: str) -> None:
    cluster, cfg, transport = solo
    spec, fields, make, words = SERVER_CASES[case]
    key = _declare(cluster, f"hostile-{case}", spec, N)
    payload = make(key) if make else _payload(spec, key)
    server = ServerEngine(cluster, cfg, transport, 0).start()
    ctrl = dict(op=OP_PUSH, key=key, step=0, lr=None, nbytes=payload.numel()) | fields
    raw = torch.frombuffer(bytearray(struct.pack("<B3xIqdQ", ctrl["op"], ctrl["key"],
                                                 ctrl["step"], math.nan if ctrl["lr"] is None
                                                 else ctrl["lr"], ctrl["nbytes"])),
                           dtype=torch.uint8)
    reply = transport.irecv(torch.empty(payload.numel(), dtype=torch.uint8), 0, key, "reply",
                            "pull")
    transport.isend(raw, 0, CTRL_TAG, "hostile control", "push")
    transport.isend(payload, 0, key, "hostile payload", "push")
    deadline = time.monotonic() + 20
    while server.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    err = server.error
    assert isinstance(err, GradpressError) and isinstance(err, ValueError), (case, err)
    assert "rank 0" in str(err) and words in str(err), (case, str(err))
    if "undeclared" not in case:
        assert str(key) in str(err), (case, str(err))
    with pytest.raises(CommTimeoutError):  # nothing was decoded into a reply
        reply.wait(0.2, "test")
    _stop(server, transport)
    assert f"server 0: {err}" in cluster.reported_errors()


def _stop(server: ServerEngine, transport: Transport) -> None:
    """Unblock a control thread still waiting for messages, then join (re-raises the error)."""
    if any(t.name.endswith("ctrl0") and t.is_alive() for t in server._threads):
        transport.isend(pack_control(Control(OP_STOP)), 0, CTRL_TAG, "stop", "push")
    with pytest.raises(GradpressError):
        server.join(10)
    for t in server._threads:
        t.join(10)
        assert not t.is_alive(), t.name


WORKER_CASES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
    "nan values": (lambda p: _set(p, HEADER_BYTES + 8, "<f", math.nan), "non-finite"),
    "wrong step": (lambda p: _set(p, 16, "<q", 7), "step 7, expected 0"),
    "bad magic": (lambda p: _set(p, 0, "2s", b"ZZ"), "not a gradpress payload"),
    "wrong numel": (lambda p: _set(p, 8, "<Q", 3), "numel 3"),
}


@pytest.mark.parametrize("case", list(WORKER_CASES))
def test_worker_rejects_hostile_reply_naming_server_and_key(
        solo: tuple[Cluster, PSConfig, Transport], case: str) -> None:
    """The test plays the server: it reads the worker's push and answers with crafted bytes."""
    cluster, cfg, transport = solo
    mutate, words = WORKER_CASES[case]
    worker = WorkerEngine(cluster, cfg, transport)
    try:
        h = worker.submit(torch.ones(64), f"reply-{case}", compression="none")
        ctrl = torch.empty(INLINE_BYTES, dtype=torch.uint8)  # a small push comes inline
        transport.irecv(ctrl, 0, CTRL_TAG, "ctrl", "push").wait(10, "test")
        msg = unpack_control(ctrl[:CTRL_BYTES])
        assert msg.op == OP_PUSH_INLINE and inline_payload(ctrl, msg.nbytes) is not None
        reply = mutate(build("none", 64).compress(torch.ones(64), key=msg.key, step=msg.step))
        transport.isend(reply, 0, msg.key, "reply", "pull")
        with pytest.raises(PayloadError) as exc:
            h.wait(20)
        assert "server 0 (rank 0)" in str(exc.value) and str(msg.key) in str(exc.value)
        assert words in str(exc.value), str(exc.value)
        assert exc.value.peer == cluster.describe(0) and exc.value.key == msg.key
    finally:
        worker.close([])


def test_signal_on_the_callers_thread_reaches_the_caller(
        solo: tuple[Cluster, PSConfig, Transport], monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt (Ctrl-C, or SIGTERM turned into one by ``gradpress train``'s worker)
    raised while push_pull starts a chunk on the caller's thread stops the caller there; the
    engine is failed, so every later call names the signal (the CI flake of stop 48: the train
    worker saw "the gradpress engine failed earlier: SIGTERM" and recorded "failed")."""
    cluster, cfg, transport = solo
    worker = WorkerEngine(cluster, cfg, transport)

    def interrupted(job: object) -> None:
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(worker, "_start", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
            worker.submit(torch.ones(64), "interrupted", compression="none")
        assert isinstance(worker.error, KeyboardInterrupt)
    finally:
        worker.close([])


HOSTILE_GLOO = textwrap.dedent('''
    import os, sys, time
    import torch
    import gradpress as gp
    from gradpress import api
    from gradpress.ps.protocol import OP_PUSH, OP_PUSH_INLINE, Control, pack_control
    from gradpress.ps.transport import CTRL_TAG, HEAD_ROOM, head_room, payload_buffer

    gp.init()
    if gp.rank() == 0:
        for step in range(100000):
            gp.push_pull(torch.ones(4096), "x")
    rt = api._RT  # worker 1: declares "x" as an honest worker would, then pushes a short message
    cs = rt.worker.planner.plan("x", 4096, True, None, None, None, None).chunks[0]
    good = cs.enc.compress(torch.ones(4096), key=cs.key, step=0)
    dst = cs.server_rank
    if os.environ["HOSTILE_MODE"] == "inline":  # control and payload in one message, cut short
        buf = payload_buffer(good.numel())
        buf.copy_(good)
        pack_control(Control(OP_PUSH_INLINE, cs.key, 0, None, good.numel()), head_room(buf))
        msg = buf._gp_frame[0][:HEAD_ROOM + good.numel() - 1000]
        rt.transport.isend(msg, dst, CTRL_TAG, "inline push", "push").wait(30, "test")
    else:  # announced on the control tag, then a payload shorter than announced
        short = payload_buffer(good.numel() - 1000)
        short.copy_(good[:short.numel()])
        ctrl = pack_control(Control(OP_PUSH, cs.key, 0, None, good.numel()))
        rt.transport.isend(ctrl, dst, CTRL_TAG, "control", "push").wait(30, "test")
        rt.transport.isend(short, dst, cs.key, "payload", "push").wait(30, "test")
    time.sleep(600)
''')


@pytest.mark.cluster
@pytest.mark.parametrize("mode", ["separate", "inline"])
def test_truncated_payload_over_gloo_is_rejected(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE_GLOO)
    marker = uuid.uuid4().hex
    p = _launch(["--workers", "2", "--servers", "1", "--timeout", "20"], script, tmp_path,
                marker, GRADPRESS_TIMEOUT="20", HOSTILE_MODE=mode)
    out = _communicate(p, marker)
    assert p.returncode == 1, out
    key = chunk_key("x", 0)
    assert "server 0 (rank 2" in out and "exited with code 1" in out, out
    assert f"key {key} ('x' chunk 0) from worker 1 (rank 1)" in out, out
    assert "truncated or corrupted" in out, out


# == 3. join authentication =====================================================================
LAYOUT = Layout(num_workers=2, num_servers=1, colocate=False)


@pytest.fixture
def store() -> Iterator[Callable[[], dist.Store]]:
    """A fresh TCP store; the factory returns a new client (one per simulated process)."""
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port = server.port
    yield lambda: dist.PrefixStore("gradpress/", dist.TCPStore("127.0.0.1", port, None, False))
    del server


def _auth_thread(store: dist.Store, rank: int, secret: str | None, timeout: float = 10.0,
                 world: int = 3) -> tuple[threading.Thread, list[BaseException | None]]:
    result: list[BaseException | None] = []

    def run() -> None:
        try:
            authenticate(store, rank=rank, world_size=world, describe=LAYOUT.describe,
                         secret=secret, timeout=timeout)
            result.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def _outcome(t: threading.Thread, result: list[BaseException | None]) -> BaseException | None:
    t.join(30)
    assert not t.is_alive() and len(result) == 1
    return result[0]


def test_handshake_refuses_wrong_and_missing_secret_then_admits_the_right_one(
        store: Callable[[], dist.Store]) -> None:
    verifier = _auth_thread(store(), 0, "s3cret")
    wrong = _outcome(*_auth_thread(store(), 1, "guess"))
    missing = _outcome(*_auth_thread(store(), 1, None))
    assert isinstance(wrong, AuthError) and "wrong secret" in str(wrong), wrong
    assert "worker 1 (rank 1) was refused" in str(wrong)
    assert isinstance(missing, AuthError) and "requires the job secret" in str(missing), missing
    good = [_auth_thread(store(), r, "s3cret") for r in (1, 2)]
    assert all(_outcome(*g) is None for g in good)
    assert _outcome(*verifier) is None


def test_handshake_open_job_and_mismatched_secret(store: Callable[[], dist.Store]) -> None:
    verifier = _auth_thread(store(), 0, None, world=2)
    err = _outcome(*_auth_thread(store(), 1, "s3cret", world=2))
    assert isinstance(err, AuthError) and "started the job without one" in str(err), err
    assert _outcome(*_auth_thread(store(), 1, None, world=2)) is None
    assert _outcome(*verifier) is None


def test_handshake_names_missing_processes(store: Callable[[], dist.Store]) -> None:
    err = _outcome(*_auth_thread(store(), 0, "s3cret", timeout=0.5))
    assert isinstance(err, CommTimeoutError), err
    assert "worker 1 (rank 1), server 0 (rank 2) did not join" in str(err), err


def test_proof_binds_nonce_identity_and_secret() -> None:
    base = proof("k", "gradpress-join", "n", "worker 1 (rank 1)", "c")
    assert len(base) == 64 and base == proof("k", "gradpress-join", "n", "worker 1 (rank 1)", "c")
    others = [proof("k2", "gradpress-join", "n", "worker 1 (rank 1)", "c"),
              proof("k", "gradpress-join", "n2", "worker 1 (rank 1)", "c"),
              proof("k", "gradpress-join", "n", "server 0 (rank 2)", "c")]
    assert base not in others


AUTH_JOB = textwrap.dedent('''
    import os, sys, torch
    import gradpress as gp
    gp.init()
    y = gp.push_pull(torch.full((10,), float(gp.rank())), "a")
    assert torch.equal(y, torch.full((10,), 0.5)), y
    print("push_pull ok", flush=True)
    gp.shutdown()
''')


@pytest.mark.cluster
def test_processes_with_wrong_or_missing_secret_are_refused_and_the_job_runs(
        tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(AUTH_JOB)
    port, secret = free_port(), "correct horse battery staple"
    env = {"GRADPRESS_TIMEOUT": "60", "GRADPRESS_SECRET": secret}
    job = [_start([sys.executable, str(script)], _manual_env(port, 0, "worker", **env),
                  tmp_path / "w0.log"),
           _start([sys.executable, "-m", "gradpress.ps.server"],
                  _manual_env(port, 2, "server", **env), tmp_path / "s.log")]
    intruder = _start([sys.executable, str(script)],  # (no secret: see the handshake tests)
                      _manual_env(port, 1, "worker", GRADPRESS_TIMEOUT="60",
                                  GRADPRESS_SECRET="wrong"), tmp_path / "bad.log")
    assert _finish_all([intruder]) == [1]
    bad = (tmp_path / "bad.log").read_text()
    assert "AuthError" in bad and "worker 1 (rank 1) was refused" in bad, bad
    assert "wrong secret" in bad, bad
    job.append(_start([sys.executable, str(script)], _manual_env(port, 1, "worker", **env),
                      tmp_path / "w1.log"))
    logs = [tmp_path / n for n in ("w0.log", "s.log", "w1.log")]
    assert _finish_all(job) == [0, 0, 0], [f.read_text() for f in logs]
    w0 = logs[0].read_text()
    assert "push_pull ok" in w0 and "push_pull ok" in logs[2].read_text()
    assert "refused a process joining as worker 1 (rank 1): wrong secret" in w0, w0
    assert secret not in "".join(f.read_text() for f in logs) + bad


# == 4. bounded soak and memory ===================================================================
SOAK = textwrap.dedent('''
    import json, os, sys, threading
    import torch
    import gradpress as gp

    def status_kb(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])

    def listening_addresses():
        """Local addresses of the TCP sockets this process listens on."""
        inodes = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found = []
        for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
            for line in open(table).read().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    found.append(cols[1].split(":")[0])
        return found

    out, steps = sys.argv[1], int(os.environ["SOAK_STEPS"])
    secret = os.environ.get("GRADPRESS_SECRET", "")
    cmdlines = open("/proc/self/cmdline", "rb").read() + \\
        open(f"/proc/{os.getppid()}/cmdline", "rb").read()
    gp.init()
    r = gp.rank()
    shared, g = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1 + r)
    sizes = [int(s) for s in torch.randint(1, 1 << 14, (int(os.environ["SOAK_TENSORS"]),),
                                           generator=shared)]  # the same on every worker
    sizes = [1 << 18 if i % 50 == 0 else s for i, s in enumerate(sizes)]  # a few large ones
    grads = [torch.randn(n, generator=g) for n in sizes]
    rss, threads = [], []
    for step in range(steps):
        hs = [gp.push_pull_async(t, f"t{i}", compression="onebit", ef="vanilla")
              for i, t in enumerate(grads)]
        for h in hs:
            h.wait()
        rss.append(status_kb("VmRSS"))
        threads.append(threading.active_count())
    # peak: the result, payload buffers and residuals of a fresh tensor, relative to its size
    n = int(os.environ["PEAK_NUMEL"])
    base = status_kb("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    big = torch.randn(n)
    for step in range(3):
        y = gp.push_pull(big, "big", compression="onebit", min_compress_bytes=0)
        del y
    peak_ratio = (status_kb("VmHWM") - base) * 1024 / (4 * n)
    addresses = listening_addresses()
    gp.shutdown()
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    json.dump({"rss_kb": rss, "threads": threads, "left": left, "peak_ratio": peak_ratio,
               "secret_len": len(secret), "secret_in_argv": secret.encode() in cmdlines,
               "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "listen": addresses},
              open(os.path.join(out, f"soak{r}.json"), "w"))
''')


def _slope_kb_per_step(ys: list[int]) -> float:
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2
                                                                 for x in range(n))


@pytest.mark.cluster
def test_soak_memory_flat_no_thread_leaks_secret_in_env_loopback_only(tmp_path: Path) -> None:
    script = tmp_path / "soak.py"
    script.write_text(SOAK)
    marker = uuid.uuid4().hex
    p = _launch(["--workers", "2", "--servers", "1", "--timeout", "60"], script, tmp_path,
                marker, GRADPRESS_TIMEOUT="60", SOAK_STEPS="40", SOAK_TENSORS="200",
                PEAK_NUMEL=str(4 << 20))
    out = _communicate(p, marker)
    assert p.returncode == 0, out
    for r in range(2):
        res = json.loads((tmp_path / f"soak{r}.json").read_text())
        rss = res["rss_kb"][10:]  # after warm-up (plans, codec buffers, numba)
        assert _slope_kb_per_step(rss) < 128, rss  # a leak per push_pull would be more
        assert len(set(res["threads"])) == 1 and res["left"] == [], res
        assert res["peak_ratio"] <= 3.0, res["peak_ratio"]
        assert res["secret_len"] == 64 and not res["secret_in_argv"], res
        assert res["gloo_ifname"] == "lo" and res["listen"], res
        assert set(res["listen"]) == {"0100007F"}, res["listen"]  # 127.0.0.1, little endian

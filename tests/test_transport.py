"""Inline pushes (control message, payload and trailer in one message on the control tag), and
the measured choice between running work here and handing it to another thread.

Units: buffer layout, the size limit, the receiver's trailer check (a truncated message is
caught, also in a buffer that held a good one before), the in-process mailbox's gloo-like
sizes. End to end: a real job (2 workers, 1 server, gloo on loopback) with ``none`` tensors on
both sides of the inline limit, compared bit for bit with the plain sum.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from gradpress.compress import build
from gradpress.ps.errors import PeerError
from gradpress.ps.handoff import HandOff, TaskPool
from gradpress.ps.protocol import CTRL_BYTES, OP_PUSH_INLINE, Control, pack_control, unpack_control
from gradpress.ps.transport import (
    CTRL_TAG,
    FRAME_BYTES,
    HEAD_ROOM,
    INLINE_BYTES,
    ByteBudget,
    Transport,
    fits_inline,
    head_room,
    inline_payload,
    payload_buffer,
)

#: the largest ``none`` tensor (elements) whose payload still travels inline
LIMIT = (INLINE_BYTES - HEAD_ROOM - FRAME_BYTES - build("none", 0).payload_bytes) // 4


def test_inline_limit_and_buffer_layout() -> None:
    assert fits_inline(build("none", LIMIT).payload_bytes)
    assert not fits_inline(build("none", LIMIT + 1).payload_bytes)
    buf = payload_buffer(100)
    assert buf.numel() == 100 and head_room(buf).numel() == HEAD_ROOM == CTRL_BYTES
    head_room(buf).fill_(7)
    buf.fill_(1)
    assert int(head_room(buf).sum()) == 7 * HEAD_ROOM  # the payload does not overlap it
    with pytest.raises(ValueError, match="payload_buffer"):
        head_room(torch.empty(100, dtype=torch.uint8))


def _solo() -> Transport:
    return Transport(0, lambda r: f"rank {r}")


def _inline_push(transport: Transport, numel: int, key: int, step: int) -> torch.Tensor:
    payload = build("none", numel).compress(torch.arange(float(numel)), key=key, step=step)
    buf = payload_buffer(payload.numel())
    buf.copy_(payload)
    pack_control(Control(OP_PUSH_INLINE, key, step, 0.5, buf.numel()), head_room(buf))
    transport.isend_inline(buf, 0, f"key {key}").wait(5, "test")
    return payload


def test_inline_round_trip_and_truncation_through_the_mailbox() -> None:
    transport, msg = _solo(), torch.empty(INLINE_BYTES, dtype=torch.uint8)
    for step, numel in enumerate((1, 1000, LIMIT)):
        op = transport.irecv(msg, 0, CTRL_TAG, "control", "push")
        sent = _inline_push(transport, numel, key=9, step=step)
        op.wait(5, "test")
        ctrl = unpack_control(msg[:CTRL_BYTES])
        assert (ctrl.op, ctrl.key, ctrl.step, ctrl.lr, ctrl.nbytes) == \
            (OP_PUSH_INLINE, 9, step, 0.5, sent.numel())
        got = inline_payload(msg, ctrl.nbytes)
        assert got is not None and torch.equal(got, sent)
    # the same message again, cut short: the last good trailer was wiped, so it cannot pass
    op = transport.irecv(msg, 0, CTRL_TAG, "control", "push")
    transport.isend(msg[:HEAD_ROOM + sent.numel() - 100].clone(), 0, CTRL_TAG, "cut", "push")
    op.wait(5, "test")
    assert inline_payload(msg, sent.numel()) is None
    assert inline_payload(msg, INLINE_BYTES) is None  # a size that cannot be inline


def test_server_names_what_is_wrong_with_an_inline_push() -> None:
    from types import SimpleNamespace

    from gradpress.ps.errors import PayloadError
    from gradpress.ps.server import ServerEngine

    server = object.__new__(ServerEngine)  # _inline uses the name only
    server.name = "server 0"
    msg = torch.zeros(INLINE_BYTES, dtype=torch.uint8)
    big = SimpleNamespace(nbytes=build("none", LIMIT + 1).payload_bytes, label="'x' chunk 0")
    most = INLINE_BYTES - HEAD_ROOM - FRAME_BYTES
    with pytest.raises(PayloadError, match=rf"pushed 'x' chunk 0 \({big.nbytes} bytes\) inline, "
                                           rf"but only payloads of at most {most} bytes"):
        server._inline(msg, big, "worker 1")
    small = SimpleNamespace(nbytes=build("none", 10).payload_bytes, label="'y' chunk 0")
    msg[HEAD_ROOM + small.nbytes:] = 0xFF  # a wiped trailer: does not match the header
    with pytest.raises(PayloadError, match="'y' chunk 0 from worker 1 rejected: the message is "
                                           "truncated or corrupted"):
        server._inline(msg, small, "worker 1")


def test_inline_send_too_large_and_mailbox_sizes() -> None:
    transport = _solo()
    big = payload_buffer(build("none", LIMIT + 1).payload_bytes)
    with pytest.raises(ValueError, match="do not fit"):
        transport.isend_inline(big, 0, "key 1")
    transport.irecv(torch.empty(8, dtype=torch.uint8), 0, 5, "small", "push")
    with pytest.raises(PeerError, match="16 bytes sent, receive buffer holds 8"):
        transport.isend(torch.zeros(16, dtype=torch.uint8), 0, 5, "big", "push")


def test_byte_budget_try_acquire() -> None:
    budget = ByteBudget(100)
    assert budget.try_acquire(500) and budget.used == 500  # a lone oversize chunk fits
    assert not budget.try_acquire(1)
    budget.release(500)
    assert budget.try_acquire(60) and not budget.try_acquire(41) and budget.try_acquire(40)
    budget.abort(RuntimeError("engine failed"))
    budget.release(100)
    assert not budget.try_acquire(1)  # the dispatcher's acquire then raises the error
    with pytest.raises(RuntimeError, match="engine failed"):
        budget.acquire(1, 1.0, "chunk")


JOB = textwrap.dedent('''
    import sys
    import torch
    import gradpress as gp

    limit = int(sys.argv[2])
    gp.init()
    r, W = gp.rank(), gp.size()
    sizes = [1, limit, limit + 1, 3 * limit]  # inline, inline, two messages, two messages
    for step in range(3):
        def make(w, i):
            g = torch.Generator().manual_seed(1000 * step + 10 * i + w)
            return torch.randn(sizes[i], generator=g)
        hs = [gp.push_pull_async(make(r, i), f"t{i}", min_compress_bytes=1 << 30)
              for i in range(len(sizes))]
        for i, h in enumerate(hs):
            ref = sum(make(w, i) for w in range(W)) / W
            assert torch.equal(h.wait().view(torch.int32), ref.view(torch.int32)), (i, step)
    gp.shutdown()
    open(sys.argv[1] + f"/ok{r}", "w").close()
''')


@pytest.mark.cluster
@pytest.mark.parametrize("inflight", [256 << 20, 1], ids=["room", "one-chunk-budget"])
def test_pushes_on_both_sides_of_the_limit_sum_exactly_over_gloo(tmp_path: Path,
                                                                   inflight: int) -> None:
    """With a budget of one byte every chunk but a lone one waits in the dispatcher's queue."""
    script = tmp_path / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, GRADPRESS_TIMEOUT="60", OMP_NUM_THREADS="1",
               GRADPRESS_PARTITION_BYTES=str(16 * LIMIT), GRADPRESS_INFLIGHT_BYTES=str(inflight))
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "1",
           "--", sys.executable, str(script), str(tmp_path), str(LIMIT)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "ok0").exists() and (tmp_path / "ok1").exists()


def test_handoff_decides_from_measured_speed_and_latency() -> None:
    gate = HandOff(latency_s=100e-6)
    assert gate.here(1 << 30)  # nothing measured yet: run here, and measure
    gate.ran(1000, 10e-6)  # 10 ns a byte: work on 10,000 bytes takes the hand-off's 100 us
    assert gate.here(9_000) and not gate.here(11_000)
    for _ in range(100):  # hand-offs measured at about 1 ms (busy cores): more work stays here
        gate.started(time.perf_counter() - 1e-3)
    assert 0.9e-3 < gate.latency_s < 1.1e-3 and gate.here(90_000) and not gate.here(110_000)
    gate.ran(0, 1.0)  # nothing to learn from empty work
    assert gate.here(90_000)
    # each kind of work (codec) has its own speed: fp32 decodes ten times quicker per byte
    gate.ran(1000, 1e-6, "none")
    assert gate.here(900_000, "none") and not gate.here(1_100_000, "none")
    assert gate.here(90_000) and not gate.here(110_000)  # the other kind's speed is unchanged
    assert gate.here(1 << 30, "onebit")  # not measured yet: run here, and measure
    with pytest.raises(ValueError, match="latency_s"):
        HandOff(latency_s=0)


def test_task_pool_runs_calls_on_its_named_threads_and_outlives_a_failing_one() -> None:
    import threading

    pool = TaskPool(2, "gp-test")
    names: list[str] = []
    both = threading.Barrier(2, timeout=10)  # two tasks in parallel: two threads
    done = threading.Event()

    def task(i: int) -> None:
        names.append(threading.current_thread().name)
        if i < 2:
            both.wait()
        if i == 3:
            done.set()

    def bad() -> None:
        raise KeyboardInterrupt  # as the engine's guard re-raises a signal

    pool.submit(task, 0)
    pool.submit(task, 1)
    pool.submit(bad)
    pool.submit(task, 3)  # still runs: a raising task does not stop its thread
    assert done.wait(10)
    assert sorted(set(names[:2])) == ["gp-test_0", "gp-test_1"]
    pool.shutdown(wait=True, timeout=10)
    assert not any(t.name.startswith("gp-test") and t.is_alive() for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(task, 4)
    with pytest.raises(ValueError, match="threads"):
        TaskPool(0, "gp-test")


def test_task_pool_hands_an_escaped_error_to_on_error_and_logs_it(caplog) -> None:
    """An exception a task lets out fails the engine (``on_error``: ``WorkerEngine.fail``)
    and is logged as an error, not at DEBUG (review of issue 54)."""
    import logging
    import threading

    failed: list[BaseException] = []
    seen = threading.Event()

    def on_error(e: BaseException) -> None:
        failed.append(e)
        seen.set()

    def bad() -> None:
        raise RuntimeError("boom in a task")

    pool = TaskPool(1, "gp-test-err", on_error=on_error)
    with caplog.at_level(logging.ERROR, logger="gradpress"):
        pool.submit(bad)
        assert seen.wait(10), "on_error was not called"
        pool.shutdown(wait=True, timeout=10)
    assert len(failed) == 1 and str(failed[0]) == "boom in a task"
    assert any(r.levelno == logging.ERROR and "gp-test-err" in r.getMessage()
               and r.exc_info for r in caplog.records)

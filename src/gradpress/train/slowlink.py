"""``gradpress demo --bandwidth RATE``: the demo's cluster behind one rate-limited link.

:func:`check_bandwidth` validates ``RATE`` and the environment (root, ``ip netns``, ``tc``)
before anything is created. :func:`launch_limited` creates a fresh network namespace whose
loopback has a token-bucket filter at ``RATE`` (:func:`.netem.rate_limited_namespace`)
and runs ``gradpress launch`` inside it: the TCP store, every worker and every server talk over
that one loopback, so all of the job's traffic (both workers' pushes and pulls) shares ``RATE``.
The namespace, and anything still running in it, is deleted when the launcher returns, also on
an error, Ctrl-C or SIGTERM (forwarded to the launcher, which stops its processes first).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .netem import (
    NetemError,
    check_environment,
    parse_rate,
    rate_bits_per_second,
    rate_limited_namespace,
)

__all__ = ["check_bandwidth", "launch_limited", "run_forwarding_signals", "link_budget",
           "STOP_GRACE_S"]

#: Seconds the launcher gets to stop its processes after a forwarded signal before it is killed.
STOP_GRACE_S = 30.0
_POLL_S = 0.1


def check_bandwidth(value: object, option: str = "--bandwidth") -> str:
    """The tc rate ``value`` (e.g. ``"100mbit"``), after checking that namespaces can be made.

    Raises:
        ValueError: ``value`` is not a positive tc rate.
        NetemError: not root, or ``ip``/``tc``/``ip netns`` missing (the message says how to run
            the demo instead).
    """
    try:
        rate = parse_rate(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{option} {value!r} is not a link rate; expected a positive number and "
                         f"a tc unit, e.g. 100mbit, 1gbit, 500kbit, 10mbps (bytes/s)") from None
    try:
        check_environment()
    except NetemError as e:
        raise NetemError(
            f"{option} {rate} runs the demo in a rate-limited network namespace, and {e}. Run "
            f"it as root, e.g. `sudo {sys.executable} -m gradpress.cli demo {option} {rate}`, "
            f"or leave out {option} to run over the unlimited loopback") from None
    return rate


def link_budget(report: Mapping[str, Any], rate: str, workers: int) -> dict[str, float] | None:
    """Seconds per step the run's traffic needs on one shared link of ``rate`` (every worker's
    push and pull bytes cross it) against its compute (forward and backward) per step."""
    steps = report.get("steps") or 0
    if not steps:
        return None
    b = report["bytes_per_step"]
    link_bytes = workers * (b["push"] + b["pull"])
    compute = report.get("stages_s", {}).get("compute_s")
    return {"link_bytes_per_step": link_bytes,
            "link_s_per_step": 8 * link_bytes / rate_bits_per_second(rate),
            "compute_s_per_step": None if compute is None else compute / steps,
            "s_per_step": report.get("s_per_step") or 0.0}


def launch_limited(rate: str, command: Sequence[str], workers: int, servers: int,
                   env: Mapping[str, str]) -> int:
    """Run ``gradpress launch --workers W --servers S -- COMMAND`` inside a fresh namespace whose
    loopback is limited to ``rate``; returns the launcher's exit status."""
    argv = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", str(workers),
            "--servers", str(servers), "--", *command]
    with rate_limited_namespace(rate, tag="demo") as ns:
        print(f"gradpress demo: every process runs in network namespace {ns.name}, whose "
              f"loopback is limited to {rate}", flush=True)
        return run_forwarding_signals(ns.cmd(argv), {**os.environ, **env})


def run_forwarding_signals(argv: Sequence[str], env: Mapping[str, str],
                           grace_s: float = STOP_GRACE_S) -> int:
    """Run ``argv``; SIGINT/SIGTERM received meanwhile are passed on to it, and it is killed if
    it has not exited ``grace_s`` seconds after the first. Returns its exit status (128 + N
    when killed by signal N)."""
    proc = subprocess.Popen(list(argv), env=dict(env))
    stop_by: list[float] = []

    def _forward(signum: int, frame: object) -> None:
        if not stop_by:
            stop_by.append(time.monotonic() + grace_s)
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    main = threading.current_thread() is threading.main_thread()  # only it may set handlers
    previous = {s: signal.signal(s, _forward) for s in (signal.SIGINT, signal.SIGTERM)} \
        if main else {}
    try:
        while proc.poll() is None and not (stop_by and time.monotonic() > stop_by[0]):
            time.sleep(_POLL_S)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if proc.poll() is None:
            proc.kill()
            proc.wait(grace_s)
    rc = proc.returncode
    return 128 - rc if rc < 0 else rc

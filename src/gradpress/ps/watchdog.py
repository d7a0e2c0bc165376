"""The failure watchdog of a gradpress process: a failure anywhere is known everywhere.

Failures are detected where they happen: a killed or crashed process closes its connections,
so every peer waiting on it fails at once (``PeerError: ... is gone``); a hung one makes the
waits on it time out (``GRADPRESS_TIMEOUT``); a server that fails records the error in the TCP
store; the launcher records a child that exited non-zero. The watchdog spreads that knowledge to
processes that are not waiting on the failed one (a worker computing, a server between steps).
Every ``watchdog_interval`` seconds, on its own connection to the store, it:

1. reads the failures recorded by other processes of this attempt (``gradpress/<attempt>/errors``)
   and by launchers
   (``launch/failed``);
2. if none is recorded but this worker engine failed (servers report their own failures),
   records that failure, so the others learn of it;
3. on the first failure it sees: a server process prints the cause and exits with status 1
   (it runs no user code); a worker process fails its engines, so the pending and every later
   ``push_pull`` raise an error naming the failure, and the user's program can unwind;
4. a worker process still alive when ``exit_within`` seconds (``GRADPRESS_TIMEOUT``) have
   passed since the failure was recorded is ended by the watchdog (status 1) with a message
   naming the failure: no orphans. (It noticed the failure up to one interval late and checks
   once per interval, so it ends the process ``exit_within - 2 * interval`` after noticing.)

Losing the store is not itself a failure (rank 0 may host it and finish first); the watchdog
then stops watching. See ``docs/reliability.md``.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from .cluster import Cluster
from .errors import PeerError

__all__ = ["Watchdog", "LAUNCH_FAILED_KEY"]

log = logging.getLogger(__name__)

#: Store key (unprefixed) where ``gradpress launch`` records a child that failed.
LAUNCH_FAILED_KEY = "launch/failed"


class Watchdog:
    """Watches the job for failures on behalf of one process (see the module docstring).

    Args:
        cluster: the joined job (its store address and this process's role).
        interval: seconds between polls; 0 disables the watchdog.
        exit_within: seconds after a recorded failure by which a worker process is ended
            (step 4).
        on_failure: called once with the failure (worker processes: fail the engines).
        local_error: returns this process's own engine error, to report (step 2).
        exit_at_once: end the process at once on a failure (server processes).
    """

    def __init__(self, cluster: Cluster, *, interval: float, exit_within: float,
                 on_failure: Callable[[PeerError], None] = lambda e: None,
                 local_error: Callable[[], BaseException | None] = lambda: None,
                 exit_at_once: bool = False) -> None:
        self.cluster = cluster
        self.interval = interval
        self.grace = max(0.0, exit_within - 2 * interval)
        self.on_failure = on_failure
        self.local_error = local_error
        self.exit_at_once = exit_at_once
        self.me = cluster.describe(cluster.rank)
        self.failure: str | None = None
        self._failed_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._raw: dist.Store | None = None  # the watchdog's own connection
        self._prefixed: dist.Store | None = None

    def start(self) -> Watchdog:
        """Open the watchdog's own store connection and start polling (no-op if disabled)."""
        if self.interval <= 0:
            return self
        raw = self.cluster.raw_store
        try:
            client = dist.TCPStore(raw.host, raw.port, None, False,
                                   timeout=datetime.timedelta(seconds=self.cluster.timeout))
        except Exception as e:  # noqa: BLE001 - without a store there is nothing to watch
            log.warning("%s: watchdog disabled: cannot connect to the store: %s", self.me, e)
            return self
        self._raw = client
        self._prefixed = dist.PrefixStore(self.cluster.prefix, client)  # the keys Cluster uses
        self._thread = threading.Thread(target=self._loop, name="gp-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and join the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.interval + self.cluster.timeout)
        self._thread = None

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self.failure is not None:  # step 4 needs no store
                if time.monotonic() - self._failed_at > self.grace:
                    self._exit(f"the job failed and this process did not exit within "
                               f"{self.grace:g} s; ending it. Cause: {self.failure}")
                continue
            try:
                cause = self._find_failure()
            except Exception as e:  # noqa: BLE001 - the store is gone: nothing left to watch
                log.debug("%s: watchdog stopped: %s", self.me, e)
                return
            if cause is not None:
                self._notice(cause)  # step 3

    def _find_failure(self) -> str | None:
        cause = self._recorded_failure()  # step 1
        if cause is None and (err := self.local_error()) is not None:  # step 2
            cause = f"{self.me}: {type(err).__name__}: {err}"
            assert self._prefixed is not None
            self._prefixed.append(  # type: ignore[attr-defined]  # not in torch's stubs
                "errors", cause + "\n")  # as Cluster.report_error does
        return cause

    def _recorded_failure(self) -> str | None:
        for store, key in ((self._prefixed, "errors"), (self._raw, LAUNCH_FAILED_KEY)):
            assert store is not None
            if store.check([key]):
                text = store.get(key).decode(errors="replace").strip()
                return text.splitlines()[0] if text else key
        return None

    def _notice(self, cause: str) -> None:
        self.failure = cause
        self._failed_at = time.monotonic()
        if self.exit_at_once:
            self._exit(f"stopping: the job failed: {cause}")
        log.error("%s: the job failed: %s", self.me, cause)
        self.on_failure(PeerError(f"the job failed: {cause}", stage="watchdog"))

    def _exit(self, message: str) -> None:
        print(f"gradpress: {self.me}: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # threads may block in gloo on the failed peer; do not wait for them

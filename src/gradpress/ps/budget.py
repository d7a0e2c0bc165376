"""The in-flight byte budget of a worker (``GRADPRESS_INFLIGHT_BYTES``)."""

from __future__ import annotations

import threading

from .errors import CommTimeoutError

__all__ = ["ByteBudget"]


class ByteBudget:
    """Bytes in flight; ``acquire`` waits for room (a lone oversize chunk always fits).

    Waits end with the room, with the error given to :meth:`abort`, or after ``timeout``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    def acquire(self, n: int, timeout: float, what: str) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: self.error is not None or self.used == 0
                                     or self.used + n <= self.limit, timeout)
            if self.error is not None:
                raise self.error
            if not ok:
                raise CommTimeoutError(f"timed out after {timeout:g} s waiting for in-flight "
                                       f"budget for {what} ({self.used} of {self.limit} bytes "
                                       f"in flight)", key=what, stage="budget")
            self.used += n

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def abort(self, e: BaseException) -> None:
        with self._cond:
            self.error = e
            self._cond.notify_all()

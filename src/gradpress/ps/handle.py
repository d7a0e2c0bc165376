"""The handle of an asynchronous ``push_pull``."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from .errors import CommTimeoutError

__all__ = ["Handle"]


class Handle:
    """Completion of one ``push_pull_async``; :meth:`wait` returns the averaged tensor.

    The result has the input's shape, dtype and device. Do not modify the input tensor before
    the handle completes: its chunks are read while they are compressed.
    """

    def __init__(self, name: str, out: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                 device: torch.device, nchunks: int,
                 on_done: Callable[[Handle], None] | None = None) -> None:
        self.name = name
        self._out = out
        self._shape = shape
        self._dtype = dtype
        self._device = device
        self._pending = nchunks
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._on_done = on_done
        self._result: torch.Tensor | None = None
        self._finished = False

    def done(self) -> bool:
        """Whether the result (or an error) is ready; never blocks."""
        return self._event.is_set()

    @property
    def completion(self) -> threading.Event:
        """Set once the result (or an error) is ready."""
        return self._event

    @property
    def error(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until done and return the result; re-raise the pipeline's error.

        ``timeout`` (seconds) bounds this wait; None waits for the pipeline, whose every stage
        is bounded by ``GRADPRESS_TIMEOUT``.
        """
        if not self._event.wait(timeout):
            raise CommTimeoutError(f"push_pull of {self.name!r} did not finish within "
                                   f"{timeout:g} s", key=self.name, stage="wait")
        if self._error is not None:
            raise self._error
        if self._result is None:
            res = self._out.view(self._shape)
            if res.dtype != self._dtype or res.device != self._device:
                res = res.to(device=self._device, dtype=self._dtype)
            self._result = res
        return self._result

    def wait_quietly(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds, ignoring the outcome (used before reuse/shutdown)."""
        self._event.wait(timeout)

    def _chunk_done(self) -> None:
        with self._lock:
            self._pending -= 1
            last = self._pending <= 0 and not self._finished
            self._finished |= last
        if last:
            self._finish()

    def _set_error(self, e: BaseException) -> None:
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._error = e
        self._finish()

    def _finish(self) -> None:
        if self._on_done is not None:
            self._on_done(self)
        self._event.set()

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "pending"
        return f"Handle({self.name!r}, {state})"

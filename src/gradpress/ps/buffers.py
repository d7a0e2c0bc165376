"""Payload buffers lent per chunk in flight, so a worker holds wire buffers only for the bytes
it has in flight (bounded by ``inflight_bytes``), not one pair per key of the whole model.

A worker takes a send and a receive buffer for a chunk when the chunk enters the pipeline and
gives both back when its reply is decoded. Given-back buffers are kept, per size, for the next
chunk of that size (a step of the same model asks for the same sizes again, and fresh large
buffers cost page faults), up to ``keep_bytes`` in all; beyond that they are freed.
"""

from __future__ import annotations

import threading

import torch

from .transport import payload_buffer

__all__ = ["BufferPool"]


class BufferPool:
    """Framed payload buffers (:func:`~gradpress.ps.transport.payload_buffer`) by size.

    Args:
        keep_bytes: at most this many bytes of idle buffers are kept for reuse.
    """

    def __init__(self, keep_bytes: int) -> None:
        if isinstance(keep_bytes, bool) or not isinstance(keep_bytes, int) or keep_bytes < 0:
            raise ValueError(f"keep_bytes must be an int >= 0, got {keep_bytes!r}")
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    @property
    def kept_bytes(self) -> int:
        """Bytes of idle buffers held for reuse."""
        return self._kept

    def take(self, nbytes: int) -> torch.Tensor:
        """A payload buffer of ``nbytes`` (contents undefined)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._kept -= nbytes
                return free.pop()
        return payload_buffer(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        """Return ``buf`` (from :meth:`take`); no operation may still use it."""
        n = buf.numel()
        with self._lock:
            if self._kept + n <= self.keep_bytes:
                self._free.setdefault(n, []).append(buf)
                self._kept += n

    def clear(self) -> None:
        """Free every idle buffer."""
        with self._lock:
            self._free.clear()
            self._kept = 0

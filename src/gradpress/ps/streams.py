"""The worker engine's CUDA streams: which stream a chunk's device work runs on.

Host mode (``compress_on="host"``): each pool thread has its own stream per device for the
way out, and each device one stream for the way back, shared by the receiver and the pool.

1. Way out: the thread's stream waits on the event recorded at submit on the caller's stream,
   copies the chunk into pinned memory and records an event, on which the thread then
   synchronises before compressing. Only that thread's chunk is ever queued there: a copy
   never queues behind another thread's wait on a later gradient (one shared stream would
   make chunk i wait for whatever gradient another thread's chunk waits for).
2. Way back: the decoded reply goes up from pinned memory on the device's back stream, after
   that stream waited on the submit event too (``out`` may be fresh from the caller's stream,
   or be the input itself). That event is complete by then (step 1's thread synchronised after
   it), so the wait costs nothing, and the way back never queues behind a way out.

Neither direction allocates device memory (the staging buffers are pinned host memory, from
torch's caching host allocator, which records its own events), so the caching allocator's
only cross-stream cases are the chunk's input and output, which the chunk functions
``record_stream`` on the stream that used them (torch ``Tensor.record_stream``: a block is
reused only on the stream it was allocated on unless recorded).

Device mode (``compress_on="device"``): one stream per device for both directions, as before.
The codecs keep state on the device (error-feedback residuals, scratch) that they allocate,
replace and update from one step to the next of a key; spread over streams, every such tensor
would need ``record_stream`` and an event between a key's steps inside the codecs, which a
GPU run has yet to check. Not measured on a GPU yet (``benchmarks/gpu_check.py``'s overlap
section does when one is lent).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CopyStreams"]


class CopyStreams:
    """The streams of one engine, made on first use and kept (``new(device)`` makes one;
    default ``torch.cuda.Stream``).

    Args:
        device_mode: the engine's ``compress_on == "device"``: one stream per device.
        new: the stream factory (tests pass stand-ins).
    """

    def __init__(self, device_mode: bool,
                 new: Callable[[torch.device], Any] | None = None) -> None:
        self.device_mode = device_mode
        self._new = new or torch.cuda.Stream
        self._lock = threading.Lock()
        self._streams: dict[tuple[int | None, object], Any] = {}

    def way_out(self, device: torch.device) -> Any:
        """The calling thread's stream of ``device`` for copying a chunk down (step 1); in
        device mode the device's one stream."""
        return self._get(device, "state" if self.device_mode else threading.get_ident())

    def way_back(self, device: torch.device) -> Any:
        """The stream of ``device`` for a chunk's result (step 2); in device mode the
        device's one stream."""
        return self._get(device, "state" if self.device_mode else "back")

    def all(self) -> list[Any]:
        """Every stream made so far."""
        with self._lock:
            return list(self._streams.values())

    def synchronize(self) -> None:
        """Wait for the work queued on every stream (codec state written there)."""
        for s in self.all():
            s.synchronize()

    def _get(self, device: torch.device, lane: object) -> Any:
        with self._lock:
            stream = self._streams.get((device.index, lane))
            if stream is None:
                stream = self._streams[(device.index, lane)] = self._new(device)
            return stream

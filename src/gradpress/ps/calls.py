"""A ``push_pull`` call as the worker pipeline (:mod:`gradpress.ps.worker`) sees it: its
arguments checked (codec spec and error feedback, the input and ``out=`` tensors), the host
buffers and CUDA streams that stage GPU tensors, what the worker keeps per tensor (``Plan``),
per key (``ChunkState``) and per chunk in flight (``ChunkJob``), and the :class:`Handle` the
caller waits on.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compress.base import Codec
from ..compress.registry import pick_ef
from ..compress.spec import CodecSpec, EFSpec, parse_ef, parse_spec
from .config import PSConfig
from .errors import CommTimeoutError
from .protocol import KeyDescriptor, decode_reply
from .transport import Transfer

__all__ = ["resolve_codec", "check_out", "flat_fp32", "host_buffer", "on_stream", "PinnedKeeper",
           "compress_chunk", "decode_chunk", "Handle", "Plan", "ChunkState", "ChunkJob"]


def resolve_codec(compression: str | Mapping[str, Any] | CodecSpec | None,
                  ef: str | EFSpec | None, cfg: PSConfig) -> tuple[CodecSpec, dict[str, Any]]:
    """Split a spec into the codec spec and wrapper options; call arguments beat config defaults.

    Returns ``(codec spec without wrappers, {"ef": ..., "momentum": ..., "mu": ...})``, with
    ``"ef"`` the canonical text of the error feedback (``str(EFSpec)``; None for none): what
    the key descriptors and checkpoints carry.
    """
    spec = parse_spec(cfg.compression if compression is None else compression)
    wrappers = dict(spec.wrappers)
    chosen = pick_ef(ef, wrappers.pop("ef", None), compression) or parse_ef(cfg.ef)
    wrappers["ef"] = str(chosen) if chosen.enabled else None
    if str(wrappers.get("momentum", "")).strip().lower() in ("", "none"):
        wrappers.pop("momentum", None)
    return CodecSpec(spec.name, dict(spec.params)), wrappers


def check_out(out: torch.Tensor, flat: torch.Tensor, name: str) -> torch.Tensor:
    """Validate ``out=`` of a push_pull whose input is ``flat``; returns its flat view.

    ``out`` must be a contiguous float32 tensor on ``flat``'s device with the input's number of
    elements; it may be the input itself (in place) but must not overlap it otherwise.
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"push_pull({name!r}): out must be a torch.Tensor, got "
                        f"{type(out).__name__}")
    if out.dtype != torch.float32 or out.device != flat.device or not out.is_contiguous():
        raise TypeError(f"push_pull({name!r}): out must be a contiguous float32 tensor on "
                        f"{flat.device} (the tensor's device), got {out.dtype} on {out.device}"
                        f"{'' if out.is_contiguous() else ' (not contiguous)'}")
    if out.numel() != flat.numel():
        raise ValueError(f"push_pull({name!r}): out has {out.numel()} elements, the tensor has "
                         f"{flat.numel()}")
    o = out.reshape(-1)
    if o.numel() and o.data_ptr() != flat.data_ptr():
        lo, hi = flat.data_ptr(), flat.data_ptr() + 4 * flat.numel()
        if o.data_ptr() < hi and lo < o.data_ptr() + 4 * o.numel():
            raise ValueError(f"push_pull({name!r}): out overlaps the input tensor without being "
                             f"the same memory; pass the tensor itself (in place) or a separate "
                             f"buffer")
    return o


def flat_fp32(tensor: torch.Tensor, name: str, *, keep_device: bool = False) -> torch.Tensor:
    """``tensor`` as a flat, contiguous float32 tensor on the CPU (``keep_device``: on its own
    device); no copy when it already is one."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"push_pull({name!r}): expected a torch.Tensor, got "
                        f"{type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"push_pull({name!r}): expected a floating-point tensor, got "
                        f"{tensor.dtype}")
    device = tensor.device if keep_device else torch.device("cpu")
    return tensor.detach().reshape(-1).to(device=device, dtype=torch.float32).contiguous()


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised float32 CPU buffer of ``like``'s size; pinned when ``like`` is on CUDA
    (torch's caching host allocator reuses pinned blocks, so this is cheap per chunk)."""
    return torch.empty(like.numel(), dtype=torch.float32, device="cpu", pin_memory=like.is_cuda)


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Run a pool thread's device work on CUDA ``stream`` (a no-op for None).

    The thread's current device is first set to the stream's and left there (pool threads are
    the engine's own). Entering ``torch.cuda.stream(s)`` alone from a thread on another device
    (a fresh thread is on device 0) records that device's current stream and leaving sets it
    back with ``torch.cuda.set_stream`` (torch/cuda/__init__.py: ``StreamContext.__exit__``),
    which makes device 0 current again (``torch._C._cuda_setStream`` selects the stream's
    device): on a rank using GPU 1, a context on GPU 0. With the device set first,
    ``StreamContext`` only swaps the current stream of one device. Not yet run on a GPU.
    """
    if stream is None:
        yield
        return
    index = stream.device.index
    if torch.cuda.current_device() != index:
        torch.cuda.set_device(index)
    with torch.cuda.stream(stream):
        yield


class PinnedKeeper:
    """Keeps pinned host buffers alive until the CUDA event recorded after their last
    asynchronous copy completed (polled with ``Event.query``, which never blocks).

    ATen's copy kernel also records an event with the caching host allocator for a pinned
    block used in a ``non_blocking`` copy (torch/include/ATen/cuda/CachingHostAllocator.h);
    holding the buffer here does not depend on that."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: deque[tuple[Any, torch.Tensor]] = deque()

    def keep(self, event: Any, buf: torch.Tensor) -> None:
        """Hold ``buf`` until ``event`` completed; drop the buffers already done."""
        with self._lock:
            self._held.append((event, buf))
            while self._held and self._held[0][0].query():
                self._held.popleft()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def drain(self, wait: bool = True) -> None:
        """Drop every buffer, after waiting for its copy (``wait=False``: a failed engine, whose
        device may not answer)."""
        with self._lock:
            held, self._held = list(self._held), deque()
        for event, _ in held if wait else ():
            event.synchronize()


class Handle:
    """Completion of one ``push_pull_async``; :meth:`wait` returns the averaged tensor.

    The result has the input's shape, dtype and device. Do not modify the input tensor before
    the handle completes: its chunks are read while they are compressed.

    On CUDA the handle completes when every chunk's result is queued on an engine
    stream; :meth:`wait` then makes the caller's current stream wait for the chunks' events
    (``Stream.wait_event``, torch/cuda/streams.py) rather than blocking the host, so the result
    is ready for work queued on that stream. Each ``wait`` does this for its own current
    stream: a second ``wait`` on another stream also waits for the dtype conversion the first
    one queued, and the result is ``record_stream``-ed for every waiting stream.
    ``dest`` (hierarchical aggregation, a device ``out=``): the result staged in ``out`` on
    the host is copied into ``dest`` on the caller's current stream at :meth:`wait`.
    """

    def __init__(self, name: str, out: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                 device: torch.device, nchunks: int,
                 on_done: Callable[[Handle], None] | None = None,
                 dest: torch.Tensor | None = None) -> None:
        self.name = name
        self._out = out
        self._dest = dest
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
        self._cuda_events: list[Any] = []  # one per chunk, recorded on its way back
        self._made: Any = None  # CUDA: event recorded after the first wait made the result

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
        """Wait until done and return the result; re-raise the pipeline's error.

        ``timeout`` (seconds) bounds this wait; None waits for the pipeline, whose every stage
        is bounded by ``GRADPRESS_TIMEOUT``.
        """
        if not self._event.wait(timeout):
            raise CommTimeoutError(f"push_pull of {self.name!r} did not finish within "
                                   f"{timeout:g} s", key=self.name, stage="wait")
        if self._error is not None:
            raise self._error
        if not self._cuda_events and self._device.type != "cuda":
            if self._result is None:
                self._result = self._materialise()
            return self._result
        # CUDA: this waiter's stream waits for the chunks and, when another stream made the
        # result (a dtype conversion, a copy into ``dest``), for that; every stream that uses
        # the result or ``out`` is recorded on them, so neither block is reused before it ran
        stream = torch.cuda.current_stream(self._device)
        for ev in self._cuda_events:
            stream.wait_event(ev)
        with self._lock:
            if self._result is None:
                self._result = self._materialise()
                self._made = stream.record_event()
            elif self._made is not None:
                stream.wait_event(self._made)
            for t in {id(x): x for x in (self._out, self._result)}.values():
                if t.is_cuda:
                    t.record_stream(stream)
        return self._result

    def _materialise(self) -> torch.Tensor:
        """The result, on the current stream; from a pinned host ``out`` (hierarchical
        aggregation) without blocking: its caching allocator keeps the block until the copy
        ran (compress/transfer.py)."""
        quiet = self._out.device.type == "cpu" and self._out.is_pinned()
        if self._dest is not None:
            self._dest.reshape(-1).copy_(self._out, non_blocking=quiet)
            return self._dest.view(self._shape)
        res = self._out.view(self._shape)
        if res.dtype != self._dtype or res.device != self._device:
            res = res.to(device=self._device, dtype=self._dtype, non_blocking=quiet)
        return res

    def wait_quietly(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds, ignoring the outcome (used before reuse/shutdown)."""
        self._event.wait(timeout)

    def _chunk_done(self, cuda_event: Any = None) -> None:
        """A chunk landed (``cuda_event``: recorded after its device copies, if any)."""
        with self._lock:
            if cuda_event is not None:
                self._cuda_events.append(cuda_event)
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


@dataclass
class ChunkState:
    """Per-key state on the worker: descriptor, codecs, payload size and step counter."""

    key: int
    desc: KeyDescriptor
    server_rank: int
    server_name: str
    enc: Codec
    dec: Codec
    nbytes: int  # payload bytes each way (the wire buffers are lent per step by the pool)
    step: int = 0

    @property
    def label(self) -> str:
        return f"key {self.key} ({self.desc.label})"


@dataclass
class Plan:
    """How one named tensor travels: its signature, generation and chunk states."""

    name: str
    signature: tuple
    generation: int
    numel: int
    chunks: list[ChunkState]
    offsets: list[int]
    last: threading.Event | None = None  # completion of the key's previous push_pull
    device: torch.device | None = None  # compress_on="device": where the codec state lives


@dataclass
class ChunkJob:
    """One chunk of one ``push_pull`` call moving through the pipeline."""

    chunk: ChunkState
    x: torch.Tensor
    out: torch.Tensor
    handle: Handle
    lr: float | None
    stream: Any = None  # CUDA: the engine stream of the way out (ps/streams.py; else None)
    ready: Any = None  # CUDA: event recorded on the caller's current stream at submit
    back: Any = None  # CUDA: the engine stream of the way back, when not ``stream``
    step: int = 0
    send: torch.Tensor | None = None  # lent by the buffer pool from dispatch to finish
    recv: torch.Tensor | None = None
    ops: list[Transfer] = field(default_factory=list)
    recv_op: Transfer | None = None
    t_sent: float = 0.0


def blocking_event() -> Any:
    """A CUDA event whose ``synchronize`` puts the waiting thread to sleep
    (``cudaEventBlockingSync``) instead of spinning: the pool thread waiting for its chunk's copy
    leaves the core to the compression of other chunks (torch/cuda/streams.py: ``Event``)."""
    return torch.cuda.Event(blocking=True)


# -- a chunk's two device crossings (ps/worker.py's module docstring: the stream model) ---------
def compress_chunk(job: ChunkJob, device_mode: bool) -> None:
    """Step 2: compress ``job.x`` into ``job.send`` (on the host, or where it lives when
    ``device_mode``); on CUDA after the event recorded at submit, on ``job.stream``."""
    chunk, x, send = job.chunk, job.x, job.send
    kw: dict[str, Any] = {"key": chunk.key, "step": job.step, "lr": job.lr}
    if job.stream is None:  # CPU (or a device without streams: a blocking copy)
        src = x if x.device.type == "cpu" or device_mode else x.to("cpu", copy=True)
        chunk.enc.compress(src, out=send, **kw)
        return
    with on_stream(job.stream):
        job.stream.wait_event(job.ready)  # the kernels that produced x, queued before submit
        if device_mode:  # the codec writes the header on the host and copies the payload
            chunk.enc.compress(x, out=send, **kw)  # into send: its one synchronisation
            x.record_stream(job.stream)
            return
        host = host_buffer(x)
        host.copy_(x, non_blocking=True)
        x.record_stream(job.stream)  # the caller may free x before the copy ran
        copied = job.stream.record_event(blocking_event())
    copied.synchronize()  # the one host synchronisation of this chunk on the way out
    chunk.enc.compress(host, out=send, **kw)


def decode_chunk(job: ChunkJob, device_mode: bool, pinned: PinnedKeeper) -> Any:
    """Step 5: validate the reply in ``job.recv`` and decode it into ``job.out``; on CUDA
    return the event recorded on the way back's stream (``job.back``, else ``job.stream``)
    once ``job.out`` is written (the host does not wait for it), else None."""
    chunk, out, payload = job.chunk, job.out, job.recv
    kw = {"key": chunk.key, "step": job.step, "sender": chunk.server_name, "label": chunk.label}
    stream = job.stream if job.back is None else job.back
    if stream is None:
        on_host = out.device.type == "cpu" or device_mode
        dst = out if on_host else torch.empty_like(out, device="cpu")
        decode_reply(chunk.dec, payload, dst, **kw)  # type: ignore[arg-type]
        if dst is not out:
            out.copy_(dst)
        return None
    host = None if device_mode else host_buffer(out)
    if host is not None:
        decode_reply(chunk.dec, payload, host, **kw)  # type: ignore[arg-type]
    with on_stream(stream):
        if stream is not job.stream:  # a stream of its own: after what preceded submit (out
            stream.wait_event(job.ready)  # may be fresh from the caller's stream, or x itself)
        try:
            if host is None:  # the codec copies the payload to the device and decodes there
                decode_reply(chunk.dec, payload, out, **kw)  # type: ignore[arg-type]
            else:
                out.copy_(host, non_blocking=True)  # from pinned memory: asynchronous
        finally:
            # also when decode_reply raises: its finiteness check of a host payload comes
            # after the decode kernels were queued, which still write out on this stream; a
            # caller that drops the failed handle must not get out's block back before then
            out.record_stream(stream)
        done = stream.record_event()
    if host is not None:
        pinned.keep(done, host)  # the copy reads host until done
    return done

"""The worker pipeline of ``push_pull`` (BytePS-Compress, Zhong et al. 2021).

For each tensor: look up (or create) its plan (:mod:`gradpress.ps.keyplan`: chunks, keys,
servers, codecs), and per chunk:

1. dispatch, in submission order: a chunk takes room in the in-flight byte budget
   (``inflight_bytes``) and goes to the thread pool; ``submit`` does this itself while there
   is room and nothing queued, otherwise a dispatcher thread waits for room (the caller never
   blocks on the budget);
2. compress on the thread pool with the chunk's worker codec (error feedback / momentum state
   lives here, per key), into the chunk's send buffer;
3. pre-post the receive of the server's reply, announce the push on the control tag, and send
   the payload on the key's tag (a small payload travels inline, in one message with its
   announcement: :mod:`gradpress.ps.protocol`);
4. a receiver thread waits for replies in push order;
5. decompress each reply into the chunk's slice of the output tensor (reassembly): the
   receiver does it itself when that is quicker than handing it back to the pool
   (:class:`~gradpress.ps.handoff.HandOff`: small chunks), else the pool does; the server
   already averaged, so when the last chunk lands the handle completes.

Chunks of different tensors overlap: while chunk i is on the wire, chunk i+1 is compressed.
A new ``push_pull`` of a name waits for the previous one of the same name (each key has one
step in flight). Any failure inside the pipeline is fatal to the engine: every pending handle
raises it, and so do later calls.

Where compression runs: ``PSConfig.compress_on`` (env ``GRADPRESS_COMPRESS_ON``). Chunks stay
where the tensor lives until the pool picks them up; the result has the tensor's device (so must
``out=``). Servers always work on the host.

* ``"host"`` (default): numba kernels on CPU. A chunk of a GPU tensor is copied to a pinned host
  buffer and compressed there; the reply is decoded on the host and copied into the chunk's
  slice of the device result.
* ``"device"``: worker codecs use the torch-op kernels (``backend="torch"``: same payload bytes,
  topk ties aside), run where the tensor lives, error-feedback residual included; only the
  payload crosses to the host. On CPU tensors this runs the torch kernels on CPU, which is how
  the tests cover it.

CUDA streams: ``submit`` records an event on the caller's current stream; a chunk's device work
(copies, device-mode kernels) runs on an engine stream (:mod:`gradpress.ps.streams`: host mode,
one per pool thread on the way out and one per device on the way back; device mode, one per
device), in a thread set to that device (:func:`~gradpress.ps.calls.on_stream`), after waiting
on that event. Host mode: the chunk is copied non-blocking into pinned memory and the pool
thread synchronises on one event per chunk before compressing; the decoded reply goes up
non-blocking from pinned memory (kept alive until its event completed). Device mode:
``compress(x, out=send)`` copies the payload down with the chunk's one synchronisation,
``decode_reply`` decodes the reply on the device without one (the codecs' side). Tensors used
on an engine stream get ``record_stream``. A handle completes when every chunk's result is
queued; ``wait`` makes the caller's current stream wait on the chunks' events. Reasoned from
PyTorch's stream semantics; the CUDA tests in ``tests/test_push_pull_device.py`` run it where a
GPU is present (none yet).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..compress.spec import CodecSpec, EFSpec
from .calls import (
    ChunkJob,
    Handle,
    PinnedKeeper,
    Plan,
    check_out,
    compress_chunk,
    decode_chunk,
    flat_fp32,
)
from .cluster import Cluster
from .codec_state import WorkerCheckpoint
from .config import PSConfig
from .errors import GradpressError
from .handoff import HandOff, TaskPool
from .keyplan import Planner
from .protocol import OP_PUSH, OP_PUSH_INLINE, OP_STOP, Control, pack_control
from .streams import CopyStreams
from .trace import Tracer
from .transport import CTRL_TAG, BufferPool, ByteBudget, Transport, fits_inline, head_room

__all__ = ["WorkerEngine"]

log = logging.getLogger(__name__)


class WorkerEngine:
    """The push/pull pipeline of one worker process (its codec state: ``checkpoint``, a
    :class:`~gradpress.ps.codec_state.WorkerCheckpoint`).

    Args:
        cluster: the joined job.
        cfg: runtime options.
        transport: point-to-point transport of this process.
        tracer: records the stages of every chunk.
    """

    def __init__(self, cluster: Cluster, cfg: PSConfig, transport: Transport,
                 tracer: Tracer | None = None) -> None:
        self.cluster = cluster
        self.cfg = cfg
        self.transport = transport
        self.tracer = tracer or Tracer(None, cluster.rank, f"worker {cluster.rank}")
        self._budget = ByteBudget(cfg.inflight_bytes)
        self._buffers = BufferPool(2 * cfg.inflight_bytes)  # send + receive of what is in flight
        self._lock = threading.Lock()
        self._live: set[Handle] = set()
        self._error: BaseException | None = None
        self._closed = False
        self._stats: dict[str, float] = dict.fromkeys(
            ("bytes_pushed", "bytes_pulled", "dense_fp32_bytes", "steps", "chunks",
             "drift_recoveries"), 0)
        self._stats.update(dict.fromkeys(("compress_s", "send_s", "wait_s", "decompress_s"), 0.0))
        self._streams = CopyStreams(cfg.compress_on == "device")  # CUDA: the engine's streams
        self._pinned = PinnedKeeper()  # pinned result buffers until their copies completed
        self._pool = TaskPool(cfg.compress_threads, "gp-compress", on_error=self.fail)
        self._decode = HandOff()  # decode on the receiver, or on the pool
        self.checkpoint = WorkerCheckpoint(self)
        self.planner = Planner(cluster, cfg, on_new=self.checkpoint.restore_pending)
        self._queue_lock = threading.Lock()
        self._queued = 0  # chunks queued for the dispatcher
        self._dispatcher = TaskPool(1, "gp-dispatch", on_error=self.fail)  # step 1, budget full
        self._receiver = TaskPool(1, "gp-receive", on_error=self.fail)  # step 4, push order

    # -- public ---------------------------------------------------------------------------------
    def submit(self, tensor: torch.Tensor, name: str, *, average: bool = True,
               compression: str | Mapping[str, Any] | CodecSpec | None = None,
               ef: str | EFSpec | None = None, lr: float | None = None,
               min_compress_bytes: int | None = None, out: torch.Tensor | None = None) -> Handle:
        """Start a push_pull of ``tensor`` under ``name``; returns a :class:`Handle`.

        With ``out`` (see :func:`check_out`) the result is written there, which may be
        ``tensor`` itself: chunk i's result lands only after chunk i was compressed.
        """
        self._check_usable()
        flat = flat_fp32(tensor, name, keep_device=True)  # chunks are moved by the pool
        dst = None if out is None else check_out(out, flat, name)
        plan = self.planner.plan(name, flat.numel(), average, compression, ef, lr,
                                 min_compress_bytes)
        self.planner.check_device(plan, flat.device)
        if plan.last is not None and not plan.last.is_set():
            plan.last.wait(self.cfg.timeout)  # one step per key in flight
        like = tensor if out is None else out  # the result's shape, dtype and device
        out = dst if dst is not None else torch.empty(flat.numel(), dtype=torch.float32,
                                                      device=flat.device)
        back = ready = None
        if flat.is_cuda:  # the chunks' device work waits for what is queued now (ps/streams.py)
            ready, back = torch.cuda.Event(), self._streams.way_back(flat.device)
            ready.record(torch.cuda.current_stream(flat.device))
        handle = Handle(name, out, like.shape, like.dtype, like.device, len(plan.chunks),
                        on_done=self._on_done)
        plan.last = handle.completion  # not the handle: its result is the caller's to keep
        with self._lock:
            self._live.add(handle)
            self._stats["dense_fp32_bytes"] += 4 * flat.numel()
        lr = None if lr is None else float(lr)
        for chunk, off in zip(plan.chunks, plan.offsets):
            n = chunk.desc.numel
            self._enqueue(ChunkJob(chunk, flat[off:off + n], out[off:off + n], handle, lr,
                                   None, ready, back=back))  # stream: the pool thread's
        if not plan.chunks:
            handle._chunk_done()
        return handle

    def sync_device(self) -> None:
        """Wait for the device work queued on the engine's streams (codec state written there)."""
        self._streams.synchronize()

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stats)

    @property
    def error(self) -> BaseException | None:
        return self._error

    def fail(self, e: BaseException) -> None:
        """Put the engine in the failed state: every pending and later call raises ``e``."""
        with self._lock:
            if self._error is not None:
                return
            self._error = e
            live = list(self._live)
        log.error("gradpress worker %d failed: %s", self.cluster.rank, e)
        self._budget.abort(e)
        for h in live:
            h._set_error(e)

    def close(self, servers: list[int]) -> None:
        """Finish in-flight work, stop the threads and tell ``servers`` (world ranks) to stop."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            live = list(self._live)
        for h in live:
            h.wait_quietly(self.cfg.timeout)
        # a failed engine's threads may wait on a peer that will never answer (the local
        # server blocked on a dead worker): they are daemons, bounded by the timeout, and
        # the process need not wait for them to exit (a restart waits on that exit)
        limit = self.cfg.timeout if self._error is None else min(self.cfg.timeout, 1.0)
        self._dispatcher.shutdown(timeout=limit)
        self._receiver.shutdown(timeout=limit)
        self._pool.shutdown(wait=self._error is None, timeout=limit)
        self._buffers.clear()
        self._pinned.drain(wait=self._error is None)
        if self._error is not None:
            return
        stop = pack_control(Control(OP_STOP))
        ops = [self.transport.isend(stop, r, CTRL_TAG, "stop message", "push") for r in servers]
        for op in ops:
            op.wait(self.cfg.timeout, "shutdown")

    # -- pipeline -------------------------------------------------------------------------------
    def _guard(self, fn: Callable[..., None], job: ChunkJob, *args: Any) -> None:
        if self._error is not None:
            job.handle._set_error(self._error)
            return
        try:
            fn(job, *args)
        except BaseException as e:  # fatal: fail every pending handle
            self.fail(e)
            if not isinstance(e, Exception):  # Ctrl-C/SIGTERM on the caller's thread (step 1):
                raise  # the caller stops as the signal asked, not at its next push_pull

    def _enqueue(self, job: ChunkJob) -> None:  # step 1, on the caller's thread
        with self._queue_lock:  # in order: directly only when nothing waits in the queue
            direct = self._queued == 0 and self._budget.try_acquire(job.chunk.nbytes)
            if not direct:
                self._queued += 1
        if direct:
            self._guard(self._start, job)
        else:
            self._dispatcher.submit(self._dispatch, job)

    def _dispatch(self, job: ChunkJob) -> None:  # step 1, on the dispatcher thread
        try:
            self._guard(self._admit, job)
        finally:  # after the start: later chunks go directly only once this one went
            with self._queue_lock:
                self._queued -= 1

    def _admit(self, job: ChunkJob) -> None:
        self._budget.acquire(job.chunk.nbytes, self.cfg.timeout, job.chunk.label)
        self._start(job)

    def _start(self, job: ChunkJob) -> None:
        n = job.chunk.nbytes
        job.send, job.recv = self._buffers.take(n), self._buffers.take(n)  # framed (transport)
        job.step = job.chunk.step
        job.chunk.step += 1
        self._pool.submit(self._guard, self._push, job)

    def _push(self, job: ChunkJob) -> None:  # steps 2-3
        chunk, send, t0 = job.chunk, job.send, time.perf_counter()
        assert send is not None and job.recv is not None  # taken by _dispatch
        if job.ready is not None:  # CUDA: this thread's stream (ps/streams.py, step 1)
            job.stream = self._streams.way_out(job.x.device)
        compress_chunk(job, self.cfg.compress_on == "device")
        t1 = time.perf_counter()
        dst, label = chunk.server_rank, chunk.label
        job.recv_op = self.transport.irecv(job.recv, dst, chunk.key, label, "pull")
        inline = fits_inline(chunk.nbytes)  # one message: control, payload, trailer
        ctrl = pack_control(Control(OP_PUSH_INLINE if inline else OP_PUSH, chunk.key, job.step,
                                    job.lr, chunk.nbytes), head_room(send))
        job.ops = [self.transport.isend_inline(send, dst, label)] if inline else [
            self.transport.isend(ctrl, dst, CTRL_TAG, label, "push"),
            self.transport.isend(send, dst, chunk.key, label, "push")]
        job.t_sent = t2 = time.perf_counter()
        self._receiver.submit(self._received, job)
        self.account(compress_s=t1 - t0, send_s=t2 - t1, bytes_pushed=chunk.nbytes, chunks=1)
        self.tracer.add("compress", t0, t1, key=chunk.key, step=job.step, name=chunk.desc.name,
                        chunk=chunk.desc.chunk)

    def _received(self, job: ChunkJob) -> None:
        self._guard(self._receive, job)

    def _receive(self, job: ChunkJob) -> None:  # step 4
        t0 = time.perf_counter()
        job.recv_op.wait(self.cfg.timeout, "pull")  # type: ignore[union-attr]
        t1 = time.perf_counter()
        self.account(wait_s=t1 - t0)
        self.tracer.add("push+pull", job.t_sent, t1, key=job.chunk.key, step=job.step)
        if self._decode.here(4 * job.chunk.desc.numel, job.chunk.desc.spec):
            self._finish(job)
        else:
            self._pool.submit(self._guard, self._finish, job, t1)

    def _finish(self, job: ChunkJob, handed_at: float | None = None) -> None:  # step 5
        chunk = job.chunk
        if handed_at is not None:
            self._decode.started(handed_at)
        for op in job.ops:  # complete already: the server replied after receiving them
            op.wait(self.cfg.timeout, "push")
        t0 = time.perf_counter()
        done = decode_chunk(job, self.cfg.compress_on == "device", self._pinned)
        self._decode.ran(4 * chunk.desc.numel, time.perf_counter() - t0, chunk.desc.spec)
        self._buffers.give(job.send)  # type: ignore[arg-type]
        self._buffers.give(job.recv)  # type: ignore[arg-type]
        job.send = job.recv = None
        self._budget.release(chunk.nbytes)
        t1 = time.perf_counter()
        self.account(decompress_s=t1 - t0, bytes_pulled=chunk.nbytes)
        self.tracer.add("decompress", t0, t1, key=chunk.key, step=job.step)
        job.handle._chunk_done(done)

    def account(self, **deltas: float) -> None:
        """Add to the counters of :meth:`stats` (new names start at 0)."""
        with self._lock:
            for k, v in deltas.items():
                self._stats[k] = self._stats.get(k, 0) + v

    def _on_done(self, handle: Handle) -> None:
        with self._lock:
            self._live.discard(handle)
            if handle.error is None:
                self._stats["steps"] += 1

    def plans(self, names: set[str] | None = None) -> dict[str, Plan]:
        """The plans of the tensors pushed so far (``names``: only those), by name."""
        return self.planner.plans(names)

    def check_call(self, name: str, compression: Any, ef: str | EFSpec | None,
                   lr: float | None = None) -> None:
        """Validate a call's name and codec options (ValueError/TypeError), before any I/O."""
        self.planner.check_call(name, compression, ef, lr)

    def check_idle(self, what: str) -> None:
        """Raise naming the tensors in flight unless no push_pull is (``what`` names the
        caller, e.g. a checkpoint operation)."""
        self._check_usable()
        with self._lock:
            busy = sorted({h.name for h in self._live})
        if busy:
            raise RuntimeError(f"{what}: push_pull of {busy} in flight; call the optimizer's "
                               f"step() or synchronize() (or wait the handles) first")
        self.sync_device()  # compress_on="device": residuals are written on the copy streams

    def _check_usable(self) -> None:
        if self._error is not None:
            raise GradpressError(f"the gradpress engine failed earlier: {self._error}") \
                from self._error
        if self._closed:
            raise GradpressError("gradpress was shut down; push_pull needs a running job")

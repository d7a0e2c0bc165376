"""The worker pipeline of ``push_pull`` (BytePS-Compress, Zhong et al. 2021, section 3).

For each tensor: look up (or create) its plan, cut it into chunks, and per chunk:

1. dispatch: a dispatcher thread takes chunks in submission order and waits for room in the
   in-flight byte budget (``inflight_bytes``);
2. compress on the thread pool with the chunk's worker codec (error feedback / momentum state
   lives here, per key), into the chunk's send buffer;
3. pre-post the receive of the server's reply, announce the push on the control tag, and send
   the payload on the key's tag;
4. a receiver thread waits for replies in push order and hands each to the pool;
5. decompress the reply into the chunk's slice of the output tensor (reassembly); the server
   already averaged, so when the last chunk lands the handle completes.

Chunks of different tensors overlap: while chunk i is on the wire, chunk i+1 is compressed.
A new ``push_pull`` of a name waits for the previous one of the same name (each key has one
step in flight). Any failure inside the pipeline is fatal to the engine: every pending handle
raises it, and so do later calls.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compress import build
from ..compress.base import Codec
from ..compress.spec import CodecSpec, parse_spec
from .budget import ByteBudget
from .buffers import BufferPool
from .cluster import Cluster
from .config import PSConfig
from .engine_state import WorkerStateMixin
from .errors import GradpressError, KeyCollisionError
from .handle import Handle
from .partition import assign_balanced, chunk_key, chunk_layout
from .protocol import CTRL_BYTES, OP_PUSH, OP_STOP, Control, KeyDescriptor, pack_control
from .trace import Tracer
from .transport import CTRL_TAG, Op, Transport
from .validate import decode_reply

__all__ = ["WorkerEngine", "Handle", "resolve_codec", "flat_fp32", "check_out"]

log = logging.getLogger(__name__)
_NO_EF = (None, "", "none")


def resolve_codec(compression: str | Mapping[str, Any] | CodecSpec | None, ef: str | None,
                  cfg: PSConfig) -> tuple[CodecSpec, dict[str, Any]]:
    """Split a spec into the codec spec and wrapper options; call arguments beat config defaults.

    Returns ``(codec spec without wrappers, {"ef": ..., "momentum": ..., "mu": ...})``.
    """
    cs = parse_spec(cfg.compression if compression is None else compression)
    wrappers = dict(cs.wrappers)
    spec_ef = wrappers.pop("ef", None)
    if ef is not None and spec_ef is not None and str(ef).lower() != str(spec_ef).lower():
        raise ValueError(f"ef given twice with different values: {ef!r} (argument) and "
                         f"{spec_ef!r} (compression spec {compression!r})")
    chosen = ef if ef is not None else spec_ef if spec_ef is not None else cfg.ef
    chosen = None if chosen is None else str(chosen).strip().lower()
    wrappers["ef"] = None if chosen in _NO_EF else chosen
    if str(wrappers.get("momentum", "")).lower() in _NO_EF:
        wrappers.pop("momentum", None)
    return CodecSpec(cs.name, dict(cs.params)), wrappers


def check_out(out: torch.Tensor, flat: torch.Tensor, name: str) -> torch.Tensor:
    """Validate ``out=`` of a push_pull whose input is ``flat``; returns its flat view.

    ``out`` must be a contiguous float32 CPU tensor with the input's number of elements; it may
    be the input itself (in place) but must not overlap it otherwise.
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"push_pull({name!r}): out must be a torch.Tensor, got "
                        f"{type(out).__name__}")
    if out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous():
        raise TypeError(f"push_pull({name!r}): out must be a contiguous float32 CPU tensor, got "
                        f"{out.dtype} on {out.device}"
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


def flat_fp32(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """``tensor`` as a flat, contiguous float32 CPU tensor (no copy when it already is one)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"push_pull({name!r}): expected a torch.Tensor, got "
                        f"{type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"push_pull({name!r}): expected a floating-point tensor, got "
                        f"{tensor.dtype}")
    return tensor.detach().reshape(-1).to(device="cpu", dtype=torch.float32).contiguous()


@dataclass
class _ChunkState:
    """Per-key state on the worker: descriptor, codecs, buffers and step counter."""

    key: int
    desc: KeyDescriptor
    server_rank: int
    server_name: str
    enc: Codec
    dec: Codec
    nbytes: int  # payload bytes each way (the wire buffers are lent per step by the pool)
    ctrl: torch.Tensor = field(default_factory=lambda: torch.empty(CTRL_BYTES,
                                                                     dtype=torch.uint8))
    step: int = 0

    @property
    def label(self) -> str:
        return f"key {self.key} ({self.desc.label})"


@dataclass
class _Plan:
    """How one named tensor travels: its signature, generation and chunk states."""

    name: str
    signature: tuple
    generation: int
    numel: int
    chunks: list[_ChunkState]
    offsets: list[int]
    last: threading.Event | None = None  # completion of the key's previous push_pull


@dataclass
class _Job:
    """One chunk of one ``push_pull`` call moving through the pipeline."""

    cs: _ChunkState
    x: torch.Tensor
    out: torch.Tensor
    handle: Handle
    lr: float | None
    step: int = 0
    send: torch.Tensor | None = None  # lent by the buffer pool from dispatch to finish
    recv: torch.Tensor | None = None
    ops: list[Op] = field(default_factory=list)
    recv_op: Op | None = None
    t_sent: float = 0.0


class WorkerEngine(WorkerStateMixin):
    """The push/pull pipeline of one worker process (checkpoint methods: ``WorkerStateMixin``).

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
        self._plans: dict[str, _Plan] = {}
        self._key_owner: dict[int, str] = {}
        self._valid_specs: set[str] = set()
        self._server_loads = [0] * cluster.layout.num_servers
        self._budget = ByteBudget(cfg.inflight_bytes)
        self._buffers = BufferPool(2 * cfg.inflight_bytes)  # send + receive of what is in flight
        self._lock = threading.Lock()
        self._live: set[Handle] = set()
        self._error: BaseException | None = None
        self._closed = False
        self._stats: dict[str, float] = dict.fromkeys(
            ("bytes_pushed", "bytes_pulled", "dense_fp32_bytes", "steps", "chunks"), 0)
        self._stats.update(dict.fromkeys(("compress_s", "send_s", "wait_s", "decompress_s"), 0.0))
        self._pool = ThreadPoolExecutor(cfg.compress_threads, thread_name_prefix="gp-compress")
        self._pending: dict[str, dict[str, Any]] = {}  # loaded state of tensors not yet seen
        self._state_seq = 0  # server state requests so far (collective over workers)
        self._dispatch_q: queue.SimpleQueue = queue.SimpleQueue()
        self._recv_q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._loop, args=(self._dispatch_q,
                                          self._dispatch), name="gp-dispatch", daemon=True),
                         threading.Thread(target=self._loop, args=(self._recv_q,
                                          self._receive), name="gp-receive", daemon=True)]
        for t in self._threads:
            t.start()

    # -- public ---------------------------------------------------------------------------------
    def submit(self, tensor: torch.Tensor, name: str, *, average: bool = True,
               compression: str | Mapping[str, Any] | CodecSpec | None = None,
               ef: str | None = None, lr: float | None = None,
               min_compress_bytes: int | None = None, out: torch.Tensor | None = None) -> Handle:
        """Start a push_pull of ``tensor`` under ``name``; returns a :class:`Handle`.

        With ``out`` (see :func:`check_out`) the result is written there, which may be
        ``tensor`` itself: chunk i's result lands only after chunk i was compressed.
        """
        self._check_usable()
        flat = flat_fp32(tensor, name)
        dst = None if out is None else check_out(out, flat, name)
        plan = self._plan(name, flat.numel(), average, compression, ef, lr, min_compress_bytes)
        if plan.last is not None and not plan.last.is_set():
            plan.last.wait(self.cfg.timeout)  # one step per key in flight
        like = tensor if out is None else out  # the result's shape, dtype and device
        out = torch.empty(flat.numel(), dtype=torch.float32) if dst is None else dst
        handle = Handle(name, out, like.shape, like.dtype, like.device, len(plan.chunks),
                        on_done=self._on_done)
        plan.last = handle.completion  # not the handle: its result is the caller's to keep
        with self._lock:
            self._live.add(handle)
            self._stats["dense_fp32_bytes"] += 4 * flat.numel()
        lr = None if lr is None else float(lr)
        for cs, off in zip(plan.chunks, plan.offsets):
            n = cs.desc.numel
            self._dispatch_q.put(_Job(cs, flat[off:off + n], out[off:off + n], handle, lr))
        if not plan.chunks:
            handle._chunk_done()
        return handle

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
        self._dispatch_q.put(None)
        self._recv_q.put(None)
        for t in self._threads:
            t.join(self.cfg.timeout)
        self._pool.shutdown(wait=self._error is None)
        self._buffers.clear()
        if self._error is not None:
            return
        stop = pack_control(Control(OP_STOP))
        ops = [self.transport.isend(stop, r, CTRL_TAG, "stop message", "push") for r in servers]
        for op in ops:
            op.wait(self.cfg.timeout, "shutdown")

    # -- planning -------------------------------------------------------------------------------
    def check_call(self, name: str, compression: Any, ef: str | None,
                   lr: float | None = None) -> None:
        """Validate a call's name and codec options (ValueError/TypeError), before any I/O."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"push_pull: name must be a non-empty str, got {name!r}")
        spec, wrappers = resolve_codec(compression, ef, self.cfg)
        if wrappers["ef"] == "corrected" and lr is None:
            raise ValueError(f"push_pull({name!r}): ef='corrected' needs the step's learning "
                             f"rate: pass lr=...")
        sig = repr((spec.name, sorted(spec.params.items()), sorted(wrappers.items())))
        if sig not in self._valid_specs:
            build(spec, 0, seed=self.cfg.seed, **wrappers)  # unknown codec or parameter: raise
            self._valid_specs.add(sig)

    def _plan(self, name: str, numel: int, average: bool, compression: Any, ef: str | None,
              lr: float | None, min_compress_bytes: int | None) -> _Plan:
        self.check_call(name, compression, ef, lr)
        limit = self.cfg.min_compress_bytes if min_compress_bytes is None else min_compress_bytes
        spec, wrappers = resolve_codec(compression, ef, self.cfg)
        if 4 * numel < limit:  # small tensors travel uncompressed (fp32, exact), no residual;
            # worker-side momentum (dist-EF-SGDM) still applies to them, as to every tensor
            spec = CodecSpec("none")
            wrappers = {"ef": None, **{k: wrappers[k] for k in ("momentum", "mu")
                                        if k in wrappers}}
        signature = (numel, spec.name, tuple(sorted(spec.params.items())),
                     tuple(sorted(wrappers.items())), bool(average))
        with self._lock:
            plan = self._plans.get(name)
        if plan is not None and plan.signature == signature:
            return plan
        gen = 0 if plan is None else plan.generation + 1
        plan = self._new_plan(name, numel, gen, spec, wrappers, bool(average), signature)
        self._restore_pending(plan)  # loaded checkpoint state; ValueError naming a mismatch
        with self._lock:
            self._plans[name] = plan
        return plan

    def _new_plan(self, name: str, numel: int, gen: int, spec: CodecSpec,
                  wrappers: dict[str, Any], average: bool, signature: tuple) -> _Plan:
        layout = chunk_layout(numel, self.cfg.partition_bytes)
        decs = [build(spec, c.numel, seed=self.cfg.seed) for c in layout]
        keys = [chunk_key(name, c.index, gen) for c in layout]
        for key, c in zip(keys, layout):
            label = f"{name!r} chunk {c.index} generation {gen}"
            owner = self._key_owner.setdefault(key, label)
            if owner != label:
                raise KeyCollisionError(f"key {key} collides: {owner} and {label} hash to the "
                                        f"same key; rename one of the tensors")
        proposal = assign_balanced({k: d.payload_bytes for k, d in zip(keys, decs)},
                                   self._server_loads)
        chunks = []
        for key, c, dec in zip(keys, layout, decs):
            desc = KeyDescriptor(name, gen, c.index, c.numel, numel, dec.spec_text,
                                 wrappers["ef"], self.cfg.seed, average, proposal[key])
            desc = self._agree(key, desc)
            self._server_loads[desc.server] += dec.payload_bytes
            enc = build(spec, c.numel, seed=self.cfg.seed, **wrappers)
            srank = self.cluster.layout.server_rank(desc.server)
            chunks.append(_ChunkState(key, desc, srank, self.cluster.describe(srank), enc, dec,
                                      dec.payload_bytes))
        return _Plan(name, signature, gen, numel, chunks, [c.offset for c in layout])

    def _agree(self, key: int, desc: KeyDescriptor) -> KeyDescriptor:
        """First writer wins in the store; everyone else must match it (except the server)."""
        raw = self.cluster.store.compare_set(f"k/{key}", "", desc.to_json())
        agreed = KeyDescriptor.from_json(raw)
        desc.check_same(agreed, key, self.cluster.describe(self.cluster.rank))
        return agreed

    # -- pipeline -------------------------------------------------------------------------------
    def _loop(self, q: queue.SimpleQueue, fn: Callable[[_Job], None]) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            self._guard(fn, job)

    def _guard(self, fn: Callable[[_Job], None], job: _Job) -> None:
        if self._error is not None:
            job.handle._set_error(self._error)
            return
        try:
            fn(job)
        except BaseException as e:  # noqa: BLE001 - fatal: fail every pending handle
            self.fail(e)

    def _dispatch(self, job: _Job) -> None:  # step 1
        n = job.cs.nbytes
        self._budget.acquire(n, self.cfg.timeout, job.cs.label)
        job.send, job.recv = self._buffers.take(n), self._buffers.take(n)  # framed (transport)
        job.step = job.cs.step
        job.cs.step += 1
        self._pool.submit(self._guard, self._push, job)

    def _push(self, job: _Job) -> None:  # steps 2-3
        cs, send, t0 = job.cs, job.send, time.perf_counter()
        cs.enc.compress(job.x, key=cs.key, step=job.step, lr=job.lr, out=send)
        t1 = time.perf_counter()
        job.recv_op = self.transport.irecv(job.recv, cs.server_rank, cs.key, cs.label, "pull")
        pack_control(Control(OP_PUSH, cs.key, job.step, job.lr, cs.nbytes), cs.ctrl)
        job.ops = [self.transport.isend(cs.ctrl, cs.server_rank, CTRL_TAG, cs.label, "push"),
                   self.transport.isend(send, cs.server_rank, cs.key, cs.label, "push")]
        job.t_sent = t2 = time.perf_counter()
        self._recv_q.put(job)
        self.account(compress_s=t1 - t0, send_s=t2 - t1, bytes_pushed=cs.nbytes, chunks=1)
        self.tracer.add("compress", t0, t1, key=cs.key, step=job.step, name=cs.desc.name,
                        chunk=cs.desc.chunk)

    def _receive(self, job: _Job) -> None:  # step 4
        t0 = time.perf_counter()
        job.recv_op.wait(self.cfg.timeout, "pull")  # type: ignore[union-attr]
        t1 = time.perf_counter()
        self.account(wait_s=t1 - t0)
        self.tracer.add("push+pull", job.t_sent, t1, key=job.cs.key, step=job.step)
        self._pool.submit(self._guard, self._finish, job)

    def _finish(self, job: _Job) -> None:  # step 5
        cs = job.cs
        for op in job.ops:  # complete already: the server replied after receiving them
            op.wait(self.cfg.timeout, "push")
        t0 = time.perf_counter()
        decode_reply(cs.dec, job.recv, job.out, key=cs.key, step=job.step,  # validated
                     sender=cs.server_name, label=cs.label)
        self._buffers.give(job.send)  # type: ignore[arg-type]
        self._buffers.give(job.recv)  # type: ignore[arg-type]
        job.send = job.recv = None
        self._budget.release(cs.nbytes)
        t1 = time.perf_counter()
        self.account(decompress_s=t1 - t0, bytes_pulled=cs.nbytes)
        self.tracer.add("decompress", t0, t1, key=cs.key, step=job.step)
        job.handle._chunk_done()

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

    def _check_usable(self) -> None:
        if self._error is not None:
            raise GradpressError(f"the gradpress engine failed earlier: {self._error}") \
                from self._error
        if self._closed:
            raise GradpressError("gradpress was shut down; push_pull needs a running job")

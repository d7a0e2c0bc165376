"""A DDP communication hook that averages gradients with two-way compression, in allreduce form.

For users who keep :class:`torch.nn.parallel.DistributedDataParallel`: the BytePS-Compress
scheme (Zhong, Xie, Zheng, Lin 2021, "Compressed Communication for Distributed Training: Adaptive
Methods and System") without separate server processes. Every rank serves one shard of each
gradient bucket, as a reduce-scatter/all-gather allreduce does, and the pushes and the replies are
both compressed with error feedback::

    from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook
    state = TwoWayCompressionState(compression="onebit", ef="vanilla", min_compress_bytes=1 << 20)
    ddp_model.register_comm_hook(state, two_way_compression_hook)

Modelled on PyTorch's ``ddp_comm_hooks/powerSGD_hook.py``: a state object holding the
hyperparameters and the per-bucket state, and a pure hook function.
"""

import copy
import functools
import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .. import defaults
from ..compress import Codec, CodecSpec, EFSpec, build, parse_ef, parse_spec
from ..compress.registry import pick_ef
from ..compress.spec import Compression
from ..ps.errors import GradpressError, PayloadError
from .buckets import (
    BucketCodecs,
    BucketExchange,
    all_gather_async,
    bucket_key,
    finish,
    reduce_shard,
)
from .checks import (
    DeviceCheck,
    finish_deferred,
    mark_rejected,
    raise_failed,
    reduce_shard_deferred,
)

__all__ = ["TwoWayCompressionState", "two_way_compression_hook"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1


class TwoWayCompressionState:
    r"""Hyperparameters and per-bucket state of :func:`two_way_compression_hook`.

    Hyperparameters are fixed at construction (assigning one raises AttributeError; build a new
    state instead); ``process_group`` and ``lr`` may be reassigned. The state holds, per bucket
    index: one worker codec per shard (error-feedback residual per (bucket, shard)), one server
    codec for the shard this rank owns (the server residual), a step counter, and wire buffers.

    1. ``compression`` (default ``"onebit"``) is the codec, given as everywhere in gradpress:
       a spec string (``"onebit"``, ``"topk:k=0.001,values=fp16"``, ``"randomk:k=0.01"``,
       ``"dithering:s=7"``), a BytePS-style dict (``{"compressor": "topk", "k": 0.01}``) or a
       :class:`~gradpress.compress.CodecSpec`. It sets the compression rate: onebit sends ~1
       bit/element; topk/randomk ``k`` is a fraction of each shard. Start with ``onebit`` or
       ``topk:k=0.01``; lower k only while accuracy holds. ``"none"`` sends fp32 (a reference
       that matches DDP's own allreduce). Read back as a ``CodecSpec`` (without ``ef``).
    2. ``ef`` (default ``"vanilla"``) is the error feedback on both sides, an
       :class:`~gradpress.compress.EFSpec` or its text (``"none"``: off, ``"vanilla"``,
       ``"corrected"`` which needs ``lr``, ``"sparse"`` for randomk; ``None``: the one inside
       ``compression``, e.g. a dict's ``"ef"`` key, else off). An ``ef`` inside
       ``compression`` must agree with this argument (ValueError). Keep it on for biased codecs
       (onebit, topk): without it they usually lose accuracy. It costs one fp32 copy of the
       gradients (plus a scratch) on every rank, and 1/world_size of that on the server side.
       Read back as an ``EFSpec``.
    3. ``min_compress_bytes`` (default 1 MiB): buckets whose fp32 size is below it are averaged
       with a plain allreduce; every shard of a larger bucket is compressed. Small tensors gain
       little from compression and pay its per-call cost; raise it if compression time shows up
       in profiles, lower it (0 compresses everything) if the network is the bottleneck.
    4. ``dense_steps`` (default 0): iterations averaged with a plain allreduce before
       compression starts. A few hundred uncompressed opening steps (as 1-bit Adam does) help
       adaptive optimizers; set it to at least the learning-rate warm-up length when accuracy
       suffers early (``docs/guide.md``). Any value >= 1 also skips DDP's first iteration,
       after which DDP rebuilds its buckets (a rebuilt bucket gets new codecs, and its
       residuals restart from zero).
    5. ``seed`` (default 0): base seed of codecs that draw random numbers (randomk); the same on
       every rank.
    6. ``overlap`` (default True): finish each bucket while the next one is being produced (see
       :func:`two_way_compression_hook`); False finishes every bucket inside its own hook call.
    7. ``lr``: the current learning rate, only for ``ef="corrected"`` and
       ``"vanilla:decay=B,anneal=1"``; set ``state.lr`` before each backward pass when the
       learning rate changes.

    Picklable: the process group is dropped (None means the default group, resolved at the next
    hook call; set ``state.process_group`` after unpickling to use another). Residuals and step
    counters are saved by :meth:`state_dict` (per rank: each rank has its own residuals).
    """

    __slots__ = ("process_group", "_lr", "_compression", "_ef", "_min_compress_bytes",
                 "_dense_steps", "_seed", "_overlap", "iter", "_buckets", "_steps",
                 "_loaded", "_resumed_at", "_inflight", "_stats", "_error", "_defer",
                 "_checks")

    def __init__(self, compression: Compression = defaults.COMPRESSION,
                 ef: str | EFSpec | None = defaults.EF, *,
                 min_compress_bytes: int = defaults.HOOK_MIN_COMPRESS_BYTES,
                 dense_steps: int = defaults.WRAPPER_DENSE_STEPS, seed: int = 0,
                 overlap: bool = True,
                 lr: float | None = None, process_group: Any = None) -> None:
        if compression is None:
            raise TypeError("TwoWayCompressionState: compression must be a spec string, a "
                            "BytePS-style dict or a CodecSpec (e.g. 'onebit'; 'none' for "
                            "fp32), got None")
        for name, v in (("min_compress_bytes", min_compress_bytes),
                        ("dense_steps", dense_steps), ("seed", seed)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TwoWayCompressionState: {name} must be an int >= 0, got {v!r}")
        cs = parse_spec(compression)  # the one parser of push_pull and the optimizers
        wrappers = dict(cs.wrappers)
        self._ef = parse_ef(pick_ef(ef, wrappers.pop("ef", None), compression))
        self._compression = CodecSpec(cs.name, dict(cs.params), wrappers)
        self._seed = seed
        build(self._compression, 16, ef=self._ef, seed=seed)  # ValueError naming a bad value
        self._min_compress_bytes = min_compress_bytes
        self._dense_steps = dense_steps
        self._overlap = bool(overlap)
        self.process_group = process_group
        self.lr = lr
        # Internal switch: None checks CUDA buckets on the device, read one step late at most,
        # and CPU buckets at once; True/False forces deferred/immediate checks on any device.
        self._defer: bool | None = None
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self.iter = 0
        self._buckets: dict[int, BucketCodecs] = {}
        self._steps: dict[int, int] = {}
        self._loaded: dict[int, Mapping[str, Any]] = {}
        self._resumed_at: int | None = None  # iter at load_state_dict, while buckets are pending
        self._inflight: BucketExchange | None = None
        # "Type: message" of the first failure; the hook then refuses. A description, not the
        # exception: its traceback's frames would keep the bucket (and through DDP's reducer the
        # process group) alive in a cycle until interpreter exit, where gloo aborts.
        self._error: str | None = None
        self._checks: deque[DeviceCheck] = deque()  # deferred buckets' flags, in bucket order
        self._stats = dict.fromkeys(("compressed_buckets", "allreduced_buckets", "dense_bytes",
                                     "payload_bytes", "allreduce_bytes"), 0)

    compression = property(lambda self: self._compression,
                           doc="the codec, a CodecSpec (its error feedback is ``ef``)")
    ef = property(lambda self: self._ef, doc="the error feedback (both sides), an EFSpec")
    min_compress_bytes = property(lambda self: self._min_compress_bytes)
    dense_steps = property(lambda self: self._dense_steps)
    seed = property(lambda self: self._seed)
    overlap = property(lambda self: self._overlap)

    @property
    def lr(self) -> float | None:
        """Learning rate carried to the codecs (needed by ``ef="corrected"`` and ``anneal=1``)."""
        return self._lr

    @lr.setter
    def lr(self, value: float | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            raise ValueError(f"TwoWayCompressionState: lr must be None or a number > 0, "
                             f"got {value!r}")
        self._lr = None if value is None else float(value)

    def __repr__(self) -> str:
        return (f"TwoWayCompressionState(compression={self.compression!r}, ef={str(self.ef)!r}, "
                f"min_compress_bytes={self.min_compress_bytes}, iter={self.iter}, "
                f"buckets={len(self._buckets)})")

    def _build(self, numel: int) -> Codec:
        """A shard's codec: every shard of a compressed bucket uses the spec (the size rule is
        the bucket's: fp32 shards with headers would cost more than a plain allreduce)."""
        return build(self._compression, numel, ef=self._ef, seed=self._seed)

    def _group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def compression_stats(self) -> dict[str, int]:
        """Counters since construction: buckets compressed/allreduced, their fp32 bytes
        (``dense_bytes``, ``allreduce_bytes``), and the payload bytes this rank produced."""
        return {"iter": self.iter, **self._stats}

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Iteration, per-bucket step counters and residuals (CPU tensors) of this rank."""
        if self._inflight is not None:
            raise RuntimeError("TwoWayCompressionState.state_dict: a bucket is in flight; call "
                               "it between iterations (after backward has finished)")
        self.check_pending()
        buckets = {i: dict(s) for i, s in self._loaded.items()}
        buckets.update({i: c.state_dict() for i, c in self._buckets.items()})
        return {"version": _STATE_VERSION, "iter": self.iter, "steps": dict(self._steps),
                "buckets": buckets}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output of the same rank.

        A bucket's residuals are applied to its codecs now, or when the bucket is first seen with
        the saved layout (size and parameter shapes; DDP builds buckets at the first backward
        pass). In a new process DDP's first iteration may use other buckets than the ones saved
        (it rebuilds them in gradient order after that iteration): a bucket whose saved residuals
        do not fit is then averaged exactly (fp32 allreduce) for that one iteration, and the
        residuals are loaded at the next, into the rebuilt bucket they were saved from. Saved
        residuals that still fit no bucket after that restart from zero, with a warning.
        """
        if not isinstance(state, Mapping) or set(state) != {"version", "iter", "steps", "buckets"}:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"TwoWayCompressionState.load_state_dict: expected keys "
                             f"['buckets', 'iter', 'steps', 'version'], got {got}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"TwoWayCompressionState.load_state_dict: state version "
                             f"{state['version']!r}, expected {_STATE_VERSION}")
        if self._inflight is not None:
            raise RuntimeError("TwoWayCompressionState.load_state_dict: a bucket is in flight")
        self.iter = int(state["iter"])
        self._error = None
        self._checks.clear()
        self._steps = {int(i): int(s) for i, s in state["steps"].items()}
        self._loaded = {}
        for i, saved in state["buckets"].items():
            codecs = self._buckets.get(int(i))
            if codecs is not None and codecs.matches(saved):
                codecs.load_state_dict(saved)
            else:
                self._loaded[int(i)] = saved
        self._resumed_at = self.iter if self._loaded else None

    def __getstate__(self) -> dict[str, Any]:
        """Hyperparameters and :meth:`state_dict`; the process group is dropped (not picklable)."""
        log.info("TwoWayCompressionState: the process group is not pickled; the default group "
                 "is used after unpickling unless process_group is set")
        hyper = {n: getattr(self, n) for n in ("compression", "ef", "min_compress_bytes",
                                               "dense_steps", "seed", "overlap", "lr")}
        return {"hyper": hyper, "state": self.state_dict()}

    def __setstate__(self, d: Mapping[str, Any]) -> None:
        """Rebuild from :meth:`__getstate__` output; codecs are re-created lazily."""
        h = dict(d["hyper"])
        TwoWayCompressionState.__init__(self, h.pop("compression"), h.pop("ef"), **h)
        self.load_state_dict(d["state"])

    # -- hook machinery ---------------------------------------------------------------------------
    def _codecs_for(self, bucket: dist.GradBucket, world: int, rank: int) -> BucketCodecs:
        """The bucket's codecs; re-created (residuals restart) when DDP changed its layout."""
        index, buf = bucket.index(), bucket.buffer()
        layout = (world, rank, buf.numel(), buf.dtype, str(buf.device),
                  tuple((tuple(p.shape), p.data_ptr()) for p in bucket.parameters()))
        cur = self._buckets.get(index)
        if cur is not None and cur.layout == layout:
            return cur
        if cur is not None:
            log.info("gradpress DDP hook: bucket %d changed layout (%d -> %d elements, e.g. DDP "
                     "rebuilt its buckets); re-creating its codecs, residuals restart from zero",
                     index, cur.numel, buf.numel())
        cur = self._buckets[index] = BucketCodecs(layout, buf.numel(), world, rank, self._build,
                                                  buf.device)
        saved = self._loaded.pop(index, None)
        if saved is not None and cur.matches(saved):
            cur.load_state_dict(saved)
        elif saved is not None:
            log.warning("gradpress DDP hook: the saved residuals of bucket %d (%s elements) do "
                        "not fit its layout (%d elements, parameter shapes %s); they restart "
                        "from zero", index, saved.get("numel"), cur.numel, cur.shapes)
        return cur

    def _awaits_saved_layout(self, bucket: dist.GradBucket) -> bool:
        """Whether this bucket should be averaged exactly this iteration because its saved
        residuals belong to another layout of the same elements: in a resumed process DDP's
        first iteration uses its initial buckets and rebuilds them afterwards into the layout
        the residuals were saved with, where they are loaded (see :meth:`load_state_dict`)."""
        saved = self._loaded.get(bucket.index())
        if saved is None or self.iter != self._resumed_at:
            return False
        shapes = [list(p.shape) for p in bucket.parameters()]
        return saved.get("shapes", shapes) != shapes

    def _launch(self, bucket: dist.GradBucket, group: Any) -> torch.futures.Future:
        """Steps 1-3: shard, compress every shard, start the payload exchange."""
        world, rank = group.size(), dist.get_rank(group)
        index, buf = bucket.index(), bucket.buffer()
        codecs = self._codecs_for(bucket, world, rank)
        step = self._steps.get(index, 0)
        self._steps[index] = step + 1
        # 1.+2. shard s of the flat buffer -> worker codec s (its residual) -> send slot s
        for s, (lo, hi) in enumerate(codecs.bounds):
            out = codecs.payload(codecs.send, s, s)
            codecs.workers[s].compress(buf[lo:hi], key=bucket_key(index, s, world), step=step,
                                       lr=self.lr, out=out)
            finite = codecs.workers[s].last_finite
            if finite is not None:  # a device payload: no raise above
                mark_rejected(out, finite)
        # 3. slot s goes to rank s; recv slot r holds rank r's payload for the shard we own
        work = dist.all_to_all_single(codecs.recv, codecs.send, group=group, async_op=True)
        deferred = self._defer if self._defer is not None else buf.device.type == "cuda"
        self._inflight = BucketExchange(index, buf, codecs, step, group, work,
                                        iteration=self.iter, deferred=deferred)
        self._stats["compressed_buckets"] += 1
        self._stats["dense_bytes"] += buf.numel() * 4
        self._stats["payload_bytes"] += codecs.send.numel() + codecs.slot
        return self._inflight.future

    def _drain(self) -> None:
        """Steps 4-5 for the bucket in flight: aggregate our shard, start the all-gather."""
        job, self._inflight = self._inflight, None
        if job is None:
            return
        try:
            job.work.wait()
            try:
                (reduce_shard_deferred if job.deferred else reduce_shard)(job, self.lr)
            except PayloadError:
                self._abort(job)
                raise
            c = job.codecs
            work = all_gather_async(c.gathered, c.agg, job.group)
            # The callback (holding the job) is dropped on gloo's thread once it has run: were
            # the job's group the last reference, gloo would join that thread from itself and
            # abort ("Resource deadlock avoided"). The job needs the group no more.
            job.group = None
            work.get_future().then(functools.partial(self._gathered, job))
        except BaseException as e:
            _set_exception(job.future, e)
            raise

    def _abort(self, job: BucketExchange) -> None:
        """A push was rejected: zero the bucket and all-gather the abort record that
        ``reduce_shard`` left in ``agg``, so the other ranks (waiting in this all-gather) fail
        now, naming the sender."""
        job.buffer.zero_()
        try:
            all_gather_async(job.codecs.gathered, job.codecs.agg, job.group).wait()
        except RuntimeError as e:  # a peer is gone too; the payload error is what to report
            log.warning("gradpress DDP hook: bucket %d: sending the abort record failed: %s",
                        job.index, e)

    def _gathered(self, job: BucketExchange, fut: torch.futures.Future) -> None:
        """Step 6, when the all-gather completes: on gloo's thread, or (NCCL, whose work future
        completes when the collective is enqueued) inline in ``_drain``, on a pool stream that
        waits for the all-gather (ATen/core/ivalue_inl.h, Future::invokeCallback)."""
        try:
            fut.wait()  # re-raises a failed all-gather
            if job.deferred:
                self._checks.append(DeviceCheck(job, finish_deferred(job)))
            else:
                finish(job)
        except Exception as e:  # noqa: BLE001 - handed to DDP through the bucket's future
            self._error = self._error or _describe(e)
            _set_exception(job.future, e)
            return
        job.future.set_result(job.buffer)

    def _resolve_checks(self, wait_all: bool = False) -> None:
        """Read the flags of the deferred buckets of earlier iterations (all with ``wait_all``),
        in bucket order; a failed one raises its PayloadError (``raise_failed``). The hook
        calls this first, so a flag is read at the first hook call of the next iteration: the
        same point on every rank (the flags come from all-gathered bytes, identical on every
        rank), before any collective of that iteration, so the ranks' collectives stay matched.
        """
        while self._checks and (wait_all or self._checks[0].job.iteration < self.iter):
            check = self._checks.popleft()
            if not check.passed():
                self._checks.clear()
                raise_failed(check.job)

    def check_pending(self) -> None:
        """Wait for the deferred checks of the buckets finished so far and raise the
        :class:`~gradpress.ps.errors.PayloadError` of one that failed (CUDA buckets are checked
        on the device and read by the hook one iteration late at most; call this after the last
        backward pass to see an error of the last iteration; :meth:`state_dict` calls it)."""
        try:
            self._resolve_checks(wait_all=True)
        except BaseException as e:
            self._fail(e)
            raise

    def _fail(self, exc: BaseException) -> None:
        """Fail the bucket in flight; this state stops (see ``_check_usable``)."""
        if self._error is None:
            self._error = _describe(exc)
        job, self._inflight = self._inflight, None
        if job is not None and not job.future.done():
            _set_exception(job.future, exc)

    def _check_usable(self, index: int) -> None:
        """After a failure the ranks no longer agree on the collectives: refuse to issue more."""
        err = self._error
        if err is None:
            return
        exc = GradpressError(f"two_way_compression_hook: bucket {index}: an earlier bucket "
                             f"failed ({err}); this state stops: build a new "
                             f"TwoWayCompressionState or load_state_dict a checkpoint")
        self._fail(exc)
        raise exc


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _set_exception(fut: torch.futures.Future, exc: BaseException) -> None:
    """Fail ``fut`` with a copy of ``exc`` that has no traceback. torch keeps a future's
    exception in C++, out of the garbage collector's sight, and the traceback's frames hold the
    bucket's job, whose future this is: the cycle would keep the process group alive until
    interpreter exit, where gloo aborts ("terminate called without an active exception")."""
    try:
        detached = copy.copy(exc) if isinstance(exc, Exception) else None
    except Exception:  # noqa: BLE001 - an exception type that cannot be rebuilt from its args
        detached = None
    if detached is None:
        detached = RuntimeError(_describe(exc))
    fut.set_exception(detached)


def _allreduce_average(buf: torch.Tensor, group: Any) -> torch.futures.Future:
    """Uncompressed path: divide by the world size, then allreduce-sum (as DDP's default)."""
    buf.div_(group.size())
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


def two_way_compression_hook(
    state: TwoWayCompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    r"""Average a DDP gradient bucket with two-way compressed communication.

    Rank r acts as the server of shard r of every bucket (BytePS-Compress's worker/server roles
    folded into the ranks, in the shape of a reduce-scatter + all-gather allreduce):

    1. Views the bucket buffer as one flat tensor and splits it into ``world_size`` shards whose
       sizes depend only on the bucket's element count, so every rank agrees.
    2. Compresses every shard with this rank's worker codec for (bucket index, shard), whose
       error-feedback residual absorbs the compression error; key = index * world + shard, step =
       this bucket's call count (randomk draws identical indices on every rank from them).
    3. Exchanges payloads with ``all_to_all_single`` on uint8 (gloo and NCCL both support it):
       owner r receives every rank's payload for shard r. Payloads have a size fixed by the codec
       and shard, padded to one slot size.
    4. The owner validates each payload (header: codec id, numel, fingerprint, size, key, step),
       decode-accumulates them in rank order (deterministic), divides by ``world_size``, adds
       its server residual and recompresses (server-side error feedback; a non-finite average
       is rejected naming the first sender that makes it so).
    5. All-gathers the compressed aggregates (fixed slot size).
    6. Every rank validates every aggregate (header, then finite values) and decodes it into the
       bucket buffer; the bytes are identical on every rank, so the replicas stay bit-identical.

    A payload that fails a check raises :class:`~gradpress.ps.errors.PayloadError` naming the
    sending rank, the bucket, the shard and what was wrong (see :mod:`gradpress.ddp.buckets`):
    from the hook or from the bucket's future, on the owner that rejected a push and, through an
    abort record it all-gathers in step 5, on every other rank. The bucket buffer is then zeroed
    and the state refuses further buckets (:class:`~gradpress.ps.errors.GradpressError`).

    CUDA buckets are checked on the device, with no host synchronisation per bucket (so
    backward keeps overlapping the exchange): a failed bucket is zeroed there and handed to DDP
    as zeros, and its PayloadError (the same text) is raised on every rank by the first hook
    call of the next iteration, before its collectives: one optimizer step late; call
    ``state.check_pending()`` after the last backward pass (``state_dict`` does) to see an error
    of the last iteration. The bucket's future is CUDA-aware, so DDP's stream waits for the
    decode kernels before it reads the result.

    Buckets below ``state.min_compress_bytes`` and iterations before
    ``state.dense_steps`` use a plain averaging allreduce.

    Overlap (``state.overlap=True``): steps 1-3 run when DDP hands over the bucket; steps 4-5 run
    at the next hook call (or at once for the last bucket of the iteration), and step 6 when the
    all-gather completes, on the communication thread. So the payload exchange overlaps the rest
    of backward, while every collective is still issued from the hook, in bucket order, which
    keeps the collectives in the same order on all ranks. The compression itself runs on the
    backward thread. With ``overlap=False`` every bucket is finished inside its own hook call:
    simpler, and communication then stalls backward.

    Args:
        state: :class:`TwoWayCompressionState` with the hyperparameters and residuals.
        bucket: the DDP gradient bucket (its ``index()`` identifies it; a change of its layout,
            e.g. DDP's bucket rebuild after the first iteration, re-creates its codecs).

    Returns:
        A future completed with the averaged bucket buffer (updated in place).

    Example::
        >>> state = TwoWayCompressionState(compression="onebit", ef="vanilla")
        >>> ddp_model.register_comm_hook(state, two_way_compression_hook)
    """
    group = state._group()
    buf = bucket.buffer()
    if not buf.is_floating_point():
        raise TypeError(f"two_way_compression_hook: bucket {bucket.index()} buffer has dtype "
                        f"{buf.dtype}, expected a floating dtype")
    state._check_usable(bucket.index())
    try:
        state._resolve_checks()  # deferred checks of earlier buckets (may raise their error)
        state._drain()  # steps 4-5 of the previous bucket, before any new collective
        if state.iter >= state.dense_steps and not state._awaits_saved_layout(bucket) \
                and buf.numel() * 4 >= max(state.min_compress_bytes, 1):
            fut = state._launch(bucket, group)
            if bucket.is_last() or not state.overlap:
                state._drain()
        else:
            state._stats["allreduced_buckets"] += 1
            state._stats["allreduce_bytes"] += buf.numel() * buf.element_size()
            fut = _allreduce_average(buf, group)
    except BaseException as e:
        state._fail(e)
        raise
    if bucket.is_last():
        state.iter += 1
    return fut

"""The per-bucket pipeline of the DDP hook (steps 1-6 of
:func:`~gradpress.ddp.two_way_compression_hook`), as methods of the state that holds it.

Internal to :mod:`gradpress.ddp`: :class:`BucketPipeline` is the base of
:class:`~gradpress.ddp.TwoWayCompressionState`; it launches a bucket's exchange (steps 1-3),
drains it at the next hook call (steps 4-5), finishes it when the all-gather completes (step 6),
reads the deferred checks of CUDA buckets one iteration late, and stops the state after a
failure.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from ..compress.base import _NonFiniteInputError
from ..ps.errors import GradpressError, PayloadError
from .buckets import (
    BucketCodecs,
    BucketExchange,
    all_gather_async,
    bucket_key,
    finish,
    reduce_shard,
    write_rejected,
)
from .checks import (
    DeviceCheck,
    finish_deferred,
    mark_rejected,
    raise_failed,
    reduce_shard_deferred,
)

__all__ = ["BucketPipeline"]

log = logging.getLogger(__name__)


class BucketPipeline:
    """Steps 1-6 of the hook, over the runtime state the subclass keeps (see
    :class:`~gradpress.ddp.TwoWayCompressionState`)."""

    __slots__ = ("iter", "_steps", "_inflight", "_stats", "_error", "_checks", "_defer",
                 "_nan_policy")

    # kept by the subclass
    iter: int
    lr: float | None
    _nan_policy: str
    _steps: dict[int, int]
    _inflight: BucketExchange | None
    _stats: dict[str, int]
    _error: str | None
    _checks: deque[DeviceCheck]
    _defer: bool | None

    def _codecs_for(self, bucket: dist.GradBucket, world: int, rank: int) -> BucketCodecs:
        raise NotImplementedError  # the subclass keeps the codecs

    def _launch(self, bucket: dist.GradBucket, group: Any) -> torch.futures.Future:
        """Steps 1-3: shard, compress every shard, start the payload exchange."""
        world, rank = group.size(), dist.get_rank(group)
        index, buf = bucket.index(), bucket.buffer()
        codecs = self._codecs_for(bucket, world, rank)
        step = self._steps.get(index, 0)
        self._steps[index] = step + 1
        skip = self._nan_policy == "skip"
        self._compress_shards(codecs, buf, index, step, skip)  # 1.+2.
        # 3. slot s goes to rank s; recv slot r holds rank r's payload for the shard we own
        work = dist.all_to_all_single(codecs.recv, codecs.send, group=group, async_op=True)
        deferred = self._defer if self._defer is not None else buf.device.type == "cuda"
        self._inflight = BucketExchange(index, buf, codecs, step, group, work,
                                        iteration=self.iter, deferred=deferred, skip=skip)
        self._stats["compressed_buckets"] += 1
        self._stats["dense_bytes"] += buf.numel() * 4
        self._stats["payload_bytes"] += codecs.send.numel() + codecs.slot
        return self._inflight.future

    def _compress_shards(self, codecs: BucketCodecs, buf: torch.Tensor, index: int, step: int,
                         skip: bool) -> None:
        """Steps 1-2: shard s of the flat buffer -> worker codec s (its residual) -> send slot
        s. A rejected (non-finite) input marks its push: on the device, from the codec's flag;
        on the host, where the compress raised, under ``skip`` only (else the error stands)."""
        for s, (lo, hi) in enumerate(codecs.bounds):
            out = codecs.payload(codecs.send, s, s)
            kw: dict[str, Any] = {"key": bucket_key(index, s, codecs.world), "step": step,
                                  "lr": self.lr}
            try:
                codecs.workers[s].compress(buf[lo:hi], out=out, **kw)
            except _NonFiniteInputError:  # the codec state is as it was
                if not skip:  # (a non-finite shard, or error feedback made it overflow)
                    raise
                write_rejected(codecs.workers[s], out, **kw)  # the owner skips the bucket
                continue
            finite = codecs.workers[s].last_finite
            if finite is not None:  # a device payload: no raise above
                mark_rejected(out, finite)

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
            elif finish(job):
                self._stats["skipped_buckets"] += 1
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
            if check.skipped:
                self._stats["skipped_buckets"] += 1

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

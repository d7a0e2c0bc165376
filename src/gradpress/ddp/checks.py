"""Device-side ("deferred") checks of the DDP hook's buckets.

Internal to :mod:`gradpress.ddp`. CUDA buckets (any bucket when
``TwoWayCompressionState._defer`` is True) are checked on the device, with no host read: the
checks of :mod:`gradpress.ddp.buckets` fold into one flag per bucket, which the hook reads at its
first call of the next iteration; a failed flag raises the same
:class:`~gradpress.ps.errors.PayloadError` there (:func:`raise_failed`). The "Deferred checks"
paragraph of :mod:`gradpress.ddp.buckets` describes them in full.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..compress.header import HEADER_BYTES, Header
from ..ps.errors import PayloadError
from ..ps.protocol import add_push, check_sum, decode_reply
from .buckets import (
    _ABORT,
    _FLAGS,
    BucketExchange,
    _check_abort,
    _check_marked,
    _is_skip_record,
    bucket_key,
    finish,
    reduce_shard,
)

if TYPE_CHECKING:
    from ..compress import Codec

__all__ = ["reduce_shard_deferred", "finish_deferred", "DeviceCheck", "raise_failed",
           "mark_rejected"]


def mark_rejected(payload: torch.Tensor, finite: torch.Tensor) -> None:
    """Set the header's first flags byte of the device ``payload`` when the 0-d bool device
    flag ``finite`` (the codec's ``last_finite``) is False, with no host read.

    A compress into a device payload does not raise for non-finite input (``nan_policy=
    "raise"``); it rolls the codec state back and leaves the verdict on the device. The payload
    still goes out, and some decode finite all the same (randomk without the bad positions,
    topk with fp16 values clamping inf), so the owner's sum check alone would let a rejected
    input through. The marked flags fail the owner's deferred header check, which names this
    sender in its abort record."""
    payload[_FLAGS:_FLAGS + 1].copy_(torch.logical_not(finite).reshape(1))


def _expected_head(codec: Codec, key: int, step: int) -> Header:
    """The header ``codec``'s payload of ``key`` at ``step`` must carry (lr is not checked)."""
    return Header(codec.codec_id, key, codec.numel, step, None, codec.fingerprint)


def reduce_shard_deferred(ex: BucketExchange, lr: float | None) -> None:
    """Step 4 without host reads: :func:`reduce_shard`'s checks folded into device flags.

    Every push is decode-added with no header read; its header is compared on the device, and
    the running sum's finiteness recorded after each push (so the first sender whose push makes
    it non-finite is known, as ``check_sum`` finds it on the host). When a push fails, the sum
    is zeroed before the server codec compresses it (its residual takes zeros; the state stops
    at the error anyway) and the first 8 bytes of ``agg`` become the abort record naming the
    first failing sender: one with a bad header, else the first non-finite partial sum.
    A codec's own decode check that raises (host side) falls back to :func:`reduce_shard`.

    Under ``nan_policy="skip"`` (``ex.skip``) a marked push with every header valid is no
    failure: the sum is filled with NaN before the server codec compresses it (a compress into
    a device payload then keeps the codec state as it was; one into a host payload raises,
    state kept too) and the skip record naming the first marked sender replaces the aggregate.
    """
    c = ex.codecs
    key = bucket_key(ex.index, c.rank, c.world)
    head = _expected_head(c.server, key, ex.step)
    bad = c.header_mismatch(c.recv, c.expected([head]), flags=not ex.skip)
    skipping = ~bad.any() & c.marked(c.recv).any() if ex.skip else None
    c.acc.zero_()
    finite = []
    try:
        for src in range(c.world):
            if c.server.numel:
                body = c.payload(c.recv, src, c.rank)[HEADER_BYTES:]
                c.server._decode_add(body, c.acc, 1.0, head)
            finite.append(torch.isfinite(c.acc).all())
    except ValueError:
        reduce_shard(ex, lr)  # today's checks name the sender (a PayloadError), or it passes
        return
    sums_finite = torch.stack(finite)
    if skipping is not None:
        sums_finite = sums_finite | skipping
    culprits = torch.where(bad.any(), bad, ~sums_finite)
    ok = ~culprits.any()
    if c.world != 1:
        c.acc.div_(c.world)
    c.acc.masked_fill_(~ok, 0.0)
    if skipping is not None:
        c.acc.masked_fill_(skipping, float("nan"))
    try:
        c.server.compress(c.acc, key=key, step=ex.step, lr=lr,
                          out=c.agg[:c.server.payload_bytes])
    except ValueError:  # only a host payload raises, and only for the NaN of a skip
        if skipping is None or c.agg.device.type != "cpu" or not bool(skipping):
            raise
    k = c.consts()
    head_bytes = c.agg[:_ABORT.size]
    record = _record(k, "prefix", torch.where(culprits, k["ranks"], c.world).min())
    if skipping is not None:
        marked = c.marked(c.recv)
        skip = _record(k, "skip", torch.where(marked, k["ranks"], c.world).min())
        record = torch.where(ok, skip, record)
        ok = ok & ~skipping
    head_bytes.copy_(torch.where(ok, head_bytes, record))


def _record(k: dict[str, torch.Tensor], magic: str, rank: torch.Tensor) -> torch.Tensor:
    """An abort (``magic="prefix"``) or skip record naming the 0-d device ``rank``."""
    return torch.cat([k[magic], ((rank >> k["shifts"]) & 0xFF).to(torch.uint8)])


def finish_deferred(job: BucketExchange) -> torch.Tensor:
    """Step 6 without host reads: decode every shard into the bucket buffer, fold the header
    checks (an abort record fails them too) and finiteness into one 0-d bool device tensor, and
    zero the buffer on the device when it is False. Returns a (2,) bool device tensor: that
    flag, and whether the bucket was skipped (``nan_policy="skip"``: a skip record among the
    aggregates, the others passing; the buffer is then filled with inf). A codec's own decode
    check that raises falls back to :func:`finish` (which raises the PayloadError)."""
    c, buf = job.codecs, job.buffer
    heads = [_expected_head(w, bucket_key(job.index, s, c.world), job.step)
             for s, w in enumerate(c.workers)]
    bad = c.header_mismatch(c.gathered, c.expected(heads))
    skips = c.skip_records(c.gathered) if job.skip else torch.zeros_like(bad)
    finite = []
    try:
        for s, (lo, hi) in enumerate(c.bounds):
            out = buf[lo:hi] if buf.dtype == torch.float32 else c.stage(hi - lo)
            if hi > lo:
                c.workers[s]._decode(c.payload(c.gathered, s, s)[HEADER_BYTES:], out, heads[s])
            finite.append(torch.isfinite(out).all())
            if buf.dtype != torch.float32:
                buf[lo:hi].copy_(out)
    except ValueError:
        return torch.tensor([True, finish(job)], device=buf.device)
    ok = ~(bad & ~skips).any() & (torch.stack(finite) | skips).all()
    skipped = ok & skips.any()
    buf.masked_fill_(~ok, 0)
    buf.masked_fill_(skipped, float("inf"))
    return torch.stack([ok, skipped])


class DeviceCheck:
    """The flags of one deferred bucket (:func:`finish_deferred`: passed, skipped) on their way
    to the host: on CUDA a non-blocking copy into pinned memory and an event recorded after it
    on the current stream (in step 6 the stream its kernels ran on); on the CPU the flags
    themselves, complete already."""

    def __init__(self, job: BucketExchange, ok: torch.Tensor) -> None:
        self.job = job
        self.event: torch.cuda.Event | None = None
        if ok.device.type == "cuda":
            self.flag = torch.empty(ok.shape, dtype=torch.bool, device="cpu", pin_memory=True)
            self.flag.copy_(ok, non_blocking=True)
            self.event = torch.cuda.Event()
            # on ok's device: Event.record() without a stream takes torch.cuda.current_stream()
            # of the thread's current device (torch/cuda/streams.py, Event.record), which on a
            # communication thread (gloo's, for CUDA tensors) need not be the bucket's
            self.event.record(torch.cuda.current_stream(ok.device))
        else:
            self.flag = ok

    def passed(self) -> bool:
        """The flag; on CUDA waits for the event first (``cudaEventSynchronize``: only this
        bucket's step 6, not the streams' later work; read one iteration later, it has
        usually completed, and the wait returns at once)."""
        if self.event is not None:
            self.event.synchronize()
        return bool(self.flag[0])

    @property
    def skipped(self) -> bool:
        """Whether the bucket was skipped (read after :meth:`passed`)."""
        return bool(self.flag[1])


def raise_failed(job: BucketExchange) -> None:
    """A deferred bucket failed on the device: re-run the immediate checks on its buffers
    (``recv`` and ``gathered`` are intact until the bucket's next step) to raise the same
    :class:`PayloadError` as they would have: the owner's push checks first, then the replies."""
    c = job.codecs
    key = bucket_key(job.index, c.rank, c.world)
    senders = [f"rank {src}" for src in range(c.world)]
    pushes = [c.payload(c.recv, src, c.rank) for src in range(c.world)]
    scratch = torch.zeros_like(c.acc)
    marked = [job.skip and int(p[_FLAGS]) != 0 for p in pushes]  # skipped, not failed
    for who, p, skip in zip(senders, pushes, marked):
        add_push(c.server, p, None if skip else scratch, key=key, step=job.step, sender=who,
                 label=job.label(c.rank))
        if not skip:
            _check_marked(p, who, key, job.label(c.rank))
    if not any(marked):
        check_sum(scratch, c.server, pushes, senders, key=key, label=job.label(c.rank))
    for s, (lo, hi) in enumerate(c.bounds):
        p = c.payload(c.gathered, s, s)
        if job.skip and _is_skip_record(p):
            continue
        _check_abort(job, p, s)
        decode_reply(c.workers[s], p, torch.empty(hi - lo, device=c.acc.device),
                     key=bucket_key(job.index, s, c.world), step=job.step,
                     sender=f"rank {s} (owner of shard {s})", label=job.label(s))
    raise PayloadError(f"{job.label(c.rank)}: the device-side checks of bucket {job.index} "
                       f"failed, but the host-side checks pass", key=key, stage="pull")

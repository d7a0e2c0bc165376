"""Device-side ("deferred") checks of :class:`~gradpress.fsdp.CompressedReduceScatter`.

On CUDA (any device when ``FSDPCompressionState._defer`` is True) the owner's checks of the
payloads it receives run on the device, with no host read, on the stream FSDP2 calls the comm on
(its reduce-scatter stream):

1. Each received header is compared with the expected one on the device (the bytes
   ``Codec.check_header`` compares, and the flags, where a sender marks a rejected input), the
   expected bytes packed on the host and copied in from pinned memory without blocking.
2. Every payload is decode-added in rank order with no header read; the running sum's
   finiteness is recorded after each one.
3. FSDP2's op is applied; when a header or a partial sum failed, the sum is zeroed (the output
   shard FSDP2 reads is zeros, never garbage) and one 0-d flag says so.
4. The flag goes to pinned host memory with a non-blocking copy and an event recorded on the
   stream (:class:`gradpress.ddp.checks.DeviceCheck`, the DDP hook's). It is read at this state's
   first compressed reduce-scatter of a later step (the next backward pass: the same point on
   every rank), before anything is sent, or by :meth:`FSDPCompressionState.check_pending`; a
   failed flag re-runs the host checks on the received payloads (intact until that module's
   next call) to raise the same :class:`~gradpress.ps.errors.PayloadError`, naming the sender.

A codec's own decode check that raises (host side) falls back to the immediate checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..compress.header import HEADER_BYTES, Header, pack_header
from ..ddp.buckets import _CHECKED
from ..ddp.checks import DeviceCheck
from ..ps.errors import PayloadError

if TYPE_CHECKING:
    from ..compress import Codec


class CodecsView(Protocol):
    """What the checks read of :class:`gradpress.fsdp.state.ModuleCodecs` (named structurally:
    state and comm import this module)."""

    world: int
    rank: int
    shard: int
    slot: int
    decoder: Codec
    recv: torch.Tensor
    acc: torch.Tensor
    checked: torch.Tensor | None

    def payload(self, buf: torch.Tensor, i: int) -> torch.Tensor: ...


class CommView(Protocol):
    """What step 4 calls of :class:`gradpress.fsdp.CompressedReduceScatter`."""

    name: str

    def key(self, shard: int, world: int) -> int: ...

    def _reduce_own(self, codecs: Any, step: int, factor: tuple[str, float] | None,
                    output: torch.Tensor) -> None: ...

__all__ = ["PendingReduce", "ReduceCheck", "reduce_own_deferred", "raise_failed"]


@dataclass
class PendingReduce:
    """What a failed flag needs to re-run the host checks of one call (the job of its
    :class:`~gradpress.ddp.checks.DeviceCheck`)."""

    comm: CommView
    codecs: CodecsView
    step: int
    factor: tuple[str, float] | None


class ReduceCheck(DeviceCheck):
    """The DDP hook's :class:`~gradpress.ddp.checks.DeviceCheck` (pinned copy, event) holding
    the flag of one reduce-scatter call: step 4."""

    job: PendingReduce  # type: ignore[assignment]  # the same role as a bucket's exchange

    def __init__(self, job: PendingReduce, ok: torch.Tensor) -> None:
        super().__init__(job, ok)  # type: ignore[arg-type]


def _expected(codecs: CodecsView, head: Header) -> torch.Tensor:
    """The header bytes of ``head`` on the receive buffer's device (no blocking copy)."""
    raw = torch.empty(HEADER_BYTES, dtype=torch.uint8, device="cpu")  # whatever the default
    pack_header(raw, head)
    dev = codecs.recv.device
    return raw if dev.type == "cpu" else raw.pin_memory().to(dev, non_blocking=True)


def _mask(codecs: CodecsView) -> torch.Tensor:
    """Bool (HEADER_BYTES,): the header bytes compared, made on the device by kernels."""
    if codecs.checked is None:
        mask = torch.zeros(HEADER_BYTES, dtype=torch.bool, device=codecs.recv.device)
        for lo, hi in _CHECKED:
            mask[lo:hi].fill_(True)
        codecs.checked = mask
    return codecs.checked


def reduce_own_deferred(codecs: CodecsView, key: int, step: int,
                        factor: tuple[str, float] | None,
                        output: torch.Tensor) -> torch.Tensor | None:
    """Steps 1-3 for the shard this rank owns; returns the (1,) bool device flag "passed",
    or None when a codec's host-side decode check raised (the caller runs the immediate
    checks)."""
    dec, world = codecs.decoder, codecs.world
    head = Header(dec.codec_id, key, codecs.shard, step, None, dec.fingerprint)
    heads = codecs.recv.view(world, codecs.slot)[:, :HEADER_BYTES]
    bad = ((heads != _expected(codecs, head)) & _mask(codecs)).any()  # 1.
    acc = codecs.acc
    acc.zero_()
    finite = []
    try:
        for src in range(world):  # 2. rank order, as the immediate path
            dec._decode_add(codecs.payload(codecs.recv, src)[HEADER_BYTES:], acc, 1.0, head)
            finite.append(torch.isfinite(acc).all())
    except ValueError:
        return None
    if factor is not None:  # 3.
        (acc.div_ if factor[0] == "div" else acc.mul_)(factor[1])
    ok = ~bad & torch.stack(finite).all()
    acc.masked_fill_(~ok, 0.0)
    output.reshape(-1).copy_(acc)
    return ok.reshape(1)


def raise_failed(job: PendingReduce) -> None:
    """Step 4 for a failed flag: the host checks on the payloads received then, which raise
    the PayloadError naming the sender."""
    scratch = torch.empty(job.codecs.shard, dtype=torch.float32, device=job.codecs.acc.device)
    job.comm._reduce_own(job.codecs, job.step, job.factor, scratch)
    key = job.comm.key(job.codecs.rank, job.codecs.world)
    raise PayloadError(f"gradpress.fsdp rank {job.codecs.rank}, module {job.comm.name!r} shard "
                       f"{job.codecs.rank} (key {key}, step {job.step}): the device-side checks "
                       f"failed, but the host-side checks pass", key=key, stage="push")

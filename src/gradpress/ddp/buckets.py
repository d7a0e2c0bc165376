"""Per-bucket codecs, wire buffers and the validated receive paths of the DDP hook.

Internal to :mod:`gradpress.ddp` (steps 4 and 6 of
:func:`~gradpress.ddp.two_way_compression_hook`). Every payload a rank decodes comes from
another process and is checked before use, with the parameter-server checks of
:mod:`gradpress.ps.protocol`; a bad one raises :class:`~gradpress.ps.errors.PayloadError` naming
the sending rank, the bucket index and shard, and what was wrong:

1. pushes a rank serves as the owner of a shard (step 4), by the parameter server's own
   :func:`~gradpress.ps.reduce.reduce_pushes`: codec header (magic, version, codec id, numel,
   config fingerprint, size, the expected key and step) before each decode, then the codec's
   own decode checks; the average must be finite, which the server codec's recompression checks
   (no extra pass): if it is not, the pushes are re-added in rank order to name the first sender
   whose push makes it so. An owner that rejects a push still takes part in the all-gather, with
   an abort record instead of its aggregate, so the other ranks fail at once naming the sender;
2. replies (step 6): the abort record, then header as in 1, then the decoded shard must be finite.

A rejected bucket's buffer is zeroed on every rank that raises: nothing of it reaches a gradient.

Non-finite gradients (``nan_policy``, shared with ``gp.DistributedOptimizer``). A sender whose
shard is not finite marks its push (the header's first flags byte; its codec state is kept as
it was). Under ``"raise"`` the owner rejects a marked push as above. Under ``"skip"`` (mixed
precision: fp16 gradients overflow at a too large loss scale) a marked push with a valid header
is no error: the owner sends a skip record (magic ``b"GS"``, the first marked sender's rank)
instead of its aggregate, its server codec state untouched, and every rank that finds a skip
record among the aggregates fills the whole bucket with inf. So every rank hands DDP the same
non-finite bucket, a ``torch.amp.GradScaler`` skips the step and lowers its scale, and the
hook goes on with the next iteration. Header errors and non-finite averages of unmarked pushes
stay errors under both policies.

Deferred checks (the default for CUDA buckets; ``TwoWayCompressionState._defer`` selects them on
any device). The checks above read headers and finiteness flags on the host, and each read waits
for the device (a ``cudaStreamSynchronize``) on the autograd thread, once per bucket and payload,
which serialises backward with the exchange. The deferred paths (``reduce_shard_deferred`` and
``finish_deferred`` in :mod:`gradpress.ddp.checks`) run the same checks as device ops with no
host read: headers are compared byte for byte with the expected ones (copied in from pinned
memory without blocking), and header validity, abort records and finiteness fold into one flag
per bucket. A failed bucket is zeroed on the device (``masked_fill_``) and handed to DDP as
zeros; the owner of a shard with a bad push sends an abort record built on the device. The
flag reaches the host through a non-blocking copy and an event (``DeviceCheck``); the hook reads
it at its first call of the next iteration (the same point on every rank), where a failed flag
raises the same :class:`~gradpress.ps.errors.PayloadError` as the immediate checks:
``raise_failed`` re-runs them on the bucket's buffers, still intact then. So an error is raised
one step late, after one optimizer step that saw the bucket as zeros.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..compress.header import HEADER_BYTES, Header, pack_header
from ..ps.errors import PayloadError
from ..ps.protocol import decode_reply
from ..ps.reduce import reduce_pushes

if TYPE_CHECKING:
    from ..compress import Codec

__all__ = ["shard_bounds", "bucket_key", "all_gather_async", "BucketCodecs", "BucketExchange",
           "reduce_shard", "finish", "write_rejected"]

# An owner that rejected a push sends this instead of its aggregate: magic b"GX" (never a payload
# header's b"GP"), 2 zero bytes, the rejected sender's rank (uint32, _NO_RANK when not one rank).
_ABORT = struct.Struct("<2s2xI")
_ABORT_MAGIC = b"GX"
# Under nan_policy="skip": an owner that received a marked push sends this (same layout) instead.
_SKIP_MAGIC = b"GS"
_NO_RANK = 0xFFFFFFFF
# Header bytes compared by the deferred checks: those Codec.check_header compares (magic, codec
# id, version, key, numel, step: bytes 0-23; fingerprint: 32-35), and the flags (36-39, 0 in
# every payload a codec writes), where a sender marks a push whose input it rejected
# (``checks.mark_rejected``); not lr (24-31).
_CHECKED = [(0, 24), (32, 40)]
_FLAGS = 36


def shard_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """Shard s = [lo, hi) of a bucket of ``numel``; fixed by (numel, world) so all ranks agree."""
    base, rem = divmod(numel, world)
    bounds, lo = [], 0
    for s in range(world):
        hi = lo + base + (1 if s < rem else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def bucket_key(index: int, shard: int, world: int) -> int:
    """The header key of (bucket ``index``, ``shard``): index * world + shard."""
    key = index * world + shard
    if key >= 2**32:
        raise ValueError(f"bucket {index} shard {shard}: key {key} does not fit the 32-bit header "
                         f"key field (world size {world})")
    return key


def all_gather_async(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Start an all-gather of ``inp`` into ``out`` (all_gather_single where torch has it, which
    replaces the deprecated all_gather_into_tensor); returns the work handle."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


class BucketCodecs:
    """Codecs and fixed-size wire buffers of one bucket layout on one rank.

    ``workers[s]`` compresses shard s (worker side, with its own residual); ``server`` recompresses
    the average of shard ``rank`` (server side, with the server residual). Every payload travels in
    a slot of ``slot`` bytes (the largest shard payload), so all messages have a fixed size.
    """

    def __init__(self, layout: tuple, numel: int, world: int, rank: int,
                 build: Any, device: torch.device) -> None:
        self.layout, self.numel, self.world, self.rank = layout, numel, world, rank
        self.bounds = shard_bounds(numel, world)
        self.workers: list[Codec] = [build(hi - lo) for lo, hi in self.bounds]
        lo, hi = self.bounds[rank]
        self.server: Codec = build(hi - lo)
        self.slot = max(c.payload_bytes for c in self.workers)
        u8: dict[str, Any] = dict(dtype=torch.uint8, device=device)
        self.send = torch.zeros(world * self.slot, **u8)
        self.recv = torch.zeros(world * self.slot, **u8)
        self.agg = torch.zeros(self.slot, **u8)
        self.gathered = torch.zeros(world * self.slot, **u8)
        self.acc = torch.zeros(hi - lo, dtype=torch.float32, device=device)
        self._stage: torch.Tensor | None = None  # fp32 decode target for non-fp32 buckets
        self._consts: dict[str, torch.Tensor] | None = None  # of the deferred checks

    def consts(self) -> dict[str, torch.Tensor]:
        """Small constants of the deferred checks, made on the device by kernels (no copy)."""
        if self._consts is None:
            dev = self.acc.device
            mask = torch.zeros(HEADER_BYTES, dtype=torch.bool, device=dev)
            for lo, hi in _CHECKED:
                mask[lo:hi].fill_(True)
            unflagged = mask.clone()
            unflagged[_FLAGS:_FLAGS + 4].fill_(False)
            prefix, skip = (torch.zeros(4, dtype=torch.uint8, device=dev) for _ in range(2))
            for i in range(2):  # b"GX" / b"GS", 2 zero bytes
                prefix[i:i + 1].fill_(_ABORT_MAGIC[i])
                skip[i:i + 1].fill_(_SKIP_MAGIC[i])
            self._consts = {"mask": mask, "unflagged": unflagged, "prefix": prefix, "skip": skip,
                            "ranks": torch.arange(self.world, device=dev),
                            "shifts": torch.arange(0, 32, 8, device=dev)}
        return self._consts

    def expected(self, heads: Sequence[Header]) -> torch.Tensor:
        """The header bytes of ``heads`` as a (len(heads), HEADER_BYTES) uint8 tensor on the
        device: packed on the host, copied in from pinned memory without blocking (the caching
        host allocator keeps the block until the copy has run)."""
        raw = torch.empty(len(heads), HEADER_BYTES, dtype=torch.uint8, device="cpu")
        for row, h in zip(raw, heads):
            pack_header(row, h)
        if self.acc.device.type == "cpu":
            return raw
        return raw.pin_memory().to(self.acc.device, non_blocking=True)

    def header_mismatch(self, buf: torch.Tensor, expected: torch.Tensor,
                        flags: bool = True) -> torch.Tensor:
        """Bool (world,): whether the header of slot i of ``buf`` differs from ``expected``
        (one row per slot, or one row for all) in a checked byte (``flags=False``: not the
        flags, where a sender marks a rejected input); device ops only."""
        heads = buf.view(self.world, self.slot)[:, :HEADER_BYTES]
        return ((heads != expected) & self.consts()["mask" if flags else "unflagged"]).any(dim=1)

    def marked(self, buf: torch.Tensor) -> torch.Tensor:
        """Bool (world,): whether slot i of ``buf`` is marked rejected by its sender."""
        return self.slots(buf)[:, _FLAGS] != 0

    def skip_records(self, buf: torch.Tensor) -> torch.Tensor:
        """Bool (world,): whether slot i of ``buf`` holds a skip record; device ops only."""
        return (self.slots(buf)[:, :4] == self.consts()["skip"]).all(dim=1)

    def slots(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` (``world`` slots) as a (world, slot) view."""
        return buf.view(self.world, self.slot)

    def payload(self, buf: torch.Tensor, i: int, shard: int) -> torch.Tensor:
        """The bytes of slot i of ``buf`` that hold a payload of shard ``shard``."""
        return buf[i * self.slot: i * self.slot + self.workers[shard].payload_bytes]

    def stage(self, n: int) -> torch.Tensor:
        """A reused float32 buffer of ``n`` (<= the largest shard) elements."""
        if self._stage is None:
            self._stage = torch.empty(self.bounds[0][1], dtype=torch.float32,
                                      device=self.acc.device)
        return self._stage[:n]

    @property
    def shapes(self) -> list[list[int]]:
        """The shapes of the bucket's parameters, in bucket order (its layout across processes:
        DDP's first buckets and its rebuilt ones can hold the same elements in another order)."""
        return [list(shape) for shape, _ in self.layout[-1]]

    def state_dict(self) -> dict[str, Any]:
        return {"numel": self.numel, "world_size": self.world, "rank": self.rank,
                "shapes": self.shapes, "worker": [c.state_dict() for c in self.workers],
                "server": self.server.state_dict()}

    def matches(self, saved: Mapping[str, Any]) -> bool:
        """Whether ``saved`` (a :meth:`state_dict`) belongs to this layout: same size, world,
        rank and (when saved, as every state since the shapes were added is) parameter shapes."""
        if "shapes" in saved and [list(s) for s in saved["shapes"]] != self.shapes:
            return False
        return (saved.get("numel"), saved.get("world_size"), saved.get("rank")) == \
            (self.numel, self.world, self.rank) and len(saved.get("worker", ())) == self.world

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        for c, s in zip(self.workers, saved["worker"]):
            c.load_state_dict(s)
        self.server.load_state_dict(saved["server"])


class BucketExchange:
    """A bucket whose payload exchange (step 3) is in flight."""

    def __init__(self, index: int, buffer: torch.Tensor, codecs: BucketCodecs, step: int,
                 group: Any, work: Any, *, iteration: int = 0, deferred: bool = False,
                 skip: bool = False) -> None:
        self.index, self.buffer, self.codecs, self.step = index, buffer, codecs, step
        self.group, self.work = group, work
        self.iteration, self.deferred = iteration, deferred
        self.skip = skip  # nan_policy="skip": a marked push skips the bucket (module docstring)
        # A CUDA bucket needs a CUDA-aware future (torch/futures/__init__.py, Future.__init__
        # and set_result): set_result then records an event on the current stream, the one
        # step 6 enqueued its decode kernels on (the pool stream of the all-gather's callback),
        # and DDP's wait() makes its own stream wait for it. A future without devices records
        # nothing (ATen/core/ivalue_inl.h, Future::markCompleted: "users using CUDA values but
        # forgetting to set devices ... silent synchronization/correctness issue"), so DDP could
        # read the bucket before those kernels ran. CPU buckets keep the plain future.
        devices: list[int | str | torch.device] | None = \
            [buffer.device] if buffer.device.type == "cuda" else None
        self.future: torch.futures.Future = torch.futures.Future(devices=devices)

    def label(self, shard: int) -> str:
        """Where a check failed, as error messages name it."""
        c = self.codecs
        return (f"DDP hook rank {c.rank}, bucket {self.index} shard {shard} (key "
                f"{bucket_key(self.index, shard, c.world)}, step {self.step})")


def _check_marked(p: torch.Tensor, who: str, key: int, label: str) -> None:
    """Raise when ``who`` marked its push as rejected (``checks.mark_rejected``)."""
    if int(p[_FLAGS]) != 0:
        raise PayloadError(f"{label}: push from {who} rejected: the sender's input has "
                           f"non-finite values (NaN/inf)", key=key, peer=who, stage="push")


def write_rejected(codec: Codec, out: torch.Tensor, *, key: int, step: int,
                   lr: float | None) -> None:
    """Under ``nan_policy="skip"``: the push of a shard whose compress into the host payload
    ``out`` raised for non-finite input (its codec state kept as it was): the header the codec
    would have written, marked rejected; the body is not read (the owner skips the bucket)."""
    pack_header(out, Header(codec.codec_id, key, codec.numel, step, lr, codec.fingerprint))
    out[_FLAGS:_FLAGS + 1].fill_(1)


def _check_pushes_marked(ex: BucketExchange, pushes: list[tuple[str, torch.Tensor]]) -> list[int]:
    """Raise for the first push in rank order that is marked rejected or has a bad header
    (the order of the deferred checks, which treat both as a header mismatch); a push with a
    bad header before any marked one is left to ``reduce_pushes``, which names it the same.
    Under ``nan_policy="skip"`` a marked push is no error: returns the marked senders' ranks
    when every header is valid (else [], and ``reduce_pushes`` names the bad header)."""
    c = ex.codecs
    key, label = bucket_key(ex.index, c.rank, c.world), ex.label(c.rank)
    marked = []
    for src, (who, p) in enumerate(pushes):
        try:
            c.server.check_header(p, key=key, step=ex.step, sender=who)
        except ValueError:
            return []
        if not ex.skip:
            _check_marked(p, who, key, label)
        elif int(p[_FLAGS]) != 0:
            marked.append(src)
    return marked


def reduce_shard(ex: BucketExchange, lr: float | None) -> None:
    """Step 4: the server side of this rank's shard, :func:`~gradpress.ps.reduce.reduce_pushes`
    (validate and decode-add every rank's push in rank order, average, recompress into ``agg``).

    On a :class:`PayloadError` ``agg`` holds an abort record naming the rejected sender, to be
    all-gathered in place of the aggregate.
    """
    c = ex.codecs
    senders = [f"rank {src}" for src in range(c.world)]
    pushes = [(who, c.payload(c.recv, src, c.rank)) for src, who in enumerate(senders)]
    try:
        marked = _check_pushes_marked(ex, pushes)
        if marked:  # nan_policy="skip": a sender's input was not finite; server state kept
            _write_record(c, _SKIP_MAGIC, marked[0])
            return
        reduce_pushes(pushes, c.server, c.server, c.acc, key=bucket_key(ex.index, c.rank, c.world),
                      step=ex.step, lr=lr, divisor=c.world, label=ex.label(c.rank),
                      out=c.agg[:c.server.payload_bytes])
    except PayloadError as e:
        _write_record(c, _ABORT_MAGIC, senders.index(e.peer) if e.peer in senders else None)
        raise


def finish(job: BucketExchange) -> bool:
    """Step 6 (all-gather done): validate every shard's aggregate and decode it into the bucket
    buffer. On a :class:`PayloadError` the buffer is zeroed before it is raised. Under
    ``nan_policy="skip"`` a skip record among the aggregates fills the buffer with inf once the
    others passed; returns whether it did."""
    c, buf = job.codecs, job.buffer
    skipped = False
    try:
        for s, (lo, hi) in enumerate(c.bounds):
            p, label = c.payload(c.gathered, s, s), job.label(s)
            if job.skip and _is_skip_record(p):
                skipped = True
                continue
            _check_abort(job, p, s)
            out = buf[lo:hi] if buf.dtype == torch.float32 else c.stage(hi - lo)
            decode_reply(c.workers[s], p, out, key=bucket_key(job.index, s, c.world),
                         step=job.step, sender=f"rank {s} (owner of shard {s})", label=label)
            if buf.dtype != torch.float32:
                buf[lo:hi].copy_(out)
    except PayloadError:
        buf.zero_()
        raise
    if skipped:
        buf.fill_(float("inf"))
    return skipped


def _write_record(c: BucketCodecs, magic: bytes, culprit: int | None) -> None:
    """Put an abort or skip record naming ``culprit`` at the head of ``agg``."""
    raw = _ABORT.pack(magic, _NO_RANK if culprit is None else culprit)
    c.agg[:_ABORT.size].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def _is_skip_record(p: torch.Tensor) -> bool:
    return bytes(p[:len(_SKIP_MAGIC)].cpu().numpy()) == _SKIP_MAGIC


def _check_abort(job: BucketExchange, p: torch.Tensor, owner: int) -> None:
    """Raise when the owner of this shard sent an abort record instead of its aggregate."""
    magic, culprit = _ABORT.unpack(bytes(p[:_ABORT.size].cpu().numpy()))
    if magic != _ABORT_MAGIC:
        return
    who = "a push" if culprit == _NO_RANK else f"the push from rank {culprit}"
    raise PayloadError(f"{job.label(owner)}: rank {owner}, the owner of this shard, rejected {who} "
                       f"and aborted bucket {job.index} (rank {owner}'s error says why)",
                       key=bucket_key(job.index, owner, job.codecs.world),
                       peer=None if culprit == _NO_RANK else f"rank {culprit}", stage="push")

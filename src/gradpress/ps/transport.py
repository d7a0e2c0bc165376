"""Point-to-point transport: gloo ``isend``/``irecv`` with timeouts and descriptive errors.

Payloads are uint8 CPU tensors sent with the chunk's key as the gloo tag; gloo matches messages
per (peer, tag) in order. Gloo cannot send to its own rank, so messages between a colocated
worker and the server engine in the same process go through an in-process mailbox with the same
semantics. Within a process a tag is used in two directions (a colocated worker receives the
reply of key K while its server receives the pushes of key K), so every message names its
``lane``: ``"push"`` (worker to server) or ``"pull"`` (server to worker); gloo needs no lanes
because a key's pushes and replies between two processes never share a direction. A gloo wait
that times out closes the link to that peer (gloo's behaviour): timeouts
are fatal and raise :class:`~gradpress.ps.errors.CommTimeoutError` naming key, peer and stage.

Payloads (every tag but ``CTRL_TAG``) travel over gloo *framed*: gloo completes a receive with a
message shorter than the posted buffer without saying so, leaving the buffer's tail from an
earlier message. So the sender appends a trailer of ``FRAME_BYTES`` (the payload header's key
and step, copied), the receiver fills the trailer with ``0xFF`` before posting, and after the
receive the trailer must equal the header it arrived with; otherwise the message was truncated
(or corrupted) and :class:`~gradpress.ps.errors.PayloadError` names the sender and the key.
Payload buffers therefore come from :func:`payload_buffer`, which leaves room for the trailer.
(A message *longer* than the posted buffer makes gloo abort the receiving process.)

Small pushes travel *inline*: the control message, the payload and its trailer in one message
on ``CTRL_TAG`` (:meth:`Transport.isend_inline`), one gloo message per push instead of two.
Every payload buffer therefore keeps ``HEAD_ROOM`` bytes in front of it for the control
message. The receiver posts a buffer of ``INLINE_BYTES`` on ``CTRL_TAG``, learns the payload's
size from the control message and checks the trailer at that place
(:func:`inline_payload`).

Flow control: :class:`BufferPool` lends payload buffers per chunk in flight, so a worker holds
wire buffers only for the bytes it has in flight (bounded by ``inflight_bytes``, which
:class:`ByteBudget` enforces), not one pair per key of the whole model. A worker takes a send
and a receive buffer for a chunk when the chunk enters the pipeline and gives both back when
its reply is decoded. Given-back buffers are kept, per size, for the next chunk of that size (a
step of the same model asks for the same sizes again, and fresh large buffers cost page
faults), up to ``keep_bytes`` in all; beyond that they are freed.
"""

from __future__ import annotations

import datetime
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..compress.header import HEADER_BYTES
from .errors import CommTimeoutError, PayloadError, PeerError

__all__ = ["Transfer", "Transport", "CTRL_TAG", "NO_LIMIT", "LANES", "FRAME_BYTES", "HEAD_ROOM",
           "INLINE_BYTES", "payload_buffer", "head_room", "fits_inline", "inline_payload",
           "BufferPool", "ByteBudget"]

#: Directions of messages: worker -> server ("push") and server -> worker ("pull").
LANES = ("push", "pull")

#: Tag of the fixed-size control messages (push announcements, stop).
CTRL_TAG = 1
#: Timeout value meaning "wait without limit" (used for a server's idle waits).
NO_LIMIT = 0.0
_FOREVER = datetime.timedelta(days=3650)
#: gloo's words for a connection the peer closed (process exit, crash, SIGKILL)
_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
#: Trailer behind every payload sent over gloo: header key (bytes 4-8) and step (16-24).
FRAME_BYTES = 12
#: Room in front of every payload buffer for the control message of an inline push.
HEAD_ROOM = 32
#: Largest message on ``CTRL_TAG``: control message, inline payload and trailer.
INLINE_BYTES = 256 << 10


def payload_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 payload buffer of ``nbytes``, with ``HEAD_ROOM`` bytes in front of it (for an
    inline push's control message) and room for the frame trailer behind it."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < HEADER_BYTES:
        raise ValueError(f"payload buffer size must be an int >= {HEADER_BYTES} (the header), "
                         f"got {nbytes!r}")
    full = torch.empty(HEAD_ROOM + nbytes + FRAME_BYTES, dtype=torch.uint8, device="cpu")
    view = full[HEAD_ROOM:HEAD_ROOM + nbytes]
    view._gp_frame = (full, full.numpy())  # type: ignore[attr-defined]
    return view


def fits_inline(nbytes: int) -> bool:
    """Whether a push of ``nbytes`` of payload travels inline (one message with its control)."""
    return HEAD_ROOM + nbytes + FRAME_BYTES <= INLINE_BYTES


def head_room(buf: torch.Tensor) -> torch.Tensor:
    """The ``HEAD_ROOM`` bytes in front of payload buffer ``buf`` (for its control message)."""
    return _frame_of(buf, "an inline push")[0][:HEAD_ROOM]


def _frame_of(buf: torch.Tensor, label: str) -> tuple[torch.Tensor, Any]:
    frame = getattr(buf, "_gp_frame", None)
    if frame is None:
        raise ValueError(f"the payload buffer of {label} has no room for the frame trailer: "
                         f"allocate it with gradpress.ps.transport.payload_buffer()")
    return frame


def _write_trailer(a: Any, n: int) -> None:
    """Trailer behind payload ``a[:n]``: the header's key and step, repeated."""
    a[n:n + 4] = a[4:8]
    a[n + 4:n + FRAME_BYTES] = a[16:24]


def _trailer_ok(a: Any, n: int) -> bool:
    return n >= HEADER_BYTES and len(a) >= n + FRAME_BYTES and \
        bytes(a[n:n + FRAME_BYTES]) == bytes(a[4:8]) + bytes(a[16:24])


def _frame(buf: torch.Tensor, label: str, is_send: bool) -> tuple[torch.Tensor, object]:
    """The framed tensor to post for payload ``buf`` and, for a receive, its numpy view."""
    full, a = _frame_of(buf, label)
    n = buf.numel()
    full, a = full[HEAD_ROOM:HEAD_ROOM + n + FRAME_BYTES], a[HEAD_ROOM:HEAD_ROOM + n + FRAME_BYTES]
    if is_send:  # the trailer repeats the header's key and step
        _write_trailer(a, n)
    else:  # a step's top byte is never 0xFF: an unwritten trailer cannot match
        a[n:] = 0xFF
    return full, a


def inline_payload(msg: torch.Tensor, nbytes: int) -> torch.Tensor | None:
    """The payload of ``nbytes`` behind the control message in ``msg`` (a received inline push
    of at most ``INLINE_BYTES``), or None if its trailer does not match its header (truncated
    or corrupted). The trailer is then overwritten, so that a later, truncated message in the
    same buffer cannot pass with this one's."""
    a = msg.numpy()[HEAD_ROOM:]
    if not fits_inline(nbytes) or not _trailer_ok(a, nbytes):
        return None
    a[nbytes:nbytes + FRAME_BYTES] = 0xFF
    return msg[HEAD_ROOM:HEAD_ROOM + nbytes]


class Transfer:
    """A posted send or receive; :meth:`wait` blocks until it completed."""

    def __init__(self, work: object, kind: str, peer: str, label: str,
                 context: Callable[[], str], frame: object = None) -> None:
        self._work = work
        self.kind = kind
        self.peer = peer
        self.label = label
        self._context = context
        self._frame = frame  # numpy view of a framed receive, checked when it completes
        self._done = False

    def wait(self, timeout: float, stage: str) -> None:
        """Wait up to ``timeout`` seconds (``NO_LIMIT``: forever); raise naming key/peer/stage."""
        if self._done:
            return
        limit = _FOREVER if timeout <= 0 else datetime.timedelta(seconds=timeout)
        try:
            self._work.wait(limit)  # type: ignore[attr-defined]
        except Exception as e:
            raise self._error(e, timeout, stage) from e
        if self._frame is not None:
            self._check_frame(stage)
        self._done = True

    def _check_frame(self, stage: str) -> None:
        a = self._frame
        if not _trailer_ok(a, len(a) - FRAME_BYTES):  # type: ignore[arg-type]
            raise PayloadError(f"{self.kind} of {self.label} from {self.peer} (stage: {stage}) "
                               f"rejected: the message is truncated or corrupted (its trailer "
                               f"does not match its header)", key=self.label, peer=self.peer,
                               stage=stage)

    def _error(self, e: Exception, timeout: float, stage: str) -> Exception:
        text = str(e)
        where = f"{self.kind} of {self.label} {'to' if self.kind == 'send' else 'from'} " \
                f"{self.peer} (stage: {stage})"
        cause = self._context()
        extra = f"; errors reported by other processes:\n{cause}" if cause else ""
        if "Timed out" in text or isinstance(e, TimeoutError):
            return CommTimeoutError(f"timed out after {timeout:g} s waiting for {where}; raise "
                                    f"GRADPRESS_TIMEOUT if the peer is just slow{extra}",
                                    key=self.label, peer=self.peer, stage=stage)
        first = text.splitlines()[0] if text else repr(e)
        if any(m in text for m in _GONE):  # the peer's process exited, crashed or was killed
            return PeerError(f"{self.peer} is gone (its connection closed: the process exited, "
                             f"crashed or was killed) during {where}; gloo: {first}{extra}",
                             key=self.label, peer=self.peer, stage=stage)
        return PeerError(f"{where} failed: {first}{extra}", key=self.label, peer=self.peer,
                         stage=stage)


class _LocalWork:
    """Completion flag of a message through the in-process mailbox."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.event = threading.Event()

    def wait(self, limit: datetime.timedelta) -> None:
        if not self.event.wait(limit.total_seconds()):
            raise TimeoutError("Timed out waiting for an in-process message")


class _Mailbox:
    """Matches sends and receives a process addresses to itself, per tag, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sends: dict[tuple[int, str], deque[_LocalWork]] = {}
        self._recvs: dict[tuple[int, str], deque[_LocalWork]] = {}

    def post(self, buf: torch.Tensor, tag: tuple[int, str], is_send: bool) -> _LocalWork:
        work = _LocalWork(buf)
        mine, theirs = (self._sends, self._recvs) if is_send else (self._recvs, self._sends)
        with self._lock:
            q = theirs.get(tag)
            if not q:
                mine.setdefault(tag, deque()).append(work)
                return work
            other = q.popleft()
            src, dst = (work, other) if is_send else (other, work)
            n = src.buf.numel()
            if n > dst.buf.numel():  # as gloo: a shorter message fills the buffer's front
                raise PeerError(f"in-process message with tag {tag}: {n} bytes sent, receive "
                                f"buffer holds {dst.buf.numel()}")
            dst.buf[:n].copy_(src.buf)
        other.event.set()
        work.event.set()
        return work


class Transport:
    """Sends and receives of one process over the world group (thread-safe)."""

    def __init__(self, rank: int, describe: Callable[[int], str],
                 context: Callable[[], str] = lambda: "") -> None:
        self.rank = rank
        self._describe = describe
        self._context = context
        self._mailbox = _Mailbox()
        self._lock = threading.Lock()

    def isend(self, buf: torch.Tensor, dst: int, tag: int, label: str, lane: str) -> Transfer:
        """Post a send of uint8 ``buf`` to world rank ``dst``; keep ``buf`` alive until waited."""
        return self._post(buf, dst, tag, label, lane, is_send=True)

    def irecv(self, buf: torch.Tensor, src: int, tag: int, label: str, lane: str) -> Transfer:
        """Post a receive into ``buf`` from world rank ``src`` (sizes must match the send)."""
        return self._post(buf, src, tag, label, lane, is_send=False)

    def isend_inline(self, buf: torch.Tensor, dst: int, label: str) -> Transfer:
        """Post payload buffer ``buf`` with the control message already in its
        :func:`head_room` and its trailer, as one message on ``CTRL_TAG`` (lane ``"push"``)."""
        full, a = _frame_of(buf, label)
        n = buf.numel()
        if not fits_inline(n):
            raise ValueError(f"inline push of {label}: {n} bytes of payload do not fit in "
                             f"{INLINE_BYTES} bytes with control message and trailer")
        _write_trailer(a[HEAD_ROOM:], n)
        return self._post(full[:HEAD_ROOM + n + FRAME_BYTES], dst, CTRL_TAG, label, "push",
                          is_send=True)

    def _post(self, buf: torch.Tensor, peer: int, tag: int, label: str, lane: str,
              is_send: bool) -> Transfer:
        kind = "send" if is_send else "receive"
        if lane not in LANES:
            raise ValueError(f"lane must be one of {', '.join(LANES)}, got {lane!r}")
        check = None
        if peer == self.rank:  # in-process: copied whole, no frame needed
            work: object = self._mailbox.post(buf, (tag, lane), is_send)
        else:
            if tag != CTRL_TAG:  # a payload: framed (see the module docstring)
                buf, a = _frame(buf, label, is_send)
                check = None if is_send else a
            with self._lock:
                try:
                    work = (dist.isend if is_send else dist.irecv)(buf, peer, tag=tag)
                except RuntimeError as e:
                    raise PeerError(f"posting {kind} of {label} with "
                                    f"{self._describe(peer)} failed: {e}", key=label,
                                    peer=self._describe(peer), stage="post") from e
        return Transfer(work, kind, self._describe(peer), label, self._context, check)


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


class ByteBudget:
    """Bytes in flight; ``acquire`` waits for room (a lone oversize chunk always fits).

    Waits end with the room, with the error given to :meth:`abort`, or after ``timeout``.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()

    def acquire(self, n: int, timeout: float, what: str) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: self.error is not None or self.used == 0
                                     or self.used + n <= self.limit, timeout)
            if self.error is not None:
                raise self.error
            if not ok:
                raise CommTimeoutError(f"timed out after {timeout:g} s waiting for in-flight "
                                       f"budget for {what} ({self.used} of {self.limit} bytes "
                                       f"in flight)", key=what, stage="budget")
            self.used += n

    def try_acquire(self, n: int) -> bool:
        """Take ``n`` bytes if there is room now (False after :meth:`abort`)."""
        with self._cond:
            if self.error is not None or (self.used and self.used + n > self.limit):
                return False
            self.used += n
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def abort(self, e: BaseException) -> None:
        with self._cond:
            self.error = e
            self._cond.notify_all()

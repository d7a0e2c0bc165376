"""Tensor fusion: small tensors that travel exact (fp32) share one key per bucket.

Every key costs a fixed amount per push, whatever its size: a control message, a header, two
transfers, a server reduce and a reply. A model's biases and norms are many small tensors that
travel exact anyway (below ``min_compress_bytes``); pushed one by one, they pay that cost each.
Fused, as Horovod's tensor fusion and DDP's buckets do, they pay it once per bucket:

1. :func:`fusion_groups` cuts an ordered list of tensors (their element counts) into buckets of
   consecutive tensors: a bucket takes the next tensor while its fp32 bytes stay within
   ``cap_bytes``; a tensor larger than the cap, or every tensor when the cap is 0, stands
   alone; where the optional ``breaks`` label changes (a device), a new bucket starts. The
   function is pure, so every worker computes the same buckets from the same list without
   communication. A bucket may align its members (``align``): each slice starts at a
   multiple of ``align`` elements, zeros in the gaps, so a block-scaled codec cuts every member
   into the blocks it would have alone.
2. :func:`fused_keys` names each bucket of two or more tensors after its members
   (:func:`fused_name`, a BLAKE2b digest of their names and sizes): a :class:`FusedKey`. A
   bucket of one tensor is not fused; that tensor keeps its own key.
3. At run time a :class:`Fuser` copies each member into its slice of the bucket's float32
   buffer as the member arrives (on CUDA on the arriving thread's current stream, with an
   event after each copy: the push waits for every member's event, whichever stream it
   came from), pushes the buffer under the fused key's name when the last
   member arrived (``push`` returns a :class:`~gradpress.ps.calls.Handle`), and hands out a
   :class:`FusedHandle` per member whose ``wait()`` returns that member's slice of the
   averaged buffer, shaped, typed and placed like the member. A member waited for before its
   bucket is complete pushes the bucket as it is (missing members as zeros): every worker
   does the same when the same members are missing.

Why the result is bit-identical to pushing each tensor alone: the exact codec (``none``)
copies fp32 values, and a server sums the workers' pushes element by element in worker rank
order starting from zero, then divides each element by the number of workers; no element's
result depends on the other elements of its key.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .calls import Handle
from .errors import CommTimeoutError

__all__ = ["FusedKey", "fusion_groups", "fused_keys", "fused_name", "Fuser", "FusedHandle",
           "FUSED_PREFIX"]

#: Fused keys are named ``FUSED_PREFIX + <first member> + ...``; see :func:`fused_name`.
FUSED_PREFIX = "gradpress.fused."
#: ``push(buffer, name) -> Handle``: the exact, averaging push_pull of a fused buffer.
Push = Callable[[torch.Tensor, str], Handle]


@dataclass(frozen=True, kw_only=True)
class FusedKey:
    """One bucket of tensors pushed together under :attr:`name`."""

    #: The name the bucket is pushed under.
    name: str
    #: The members' names, in the bucket's order (their slices follow this order).
    members: tuple[str, ...]
    #: The members' element counts, in the same order.
    numels: tuple[int, ...]
    #: Every member's slice starts at a multiple of ``align`` elements (zeros fill the gaps):
    #: with a block-scaled codec, the codec's block, so each member is cut into the same blocks
    #: as when pushed alone.
    align: int = 1
    #: Whether the bucket travels exact (fp32) whatever the pushes' codec: tensors kept exact
    #: by name share buckets of their own.
    exact: bool = False

    @property
    def numel(self) -> int:
        """Elements of the fused buffer (padding included)."""
        return self.offsets[-1] + self.numels[-1]

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each member's slice starts in the buffer."""
        out, at = [], 0
        for n in self.numels:
            out.append(at)
            at += -(-n // self.align) * self.align
        return tuple(out)


def _check_count(what: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what} must be an int >= 0, got {v!r}")
    return v


def fusion_groups(numels: Sequence[int], cap_bytes: int,
                  breaks: Sequence[Hashable] | None = None) -> list[range]:
    """Cut tensors of ``numels`` elements (fp32, in this order) into buckets (step 1).

    Args:
        numels: element counts, in the order every worker uses.
        cap_bytes: most fp32 bytes of a bucket; 0 puts every tensor alone.
        breaks: optional label per tensor (e.g. its device); a bucket never spans two labels.

    Returns:
        Consecutive, non-empty ranges of positions covering ``range(len(numels))``.
    """
    _check_count("cap_bytes", cap_bytes)
    if breaks is not None and len(breaks) != len(numels):
        raise ValueError(f"breaks has {len(breaks)} labels for {len(numels)} tensors; expected "
                         f"one label per tensor")
    groups: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(numels):
        nbytes = 4 * _check_count(f"numels[{i}]", n)
        same = breaks is None or i == 0 or breaks[i] == breaks[i - 1]
        if i > start and (not same or size + nbytes > cap_bytes):
            groups.append(range(start, i))  # the bucket is full: close it
            start, size = i, 0
        size += nbytes
    if len(numels) > start:
        groups.append(range(start, len(numels)))
    return groups


def fused_name(members: Sequence[str], numels: Sequence[int], align: int = 1,
               exact: bool = False) -> str:
    """The name of a fused key: its first member, how many others, a digest of all (step 2).

    The same members of the same sizes (and the same ``align`` and ``exact``) give the same
    name on every worker and in every run; any change gives another name, so another key.
    """
    text = "\x00".join(f"{m}\x01{n}" for m, n in zip(members, numels))
    if align != 1 or exact:
        text += f"\x02{align}\x02{int(exact)}"
    digest = hashlib.blake2b(text.encode(), digest_size=6, person=b"gradpress-fuse").hexdigest()
    return f"{FUSED_PREFIX}{members[0]}+{len(members) - 1}.{digest}"


def fused_keys(entries: Sequence[tuple[str, int]], cap_bytes: int,
               breaks: Sequence[Hashable] | None = None, *, align: int = 1,
               exact: bool = False) -> list[FusedKey]:
    """The fused keys of ``(name, numel)`` entries (steps 1-2): buckets of two or more, each
    member aligned to ``align`` elements, travelling exact where ``exact``."""
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise ValueError(f"align must be an int >= 1, got {align!r}")
    names = [n for n, _ in entries]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"fused_keys: tensor names must be unique, got {dup} more than once")
    numels = [n for _, n in entries]
    out = []
    for g in fusion_groups(numels, cap_bytes, breaks):
        if len(g) > 1:
            members, sizes = tuple(names[i] for i in g), tuple(numels[i] for i in g)
            out.append(FusedKey(name=fused_name(members, sizes, align, exact), members=members,
                                numels=sizes, align=align, exact=exact))
    return out


@dataclass(eq=False)
class _Round:
    """One push of one fused key: its buffer, the members that arrived, its handle."""

    key: FusedKey
    suffix: str
    buf: torch.Tensor
    arrived: set[str] = field(default_factory=set)
    launched: bool = False
    ready: threading.Event = field(default_factory=threading.Event)
    handle: Handle | None = None
    error: BaseException | None = None
    waited: set[str] = field(default_factory=set)  # members whose result was taken
    # CUDA: events recorded after the zero fill of ``buf`` and after each member's copy, on
    # the stream each ran on (a member arrives on the stream of its backward, another on the
    # main thread's); the push waits for all of them (:meth:`Fuser._launch`)
    created: Any = None
    copied: list[Any] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.key.name + self.suffix


class Fuser:
    """Packs the members of fused keys as they arrive and pushes each bucket (step 3).

    Args:
        keys: the fused keys (:func:`fused_keys`); a tensor in none of them is not this
            fuser's (:meth:`fuses`).
        push: ``push(buffer, name) -> Handle``, an exact averaging push_pull (in place).
        timeout: seconds a member's wait may spend waiting for another thread's push of its
            bucket to start (the push itself is bounded by the runtime's own timeout).
        reuse: a bucket's next round reuses its buffer once the result of every member of the
            previous round was taken (:meth:`FusedHandle.wait`): no allocation, no page faults,
            no zero fill of the whole bucket a step. Only for callers that copy each result
            out before the next round (``DistributedOptimizer`` does): a result kept as it is
            would be overwritten.
    """

    def __init__(self, keys: Sequence[FusedKey], push: Push, timeout: float,
                 reuse: bool = False) -> None:
        self.keys = tuple(keys)
        self._push = push
        self._timeout = float(timeout)
        self._reuse = bool(reuse)
        self._last: dict[tuple[str, str], _Round] = {}  # reuse: the last round per key, suffix
        self._where = {m: (k, j) for k in self.keys for j, m in enumerate(k.members)}
        self._open: dict[str, _Round] = {}
        self._lock = threading.Lock()

    def fuses(self, name: str) -> bool:
        """Whether tensor ``name`` travels in one of the fused keys."""
        return name in self._where

    def names(self, suffixes: Sequence[str] = ("",)) -> set[str]:
        """The names the fused keys are pushed under, with each of ``suffixes``."""
        return {k.name + s for k in self.keys for s in suffixes}

    def add(self, name: str, tensor: torch.Tensor, suffix: str = "") -> FusedHandle:
        """Member ``name`` arrived with ``tensor``: copy it into its bucket, push the bucket
        if it is complete; returns the member's handle.

        ``suffix`` is appended to the key's name (``"@dense"`` for a dense phase's own keys).
        A member that arrives again, or under another suffix, starts the bucket's next round
        (an incomplete previous round is pushed first).
        """
        if name not in self._where:
            raise ValueError(f"tensor {name!r} is in none of the {len(self.keys)} fused keys; "
                             f"expected a name for which fuses() is true")
        key, j = self._where[name]
        off, n = key.offsets[j], key.numels[j]
        if tensor.numel() != n:
            raise ValueError(f"fused tensor {name!r} has {tensor.numel()} elements, but its "
                             f"fused key {key.name!r} was planned with {n}")
        with self._lock:
            old = self._open.get(key.name)  # only rounds not pushed yet are open
            r = old if old is not None and name not in old.arrived and old.suffix == suffix \
                else None
            if r is None:
                r = _Round(key, suffix, self._buffer(key, suffix, tensor.device))
                if self._reuse:
                    self._last[(key.name, suffix)] = r
                if r.buf.is_cuda:
                    r.created = torch.cuda.current_stream(r.buf.device).record_event()
                self._open[key.name] = r
        if old is not None and old is not r:
            self._launch(old)  # the previous round never completed: push it as it is
        copied = _copy_member(r, off, n, tensor)
        with self._lock:
            if copied is not None:
                r.copied.append(copied)
            r.arrived.add(name)
            complete = len(r.arrived) == len(key.members)
        if complete:
            self._launch(r)
        return FusedHandle(self, r, name, off, n, tensor)

    def _buffer(self, key: FusedKey, suffix: str, device: torch.device) -> torch.Tensor:
        """The buffer of a new round of ``key`` (under the lock): the previous round's when it
        may be reused, else a new one; the gaps between members zeroed (members are copied
        in, or zeroed at the push when missing)."""
        prev = self._last.get((key.name, suffix))
        if (prev is not None and prev.launched and prev.error is None
                and prev.buf.device == device and prev.arrived <= prev.waited):
            buf = prev.buf
        else:
            buf = torch.empty(key.numel, dtype=torch.float32, device=device)
        for off, n, end in zip(key.offsets, key.numels, (*key.offsets[1:], key.numel)):
            if end > off + n:
                buf[off + n:end].zero_()
        return buf

    def flush(self) -> None:
        """Push every bucket with members waiting (the missing ones as zeros)."""
        with self._lock:
            rounds = list(self._open.values())
        for r in rounds:
            self._launch(r)

    def _launch(self, r: _Round) -> None:
        """Push round ``r`` once (the first caller does; later callers return at once)."""
        with self._lock:
            if r.launched:
                return
            r.launched = True
            if self._open.get(r.key.name) is r:
                del self._open[r.key.name]
            copies = list(r.copied)
            missing = [j for j, m in enumerate(r.key.members) if m not in r.arrived]
        try:
            if copies:  # submit's ready event, recorded on this stream, then covers them all
                stream = torch.cuda.current_stream(r.buf.device)
                for ev in copies:
                    stream.wait_event(ev)
            if missing and r.buf.is_cuda:
                torch.cuda.current_stream(r.buf.device).wait_event(r.created)
            for j in missing:  # pushed before they arrived: zeros
                off = r.key.offsets[j]
                r.buf[off:off + r.key.numels[j]].zero_()
            r.handle = self._push(r.buf, r.name)
        except BaseException as e:
            r.error = e
            raise
        finally:
            r.ready.set()

    def _wait_launched(self, r: _Round, member: str) -> Handle:
        """The handle of ``r``'s push, pushing the bucket now if it is still incomplete."""
        if not r.launched:
            self._launch(r)
        if not r.ready.wait(self._timeout):
            raise CommTimeoutError(f"the push of fused key {r.name!r} (holding {member!r}) did "
                                   f"not start within {self._timeout:g} s", key=r.name,
                                   stage="wait")
        if r.error is not None or r.handle is None:
            raise r.error or RuntimeError(f"fused key {r.name!r} has no push")
        return r.handle


def _copy_member(r: _Round, off: int, n: int, tensor: torch.Tensor) -> Any:
    """Copy a member into its slice of ``r.buf`` on the current stream; on CUDA return the
    event recorded after the copy (the copy first waits for the zero fill, which may have run
    on another stream, and ``buf`` is recorded for this stream)."""
    if not r.buf.is_cuda:
        r.buf[off:off + n].copy_(tensor.detach().reshape(-1))
        return None
    stream = torch.cuda.current_stream(r.buf.device)
    stream.wait_event(r.created)
    r.buf[off:off + n].copy_(tensor.detach().reshape(-1))
    r.buf.record_stream(stream)
    return stream.record_event()


class FusedHandle:
    """One member's completion of a fused push: :meth:`wait` returns its averaged tensor,
    with the shape, dtype and device of the tensor it arrived with."""

    def __init__(self, fuser: Fuser, r: _Round, name: str, offset: int, numel: int,
                 like: torch.Tensor) -> None:
        self.name = name
        self._fuser = fuser
        self._round = r
        self._slice = (offset, numel)
        self._shape, self._dtype, self._device = like.shape, like.dtype, like.device

    def done(self) -> bool:
        """Whether the result (or an error) is ready; never blocks."""
        r = self._round
        return r.error is not None or (r.handle is not None and r.handle.done())

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until the fused key's push_pull completed; return this member's average.

        ``timeout`` bounds the wait for the push_pull, as :meth:`Handle.wait`'s does.
        """
        out = self._fuser._wait_launched(self._round, self.name).wait(timeout)
        with self._fuser._lock:
            self._round.waited.add(self.name)
        off, n = self._slice
        res = out.reshape(-1)[off:off + n].view(self._shape)
        if res.dtype != self._dtype or res.device != self._device:
            res = res.to(device=self._device, dtype=self._dtype)
        return res

    def __repr__(self) -> str:
        return f"FusedHandle({self.name!r} in {self._round.name!r})"

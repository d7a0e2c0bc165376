"""Messages between workers and servers besides the payloads themselves.

* Control messages (fixed 32 bytes, tag ``CTRL_TAG``), little endian::

      offset size field
      0      1    op      (1 = push announcement, 2 = stop, 3 = save server state,
                           4 = load server state; for 3 and 4 ``step`` is the request number,
                           see :mod:`gradpress.ps.codec_state`; 5 = inline push)
      1      3    padding
      4      4    key     (uint32; the gloo tag of the payload that follows)
      8      8    step    (int64; the key's step counter)
      16     8    lr      (float64; NaN when none)
      24     8    nbytes  (uint64; payload size, checked by the server)

  A worker announces each push on the control tag, then sends the payload on the key's tag; a
  server's per-worker control thread posts the payload receive when it reads the announcement,
  so the server never blocks on a key a worker has not pushed yet. A payload that fits in
  ``INLINE_BYTES`` with its control message and trailer travels *inline* instead (op 5): in
  the same message, behind the control message (:meth:`~gradpress.ps.transport.Transport.
  isend_inline`), one message per push instead of two; the server copies it out of its control
  buffer after checking its trailer.
* Key descriptors (JSON in the TCP store under ``k/<key>``): written once per key with
  ``compare_set`` by the first worker to use it; every other worker compares its own and a
  difference is a clear error; servers read them to build their codecs.
* Server state requests (:mod:`gradpress.ps.codec_state`): agreed in the TCP store under
  ``state/<seq>``, announced with ``OP_SAVE``/``OP_LOAD`` control messages, acknowledged under
  ``state/<seq>/ack/<server>``.

Everything a worker or server receives from another process is validated before use. A message
from a peer is hostile until checked: a bug, a mismatched build or an attacker on the network
can send any bytes. Every check raises :class:`~gradpress.ps.errors.PayloadError` naming the
sender (role and rank) and the key; nothing that fails a check is handed to the optimizer, and
the engine that received it stops in the failed state (fatal, reported to the other processes)
rather than continuing with a partial sum. See docs/design.md (failure model).

Checks, in the order a message is used:

1. control message (server): a known op; for a push, a key some worker declared in the store
   (instead of waiting for a descriptor that never comes) and a finite, non-negative learning
   rate. Size and step of the push are checked by the server against the key's state.
2. push payload (server): the codec header (magic, version, codec id, numel, config
   fingerprint, total size, key, step; :meth:`~gradpress.compress.base.Codec.check_header`),
   then the codec's own decode checks (e.g. ``topk`` indices in range, nothing written if not).
3. sum of the pushes (server): finite. If not, the pushes are re-added one by one in rank order
   to name the first sender whose push makes the sum non-finite (NaN/inf values, or values
   whose sum overflows float32).
4. reply payload (worker): header as in 2, then the decoded values must be finite.

Honest senders never send non-finite values: codecs in the runtime use ``nan_policy="raise"``,
and ``DistributedOptimizer(nan_policy="skip")`` pushes zeros for a non-finite gradient.
"""

from __future__ import annotations

import json
import math
import struct
import threading
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..compress.base import Codec
from .errors import (
    CheckpointError,
    CommTimeoutError,
    ConfigMismatchError,
    GradpressError,
    KeyCollisionError,
    PayloadError,
)
from .transport import CTRL_TAG, HEAD_ROOM

if TYPE_CHECKING:
    from .cluster import Cluster
    from .transport import Transport

__all__ = ["CTRL_BYTES", "OP_PUSH", "OP_PUSH_INLINE", "OP_STOP", "OP_SAVE", "OP_LOAD", "Control",
           "pack_control", "unpack_control", "KeyDescriptor", "read_control", "require_declared",
           "add_push", "check_sum", "decode_reply", "is_finite", "request_server_op",
           "read_request", "acknowledge", "ArrivalCounter"]

_FMT = struct.Struct("<B3xIqdQ")
CTRL_BYTES = _FMT.size
OP_PUSH = 1
OP_STOP = 2
OP_SAVE = 3
OP_LOAD = 4
OP_PUSH_INLINE = 5
_OPS = (OP_PUSH, OP_STOP, OP_SAVE, OP_LOAD, OP_PUSH_INLINE)
if CTRL_BYTES > HEAD_ROOM:  # an inline push's control message lives in the buffer's head room
    raise ImportError(f"control messages ({CTRL_BYTES} bytes) outgrew HEAD_ROOM ({HEAD_ROOM})")


@dataclass(frozen=True)
class Control:
    """A decoded control message."""

    op: int
    key: int = 0
    step: int = 0
    lr: float | None = None
    nbytes: int = 0


def pack_control(msg: Control, buf: torch.Tensor | None = None) -> torch.Tensor:
    """Encode ``msg`` into a uint8 tensor of ``CTRL_BYTES`` (``buf`` when given)."""
    raw = _FMT.pack(msg.op, msg.key, msg.step, math.nan if msg.lr is None else float(msg.lr),
                    msg.nbytes)
    if buf is None:
        buf = torch.empty(CTRL_BYTES, dtype=torch.uint8, device="cpu")
    buf.numpy()[:] = memoryview(raw)
    return buf


def unpack_control(buf: torch.Tensor) -> Control:
    """Decode a control message; ValueError for an unknown op."""
    op, key, step, lr, nbytes = _FMT.unpack(bytes(buf.numpy()))
    if op not in _OPS:
        raise ValueError(f"control message with unknown op {op}, expected one of {_OPS}")
    return Control(op, key, step, None if math.isnan(lr) else lr, nbytes)


@dataclass(frozen=True)
class KeyDescriptor:
    """What every process must agree on for one key."""

    name: str
    generation: int
    chunk: int
    numel: int
    total_numel: int
    spec: str
    ef: str | None
    seed: int
    average: bool
    server: int

    @property
    def label(self) -> str:
        return f"{self.name!r} chunk {self.chunk}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> KeyDescriptor:
        return cls(**json.loads(text))

    def check_same(self, other: KeyDescriptor, key: int, who: str) -> None:
        """Raise if ``other`` (the agreed descriptor) is not this one's key or configuration."""
        if (other.name, other.generation, other.chunk) != (self.name, self.generation,
                                                           self.chunk):
            raise KeyCollisionError(
                f"key {key} collides: {self.label} (generation {self.generation}) and "
                f"{other.label} (generation {other.generation}) hash to the same key; rename "
                f"one of the tensors")
        mine, theirs = asdict(self), asdict(other)
        diffs = [f"{k}={mine[k]!r} here but {theirs[k]!r} on another worker"
                 for k in ("total_numel", "numel", "spec", "ef", "average", "seed")
                 if mine[k] != theirs[k]]
        if diffs:
            raise ConfigMismatchError(f"{who}: workers disagree on tensor {self.name!r} "
                                      f"(key {key}, chunk {self.chunk}): {'; '.join(diffs)}")


# -- checks of what peers send ---------------------------------------------------------------
def is_finite(t: torch.Tensor) -> bool:
    """Whether every element of float32 tensor ``t`` is finite (one pass, near bandwidth).

    On a device this reads the answer back: a host synchronisation (device-mode callers keep
    ``torch.isfinite(t).all()`` on the device and read it together with other results)."""
    if t.numel() == 0:
        return True
    if t.device.type == "cpu" and t.is_contiguous():
        from ..compress.kernels.common import all_finite
        return all_finite(t.reshape(-1).numpy())
    return bool(torch.isfinite(t).all())


def read_control(buf: torch.Tensor, *, sender: str, receiver: str) -> Control:
    """Decode a control message from ``sender`` (step 1); PayloadError if it is malformed."""
    try:
        msg = unpack_control(buf)
    except ValueError as e:
        key = int.from_bytes(bytes(buf[4:8].numpy()), "little")  # the key field, as sent
        raise PayloadError(f"{receiver}: control message from {sender} (key field {key}) "
                           f"rejected: {e}", key=key, peer=sender, stage="control") from e
    pushes = msg.op in (OP_PUSH, OP_PUSH_INLINE)
    if pushes and msg.lr is not None and not (math.isfinite(msg.lr) and msg.lr >= 0):
        raise PayloadError(f"{receiver}: {sender} pushes key {msg.key} with learning rate "
                           f"{msg.lr!r}; expected a finite number >= 0; rejected", key=msg.key,
                           peer=sender, stage="control")
    return msg


def require_declared(store: dist.Store, key: int, *, sender: str, receiver: str) -> None:
    """Reject a push of a key no worker declared (workers declare before they push)."""
    if not store.check([f"k/{key}"]):
        raise PayloadError(f"{receiver}: {sender} pushes key {key}, which no worker declared "
                           f"(no descriptor in the store); rejected", key=key, peer=sender,
                           stage="control")


def add_push(codec: Codec, payload: torch.Tensor, acc: torch.Tensor | None, *, key: int,
             step: int, sender: str, label: str) -> None:
    """Validate ``sender``'s push of ``key`` at ``step`` and add its values to ``acc`` (step 2;
    ``acc`` None: validate only)."""
    try:
        codec.check_header(payload, key=key, step=step, sender=sender)
        if acc is not None:
            codec.decompress_add(payload, acc)
    except ValueError as e:
        raise PayloadError(f"{label}: push from {sender} rejected: {e}", key=key, peer=sender,
                           stage="push") from e


def check_sum(acc: torch.Tensor, codec: Codec, payloads: list[torch.Tensor],
              senders: list[str], *, key: int, label: str) -> None:
    """Step 3: ``acc`` (the sum of ``payloads``) must be finite; else name the first culprit."""
    if is_finite(acc):
        return
    partial = torch.zeros_like(acc)  # error path only: re-add in rank order
    for payload, sender in zip(payloads, senders):
        codec.decompress_add(payload, partial)
        if not is_finite(partial):
            raise PayloadError(f"{label}: push from {sender} rejected: it has non-finite values "
                               f"(NaN/inf) or makes the sum overflow float32", key=key,
                               peer=sender, stage="push")
    raise PayloadError(f"{label}: the sum of the pushes from {', '.join(senders)} is not finite; "
                       f"rejected", key=key, peer=", ".join(senders), stage="push")


def decode_reply(codec: Codec, payload: torch.Tensor, out: torch.Tensor, *, key: int,
                 step: int, sender: str, label: str) -> None:
    """Step 4: validate ``sender``'s reply for ``key`` at ``step`` and decode it into ``out``.

    A host payload is judged finite from its bytes
    (:meth:`~gradpress.compress.base.Codec.payload_finite`: onebit reads its scale, topk its
    values), not by scanning the decoded ``out``: no extra pass over the result, and no host
    synchronisation when the decode runs on a GPU. Both decide the same thing: every codec
    decodes a payload whose values/scale/norm are finite (and, for dithering, whose codes are
    valid) to finite values. A payload on a device is scanned after decoding."""
    from_bytes = payload.device.type == "cpu"
    try:
        codec.check_header(payload, key=key, step=step, sender=sender)
        codec.decompress(payload, out=out)
    except ValueError as e:
        raise PayloadError(f"{label}: reply from {sender} rejected: {e}", key=key, peer=sender,
                           stage="pull") from e
    if not (codec.payload_finite(payload) if from_bytes else is_finite(out)):
        raise PayloadError(f"{label}: reply from {sender} rejected: it decodes to non-finite "
                           f"values (NaN/inf)", key=key, peer=sender, stage="pull")


# -- server state requests -------------------------------------------------------------------
OPS = {"save": OP_SAVE, "load": OP_LOAD}
_POLL_S = 0.01


def read_request(cluster: Cluster, seq: int, op: int) -> dict[str, Any]:
    """The request ``seq`` the workers agreed on; ValueError if there is none or not ``op``."""
    if not cluster.store.check([f"state/{seq}"]):  # the workers write it before they send
        raise ValueError(f"server state request {seq} is unknown (no record in the store)")
    req = json.loads(cluster.store.get(f"state/{seq}"))
    if OPS.get(req.get("op")) != op:
        raise ValueError(f"server state request {seq} is {req.get('op')!r}, but the control "
                         f"message asked for op {op}")
    return req


def acknowledge(cluster: Cluster, seq: int, index: int, error: BaseException | None) -> None:
    """Tell the workers the outcome of request ``seq`` on server ``index``."""
    text = "ok" if error is None else f"error: {type(error).__name__}: {error}"
    cluster.store.set(f"state/{seq}/ack/{index}", text)


def request_server_op(cluster: Cluster, transport: Transport, timeout: float, seq: int, op: str,
                      directory: str, tag: str | None) -> None:
    """Worker side of steps 1, 2 and 4 (see the module docstring); collective over workers."""
    lay = cluster.layout
    record = json.dumps({"op": op, "dir": directory, "tag": tag}, sort_keys=True)
    agreed = cluster.store.compare_set(f"state/{seq}", "", record).decode()
    if agreed != record:
        text = (f"workers disagree on server state request {seq}: here {record}, elsewhere "
                f"{agreed}; call save/load on every worker with the same directory")
        cluster.report_error(text)  # the other workers stop waiting for acknowledgements
        raise ValueError(f"{cluster.describe(cluster.rank)}: {text}")
    servers = range(lay.num_servers)
    if cluster.rank in lay.pushers:  # step 2: behind this worker's push announcements
        msg = pack_control(Control(OPS[op], 0, seq))
        sends = [transport.isend(msg, lay.server_rank(s), CTRL_TAG, f"{op} of server state",
                                 "push") for s in servers]
        for s in sends:
            s.wait(timeout, f"{op} server state")
    acks = _wait_acks(cluster, seq, timeout, op)  # step 4
    failed = [f"{cluster.describe(lay.server_rank(s))}: {acks[s]}" for s in servers
              if acks[s] != "ok"]
    if failed:  # a refused load is a refused checkpoint; a failed save, a runtime failure
        raise (CheckpointError if op == "load" else GradpressError)(
            f"{op} of server state in {directory} failed on {'; '.join(failed)}")


def _wait_acks(cluster: Cluster, seq: int, timeout: float, op: str) -> list[str]:
    keys = [f"state/{seq}/ack/{s}" for s in range(cluster.layout.num_servers)]
    deadline = time.monotonic() + timeout
    last_check = 0.0
    while not cluster.store.check(keys):
        now = time.monotonic()
        if now - last_check > 0.5:
            last_check = now
            if errors := cluster.reported_errors():
                raise GradpressError(f"{op} of server state: a process failed:\n{errors}")
        if now > deadline:
            missing = [cluster.describe(cluster.layout.server_rank(s))
                       for s, k in enumerate(keys) if not cluster.store.check([k])]
            raise CommTimeoutError(f"{op} of server state: no answer from {', '.join(missing)} "
                                   f"within {timeout:g} s", peer=", ".join(missing),
                                   stage=f"{op} server state")
        time.sleep(_POLL_S)
    return [cluster.store.get(k).decode(errors="replace") for k in keys]


class ArrivalCounter:
    """Counts the pushers' control messages per request (server side of step 3)."""

    def __init__(self, pushers: int) -> None:
        self._pushers = pushers
        self._seen: dict[int, set[int]] = {}
        self._lock = threading.Lock()

    def arrive(self, seq: int, pusher: int) -> bool:
        """Record ``pusher``'s message for ``seq``; True once every pusher sent one (a repeat
        from the same pusher does not count)."""
        with self._lock:
            seen = self._seen.setdefault(seq, set())
            seen.add(pusher)
            if len(seen) < self._pushers:
                return False
            del self._seen[seq]
            return True

"""Messages between workers and servers besides the payloads themselves.

* Control messages (fixed 32 bytes, tag ``CTRL_TAG``), little endian::

      offset size field
      0      1    op      (1 = push announcement, 2 = stop, 3 = save server state,
                           4 = load server state; for 3 and 4 ``step`` is the request number,
                           see :mod:`gradpress.ps.state`)
      1      3    padding
      4      4    key     (uint32; the gloo tag of the payload that follows)
      8      8    step    (int64; the key's step counter)
      16     8    lr      (float64; NaN when none)
      24     8    nbytes  (uint64; payload size, checked by the server)

  A worker announces each push on the control tag, then sends the payload on the key's tag; a
  server's per-worker control thread posts the payload receive when it reads the announcement,
  so the server never blocks on a key a worker has not pushed yet.
* Key descriptors (JSON in the TCP store under ``k/<key>``): written once per key with
  ``compare_set`` by the first worker to use it; every other worker compares its own and a
  difference is a clear error; servers read them to build their codecs.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass

import torch

from .errors import ConfigMismatchError, KeyCollisionError

__all__ = ["CTRL_BYTES", "OP_PUSH", "OP_STOP", "OP_SAVE", "OP_LOAD", "Control", "pack_control",
           "unpack_control", "KeyDescriptor"]

_FMT = struct.Struct("<B3xIqdQ")
CTRL_BYTES = _FMT.size
OP_PUSH = 1
OP_STOP = 2
OP_SAVE = 3
OP_LOAD = 4
_OPS = (OP_PUSH, OP_STOP, OP_SAVE, OP_LOAD)


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
        buf = torch.empty(CTRL_BYTES, dtype=torch.uint8)
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

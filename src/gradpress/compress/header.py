"""Payload header: every codec payload starts with these bytes.

Layout (little endian, ``HEADER_BYTES`` = 40)::

    offset size field
    0      2    magic  b"GP"
    2      1    codec id (see ``gradpress.compress.registry``)
    3      1    wire-format version
    4      4    key    (uint32)
    8      8    numel  (uint64)
    16     8    step   (int64)
    24     8    lr     (float64; NaN when the sender gave none)
    32     4    config fingerprint (uint32 crc32 of the canonical spec)
    36     4    flags  (uint32, reserved, 0; a device-mode compress into a host payload
                        lands its finiteness flag here, then writes the header over it)

The receiver validates magic, version, codec id, numel and fingerprint against its own codec, and
key/step when it knows which it expects; any difference is a ``ValueError`` naming the field, the
value found and the value expected.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

from . import transfer

MAGIC = b"GP"
VERSION = 1
_FMT = struct.Struct("<2sBBIQqdII")
HEADER_BYTES = _FMT.size
assert HEADER_BYTES == 40

__all__ = ["HEADER_BYTES", "Header", "header_bytes", "pack_header", "read_header"]


@dataclass(frozen=True)
class Header:
    """Decoded payload header."""

    codec_id: int
    key: int
    numel: int
    step: int
    lr: float | None
    fingerprint: int
    version: int = VERSION


def header_bytes(h: Header) -> bytes:
    """The ``HEADER_BYTES`` bytes of ``h``; ValueError for a key outside the 32-bit range."""
    if not 0 <= h.key < 2**32:
        raise ValueError(f"key must be in [0, 2**32), got {h.key}")
    lr = math.nan if h.lr is None else float(h.lr)
    return _FMT.pack(MAGIC, h.codec_id, h.version, h.key, h.numel, h.step, lr, h.fingerprint, 0)


def pack_header(buf: torch.Tensor, h: Header) -> None:
    """Write ``h`` into the first ``HEADER_BYTES`` of the uint8 tensor ``buf`` (any device; on a
    CUDA device without a host synchronisation, see :func:`.transfer.bytes_to`)."""
    transfer.bytes_to(buf[:HEADER_BYTES], header_bytes(h))


def read_header(buf: torch.Tensor) -> Header:
    """Parse the header of payload ``buf``; ValueError if too short or not a gradpress payload.

    A payload on the host is read in place; one on a device is copied back first (a host
    synchronisation: device-mode callers validate headers on a host copy instead)."""
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        got = f"{type(buf).__name__}" if not isinstance(buf, torch.Tensor) else (
            f"tensor dtype={buf.dtype} dim={buf.dim()}")
        raise TypeError(f"payload must be a 1-D torch.uint8 tensor, got {got}")
    if buf.numel() < HEADER_BYTES:
        raise ValueError(
            f"payload truncated: {buf.numel()} bytes, shorter than the {HEADER_BYTES}-byte header")
    head = buf[:HEADER_BYTES]
    raw = bytes(head.numpy()) if head.device.type == "cpu" else bytes(head.cpu().numpy())
    magic, cid, ver, key, numel, step, lr, fp, _flags = _FMT.unpack(raw)
    if magic != MAGIC:
        raise ValueError(f"payload is not a gradpress payload: magic {magic!r}, expected {MAGIC!r}")
    if ver != VERSION:
        raise ValueError(f"payload wire-format version {ver}, expected {VERSION}")
    return Header(cid, key, numel, step, None if math.isnan(lr) else lr, fp, ver)

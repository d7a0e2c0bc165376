"""Partitioning of tensors into keyed chunks and balancing of keys over servers (pure functions).

The scheme follows BytePS (Jiang et al., "A Unified Architecture for Accelerating Distributed DNN
Training in Heterogeneous GPU/CPU Clusters", OSDI 2020, section 4), which cuts every tensor into
partitions of ``BYTEPS_PARTITION_BYTES`` so that large tensors are spread over servers and
pipelined:

1. :func:`chunk_layout` cuts a tensor of ``numel`` float32 elements into chunks of
   ``max(1, partition_bytes // 4)`` elements; the last chunk takes the remainder and an empty
   tensor has no chunks.
2. :func:`chunk_key` derives each chunk's key from the tensor *name*, the chunk index and a
   generation number (bumped when a tensor's codec changes), by a keyed hash (BLAKE2b), so all
   workers agree on the keys whatever order they declare tensors in. Keys are gloo tags in
   ``[KEY_BASE, 2**31)``; tags below ``KEY_BASE`` are reserved for control messages. Collisions
   are possible (31-bit hash) and are detected by the runtime, never resolved silently.
3. :func:`assign_balanced` assigns keys to servers (and, on a server, keys to engine threads) by
   the longest-processing-time-first greedy of Graham ("Bounds on multiprocessing timing
   anomalies", 1969): items sorted by bytes (descending, ties by key) each go to the currently
   least-loaded bin (ties: lowest index). Sorting makes the result independent of input order;
   ``loads`` carries the bytes already placed, so tensors declared one at a time stay balanced.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Chunk", "KEY_BASE", "KEY_LIMIT", "chunk_layout", "chunk_key", "assign_balanced"]

#: Smallest key; tags below it are reserved for control messages.
KEY_BASE = 1 << 10
#: Keys are gloo tags, which must fit a signed 32-bit int.
KEY_LIMIT = 1 << 31


@dataclass(frozen=True)
class Chunk:
    """One partition of a flat tensor: elements ``[offset, offset + numel)``."""

    index: int
    offset: int
    numel: int


def _check_nonneg_int(name: str, v: object, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


def chunk_layout(numel: int, partition_bytes: int, itemsize: int = 4) -> list[Chunk]:
    """Cut ``numel`` elements of ``itemsize`` bytes into chunks of at most ``partition_bytes``.

    Every chunk holds at least one element, so ``partition_bytes`` below ``itemsize`` still
    makes progress. ``chunk_layout(0, ...)`` is ``[]``.
    """
    _check_nonneg_int("numel", numel)
    _check_nonneg_int("partition_bytes", partition_bytes, 1)
    _check_nonneg_int("itemsize", itemsize, 1)
    per = max(1, partition_bytes // itemsize)
    return [Chunk(i, off, min(per, numel - off))
            for i, off in enumerate(range(0, numel, per))]


def chunk_key(name: str, index: int, generation: int = 0) -> int:
    """Key of chunk ``index`` of tensor ``name`` (a gloo tag in ``[KEY_BASE, KEY_LIMIT)``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tensor name must be a non-empty str, got {name!r}")
    _check_nonneg_int("chunk index", index)
    _check_nonneg_int("generation", generation)
    digest = hashlib.blake2b(f"{name}\x00{generation}\x00{index}".encode(),
                             digest_size=8, person=b"gradpress-key").digest()
    return KEY_BASE + int.from_bytes(digest, "little") % (KEY_LIMIT - KEY_BASE)


def assign_balanced(items: Mapping[int, int], loads: Sequence[int]) -> dict[int, int]:
    """Assign each item (key -> bytes) to a bin, balancing bytes (LPT greedy, see module doc).

    Args:
        items: key -> bytes of the items to place.
        loads: bytes already placed in each bin; ``len(loads)`` is the number of bins.

    Returns:
        key -> bin index. The result depends only on the contents of ``items`` and ``loads``.
    """
    if len(loads) < 1:
        raise ValueError("loads must list at least one bin (server or thread), got none")
    bins = [int(b) for b in loads]
    out: dict[int, int] = {}
    # step 1: largest first, ties by key, so the input order does not matter
    for key, nbytes in sorted(items.items(), key=lambda kv: (-kv[1], kv[0])):
        if nbytes < 0:
            raise ValueError(f"item {key} has negative size {nbytes}")
        # step 2: the least-loaded bin takes it (ties: the lowest index)
        b = min(range(len(bins)), key=lambda i: (bins[i], i))
        out[key] = b
        bins[b] += nbytes
    return out

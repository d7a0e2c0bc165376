"""Validation of everything a worker or server receives from another process, before use.

A message from a peer is hostile until checked: a bug, a mismatched build or an attacker on the
network can send any bytes. Every check below raises :class:`~gradpress.ps.errors.PayloadError`
naming the sender (role and rank) and the key; nothing that fails a check is handed to the
optimizer, and the engine that received it stops in the failed state (fatal, reported to the
other processes) rather than continuing with a partial sum. See ``docs/reliability.md``.

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

import math

import torch
import torch.distributed as dist

from ..compress.base import Codec
from .errors import PayloadError
from .protocol import OP_PUSH, Control, unpack_control

__all__ = ["read_control", "require_declared", "add_push", "check_sum", "decode_reply",
           "is_finite"]


def is_finite(t: torch.Tensor) -> bool:
    """Whether every element of float32 tensor ``t`` is finite (one pass, near bandwidth)."""
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
    if msg.op == OP_PUSH and msg.lr is not None and not (math.isfinite(msg.lr) and msg.lr >= 0):
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


def add_push(codec: Codec, payload: torch.Tensor, acc: torch.Tensor, *, key: int, step: int,
             sender: str, label: str) -> None:
    """Validate ``sender``'s push of ``key`` at ``step`` and add its values to ``acc`` (step 2)."""
    try:
        codec.check_header(payload, key=key, step=step, sender=sender)
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
    """Step 4: validate ``sender``'s reply for ``key`` at ``step`` and decode it into ``out``."""
    try:
        codec.check_header(payload, key=key, step=step, sender=sender)
        codec.decompress(payload, out=out)
    except ValueError as e:
        raise PayloadError(f"{label}: reply from {sender} rejected: {e}", key=key, peer=sender,
                           stage="pull") from e
    if not is_finite(out):
        raise PayloadError(f"{label}: reply from {sender} rejected: it decodes to non-finite "
                           f"values (NaN/inf)", key=key, peer=sender, stage="pull")

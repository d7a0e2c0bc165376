"""The server's arithmetic for one key and step (BytePS-Compress, Zhong et al. 2021): decode and
sum the workers' pushes in rank order, average, and compress the result with the server's
error feedback. One implementation, shared by the parameter server
(:mod:`gradpress.ps.server`) and the DDP hook (:mod:`gradpress.ddp`, whose ranks each
serve a shard), so both send the same bytes for the same pushes."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..compress import Codec
from .protocol import add_push, check_sum, is_finite

__all__ = ["reduce_pushes"]


def reduce_pushes(pushes: Iterable[tuple[str, torch.Tensor]], decoder: Codec, encoder: Codec,
                  acc: torch.Tensor, *, key: int, step: int, lr: float | None, divisor: int,
                  label: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """The server side of two-way compression for one key and step; returns the reply payload.

    1. ``acc = 0``, then ``acc += D(p)`` for each ``(sender, p)`` of ``pushes`` in the order
       given (rank order: the float32 additions happen in the same order on every run), each
       push validated first (header: codec, numel, fingerprint, size, ``key``, ``step``);
    2. ``acc /= divisor`` (the number of workers when averaging, 1 for the plain sum);
    3. ``encoder.compress(acc, key, step, lr, out)``: the encoder carries the server residual.

    Fused path: where ``encoder.fuses_sum(decoder, acc.device)`` (onebit pushes into a onebit
    reply, with or without dense error feedback, numba on the CPU), every push is validated
    (step 1's checks, same order) as it arrives, then ``encoder.compress_sum`` runs steps 1-3
    in the codec's own passes, each element of the sum computed from the pushes' bodies with
    the same float32 operations in the same order, never stored (``acc`` is not used): the
    same reply bytes and residual. A non-finite sum falls back to steps 1-3 as above, which
    raise the error.

    Args:
        pushes: ``(sender, payload)`` pairs in rank order; may be a generator that waits for
            each payload as it is asked for it.
        decoder: the codec of the pushes (its header checks and decoders are used).
        encoder: the codec of the reply, usually with the server's error feedback.
        acc: float32 scratch of ``decoder.numel`` elements (contents afterwards unspecified).
        key, step, lr: the round's key and step (checked in every push) and learning rate
            (carried in the reply).
        divisor: what the sum is divided by (>= 1).
        label: names the key in error messages.
        out: the reply buffer (``encoder.payload_bytes``), or None for a new tensor.

    Raises :class:`~gradpress.ps.errors.PayloadError` naming the sender of a push that fails
    validation, or the first sender whose push makes the sum non-finite; the encoder's state is
    then untouched.
    """
    if encoder.fuses_sum(decoder, acc.device) and (out is None or out.device.type == "cpu"):
        arrived: list[tuple[str, torch.Tensor]] = []
        for sender, payload in pushes:  # step 1's checks, in rank order, as pushes arrive
            add_push(decoder, payload, None, key=key, step=step, sender=sender, label=label)
            arrived.append((sender, payload))
        reply = encoder.compress_sum([p for _, p in arrived], decoder, divisor, key=key,
                                     step=step, lr=lr, out=out)
        if reply is not None:
            return reply
        pushes = arrived
    acc.zero_()
    seen: list[tuple[str, torch.Tensor]] = []
    for sender, payload in pushes:
        add_push(decoder, payload, acc, key=key, step=step, sender=sender, label=label)
        seen.append((sender, payload))
    if divisor != 1:
        acc.div_(divisor)
    try:  # the encoder adds its residual, checks finiteness (no extra pass) and compresses
        return encoder.compress(acc, key=key, step=step, lr=lr, out=out)
    except ValueError:
        if is_finite(acc):
            raise  # not the pushes' fault (e.g. the residual overflowed)
        # error path only: name the first sender whose push makes the sum non-finite
        check_sum(acc, decoder, [p for _, p in seen], [s for s, _ in seen], key=key,
                  label=label)
        raise

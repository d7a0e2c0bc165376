"""Server side of two-way compression: aggregate compressed pushes, recompress the result.

BytePS-Compress (Zhong, Xie, Zheng, Lin 2021, "Compressed Communication for Distributed
Training: Adaptive Methods and System") compresses both directions. For each key and round
(training step), the server:

1. validates every worker's payload header (codec id, numel, config fingerprint, size; the key and
   step must be the same for all pushes of the round) — errors name the sender and the key;
2. decompresses each push into one float32 accumulator (the first one overwrites it, later ones are
   added with the codec's decode-accumulate, so sparse codecs touch only their k entries and dense
   codecs need no dense temporary);
3. once all ``num_workers`` pushes are in, divides by ``num_workers`` (when averaging);
4. recompresses the result with its own codec, usually error feedback around the same spec, so the
   server's compression error is fed back into the next round (the server residual);
5. returns one payload, carrying the round's key, step and learning rate, that every worker
   receives: identical bytes, so the replicas stay bit-identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .base import Codec
from .header import HEADER_BYTES, Header
from .registry import build

__all__ = ["ServerAggregator"]


class ServerAggregator:
    """Aggregates one key's pushes per round and recompresses the sum (see the module docstring).

    Args:
        decoder: codec of the workers' pushes (its header checks and decoders are used).
        recompress: codec for the reply, usually ``build(spec, numel, ef="vanilla")``; must have
            the same ``numel`` as ``decoder``.
        num_workers: pushes per round.
        average: divide the sum by ``num_workers`` (default) or send the plain sum.
    """

    def __init__(self, decoder: Codec, recompress: Codec, num_workers: int, *,
                 average: bool = True) -> None:
        for what, c in (("decoder", decoder), ("recompress", recompress)):
            if not isinstance(c, Codec):
                raise TypeError(f"ServerAggregator {what} must be a Codec, got {type(c).__name__}")
        if recompress.numel != decoder.numel:
            raise ValueError(f"ServerAggregator: recompress codec numel {recompress.numel} != "
                             f"decoder numel {decoder.numel}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"ServerAggregator: num_workers must be an int >= 1, "
                             f"got {num_workers!r}")
        self.decoder = decoder
        self.recompress = recompress
        self.num_workers = num_workers
        self.average = bool(average)
        self._acc: torch.Tensor | None = None
        self.reset()

    @classmethod
    def from_spec(cls, spec: Any, numel: int, num_workers: int, *, ef: str | None = "vanilla",
                  average: bool = True, seed: int = 0) -> ServerAggregator:
        """Decoder ``build(spec)``, recompress ``build(spec, ef=ef)`` (no momentum on servers)."""
        return cls(build(spec, numel, seed=seed), build(spec, numel, ef=ef, seed=seed),
                   num_workers, average=average)

    @property
    def numel(self) -> int:
        return self.decoder.numel

    @property
    def senders(self) -> tuple[str, ...]:
        """Senders that have contributed to the current round, in arrival order."""
        return tuple(self._senders)

    def reset(self) -> None:
        """Drop the current round's contributions (the server residual is kept)."""
        self._senders: list[str] = []
        self._round: Header | None = None

    def add(self, payload: torch.Tensor, *, sender: str) -> Header:
        """Validate ``payload`` from ``sender`` and accumulate its decoding; returns its header."""
        h = self.decoder.check_header(payload, sender=sender)
        self._check_round(h, sender)
        if self.numel:
            acc = self._accumulator(payload.device)
            body = payload[HEADER_BYTES:]
            if not self._senders:
                self.decoder._decode(body, acc, h)          # first push overwrites
            else:
                self.decoder._decode_add(body, acc, 1.0, h)  # later pushes accumulate
        if self._round is None:
            self._round = h
        self._senders.append(sender)
        return h

    def finish(self, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Average (optionally), recompress and return the reply payload; starts a new round.

        Raises RuntimeError naming how many workers are missing when the round is incomplete.
        """
        have = len(self._senders)
        if have < self.num_workers or self._round is None:
            key = "?" if self._round is None else self._round.key
            raise RuntimeError(
                f"server key {key}: {self.num_workers - have} of {self.num_workers} workers "
                f"missing from the round (received from: {', '.join(self._senders) or 'none'})")
        h = self._round
        if self.numel:
            acc = self._acc
            if self.average and self.num_workers > 1:
                acc.div_(self.num_workers)
        else:
            acc = torch.empty(0, dtype=torch.float32)
        reply = self.recompress.compress(acc, key=h.key, step=h.step, lr=h.lr, out=out)
        self.reset()
        return reply

    def _check_round(self, h: Header, sender: str) -> None:
        if sender in self._senders:
            raise ValueError(f"payload from {sender} key {h.key} step {h.step}: {sender} already "
                             f"pushed in this round")
        if len(self._senders) >= self.num_workers:
            raise ValueError(f"payload from {sender} key {h.key}: round already has all "
                             f"{self.num_workers} workers; call finish() first")
        r = self._round
        if r is None:
            return
        if h.key != r.key:
            raise ValueError(f"payload from {sender} key {h.key}: this round is for key {r.key}")
        if h.step != r.step:
            raise ValueError(f"payload from {sender} key {h.key}: step {h.step}, expected "
                             f"{r.step} (the round's step)")
        if h.lr != r.lr:
            raise ValueError(f"payload from {sender} key {h.key} step {h.step}: lr {h.lr}, "
                             f"expected {r.lr} (the round's lr)")

    def _accumulator(self, device: torch.device) -> torch.Tensor:
        if self._acc is None or self._acc.device != device:
            if self._senders:
                raise ValueError(f"server key {self._round.key}: payload on {device}, but this "
                                 f"round accumulates on {self._acc.device}")
            self._acc = torch.empty(self.numel, dtype=torch.float32, device=device)
        return self._acc

    def state_dict(self) -> dict[str, Any]:
        """The recompress codec's state (the server residual); an open round is not saved."""
        return {"recompress": self.recompress.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (ValueError naming bad keys); resets the round."""
        if not isinstance(state, Mapping) or set(state) != {"recompress"}:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"ServerAggregator.load_state_dict: expected keys ['recompress'], "
                             f"got {got}")
        self.recompress.load_state_dict(state["recompress"])
        self.reset()

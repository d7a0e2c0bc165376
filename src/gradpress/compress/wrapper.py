"""The base of stateful wrappers (error feedback, momentum) around a codec."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .base import Codec
from .header import Header

__all__ = ["CodecWrapper", "check_state_keys"]


class CodecWrapper(Codec):
    """Base of stateful wrappers: same wire identity as ``inner`` (name, codec id, numel,
    payload size, fingerprint, spec text); decoding and header checks are delegated to it."""

    def __init__(self, inner: Codec) -> None:
        if not isinstance(inner, Codec):
            raise TypeError(f"{type(self).__name__} wraps a Codec, got {type(inner).__name__}")
        self.inner = inner
        for attr in ("numel", "params", "seed", "nan_policy", "backend", "spec_text",
                     "fingerprint", "payload_bytes"):
            setattr(self, attr, getattr(inner, attr))

    name = property(lambda self: self.inner.name)
    codec_id = property(lambda self: self.inner.codec_id)
    checks_finite = property(lambda self: self.inner.checks_finite)

    # the codec hooks are the inner codec's (stateless) ones
    def _body_bytes(self) -> int:
        return self.inner._body_bytes()

    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int,
                step: int) -> torch.Tensor | None:
        return self.inner._encode(x, body, key, step)

    def _body_finite(self, body: np.ndarray) -> bool:
        return self.inner._body_finite(body)

    def _check_body(self, body: torch.Tensor, h: Header) -> None:
        self.inner._check_body(body, h)

    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        self.inner._decode(body, out, h)

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        self.inner._decode_add(body, acc, alpha, h)

    def decompress(self, payload: torch.Tensor, *, out: torch.Tensor | None = None,
                   key: int | None = None, step: int | None = None) -> torch.Tensor:
        """Decode with the inner codec (decoding is stateless)."""
        return self.inner.decompress(payload, out=out, key=key, step=step)

    def decompress_add(self, payload: torch.Tensor, acc: torch.Tensor, *, alpha: float = 1.0,
                       key: int | None = None, step: int | None = None) -> Header:
        """``acc += alpha * decompress(payload)``, by the inner codec."""
        return self.inner.decompress_add(payload, acc, alpha=alpha, key=key, step=step)

    def check_header(self, payload: torch.Tensor, *, key: int | None = None,
                     step: int | None = None, sender: str | None = None) -> Header:
        """Validate ``payload`` against the inner codec."""
        return self.inner.check_header(payload, key=key, step=step, sender=sender)

    def use_torch(self, device: torch.device) -> bool:
        return self.inner.use_torch(device)

    def _state_tensor(self, state: Mapping[str, Any], name: str) -> torch.Tensor | None:
        """Validate a saved float tensor of ``numel`` elements (or None); returns float32 CPU."""
        t = state[name]
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{type(self).__name__} state {name!r}: expected a float tensor or "
                             f"None, got {type(t).__name__}")
        if t.numel() != self.numel:
            raise ValueError(f"{type(self).__name__} state {name!r}: shape {tuple(t.shape)}, "
                             f"expected ({self.numel},) for {self.spec_text}")
        return t.detach().reshape(-1).to("cpu", torch.float32).clone()


def check_state_keys(owner: str, state: Mapping[str, Any], expected: set[str]) -> None:
    """``state`` (given to ``owner.load_state_dict``) must be a mapping with exactly the keys
    ``expected``; TypeError/ValueError naming the missing and unexpected ones otherwise."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{owner}.load_state_dict expects a mapping, got {type(state).__name__}")
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"{owner}.load_state_dict: state keys do not match; missing {missing}, "
                         f"unexpected {extra}, expected {sorted(expected)}")

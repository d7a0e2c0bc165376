"""Dense codecs: ``none`` (fp32 values, lossless) and the 16-bit casts ``fp16`` and ``bf16``."""

from __future__ import annotations

import torch

from .base import Codec
from .header import Header
from .registry import register

__all__ = ["NoneCodec"]


@register
class NoneCodec(Codec):
    """No compression: the payload body is the float32 values themselves (32 bits/element)."""

    name = "none"
    codec_id = 0

    def _body_bytes(self) -> int:
        return 4 * self.numel

    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int, step: int) -> None:
        body.view(torch.float32).copy_(x)

    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        out.copy_(body.view(torch.float32))

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        acc.add_(body.view(torch.float32), alpha=alpha)

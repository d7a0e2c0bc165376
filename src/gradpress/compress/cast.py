"""Dense codecs: ``none`` (fp32 values, lossless) and the 16-bit casts ``fp16`` and ``bf16``.

The 16-bit codecs store each element rounded to nearest (ties to even), exactly like torch's
``.to(torch.float16)`` / ``.to(torch.bfloat16)``: fp16 keeps 11 significant bits but overflows
to inf above 65504 and flushes below 2**-24 (use it for gradients of moderate range, as mixed
precision does); bf16 keeps float32's range with 8 significant bits. NaN is stored as the
canonical quiet NaN with the input's sign (only reachable with ``nan_policy="allow"``).

CPU encoding runs one fused numba pass (round + non-finite check, :mod:`.kernels.cast`); decoding
uses torch's vectorized conversion (already at memory bandwidth); decode-accumulate converts on
the fly in numba. Other devices (or ``backend="torch"``) use torch ops throughout and produce the
same bytes. Error feedback on CPU is one numba pass (``p = x + e``, the 16-bit values and the
residual; ``_encode_ef_fused``).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from .base import Codec, register
from .header import Header
from .kernels import cast as K
from .kernels.common import MODE_P, all_finite, ef_args

__all__ = ["NoneCodec", "Fp16Codec", "Bf16Codec"]


@register
class NoneCodec(Codec):
    """No compression: the payload body is the float32 values themselves (32 bits/element)."""

    name = "none"
    codec_id = 0

    def _body_bytes(self) -> int:
        return 4 * self.numel

    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int, step: int) -> None:
        body.view(torch.float32).copy_(x)

    def _body_finite(self, body: np.ndarray) -> bool:
        return all_finite(_aligned(body, np.float32))

    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        out.copy_(body.view(torch.float32))

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        acc.add_(body.view(torch.float32), alpha=alpha)


class _Cast16Codec(Codec):
    """Shared machinery of ``fp16`` and ``bf16``: 2 bytes per element, little endian."""

    dtype: ClassVar[torch.dtype]
    #: canonical NaN bit patterns (as int16) for a positive and a negative NaN input
    nan_bits: ClassVar[tuple[int, int]]
    checks_finite = True

    def _body_bytes(self) -> int:
        return 2 * self.numel

    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int,
                step: int) -> torch.Tensor | None:
        if self.use_torch(x.device):
            return self._encode_torch(x, body)
        _require_cpu(self, x)
        if not self._encode_numba(x.numpy(), body.numpy().view(np.uint16)) \
                and self.nan_policy == "raise":
            self._check_finite(x, key)  # raises the standard non-finite error
        return None

    def _encode_numba(self, x: np.ndarray, h: np.ndarray) -> bool:
        raise NotImplementedError

    def _encode_torch(self, x: torch.Tensor, body: torch.Tensor) -> torch.Tensor | None:
        """Torch ops, nothing read on the host; the finiteness flag under "raise"."""
        h = body.view(self.dtype)
        h.copy_(x)
        if self.nan_policy == "raise":
            return torch.isfinite(x).all()
        # canonical NaN, like the numba kernel (torch keeps payload bits / may set the sign)
        pos, neg = self.nan_bits
        canon = torch.where(torch.signbit(x), neg, pos).to(torch.int16)
        bits = body.view(torch.int16)
        bits.copy_(torch.where(torch.isnan(x), canon, bits))
        return None

    def _body_finite(self, body: np.ndarray) -> bool:
        exp = 0x7F80 if self.dtype == torch.bfloat16 else 0x7C00  # all ones: inf or NaN
        return not bool(((_aligned(body, np.uint16) & exp) == exp).any())

    # -- error feedback (see Codec's docstring): one pass, p never stored -------------------------
    def _encode_ef(self, p: torch.Tensor, body: torch.Tensor, residual: torch.Tensor, key: int,
                   step: int) -> bool:
        if self.use_torch(p.device):
            return False
        _require_cpu(self, p)
        pa = p.numpy()
        if self.nan_policy == "raise" and not all_finite(pa):
            raise self._non_finite_error(key)  # before residual is written
        K.encode_ef(self.name, pa, pa, np.float32(1.0), MODE_P, body.numpy().view(np.uint16),
                    residual.numpy())
        return True

    def _encode_ef_fused(self, g: torch.Tensor, e: torch.Tensor, ratio: float, body: torch.Tensor,
                         spare: torch.Tensor, key: int, step: int) -> torch.Tensor | None:
        if self.use_torch(g.device):
            return None
        _require_cpu(self, g)
        r, mode = ef_args(ratio)
        # one pass; the finite check comes at its end, so under "raise" the residual goes to the
        # scratch and e survives a rejected input
        res = spare if self.nan_policy == "raise" else e
        if not K.encode_ef(self.name, g.numpy(), e.numpy(), r, mode,
                           body.numpy().view(np.uint16), None if res is e else res.numpy()) \
                and self.nan_policy == "raise":
            raise self._non_finite_error(key)
        return res

    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        out.copy_(body.view(self.dtype))

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        if self.use_torch(acc.device):
            acc.add_(body.view(self.dtype), alpha=alpha)  # dynamic cast: no temporary on GPUs
            return
        _require_cpu(self, acc)
        self._decode_add_numba(body.numpy().view(np.uint16), acc.numpy(), np.float32(alpha))

    def _decode_add_numba(self, h: np.ndarray, acc: np.ndarray, alpha: np.float32) -> None:
        raise NotImplementedError


@register
class Fp16Codec(_Cast16Codec):
    """IEEE half precision values (16 bits/element), rounded to nearest even."""

    name = "fp16"
    codec_id = 1
    dtype = torch.float16
    nan_bits = (0x7E00, 0xFE00 - 0x10000)

    def _encode_numba(self, x: np.ndarray, h: np.ndarray) -> bool:
        return K.encode_fp16(x, h)

    def _decode_add_numba(self, h: np.ndarray, acc: np.ndarray, alpha: np.float32) -> None:
        K.decode_add_fp16(h, acc, alpha)


@register
class Bf16Codec(_Cast16Codec):
    """bfloat16 values (16 bits/element: float32's exponent, 8-bit significand), nearest even."""

    name = "bf16"
    codec_id = 2
    dtype = torch.bfloat16
    nan_bits = (0x7FC0, 0xFFC0 - 0x10000)

    def _encode_numba(self, x: np.ndarray, h: np.ndarray) -> bool:
        return K.encode_bf16(x, h)

    def _decode_add_numba(self, h: np.ndarray, acc: np.ndarray, alpha: np.float32) -> None:
        K.decode_add_bf16(h, acc, alpha)


def _require_cpu(codec: Codec, t: torch.Tensor) -> None:
    """The numba backend runs on CPU tensors only."""
    if t.device.type != "cpu":
        raise ValueError(f"{codec.name} codec with backend={codec.backend!r} needs CPU tensors, "
                         f"got a tensor on {t.device}; use backend='auto' or 'torch'")


def _aligned(body: np.ndarray, dtype: type) -> np.ndarray:
    """The uint8 ``body`` viewed as ``dtype``, copied first if it is not aligned for it (read
    only: the view may share ``body``'s memory)."""
    if body.ctypes.data % np.dtype(dtype).itemsize:
        body = body.copy()
    return body.view(dtype)

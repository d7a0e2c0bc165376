"""``onebit``: scaled sign compression, about 1 bit per element.

Algorithm (1-bit SGD, Seide et al., Interspeech 2014, "1-Bit Stochastic Gradient Descent and its
Application to Data-Parallel Distributed Training of Speech DNNs"; the scale is that of EF-SignSGD,
Karimireddy et al., ICML 2019, "Error Feedback Fixes SignSGD and other Gradient Compression
Schemes", alg. 1: ``C(x) = (||x||_1 / d) * sign(x)``; BytePS's ``onebit`` with ``scaling``):

1. One bit per element: 1 when the float's sign bit is set (so -0.0 and negative NaN count as
   negative, +0.0 as positive), packed 8 per byte, element ``i`` in byte ``i // 8`` at bit
   ``i % 8`` (LSB first).
2. One float32 ``scale``: the mean of ``|x|`` (``scaling=1``, the default), summed in float64 in
   the fixed blocked order of :mod:`.kernels.onebit`, or ``1.0`` (``scaling=0``).
3. Decode: ``-scale`` where the bit is 1, ``+scale`` elsewhere.

Payload body: ``ceil(numel / 8)`` bytes of bits, then the little-endian float32 scale. The CPU
path is one fused numba pass (bits + float64 |x| sum + non-finite check); torch ops (for GPU
tensors or ``backend="torch"``) produce identical bytes. Error feedback on CPU takes two passes
with ``p = x + e`` never stored (``_encode_ef_fused``, see :mod:`.kernels.onebit`). A server
reducing onebit pushes into a onebit reply (``Codec.compress_sum``) computes each element of
the pushes' sum from their bits inside the same two passes (:mod:`.kernels.onebit_sum`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import Codec, register
from .cast import _aligned, _require_cpu
from .header import Header
from .kernels import onebit as K
from .kernels import onebit_sum as KS
from .kernels.common import MODE_P, ef_args
from .spec import Param, parse_bool
from .wrapper import CodecWrapper

__all__ = ["OneBitCodec"]

_CANONICAL_NAN = float("nan")  # float32 0x7FC00000
_NO_E = np.empty(0, np.float32)  # the residual argument of the kernels without error feedback


@register
class OneBitCodec(Codec):
    """Signs packed 8 per byte plus one float32 scale (mean |x|, or 1.0 with ``scaling=0``)."""

    name = "onebit"
    codec_id = 3
    PARAMS = (Param("scaling", True, parse_bool,
                    "scale the signs by mean |x| (1, default) or send plain signs (0)"),)
    checks_finite = True

    def _body_bytes(self) -> int:
        return (self.numel + 7) // 8 + 4

    # -- encode -----------------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int,
                step: int) -> torch.Tensor | None:
        if self.use_torch(x.device):
            return self._encode_torch(x, body)
        _require_cpu(self, x)
        total = K.encode(x.numpy(), body.numpy(), bool(self.params["scaling"]))
        if self.nan_policy == "raise" and not math.isfinite(total):
            self._check_finite(x, key)  # raises the standard non-finite error
        return None

    def _encode_torch(self, x: torch.Tensor, body: torch.Tensor) -> torch.Tensor | None:
        """Torch ops, nothing read on the host; returns the finiteness flag under "raise"."""
        nbits = (self.numel + 7) // 8
        scaling = bool(self.params["scaling"])
        flag = None
        # 2. float64 |x| sum in the kernel's order: finite exactly when every input is
        if scaling or self.nan_policy == "raise":
            total = K.abs_sum_torch(x)
            if self.nan_policy == "raise":
                flag = torch.isfinite(total)
        if scaling:
            # a tensor divisor: ATen's CUDA div_true multiplies by the reciprocal of a CPU scalar
            # ("may lose one bit of precision", aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu,
            # not shipped in the wheel), one rounding more than the numba kernel's division
            n = torch.full((), float(self.numel), dtype=torch.float64, device=x.device)
            scale = (total / n).to(torch.float32)
            scale = torch.where(torch.isnan(scale), _CANONICAL_NAN, scale)
        else:
            scale = torch.ones((), dtype=torch.float32, device=x.device)
        # 1. sign bits, 8 per byte, LSB first
        signs = torch.zeros(nbits * 8, dtype=torch.uint8, device=x.device)
        signs[:self.numel] = torch.signbit(x)
        weights = 1 << torch.arange(8, dtype=torch.int32, device=x.device)  # no host tensor
        body[:nbits].copy_((signs.view(nbits, 8) * weights).sum(dim=1, dtype=torch.int32))
        body[nbits:nbits + 4].copy_(scale.reshape(1).view(torch.uint8))
        return flag

    def _body_finite(self, body: np.ndarray) -> bool:
        nbits = (self.numel + 7) // 8
        return math.isfinite(float(_aligned(body[nbits:nbits + 4], np.float32)[0]))

    # -- error feedback (see Codec's docstring): two passes, p never stored ------------------------
    def _encode_ef(self, p: torch.Tensor, body: torch.Tensor, residual: torch.Tensor, key: int,
                   step: int) -> bool:
        if self.use_torch(p.device):
            return False
        _require_cpu(self, p)
        pa = p.numpy()
        self._ef_passes(pa, pa, np.float32(1.0), MODE_P, body, residual.numpy(), key)
        return True

    def _encode_ef_fused(self, g: torch.Tensor, e: torch.Tensor, ratio: float, body: torch.Tensor,
                         spare: torch.Tensor, key: int, step: int) -> torch.Tensor | None:
        if self.use_torch(g.device):
            return None
        _require_cpu(self, g)
        r, mode = ef_args(ratio)
        self._ef_passes(g.numpy(), e.numpy(), r, mode, body, None, key)
        return e  # pass 2 runs only once p is accepted, so it may overwrite e

    def _ef_passes(self, g: np.ndarray, e: np.ndarray, r: np.float32, mode: int,
                   body: torch.Tensor, res: np.ndarray | None, key: int) -> None:
        """Pass 1: bits, |p| sum and scale (the finite check); pass 2: ``res = p - decode``
        (into ``e`` when ``res`` is None). ``p`` is recomputed in pass 2, bit for bit."""
        b = body.numpy()
        total = K.encode_ef(g, e, r, mode, b, bool(self.params["scaling"]))
        if self.nan_policy == "raise" and not math.isfinite(total):
            raise self._non_finite_error(key)
        inplace = res is None
        K.residual_ef(g, e, r, mode, b, np.float32(-1.0), e if inplace else res, inplace)

    # -- the server's fused reduce (Codec.compress_sum): the sum of onebit pushes never stored ----
    def fuses_sum(self, decoder: Codec, device: torch.device) -> bool:
        inner = decoder
        while isinstance(inner, CodecWrapper):  # decoding is the wrapped codec's
            inner = inner.inner
        return (device.type == "cpu" and self.numel > 0 and self.nan_policy == "raise"
                and isinstance(inner, OneBitCodec) and inner.numel == self.numel
                and not self.use_torch(device) and not inner.use_torch(device))

    def _step_sum(self, bodies: list[torch.Tensor], divisor: int, body: torch.Tensor,
                  h: Header) -> bool:
        return self._encode_sum_ef(bodies, divisor, None, 1.0, body)

    def _encode_sum_ef(self, bodies: list[torch.Tensor], divisor: int, e: torch.Tensor | None,
                       ratio: float, body: torch.Tensor) -> bool:
        """Encode ``p = ef_p(sum_w decode(bodies[w]) / divisor, e, ratio)`` (``p = g`` when ``e``
        is None) into ``body`` and write ``e = p - decode(body)`` in place (two numba passes,
        :mod:`.kernels.onebit_sum`). Returns False, ``e`` untouched, for a non-finite ``p`` (or
        bodies the kernels do not take: not contiguous host tensors of the body's size)."""
        size = self._body_bytes()
        if not all(b.device.type == "cpu" and b.is_contiguous() and b.numel() == size
                   for b in bodies):
            return False
        bs = tuple(b.numpy() for b in bodies)
        r, mode = (np.float32(1.0), MODE_P) if e is None else ef_args(ratio)
        ea = _NO_E if e is None else e.numpy()
        b = body.numpy()
        total = KS.encode_sum_ef(bs, self.numel, int(divisor), ea, r, mode, b,
                                 bool(self.params["scaling"]))
        if not math.isfinite(total):
            return False  # the generic path names the culprit
        if e is not None:
            KS.residual_sum_ef(bs, self.numel, int(divisor), ea, r, mode, b)
        return True

    # -- decode -----------------------------------------------------------------------------------
    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        if self.use_torch(out.device):
            scale = K.read_scale(body, self.numel)
            out.copy_(torch.where(self._negative_torch(body), -scale, scale))
            return
        _require_cpu(self, out)
        K.decode(body.numpy(), out.numpy())

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        if self.use_torch(acc.device):
            # v = float32(alpha * scale), one rounding, as in the numba kernel; torch.full
            # fills on the device (torch.tensor(alpha, device=...) would be a blocking copy)
            v = K.read_scale(body, self.numel) * torch.full((), alpha, dtype=torch.float32,
                                                            device=acc.device)
            acc.add_(torch.where(self._negative_torch(body), -v, v))
            return
        _require_cpu(self, acc)
        K.decode_add(body.numpy(), acc.numpy(), np.float32(alpha))

    def _negative_torch(self, body: torch.Tensor) -> torch.Tensor:
        """Bool tensor of numel: the unpacked sign bits."""
        nbits = (self.numel + 7) // 8
        shifts = torch.arange(8, dtype=torch.uint8, device=body.device)
        bits = (body[:nbits].unsqueeze(1) >> shifts) & 1
        return bits.view(-1)[:self.numel].bool()

"""The ``dithering`` codec: unbiased stochastic quantization to ``s`` levels (codec id 6).

QSGD (Alistarh et al., NeurIPS 2017, sec. 3.1) and natural dithering (Horvath et al., 2019,
"Natural Compression for Distributed Deep Learning"), as in BytePS's ``dithering`` compressor.

Parameters (spec ``dithering:s=7,partition=linear,normalize=max``):

* ``s`` (1..127, default 7): number of non-zero levels. ``s=1`` is sign-only ternary {-1, 0, 1}.
* ``partition``: ``linear`` (default): levels ``k / s`` for ``k = 0..s``; ``natural``: levels
  0 and ``2**(k - s)`` for ``k = 1..s``, i.e. 0, 2**-(s-1), ..., 1/4, 1/2, 1 (BytePS's natural
  partition; at ``s=1`` both are {0, 1}).
* ``normalize``: ``max`` (default): ``norm = max|x|``; ``l2``: ``norm = ||x||_2``.

Encoding (steps numbered as in :mod:`gradpress.compress.kernels.dithering`):

1. ``norm`` is computed (squares summed in float64 in a fixed blocked order that torch ops
   reproduce bit for bit as a parallel reduction, :func:`sumsq_torch`), stored as float32 and
   used as such below (an l2 norm above the float32
   range is stored as the largest float32, which still bounds max|x|).
2. Each element's ``r = |x| / norm`` lies in [0, 1]; with ``lo <= r <= hi`` the adjacent levels,
   it becomes ``hi`` with probability ``(r - lo) / (hi - lo)``, else ``lo``: ``E[level] = r``.
3. Decoding gives ``sign * level * norm`` (computed in float64, rounded to float32).

Randomness: ``(k0, k1) = splitmix64`` chain over ``(seed, key, step)``; element ``i`` uses
``hash32(i mod 2**32, k0, k1 ^ (i >> 32) * 0x9E3779B9)`` (a keyed "lowbias32" hash), so every
worker, server and backend draws the same numbers, in any order, in parallel.

Payload body (after the 40-byte header), ``b = ceil(log2(s + 1)) + 1`` bits per element::

    bytes [0, ceil(numel * b / 8))   codes, LSB-first bit stream: element i occupies stream bits
                                     [i*b, i*b + b), stream bit j is bit (j % 8) of byte j // 8;
                                     code = level index (bits 0..b-2) | sign << (b-1), sign 1 =
                                     negative; unused bits of the last byte are 0
    next 4 bytes                     norm, float32 little endian

e.g. ``s=7``: 4 bits per element, two per byte, element 2j in the low nibble of byte j.

Non-finite input: ``nan_policy='raise'`` raises ValueError (detected by the norm pass, no extra
scan; with torch ops the norm stays on the device and the check is a device flag, see
:meth:`~gradpress.compress.base.Codec.compress`); ``'allow'`` encodes the whole chunk as NaN
(codes 0, norm NaN), so the NaN reaches the receiver as it would uncompressed. Codes naming a
level above ``s`` (impossible from an encoder) decode to NaN.

Error feedback on CPU (``_encode_ef_fused``): the norm pass reads ``p = x + e`` on the fly, then
one pass stores ``p`` over ``e``, quantizes it and subtracts the decoded value in place; a zero or
non-finite norm (rare) falls back to the unfused path.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import transfer
from .base import Codec, _NonFiniteInputError, register
from .cast import _aligned, _require_cpu
from .header import Header
from .kernels import dithering as K
from .kernels.common import MODE_P, blocked_sum_torch, ef_args
from .spec import Param, choice, parse_int

__all__ = ["Dithering", "stream_keys"]

_M64 = (1 << 64) - 1
_DOMAIN = 0xD1B54A32D192ED03  # separates this codec's random stream from other codecs'
_GOLD32 = 0x9E3779B9
_F32_MAX = float(np.finfo(np.float32).max)
_HASH_M1, _HASH_M2 = 0x7FEB352D, 0x846CA68B


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stream_keys(seed: int, key: int, step: int) -> tuple[int, int]:
    """The two 32-bit hash keys of the random stream of ``(seed, key, step)``."""
    z = _splitmix64((seed & _M64) ^ _DOMAIN)
    z = _splitmix64(z ^ (key & _M64))
    z = _splitmix64(z ^ (step & _M64))
    return z & 0xFFFFFFFF, z >> 32


@register
class Dithering(Codec):
    """Stochastic quantization to ``s`` levels; see the module docstring for the wire format."""

    name = "dithering"
    codec_id = 6
    PARAMS = (
        Param("s", 7, parse_int(1, 127), "non-zero levels, 1..127"),
        Param("partition", "linear", choice("linear", "natural"),
              "linear: k/s; natural: 0 and powers of two 2**(k-s)"),
        Param("normalize", "max", choice("max", "l2"), "norm: max|x| or the l2 norm"),
    )
    checks_finite = True

    def __init__(self, numel: int, params: Any, **kwargs: Any) -> None:
        super().__init__(numel, params, **kwargs)
        self.s: int = self.params["s"]
        self.natural = self.params["partition"] == "natural"
        self.l2 = self.params["normalize"] == "l2"
        self.bits = _code_bits(self.s)
        self.code_bytes = (numel * self.bits + 7) // 8
        self._signed_levels = self._level_table()
        self._dev_levels: dict[str, torch.Tensor] = {}

    def _body_bytes(self) -> int:
        return (self.numel * _code_bits(self.params["s"]) + 7) // 8 + 4

    def _level_table(self) -> np.ndarray:
        """float64 ``sign * level`` for every code (NaN for codes naming a level above s)."""
        half = 1 << (self.bits - 1)
        k = np.arange(half, dtype=np.float64)
        mag = np.exp2(k - self.s) if self.natural else k / self.s
        if self.natural:
            mag[0] = 0.0
        mag[self.s + 1:] = np.nan
        return np.concatenate([mag, -mag])

    # -- encode -----------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int,
                step: int) -> torch.Tensor | None:
        if self.use_torch(x.device):
            return self._encode_torch(x, body, key, step)
        norm, finite = _norm_numba(x.numpy(), self.l2)
        if not finite:
            if self.nan_policy == "raise":
                self._check_finite(x, key)  # raises, with the message every codec uses
                raise _NonFiniteInputError(f"{self.name}.compress key {key}: non-finite norm "
                                           f"{norm}")
            norm = math.nan
        if norm == 0.0 or not finite:
            body[:self.code_bytes].zero_()
        else:
            pre, scale = self._scales(norm)
            k0, k1 = stream_keys(self.seed, key, step)
            kernel = K.encode_natural if self.natural else K.encode_linear
            kernel(x.numpy(), body.numpy()[:self.code_bytes], self.bits, self.s,
                   np.float32(pre), np.float32(scale), np.uint32(k0), np.uint32(k1))
        body.numpy()[self.code_bytes:] = np.frombuffer(np.float32(norm).tobytes(), np.uint8)
        return None

    def _encode_torch(self, x: torch.Tensor, body: torch.Tensor, key: int,
                      step: int) -> torch.Tensor | None:
        """Torch twin of the numba path with the norm kept on the device (nothing is read on
        the host): a zero or non-finite norm selects all-zero codes with ``torch.where``; the
        finiteness flag is returned under "raise"."""
        norm, finite = _norm_torch(x, self.l2)
        pre, scale = self._scales_torch(norm)
        k0, k1 = stream_keys(self.seed, key, step)
        codes = self._codes_torch(x, pre, scale, k0, k1)
        codes = torch.where(finite & (norm != 0.0), codes, 0)
        body[:self.code_bytes].copy_(_pack_torch(codes, self.bits, self.code_bytes))
        stored = torch.where(finite, norm, torch.nan)
        body[self.code_bytes:].copy_(stored.reshape(1).view(torch.uint8))
        return finite if self.nan_policy == "raise" else None

    def _scales(self, norm: float) -> tuple[float, float]:
        """``(pre, scale)``, float32 values with ``(|x| * pre) * scale = L * |x| / norm`` (L = s
        linear, 1 natural); ``pre`` is a power of two keeping ``scale`` a normal float32."""
        pre = 2.0 ** 64 if norm < 2.0 ** -64 else (2.0 ** -64 if norm >= 2.0 ** 64 else 1.0)
        top = 1.0 if self.natural else float(self.s)
        return pre, float(np.float32(top / (norm * pre)))

    def _scales_torch(self, norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_scales` of a 0-d float32 device tensor, as 0-d float32 tensors (the same
        float64 operations: a tensor division, not ``float / tensor``, which torch computes as
        a reciprocal and a product)."""
        n64 = norm.to(torch.float64)
        one = torch.ones((), dtype=torch.float64, device=norm.device)
        pre = torch.where(n64 < 2.0 ** -64, one * 2.0 ** 64,
                          torch.where(n64 >= 2.0 ** 64, one * 2.0 ** -64, one))
        top = one * (1.0 if self.natural else float(self.s))
        return pre.to(torch.float32), torch.div(top, n64 * pre).to(torch.float32)

    def _codes_torch(self, x: torch.Tensor, pre: torch.Tensor, scale: torch.Tensor, k0: int,
                     k1: int) -> torch.Tensor:
        """Torch-op twin of the numba kernels (same float32 operations, same codes): the int64
        codes ``level | sign << (b-1)`` (meaningless for a zero or non-finite norm)."""
        idx = torch.arange(self.numel, dtype=torch.int64, device=x.device)
        h = _hash32_torch(idx, k0, k1, wide=(self.numel - 1) >> 32 != 0)
        u = (h >> 8).to(torch.float32) * 2.0 ** -24
        y = (x.abs() * pre) * scale
        if self.natural:
            y = y.clamp_max(1.0)
            bits = y.view(torch.int32).to(torch.int64)
            e = bits >> 23
            big = ((h >> 9) < (bits & 0x7FFFFF)).to(torch.int64)
            small = (u < y * 2.0 ** (self.s - 1)).to(torch.int64)
            level = torch.where(e < 128 - self.s, small, e - (127 - self.s) + big)
        else:
            y = y.clamp_max(float(self.s))
            lo = y.to(torch.int32).clamp_max(self.s - 1)
            level = lo.to(torch.int64) + (u < y - lo.to(torch.float32)).to(torch.int64)
        sign = (x.view(torch.int32) < 0).to(torch.int64) << (self.bits - 1)
        return level | sign

    # -- error feedback (see Codec's docstring): a norm pass, then one pass writing everything --
    def _encode_ef(self, p: torch.Tensor, body: torch.Tensor, residual: torch.Tensor, key: int,
                   step: int) -> bool:
        if self.use_torch(p.device):
            return False
        _require_cpu(self, p)
        pa = p.numpy()
        return self._ef_numba(pa, pa, np.float32(1.0), MODE_P, body, residual.numpy(), key, step)

    def _encode_ef_fused(self, g: torch.Tensor, e: torch.Tensor, ratio: float, body: torch.Tensor,
                         spare: torch.Tensor, key: int, step: int) -> torch.Tensor | None:
        if self.use_torch(g.device):
            return None
        _require_cpu(self, g)
        r, mode = ef_args(ratio)
        return e if self._ef_numba(g.numpy(), e.numpy(), r, mode, body, None, key, step) else None

    def _ef_numba(self, g: np.ndarray, e: np.ndarray, r: np.float32, mode: int,
                  body: torch.Tensor, res: np.ndarray | None, key: int, step: int) -> bool:
        """Steps 1-4 on ``p`` (:func:`~.kernels.common.ef_p`) plus ``res = p - decode`` (into
        ``e`` when ``res`` is None); False, nothing written, for a zero or non-finite norm."""
        # 1. the norm of p (and the finite check) before anything is written
        if self.l2:
            norm, finite = _l2_norm(float(K.sumsq_ef(g, e, r, mode)))
        else:
            m = int(K.max_abs_ef(g, e, r, mode))
            norm, finite = float(np.uint32(m).view(np.float32)), m < 0x7F800000
        if not finite and self.nan_policy == "raise":
            raise self._non_finite_error(key)
        if norm == 0.0 or not finite:
            return False  # rare: the unfused path writes the all-zero codes
        # 2.-4. quantize p block by block; the residual adds the decode-add table for alpha = -1
        pre, scale = self._scales(norm)
        k0, k1 = stream_keys(self.seed, key, step)
        table = (self._signed_levels * (norm * -1.0)).astype(np.float32)
        out = body.numpy()
        inplace = res is None
        K.encode_ef(g, e, r, mode, out[:self.code_bytes], self.bits, self.s, self.natural,
                    np.float32(pre), np.float32(scale), np.uint32(k0), np.uint32(k1), table,
                    e if inplace else res, inplace)
        out[self.code_bytes:] = np.frombuffer(np.float32(norm).tobytes(), np.uint8)
        return True

    # -- decode -----------------------------------------------------------------------------
    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        self._apply(body, out, 1.0, add=False)

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        """``acc += float32(sign * level * (norm * alpha))`` straight from the codes (no dense
        temporary; the products in float64)."""
        self._apply(body, acc, alpha, add=True)

    def _apply(self, body: torch.Tensor, out: torch.Tensor, alpha: float, add: bool) -> None:
        codes = body[:self.code_bytes]
        if self.use_torch(out.device):
            norm = body[self.code_bytes:].clone().view(torch.float32).to(torch.float64)
            table = (self._levels_on(out.device) * (norm * alpha)).to(torch.float32)
            vals = table.index_select(0, _unpack_torch(codes, self.bits, self.numel))
            if add:
                out.add_(vals)
            else:
                out.copy_(vals)
            return
        host_norm = float(body[self.code_bytes:].numpy().view(np.float32)[0])
        host_table = (self._signed_levels * (host_norm * alpha)).astype(np.float32)
        (K.decode_add if add else K.decode)(codes.numpy(), self.bits, host_table, out.numpy())

    def _levels_on(self, device: torch.device) -> torch.Tensor:
        t = self._dev_levels.get(str(device))
        if t is None:
            t = self._dev_levels[str(device)] = torch.empty(len(self._signed_levels),
                                                            dtype=torch.float64, device=device)
            transfer.host_to(t, torch.from_numpy(self._signed_levels))  # no host sync
        return t

    def _body_finite(self, body: np.ndarray) -> bool:
        """Finite norm, and (unless every ``b - 1``-bit level index is valid) no code naming
        a level above ``s`` (those decode to NaN): a host scan of the codes."""
        if not math.isfinite(float(_aligned(body[self.code_bytes:], np.float32)[0])):
            return False
        if 1 << (self.bits - 1) == self.s + 1:
            return True
        mask = (np.arange(1 << self.bits) & ((1 << (self.bits - 1)) - 1)) > self.s
        bad = np.where(mask, np.float32(np.nan), np.float32(0.0)).astype(np.float32)
        out = np.empty(self.numel, np.float32)
        K.decode(body[:self.code_bytes], self.bits, bad, out)
        return bool(np.isfinite(out).all())


def _code_bits(s: int) -> int:
    """Bits per element: ceil(log2(s + 1)) for the level index, plus one sign bit."""
    return s.bit_length() + 1


# -- norm (step 1) ----------------------------------------------------------------------------
def _l2_norm(total: float) -> tuple[float, bool]:
    """float32 l2 norm from the float64 sum of squares; an l2 norm beyond the float32 range
    (finite input) becomes the largest float32, still >= max|x|, so quantization stays exact."""
    if not math.isfinite(total):
        return total, False
    return float(np.float32(min(math.sqrt(total), _F32_MAX))), True


def _norm_numba(x: np.ndarray, l2: bool) -> tuple[float, bool]:
    """``(norm as float32 value, all finite)`` by one numba pass."""
    if l2:
        return _l2_norm(float(K.sumsq(x)))
    bits = int(K.max_abs_bits(x.view(np.uint32)))
    return float(np.uint32(bits).view(np.float32)), bits < 0x7F800000


def _norm_torch(x: torch.Tensor, l2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`_norm_numba`, kept on the device: ``(norm, finite)`` as a 0-d
    float32 and a 0-d bool tensor (for a non-finite input the norm is meaningless)."""
    if l2:
        total = sumsq_torch(x)
        finite = torch.isfinite(total)
        return total.sqrt().clamp_max(_F32_MAX).to(torch.float32), finite
    bits = (x.view(torch.int32) & 0x7FFFFFFF).max()
    return bits.reshape(1).view(torch.float32)[0], bits < 0x7F800000


def sumsq_torch(x: torch.Tensor) -> torch.Tensor:
    """:func:`.kernels.dithering.sumsq` with torch ops, a 0-d float64 tensor: the same float64
    additions in the same order, hence the same sum bit for bit."""
    return blocked_sum_torch(x, square=True, rows=K.ROWS, lanes=K.LANES)


# -- torch twins of the hash and the bit packing ----------------------------------------------
def _mul32(a: torch.Tensor, m: int) -> torch.Tensor:
    """``(a * m) mod 2**32`` for int64 ``a`` in [0, 2**32) without int64 overflow."""
    lo = a * (m & 0xFFFF)
    hi = ((a * (m >> 16)) & 0xFFFF) << 16
    return (lo + hi) & 0xFFFFFFFF


def _hash32_torch(idx: torch.Tensor, k0: int, k1: int, *, wide: bool = False) -> torch.Tensor:
    """:func:`gradpress.compress.kernels.dithering.hash32` of element indices, as int64;
    ``wide``: some index is ``>= 2**32`` (known on the host from numel: nothing is read)."""
    kk1: torch.Tensor | int = k1
    if wide:
        kk1 = k1 ^ (((idx >> 32) * _GOLD32) & 0xFFFFFFFF)
    h = (idx & 0xFFFFFFFF) ^ k0
    h = h ^ (h >> 16)
    h = _mul32(h, _HASH_M1)
    h = h ^ (h >> 15) ^ kk1
    h = _mul32(h, _HASH_M2)
    return h ^ (h >> 16)


def _pack_torch(codes: torch.Tensor, b: int, nbytes: int) -> torch.Tensor:
    """Pack int64 ``b``-bit codes LSB-first into ``nbytes`` uint8 (the module's layout)."""
    if b == 8:
        return codes.to(torch.uint8)
    pad = (-codes.numel()) % 8
    groups = torch.cat([codes, codes.new_zeros(pad)]).view(-1, 8)
    shifts = torch.arange(8, device=codes.device) * b
    word = (groups << shifts).sum(1, keepdim=True)  # disjoint bit fields: sum == or; < 2**56
    out = (word >> (torch.arange(b, device=codes.device) * 8)) & 0xFF
    return out.reshape(-1)[:nbytes].to(torch.uint8)


def _unpack_torch(body: torch.Tensor, b: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`_pack_torch`: int64 codes of ``numel`` elements."""
    if b == 8:
        return body.to(torch.int64)
    pad = (-body.numel()) % b
    groups = torch.cat([body, body.new_zeros(pad)]).to(torch.int64).view(-1, b)
    word = (groups << (torch.arange(b, device=body.device) * 8)).sum(1, keepdim=True)
    codes = (word >> (torch.arange(8, device=body.device) * b)) & ((1 << b) - 1)
    return codes.reshape(-1)[:numel]

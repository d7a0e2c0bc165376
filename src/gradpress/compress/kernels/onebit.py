"""numba kernels of the ``onebit`` codec (scaled sign compression).

Wire format of the body (after the header): ``ceil(numel / 8)`` bytes of sign bits, element ``i``
in byte ``i // 8`` at bit ``i % 8`` (LSB first, like ``np.packbits(..., bitorder="little")``), a bit
of 1 meaning the float's sign bit is set (negative, including -0.0), unused high bits of the last
byte 0; then one little-endian float32 ``scale`` (unaligned, right after the bits).

Encoding, one pass over the input (:func:`encode`):

1. Rows of ``LANES`` elements: add ``float64(|x_i|)`` to lane accumulator ``acc[i % LANES]``
   (a lane-wise vector add, so LLVM vectorizes it without reassociating anything), note each
   sign bit as a byte, and pack the row's sign bytes 8 per byte by a multiply-shift while the
   row is in L1 (little-endian hosts).
2. Every ``ROWS`` rows (a block of ``BLOCK`` elements) the lanes are folded by a halving tree
   (``acc[j] += acc[j + w]`` for ``w = LANES/2, ..., 1``) into one block sum.
3. The block sums, zero-padded to a power of two, are folded by the same halving tree.
4. ``scale = float32(total / numel)`` (``scaling``) or ``1.0``; a NaN scale is stored as the
   canonical quiet NaN ``0x7FC00000``.

The summation order is fixed by (1)-(3) alone, so :func:`abs_sum_torch` reproduces ``total`` bit
for bit with torch ops on any device. Since a float64 sum of float32 magnitudes cannot overflow,
``total`` is finite exactly when every input is: the non-finite check costs nothing extra.

Decoding writes ``scale`` with the sign bit of each element's bit (``-scale`` for 1).

Error feedback (:class:`gradpress.compress.ef.ErrorFeedback`), two passes, ``p`` never stored:

1. :func:`encode_ef` is :func:`encode` of ``p = g + e`` (or ``g + r * e``, see
   :mod:`.common`), computed element by element in the same loops, so the sum and the scale are
   bit-identical to encoding a stored ``p``; its non-finite total rejects ``p`` before any
   residual is written.
2. :func:`residual_ef` recomputes ``p`` and writes ``p + v'`` over ``e`` (``v = float32(-1 *
   scale)``, ``v'`` = ``v`` with ``p``'s sign bit flipped in): the arithmetic of
   :func:`decode_add` with ``alpha = -1`` on a stored ``p``.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from .common import MODE_P, bits_f32, block_sums, blocked_sum_torch, ef_p, f32_bits, fold

__all__ = ["LANES", "ROWS", "BLOCK", "encode", "encode_ef", "residual_ef", "decode", "decode_add",
           "abs_sum_torch", "read_scale"]

LANES = 256
ROWS = 16
BLOCK = LANES * ROWS
_U = np.uint32
_CANONICAL_NAN = 0x7FC00000
_SIGN = np.uint32(0x80000000)
# Reading 8 sign bytes (0/1) as one little-endian uint64 t = sum_j s_j 2**(8j), the product
# t * _GATHER holds sum_j s_j 2**(56+j) in its top byte: the partial products are distinct powers
# of two, so nothing carries. A vectorizable multiply-shift instead of 8 shifts and ORs.
_GATHER = np.uint64(0x0102040810204080)


@numba.njit(cache=True, nogil=True)
def _put_scale(body: np.ndarray, at: int, scale: np.float32) -> None:
    s = np.float32(scale).view(np.uint32)
    if s & _U(0x7FFFFFFF) > _U(0x7F800000):
        s = _U(_CANONICAL_NAN)
    for k in range(4):
        body[at + k] = np.uint8(_U(s >> _U(8 * k)) & _U(0xFF))


@numba.njit(cache=True, nogil=True)
def _get_scale_bits(body: np.ndarray, at: int) -> np.uint32:
    s = _U(0)
    for k in range(4):
        s = _U(s | _U(_U(body[at + k]) << _U(8 * k)))
    return s


@numba.njit(cache=True, nogil=True)
def _tail_block(g, e, r, mode, body, first, acc, signs, s64):  # type: ignore[no-untyped-def]
    """Steps 1-2 for the last, incomplete block ``p[first:]`` (missing elements: +0.0, bit 0)."""
    n = g.shape[0]
    acc[:] = 0.0
    for base in range(first, n, LANES):
        c = min(LANES, n - base)
        signs[:] = 0
        for j in range(c):
            v = ef_p(g, e, r, mode, base + j)
            acc[j] += np.float64(abs(v))
            signs[j] = np.uint8(f32_bits(v) >> _U(31))
        for k in range((c + 7) // 8):
            body[base // 8 + k] = np.uint8((s64[k] * _GATHER) >> np.uint64(56))
    return fold(acc, LANES)


@numba.njit(cache=True, nogil=True)
def encode_ef(g: np.ndarray, e: np.ndarray, r: np.float32, mode: int, body: np.ndarray,
              scaling: bool) -> float:
    """Pack the signs of ``p`` (:func:`.common.ef_p` of ``g, e, r, mode``) and the scale into
    ``body``; return the float64 |p| sum, non-finite exactly when ``p`` holds a NaN or an inf.

    ``p`` is computed on the fly and never stored (error feedback's pass 1)."""
    n = g.shape[0]
    nblk = (n + BLOCK - 1) // BLOCK
    sums = block_sums(n, BLOCK)
    acc = np.empty(LANES)
    signs = np.empty(LANES, np.uint8)  # one sign byte (0/1) per element of the row
    s64 = signs.view(np.uint64)
    nfull = n // BLOCK
    for b in range(nfull):
        acc[:] = 0.0
        for row in range(b * ROWS, (b + 1) * ROWS):
            base = row * LANES
            # 1. lane-wise float64 accumulation and the row's sign bytes (vectorized) ...
            for j in range(LANES):
                v = ef_p(g, e, r, mode, base + j)
                acc[j] += np.float64(abs(v))
                signs[j] = np.uint8(f32_bits(v) >> _U(31))
            # ... gathered 8 per byte by a multiply-shift (see _GATHER)
            for k in range(LANES // 8):
                body[row * (LANES // 8) + k] = np.uint8((s64[k] * _GATHER) >> np.uint64(56))
        # 2. fold the lanes into the block sum
        sums[b] = fold(acc, LANES)
    if nfull < nblk:
        sums[nfull] = _tail_block(g, e, r, mode, body, nfull * BLOCK, acc, signs, s64)
    return _total_and_scale(sums, n, body, scaling)  # steps 3-4


@numba.njit(cache=True, nogil=True)
def _total_and_scale(sums: np.ndarray, n: int, body: np.ndarray, scaling: bool) -> float:
    """Steps 3-4: fold the block sums (zero-padded to a power of two) into the float64 total
    and write the scale after the ``n`` elements' bits; returns the total."""
    total = fold(sums, sums.shape[0])
    scale = np.float32(total / max(n, 1)) if scaling else np.float32(1.0)
    _put_scale(body, (n + 7) // 8, scale)
    return total


@numba.njit(cache=True, nogil=True)
def encode(x: np.ndarray, body: np.ndarray, scaling: bool) -> float:
    """Pack the signs of float32 ``x`` and the scale into ``body``; return the float64 |x| sum.

    The return value is non-finite exactly when ``x`` holds a NaN or an infinity.
    """
    return encode_ef(x, x, np.float32(1.0), MODE_P, body, scaling)


@numba.njit(cache=True, nogil=True)
def residual_ef(g: np.ndarray, e: np.ndarray, r: np.float32, mode: int, body: np.ndarray,
                alpha: np.float32, res: np.ndarray, inplace: bool) -> None:
    """``res = p + alpha * decode(body)`` with ``p`` recomputed on the fly (error feedback's pass
    2, after :func:`encode_ef` wrote ``body``), written into ``e`` itself when ``inplace``.

    The arithmetic is that of :func:`decode_add` on a stored ``p``: ``v = float32(alpha *
    scale)``, then ``p + (v with the sign flipped where p's sign bit is set)``; the sign bit of
    ``p`` is the bit :func:`encode_ef` stored, so the body bits need not be read back."""
    n = g.shape[0]
    v = np.float32(alpha * bits_f32(_get_scale_bits(body, (n + 7) // 8)))
    vb = f32_bits(v)
    if inplace:
        for i in range(n):
            p = ef_p(g, e, r, mode, i)
            e[i] = p + bits_f32(_U(vb ^ _U(f32_bits(p) & _SIGN)))
    else:
        for i in range(n):
            p = ef_p(g, e, r, mode, i)
            res[i] = p + bits_f32(_U(vb ^ _U(f32_bits(p) & _SIGN)))


@numba.njit(cache=True, nogil=True)
def decode(body: np.ndarray, out: np.ndarray) -> None:
    """out[i] = -scale if bit i else +scale (float32 ``out`` of numel elements)."""
    n = out.shape[0]
    o = out.view(np.uint32)
    nbits = (n + 7) // 8
    s = _get_scale_bits(body, nbits)
    whole = n // 8
    for k in range(whole):
        byte = _U(body[k])
        for j in range(8):
            o[8 * k + j] = _U(s ^ _U(_U(_U(byte >> _U(j)) & _U(1)) << _U(31)))
    if whole < nbits:
        byte = _U(body[whole])
        for j in range(n - 8 * whole):
            o[8 * whole + j] = _U(s ^ _U(_U(_U(byte >> _U(j)) & _U(1)) << _U(31)))


@numba.njit(cache=True, nogil=True)
def decode_add(body: np.ndarray, acc: np.ndarray, alpha: np.float32) -> None:
    """acc[i] += -v if bit i else +v, with v = float32(alpha * scale) (one rounding; any sign)."""
    n = acc.shape[0]
    nbits = (n + 7) // 8
    v = np.float32(alpha * np.uint32(_get_scale_bits(body, nbits)).view(np.float32))
    vb = np.float32(v).view(np.uint32)
    whole = n // 8
    for k in range(whole):
        byte = _U(body[k])
        for j in range(8):
            sv = _U(vb ^ _U(_U(_U(byte >> _U(j)) & _U(1)) << _U(31)))
            acc[8 * k + j] += np.uint32(sv).view(np.float32)
    if whole < nbits:
        byte = _U(body[whole])
        for j in range(n - 8 * whole):
            sv = _U(vb ^ _U(_U(_U(byte >> _U(j)) & _U(1)) << _U(31)))
            acc[8 * whole + j] += np.uint32(sv).view(np.float32)


def read_scale(body: torch.Tensor, numel: int) -> torch.Tensor:
    """The float32 scale stored after the sign bits, as a 0-d tensor on ``body``'s device."""
    nbits = (numel + 7) // 8
    return body[nbits:nbits + 4].clone().view(torch.float32)[0]


def abs_sum_torch(x: torch.Tensor) -> torch.Tensor:
    """float64 sum of |x| in exactly the order of :func:`encode` (a 0-d tensor, same device)."""
    return blocked_sum_torch(x, square=False, rows=ROWS, lanes=LANES)

"""numba kernels of the block-scaled integer codecs ``int2``, ``int3``, ``int4``, ``int8``.

Algorithm (per block of ``B`` elements; symmetric N-bit codes with one scale per block, as
ZeRO++'s qgZ and LoCo quantize gradients; :mod:`gradpress.compress.blockint` has the format):

1. ``m = max|p|`` over the block (an integer max of the float32 bits without the sign; a value
   ``>= 0x7F800000`` means a NaN or inf in the block).
2. The scale ``s = bf16_up(m / L)`` with ``L = 2**(N-1) - 1`` the largest magnitude code:
   ``m / L`` in float32, rounded *up* to the bfloat16 grid (so ``|p| / s <= L`` up to one
   rounding, and the scale keeps float32's range). A zero block has ``s = 0``; a block with a
   NaN/inf has the NaN scale ``0x7FC0`` and magnitude codes 0 (it decodes to NaN).
3. Magnitude ``q = min(int(|p| / s + 0.5), L)`` (nearest; error feedback keeps what rounding
   drops), sign = the float's sign bit; ``code = q | sign << (N-1)``. Zero is exact: ``p = 0``
   gives ``q = 0`` whatever the scale.
4. Decoding: ``v = float32(q) * s``, its sign bit flipped when the code's sign is set.

Codes are packed as the dithering codec's LSB-first ``N``-bit stream (:func:`.dithering._store`).
Work is done per tile of whole blocks (about 4096 elements, L1-resident): the error-feedback
input ``p`` (:func:`.common.ef_p`) is stored in a tile scratch, then steps 1-3 and, when asked,
the residual ``p - v`` run over it; every arithmetic step is a float32 operation the torch twin
(:mod:`gradpress.compress.blockint`) performs in the same order, so both give the same bytes.
"""

from __future__ import annotations

import numba
import numpy as np

from .common import MODE_P, bits_f32, f32_bits, fill_p
from .dithering import _store, _unpack

__all__ = ["TILE", "tile_elems", "encode", "decode", "NAN_SCALE", "MAX_SCALE"]

TILE = 4096  # elements per tile (rounded to whole blocks)
NAN_SCALE = np.uint16(0x7FC0)  # bfloat16 quiet NaN: the scale of a block with a NaN/inf
MAX_SCALE = np.uint32(0x7F7F0000)  # the largest finite bfloat16, as float32 bits
_MAG = np.uint32(0x7FFFFFFF)
_EXP = np.uint32(0x7F800000)
_LOW = np.uint32(0xFFFF)
_HIGH = np.uint32(0xFFFF0000)
_U16 = np.uint32(16)
_U31 = np.uint32(31)
_HALF = np.float32(0.5)


def tile_elems(block: int) -> int:
    """Elements per tile: whole blocks, about :data:`TILE`."""
    return block * max(1, TILE // block)


@numba.njit(cache=True, nogil=True, inline="always")
def _scale_bits(mb, lf):  # type: ignore[no-untyped-def]
    """Step 2: the bfloat16 scale bits (as a float32 bit pattern) of a block whose max
    magnitude bits are ``mb`` (finite, non-zero)."""
    s = bits_f32(np.uint32(mb)) / lf
    u = np.uint32((f32_bits(s) + _LOW) & _HIGH)  # round up to the bfloat16 grid
    return u if u < _EXP else MAX_SCALE


# Loops run over whole slices from index 0 (``range(len)``): indices numba can prove
# non-negative, so no wraparound check stops LLVM from vectorising them.
@numba.njit(cache=True, nogil=True)
def _quantize_block(p, codes, lf, li, sbit, res, write_res):  # type: ignore[no-untyped-def]
    """Steps 1-3 for the block ``p`` into ``codes`` (and ``res = p - v`` with ``write_res``);
    returns ``(scale bits16, max bits)``."""
    pb = p.view(np.uint32)
    mb = np.uint32(0)
    for j in range(p.shape[0]):  # 1.
        mb = max(mb, np.uint32(pb[j] & _MAG))
    if mb == 0 or mb >= _EXP:  # a zero block, or one with a NaN/inf: magnitudes 0
        s = np.float32(0.0) if mb == 0 else np.float32(np.nan)
        for j in range(p.shape[0]):
            codes[j] = np.uint8(sbit if pb[j] > _MAG else 0)
            if write_res:
                res[j] = p[j] - bits_f32(np.uint32(f32_bits(np.float32(0.0) * s)
                                                   | (pb[j] & ~_MAG)))
        return (np.uint16(0) if mb == 0 else NAN_SCALE), np.uint32(mb)
    u = np.uint32(_scale_bits(mb, lf))  # 2.
    s = bits_f32(u)
    for j in range(p.shape[0]):  # 3.
        q = np.int32(abs(p[j]) / s + _HALF)
        q = q if q < li else li
        sign = sbit if pb[j] > _MAG else np.int32(0)
        codes[j] = np.uint8(q + sign)
        if write_res:  # 4. the decoded value's sign is the input's
            res[j] = p[j] - bits_f32(np.uint32(f32_bits(np.float32(q) * s) | (pb[j] & ~_MAG)))
    return np.uint16(u >> _U16), np.uint32(mb)


@numba.njit(cache=True, nogil=True, inline="always")
def _value(c, s, magmask, nb1):  # type: ignore[no-untyped-def]
    """Step 4: the float32 value of code ``c`` with scale ``s``."""
    v = np.float32(np.int32(c & magmask)) * s
    return bits_f32(np.uint32(f32_bits(v) ^ np.uint32(np.uint32(c >> nb1) << _U31)))


@numba.njit(cache=True, nogil=True)
def encode(g, e, r, mode, scales, out, b, block, res, write_res):  # type: ignore[no-untyped-def]
    """Encode ``p`` (:func:`.common.ef_p` of ``g, e, r, mode``; ``mode == MODE_P``: ``p = g``)
    into the uint16 ``scales`` (one per block) and the packed codes ``out``; with ``write_res``
    also store ``res = p - decode`` (``res`` may be ``e`` itself: each tile's ``p`` is read
    before it is written). Returns the largest magnitude bits seen (``>= 0x7F800000``: the
    input had a NaN/inf)."""
    n = g.shape[0]
    li = np.int32((1 << (b - 1)) - 1)
    lf = np.float32(li)
    sbit = np.int32(1 << (b - 1))
    tile = block * max(1, TILE // block)
    buf = np.empty(tile, np.float32)
    codes = np.empty(tile, np.uint8)
    tmp = np.zeros(tile, np.uint8)
    top = np.uint32(0)
    for t0 in range(0, n, tile):
        m = min(tile, n - t0)
        if mode == MODE_P:
            p = g[t0:t0 + m]
        else:
            p = buf[:m]
            fill_p(g[t0:t0 + m], e[t0:t0 + m], r, mode, p, False)
        for lo in range(0, m, block):
            hi = min(lo + block, m)
            s16, mb = _quantize_block(p[lo:hi], codes[lo:hi], lf, li, sbit,
                                      res[t0 + lo:t0 + hi], write_res)
            scales[(t0 + lo) // block] = s16
            top = max(top, mb)
        _store(codes, m, b, out, t0 // 8 * b, tmp)
    return top


@numba.njit(cache=True, nogil=True, inline="always")
def _unpack_tile(body, o, m, b, codes, tmp):  # type: ignore[no-untyped-def]
    """Unpack ``m`` codes from ``body[o:]`` (fast paths for b = 2, 4, 8)."""
    nbytes = (m * b + 7) // 8
    if b == 8:
        codes[:m] = body[o:o + m]
    elif b == 4:
        for j in range(m // 2):
            v = body[o + j]
            codes[2 * j] = v & np.uint8(15)
            codes[2 * j + 1] = v >> np.uint8(4)
        if m % 2:
            codes[m - 1] = body[o + m // 2] & np.uint8(15)
    elif b == 2:
        for j in range(m // 4):
            v = body[o + j]
            codes[4 * j] = v & np.uint8(3)
            codes[4 * j + 1] = (v >> np.uint8(2)) & np.uint8(3)
            codes[4 * j + 2] = (v >> np.uint8(4)) & np.uint8(3)
            codes[4 * j + 3] = v >> np.uint8(6)
        for i in range(m // 4 * 4, m):
            codes[i] = (body[o + i // 4] >> np.uint8(2 * (i % 4))) & np.uint8(3)
    else:
        ngroups = (m + 7) // 8
        tmp[:] = 0
        tmp[:nbytes] = body[o:o + nbytes]
        _unpack(tmp, ngroups, b, codes)


@numba.njit(cache=True, nogil=True)
def decode(scales, body, b, block, out, alpha, add):  # type: ignore[no-untyped-def]
    """Step 4 for every element: ``out[i] = v_i``, or with ``add`` ``out[i] += v_i * alpha``
    (``alpha == 1``: ``out[i] += v_i``), from the uint16 ``scales`` and the packed codes."""
    n = out.shape[0]
    magmask = np.uint8((1 << (b - 1)) - 1)
    nb1 = np.uint8(b - 1)
    tile = block * max(1, TILE // block)
    codes = np.empty(tile, np.uint8)
    tmp = np.zeros(tile, np.uint8)
    one = alpha == np.float32(1.0)
    for t0 in range(0, n, tile):
        m = min(tile, n - t0)
        _unpack_tile(body, t0 // 8 * b, m, b, codes, tmp)
        for lo in range(0, m, block):
            hi = min(lo + block, m)
            s = bits_f32(np.uint32(np.uint32(scales[(t0 + lo) // block]) << _U16))
            _values(codes[lo:hi], s, magmask, nb1, out[t0 + lo:t0 + hi], alpha, add, one)


@numba.njit(cache=True, nogil=True)
def _values(codes, s, magmask, nb1, out, alpha, add, one):  # type: ignore[no-untyped-def]
    """Step 4 over one block: ``out = v``, ``out += v`` or ``out += v * alpha``."""
    if not add:
        for j in range(codes.shape[0]):
            out[j] = _value(codes[j], s, magmask, nb1)
    elif one:
        for j in range(codes.shape[0]):
            out[j] += _value(codes[j], s, magmask, nb1)
    else:
        for j in range(codes.shape[0]):
            out[j] += _value(codes[j], s, magmask, nb1) * alpha

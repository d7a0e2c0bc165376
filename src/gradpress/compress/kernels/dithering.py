"""numba kernels of the ``dithering`` codec (stochastic quantization, QSGD-style).

Algorithm (Alistarh et al., NeurIPS 2017, "QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding", sec. 3.1; natural partition after Horvath et al. 2019, "Natural
Compression for Distributed Deep Learning"; as in BytePS's ``dithering`` compressor):

1. ``norm`` = max|x| or ||x||_2 (:func:`max_abs_bits`, :func:`sumsq`); a non-finite input
   shows up as a non-finite norm, so this pass doubles as the NaN/inf check.
2. ``y = (|x| * pre) * scale`` in float32, with ``pre`` a power of two that keeps ``scale`` in
   the normal float32 range; ``y`` is ``r = |x| / norm`` mapped onto the level grid:
   linear: ``y = r * s`` in ``[0, s]``, level ``k`` is ``k / s``;
   natural: ``y = r`` in ``[0, 1]``, level ``k >= 1`` is ``2**(k - s)``, level 0 is 0.
3. Find the adjacent levels ``lo <= y <= hi`` and round up with probability
   ``(y - lo) / (hi - lo)`` (unbiased): linear: ``lo = trunc(y)``, ``p = y - lo``; natural: the
   float32 biased exponent ``e`` of ``y`` gives the level ``e - 127 + s``, its 23 mantissa bits
   are ``p`` (exactly); below level 1, ``p = y * 2**(s-1)``. The uniform comes from a
   counter-based hash of the element index (:func:`hash32`), keyed by two words derived from
   (seed, key, step): 24 bits as a float32
   ``u = (h >> 8) * 2**-24`` (up iff ``u < p``, so P(up) = ceil(p * 2**24) / 2**24: unbiased
   to within 2**-24 of a level gap), or 23 bits compared with the mantissa (exact).
4. Pack ``code = level | sign << (b-1)`` in ``b`` bits per element, LSB-first (see
   :mod:`gradpress.compress.dithering` for the byte layout).

Encoding works per block of ``BLOCK`` elements: a vectorisable quantize loop (no division, 32-bit
integer lanes) writes codes to an L1-resident scratch, a pack loop (specialised for b = 2, 4, 8)
writes the bytes. Decoding is one table lookup per element, ``table[code]`` = sign * level * norm
(times alpha for decode-add), straight from the bytes for b = 2, 4, 8, else via a block of
unpacked codes.

Error feedback, two passes: the norm of ``p = g + e`` (:mod:`.common`) computed on the fly
(:func:`max_abs_ef`, :func:`sumsq_ef`: same order, same value as on a stored ``p``), then
:func:`encode_ef`: per block, ``p`` is stored over ``e``, quantized by the same block kernels and
the decode-add table (alpha = -1) added in place, as :func:`decode_add` would.
"""

from __future__ import annotations

import numba
import numpy as np

from .common import (  # max_abs_ef: re-exported
    MODE_P,
    block_sums,
    ef_p,
    f32_bits,
    fill_p,
    fold,
    max_abs_ef,
)

__all__ = ["BLOCK", "LANES", "ROWS", "hash32", "hash32_np", "max_abs_bits", "sumsq",
           "encode_linear", "encode_natural", "decode", "decode_add", "sumsq_ef",
           "max_abs_ef", "encode_ef"]

BLOCK = 4096  # elements per block; a multiple of 8 (blocks start on a byte) dividing 2**32
LANES = 256  # lanes of the l2 norm's float64 sum (fixed order, reproduced by torch ops)
ROWS = 16  # rows of LANES per BLOCK in that sum

_U8 = np.uint32(8)
_U9 = np.uint32(9)
_U15 = np.uint32(15)
_U16 = np.uint32(16)
_U23 = np.uint32(23)
_M1 = np.uint32(0x7FEB352D)
_M2 = np.uint32(0x846CA68B)
_MAG = np.uint32(0x7FFFFFFF)
_MANT = np.uint32(0x007FFFFF)
_INV24 = np.float32(2.0 ** -24)
_ONE = np.float32(1.0)


@numba.njit(cache=True, nogil=True, inline="always")
def hash32(i: np.uint32, k0: np.uint32, k1: np.uint32) -> np.uint32:
    """Keyed "lowbias32" integer hash (C. Wellons) of a 32-bit counter: a bijection of ``i``."""
    h = np.uint32(i ^ k0)
    h = np.uint32(h ^ (h >> _U16))
    h = np.uint32(h * _M1)
    h = np.uint32(h ^ (h >> _U15))
    h = np.uint32(h ^ k1)
    h = np.uint32(h * _M2)
    return np.uint32(h ^ (h >> _U16))


def hash32_np(i: np.ndarray, k0: int, k1: int) -> np.ndarray:
    """numpy reference of :func:`hash32` (uint32 arrays wrap modulo 2**32); for tests."""
    h = i.astype(np.uint32) ^ np.uint32(k0)
    h ^= h >> np.uint32(16)
    h *= _M1
    h ^= h >> np.uint32(15)
    h ^= np.uint32(k1)
    h *= _M2
    return h ^ (h >> np.uint32(16))


# -- step 1: the norm ---------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def max_abs_bits(xb: np.ndarray) -> np.uint32:
    """Max of ``bits & 0x7FFFFFFF`` over the uint32 view of float32 ``x``: the bits of max|x|
    (integer order equals float order for non-negative floats); ``>= 0x7F800000`` means NaN/inf."""
    m = np.uint32(0)
    for i in range(xb.shape[0]):
        a = xb[i] & _MAG
        m = a if a > m else m
    return m


@numba.njit(cache=True, nogil=True)
def sumsq_ef(g, e, r, mode):  # type: ignore[no-untyped-def]
    """float64 sum of p**2 (``p`` = :func:`.common.ef_p` of ``g, e, r, mode``) in a fixed order
    that a parallel reduction reproduces (:func:`gradpress.compress.dithering.sumsq_torch`),
    the order of the onebit kernels' |x| sum: per block of ``BLOCK`` elements, ``ROWS`` rows of
    ``LANES`` added lane-wise in row order (a vectorizable loop), the lanes folded by a halving
    tree; then the block sums, zero-padded to a power of two, by the same tree. Squares of
    float32 are exact in float64 and missing elements count as +0.0 (which changes no sum), so
    the total is non-finite exactly when p is."""
    n = g.shape[0]
    nblk = max(1, (n + BLOCK - 1) // BLOCK)
    sums = block_sums(n, BLOCK)
    acc = np.empty(LANES)
    for b in range(nblk):
        lo = b * BLOCK
        acc[:] = 0.0
        if lo + BLOCK <= n:
            for row in range(ROWS):
                base = lo + row * LANES
                for j in range(LANES):
                    v = np.float64(ef_p(g, e, r, mode, base + j))
                    acc[j] += v * v
        else:
            for i in range(lo, n):
                v = np.float64(ef_p(g, e, r, mode, i))
                acc[(i - lo) % LANES] += v * v
        sums[b] = fold(acc, LANES)
    return fold(sums, sums.shape[0])


@numba.njit(cache=True, nogil=True)
def sumsq(x: np.ndarray) -> float:
    """:func:`sumsq_ef` of ``p = x``."""
    return sumsq_ef(x, x, np.float32(1.0), MODE_P)


# -- steps 2-3: quantize a block into codes -----------------------------------------------------
@numba.njit(cache=True, nogil=True, inline="always")
def _uniform24(i, k0, k1):  # type: ignore[no-untyped-def]
    """A uniform float32 in [0, 1) on the 2**-24 grid: the top 24 bits of hash32 (exact)."""
    return np.float32(np.int32(hash32(np.uint32(i), k0, k1) >> _U8)) * _INV24


# Integer intermediates are cast to 32 bits on purpose: numba widens to 64 bits, and 32-bit
# lanes let LLVM vectorise twice as wide.
@numba.njit(cache=True, nogil=True)
def _quantize_linear(  # type: ignore[no-untyped-def]
        x, xb, start, codes, sbit, s, pre, scale, k0, k1):
    # x, xb: the block (float32 and its uint32 bits); start: index of x[0] (hash counter)
    sf = np.float32(s)
    top = np.int32(s - 1)
    for j in range(x.shape[0]):
        y = min(abs(x[j]) * pre * scale, sf)  # step 2: r * s, clamped to the last level
        lo = min(np.int32(y), top)  # step 3: lower level (y = s goes up from s-1 with p = 1)
        up = np.int32(1) if _uniform24(start + j, k0, k1) < y - np.float32(lo) else np.int32(0)
        sign = sbit if xb[j] > _MAG else np.int32(0)
        codes[j] = np.uint8(np.int32(lo + up) + sign)  # step 4: level | sign << (b - 1)


@numba.njit(cache=True, nogil=True)
def _quantize_natural(  # type: ignore[no-untyped-def]
        x, xb, start, codes, sbit, s, pre, scale, k0, k1):
    c2 = np.float32(2.0 ** (s - 1))
    e_min = np.int32(128 - s)  # biased float32 exponent of level 1 = 2**(1-s)
    off = np.int32(127 - s)
    for j in range(x.shape[0]):
        y = min(abs(x[j]) * pre * scale, _ONE)  # step 2: r, clamped to 1
        bits = f32_bits(y)
        e = np.int32(bits >> _U23)
        h = hash32(np.uint32(start + j), k0, k1)
        # step 3, y >= 2**(1-s): level e - 127 + s, p = mantissa / 2**23, compared exactly
        big = np.int32(1) if np.int32(h >> _U9) < np.int32(bits & _MANT) else np.int32(0)
        # step 3, y < 2**(1-s): between level 0 and level 1, p = y * 2**(s-1)
        u = np.float32(np.int32(h >> _U8)) * _INV24
        small = np.int32(1) if u < y * c2 else np.int32(0)
        level = np.int32(small if e < e_min else e - off + big)
        sign = sbit if xb[j] > _MAG else np.int32(0)
        codes[j] = np.uint8(np.int32(level + sign))  # step 4: level | sign << (b - 1)


# -- step 4: pack / unpack b-bit codes (LSB-first) ----------------------------------------------
@numba.njit(cache=True, nogil=True)
def _pack(codes, ngroups, b, out):  # type: ignore[no-untyped-def]
    """Pack ``8 * ngroups`` codes into the ``b * ngroups`` bytes ``out``."""
    if b == 8:
        for j in range(8 * ngroups):
            out[j] = codes[j]
    elif b == 4:
        for j in range(4 * ngroups):
            out[j] = codes[2 * j] | (codes[2 * j + 1] << np.uint8(4))
    elif b == 2:
        for j in range(2 * ngroups):
            q = 4 * j
            out[j] = codes[q] | (codes[q + 1] << np.uint8(2)) \
                | (codes[q + 2] << np.uint8(4)) | (codes[q + 3] << np.uint8(6))
    else:
        ub = np.uint64(b)
        for g in range(ngroups):
            w = np.uint64(0)
            for t in range(8):
                w |= np.uint64(codes[8 * g + t]) << (ub * np.uint64(t))
            for t in range(b):
                out[b * g + t] = np.uint8((w >> np.uint64(8 * t)) & np.uint64(0xFF))


@numba.njit(cache=True, nogil=True)
def _unpack(body, ngroups, b, codes):  # type: ignore[no-untyped-def]
    """Unpack ``8 * ngroups`` codes from the ``b * ngroups`` bytes ``body`` (b not in 2, 4, 8)."""
    ub = np.uint64(b)
    mask = np.uint64((1 << b) - 1)
    for g in range(ngroups):
        w = np.uint64(0)
        for t in range(b):
            w |= np.uint64(body[b * g + t]) << np.uint64(8 * t)
        for t in range(8):
            codes[8 * g + t] = np.uint8((w >> (ub * np.uint64(t))) & mask)


@numba.njit(cache=True, nogil=True)
def _store(codes, m, b, out, o, tmp):  # type: ignore[no-untyped-def]
    """Pack ``m`` codes (a whole block, or the zero-padded tail) to ``out[o:]``."""
    ngroups = (m + 7) // 8
    if m % 8 == 0:
        _pack(codes, ngroups, b, out[o:o + ngroups * b])
        return
    codes[m:8 * ngroups] = 0
    _pack(codes, ngroups, b, tmp)
    nbytes = (m * b + 7) // 8
    out[o:o + nbytes] = tmp[:nbytes]


@numba.njit(cache=True, nogil=True)
def _load(body, o, m, b, codes, tmp):  # type: ignore[no-untyped-def]
    """Unpack ``m`` codes from ``body[o:]`` (a whole block, or the tail via a padded copy)."""
    ngroups = (m + 7) // 8
    if m % 8 == 0:
        _unpack(body[o:o + ngroups * b], ngroups, b, codes)
        return
    nbytes = (m * b + 7) // 8
    tmp[:] = 0
    tmp[:nbytes] = body[o:o + nbytes]
    _unpack(tmp, ngroups, b, codes)


# -- entry points -------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def encode_linear(x, out, b, s, pre, scale, k0, k1):  # type: ignore[no-untyped-def]
    """Quantize float32 ``x`` to the linear grid and pack into ``out`` (``ceil(n*b/8)`` bytes).

    ``pre``/``scale`` are float32 (``y = (|x| * pre) * scale = s * |x| / norm``), ``k0``/``k1`` the
    uint32 hash keys of (seed, key, step)."""
    xb = x.view(np.uint32)
    codes = np.empty(BLOCK, np.uint8)
    tmp = np.zeros(BLOCK, np.uint8)
    sbit = np.int32(1 << (b - 1))
    for start in range(0, x.shape[0], BLOCK):
        m = min(BLOCK, x.shape[0] - start)
        k1b = np.uint32(k1 ^ np.uint32((start >> 32) * 0x9E3779B9 & 0xFFFFFFFF))
        _quantize_linear(x[start:start + m], xb[start:start + m], start, codes, sbit, s, pre,
                         scale, k0, k1b)
        _store(codes, m, b, out, start // 8 * b, tmp)


@numba.njit(cache=True, nogil=True)
def encode_natural(x, out, b, s, pre, scale, k0, k1):  # type: ignore[no-untyped-def]
    """As :func:`encode_linear` on the natural grid (``y = |x| / norm``)."""
    xb = x.view(np.uint32)
    codes = np.empty(BLOCK, np.uint8)
    tmp = np.zeros(BLOCK, np.uint8)
    sbit = np.int32(1 << (b - 1))
    for start in range(0, x.shape[0], BLOCK):
        m = min(BLOCK, x.shape[0] - start)
        k1b = np.uint32(k1 ^ np.uint32((start >> 32) * 0x9E3779B9 & 0xFFFFFFFF))
        _quantize_natural(x[start:start + m], xb[start:start + m], start, codes, sbit, s, pre,
                          scale, k0, k1b)
        _store(codes, m, b, out, start // 8 * b, tmp)


@numba.njit(cache=True, nogil=True, inline="always")
def _lookup(body, b, table, out, add):  # type: ignore[no-untyped-def]
    """``out[i] (+)= table[code_i]`` straight from the bytes, for b in (2, 4, 8)."""
    n = out.shape[0]
    per = 8 // b
    full = n // per
    mask = np.uint8((1 << b) - 1)
    ub = np.uint8(b)
    for j in range(full):
        v = body[j]
        for t in range(per):
            c = (v >> (ub * np.uint8(t))) & mask
            if add:
                out[per * j + t] += table[c]
            else:
                out[per * j + t] = table[c]
    v = body[full] if full * per < n else np.uint8(0)
    for i in range(full * per, n):
        c = (v >> (ub * np.uint8(i - full * per))) & mask
        if add:
            out[i] += table[c]
        else:
            out[i] = table[c]


@numba.njit(cache=True, nogil=True, inline="always")
def _decode(body, b, table, out, add):  # type: ignore[no-untyped-def]
    if b == 8 or b == 4 or b == 2:
        _lookup(body, b, table, out, add)
        return
    codes = np.empty(BLOCK, np.uint8)
    tmp = np.zeros(BLOCK, np.uint8)
    for start in range(0, out.shape[0], BLOCK):
        m = min(BLOCK, out.shape[0] - start)
        _load(body, start // 8 * b, m, b, codes, tmp)
        o = out[start:start + m]
        for j in range(m):
            if add:
                o[j] += table[codes[j]]
            else:
                o[j] = table[codes[j]]


@numba.njit(cache=True, nogil=True)
def decode(body, b, table, out):  # type: ignore[no-untyped-def]
    """``out[i] = table[code_i]`` for the ``b``-bit codes packed in ``body``."""
    _decode(body, b, table, out, False)


@numba.njit(cache=True, nogil=True)
def decode_add(body, b, table, acc):  # type: ignore[no-untyped-def]
    """``acc[i] += table[code_i]`` (the caller scales ``table`` by alpha)."""
    _decode(body, b, table, acc, True)


@numba.njit(cache=True, nogil=True)
def encode_ef(  # type: ignore[no-untyped-def]
        g, e, r, mode, out, b, s, natural, pre, scale, k0, k1, table, res, inplace):
    """Error feedback's pass 2 (after the norm of ``p`` is known, finite and non-zero): per block,
    store ``p`` (:func:`.common.ef_p`) where the residual goes (``e`` itself when ``inplace``,
    else ``res``), quantize and pack it as :func:`encode_linear` / :func:`encode_natural` do, then
    add ``table[code]`` (``table`` = the decode-add table for alpha = -1), exactly the arithmetic
    of :func:`decode_add`."""
    codes = np.empty(BLOCK, np.uint8)
    tmp = np.zeros(BLOCK, np.uint8)
    sbit = np.int32(1 << (b - 1))
    for start in range(0, g.shape[0], BLOCK):
        m = min(BLOCK, g.shape[0] - start)
        k1b = np.uint32(k1 ^ np.uint32((start >> 32) * 0x9E3779B9 & 0xFFFFFFFF))
        gb = g[start:start + m]
        eb = e[start:start + m]
        p = eb if inplace else res[start:start + m]
        fill_p(gb, eb, r, mode, p, inplace)
        if natural:
            _quantize_natural(p, p.view(np.uint32), start, codes, sbit, s, pre, scale, k0, k1b)
        else:
            _quantize_linear(p, p.view(np.uint32), start, codes, sbit, s, pre, scale, k0, k1b)
        _store(codes, m, b, out, start // 8 * b, tmp)
        for j in range(m):
            p[j] += table[codes[j]]

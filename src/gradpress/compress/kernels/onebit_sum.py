"""numba kernels of the server's fused onebit reduce: encode (with error feedback) the sum of
onebit payloads without storing the sum (:meth:`gradpress.compress.base.Codec.compress_sum`).

The input element ``g_i`` is computed on the fly from the pushes' sign bits and scales, with the
float32 operations of the generic server path (``acc = 0``, :func:`.onebit.decode_add` of every
push in the order given, then ``acc /= divisor``: a true float32 division, as torch's CPU
``div_`` by a Python int):

    ``g_i = ((0.0f + v_1,i) + v_2,i + ...) / float32(divisor)``, ``v_w,i = +-float32(1 * scale_w)``

(the ``+0.0f`` start matters: ``0.0f + (-0.0f)`` is ``+0.0f``; no division when ``divisor`` is
1). Then ``p = ef_p(g, e, r, mode)`` exactly as :mod:`.common` defines it, and the two passes of
:mod:`.onebit`'s error feedback, in its block order:

1. :func:`encode_sum_ef`: sign bits and scale of ``p`` into the reply body; returns the float64
   ``|p|`` sum (non-finite exactly when ``p`` holds a NaN or an inf: reject before pass 2);
2. :func:`residual_sum_ef`: ``e = p - decode(body)``, in place (``p`` recomputed, bit for bit).

Each row of ``LANES`` elements of ``g`` is built in an L1-resident scratch, byte by byte from
the pushes' bits, so the passes stream ``e`` (and the bits, 1/32 of it per push) only.
"""

from __future__ import annotations

import numba
import numpy as np

from .common import MODE_ADD, MODE_P, bits_f32, block_sums, f32_bits, fold
from .onebit import _GATHER, BLOCK, LANES, ROWS, _get_scale_bits, _total_and_scale

__all__ = ["encode_sum_ef", "residual_sum_ef"]

_U = np.uint32
_SIGN = np.uint32(0x80000000)
_JIT = {"cache": True, "nogil": True, "error_model": "numpy"}


@numba.njit(**_JIT)
def _push_values(bodies, n):  # type: ignore[no-untyped-def]
    """Per push, the bits of ``v = float32(1.0f * scale)`` (:func:`.onebit.decode_add`'s ``v``)."""
    vbs = np.empty(len(bodies), np.uint32)
    for w in range(len(bodies)):
        s = _get_scale_bits(bodies[w], (n + 7) // 8)
        vbs[w] = f32_bits(np.float32(np.float32(1.0) * bits_f32(s)))
    return vbs


@numba.njit(inline="always", **_JIT)
def _sv(vb, byte, j):  # type: ignore[no-untyped-def]
    """``+-v`` (bits ``vb``) by bit ``j`` of ``byte``, as :func:`.onebit.decode_add` decodes."""
    return bits_f32(_U(vb ^ _U(_U(_U(byte >> _U(j)) & _U(1)) << _U(31))))


@numba.njit(inline="always", **_JIT)
def _row_g(bodies, vbs, base, c, dv, divide, g):  # type: ignore[no-untyped-def]
    """``g[:c] = `` the sum's elements ``base .. base + c - 1`` (``base`` a multiple of 8).

    One loop over the bytes, the pushes innermost (``len(bodies)`` is a compile-time constant,
    so LLVM unrolls it and vectorizes over the bytes). Arrays are indexed through slices, so
    that every index is a loop counter: numba's negative-index wraparound of ``base + j`` would
    keep LLVM from vectorizing (much slower out of cache)."""
    k0 = base // 8
    nb = c // 8
    for k in range(nb):
        for j in range(8):
            x = np.float32(0.0)
            for w in range(len(bodies)):
                x += _sv(vbs[w], _U(bodies[w][k0:][k]), j)
            g[8 * k + j] = x / dv if divide else x
    for j in range(c - 8 * nb):  # the last, partial byte
        x = np.float32(0.0)
        for w in range(len(bodies)):
            x += _sv(vbs[w], _U(bodies[w][k0:][nb]), j)
        g[8 * nb + j] = x / dv if divide else x


@numba.njit(inline="always", **_JIT)
def _add_e(g, e, c, r, mode):  # type: ignore[no-untyped-def]
    """``g[:c] = ef_p(g, e, r, mode)`` (:func:`.common.ef_p`; ``e`` the same row of the
    residual), one loop per mode: a loop that branches on ``mode`` inside is not unswitched
    here and runs much slower out of cache."""
    if mode == MODE_ADD:
        for j in range(c):
            g[j] = g[j] + e[j]
    elif mode != MODE_P:
        for j in range(c):
            g[j] = g[j] + r * e[j]


@numba.njit(**_JIT)
def _tail_block(bodies, vbs, dv, divide, e, r, mode, body,  # type: ignore[no-untyped-def]
                first, n, acc, g, signs, s64):
    """Rows of the last, incomplete block ``p[first:n]`` (missing elements: +0.0, bit 0)."""
    acc[:] = 0.0
    for base in range(first, n, LANES):
        c = min(LANES, n - base)
        _row_g(bodies, vbs, base, c, dv, divide, g)
        er = e[base:base + c]
        _add_e(g, er, c, r, mode)
        signs[:] = 0
        for j in range(c):
            v = g[j]
            acc[j] += np.float64(abs(v))
            signs[j] = np.uint8(f32_bits(v) >> _U(31))
        out = body[base // 8:(base + c + 7) // 8]
        for k in range((c + 7) // 8):
            out[k] = np.uint8((s64[k] * _GATHER) >> np.uint64(56))
    return fold(acc, LANES)


@numba.njit(**_JIT)
def encode_sum_ef(bodies, n, divisor, e, r, mode, body, scaling):  # type: ignore[no-untyped-def]
    """Pass 1: pack the signs of ``p`` (``n`` elements, from the push bodies ``bodies``, a tuple
    of uint8 arrays) and the scale into ``body``; return the float64 ``|p|`` sum. The order of
    :func:`.onebit.encode_ef` (rows, blocks, the same folds); ``e`` is unused (may be empty)
    with MODE_P."""
    vbs = _push_values(bodies, n)
    dv = np.float32(divisor)
    divide = divisor != 1
    nblk = (n + BLOCK - 1) // BLOCK
    sums = block_sums(n, BLOCK)
    acc = np.empty(LANES)
    g = np.empty(LANES, np.float32)
    signs = np.empty(LANES, np.uint8)
    s64 = signs.view(np.uint64)
    nfull = n // BLOCK
    for b in range(nfull):
        acc[:] = 0.0
        for row in range(b * ROWS, (b + 1) * ROWS):
            base = row * LANES
            _row_g(bodies, vbs, base, LANES, dv, divide, g)
            er = e[base:base + LANES]
            _add_e(g, er, LANES, r, mode)
            for j in range(LANES):
                v = g[j]
                acc[j] += np.float64(abs(v))
                signs[j] = np.uint8(f32_bits(v) >> _U(31))
            out = body[row * (LANES // 8):(row + 1) * (LANES // 8)]
            for k in range(LANES // 8):
                out[k] = np.uint8((s64[k] * _GATHER) >> np.uint64(56))
        sums[b] = fold(acc, LANES)
    if nfull < nblk:
        sums[nfull] = _tail_block(bodies, vbs, dv, divide, e, r, mode, body, nfull * BLOCK, n,
                                  acc, g, signs, s64)
    return _total_and_scale(sums, n, body, scaling)


@numba.njit(inline="always", **_JIT)
def _residual_row(bodies, vbs, dv, divide, e, r, mode, vb,  # type: ignore[no-untyped-def]
                  base, c, g):
    """One row of pass 2 (``mode`` MODE_ADD or MODE_SCALED; one loop per mode, see _add_e)."""
    _row_g(bodies, vbs, base, c, dv, divide, g)
    er = e[base:base + c]
    if mode == MODE_ADD:
        for j in range(c):
            p = g[j] + er[j]
            er[j] = p + bits_f32(_U(vb ^ _U(f32_bits(p) & _SIGN)))
    else:
        for j in range(c):
            p = g[j] + r * er[j]
            er[j] = p + bits_f32(_U(vb ^ _U(f32_bits(p) & _SIGN)))


@numba.njit(**_JIT)
def residual_sum_ef(bodies, n, divisor, e, r, mode, body):  # type: ignore[no-untyped-def]
    """Pass 2 (after :func:`encode_sum_ef` accepted ``p``; error feedback only, ``mode`` not
    MODE_P): ``e = p - decode(body)`` in place, the arithmetic of :func:`.onebit.residual_ef`
    (``alpha = -1``)."""
    vbs = _push_values(bodies, n)
    dv = np.float32(divisor)
    divide = divisor != 1
    v = np.float32(np.float32(-1.0) * bits_f32(_get_scale_bits(body, (n + 7) // 8)))
    vb = f32_bits(v)
    g = np.empty(LANES, np.float32)
    nfull = n // LANES
    for row in range(nfull):  # full rows (a constant trip count), then the last one
        _residual_row(bodies, vbs, dv, divide, e, r, mode, vb, row * LANES, LANES, g)
    if nfull * LANES < n:
        _residual_row(bodies, vbs, dv, divide, e, r, mode, vb, nfull * LANES, n - nfull * LANES,
                      g)

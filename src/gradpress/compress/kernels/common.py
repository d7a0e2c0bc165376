"""Kernels shared by several codecs: the non-finite scan, float32 bit casts, and the error-feedback
input ``p`` that the fused error-feedback kernels compute on the fly.

Error-feedback input (:class:`gradpress.compress.ef.ErrorFeedback`): every kernel that takes
``(g, e, r, mode)`` reads element ``i`` of ``p`` as :func:`ef_p` defines it, so the fused kernels
(which never store ``p``) and the unfused path (which stores it with :func:`fill_p`) see the very
same float32 values:

* ``mode == MODE_P`` (0): ``p = g`` (``e`` and ``r`` unused; the codec's ``_encode_ef`` hook);
* ``mode == MODE_ADD`` (1): ``p = g + e``, one float32 addition (vanilla EF, or a ratio of 1);
* ``mode == MODE_SCALED`` (2): ``p = g + float32(r * e)``, a float32 product then a float32
  addition, two roundings, never fused into an FMA (numba does not contract without fastmath).
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["fold", "block_sums", "blocked_sum_torch", "all_finite", "p_all_finite", "max_abs_ef",
           "f32_bits", "bits_f32", "ef_p", "ef_args", "fill_p", "MODE_P", "MODE_ADD",
           "MODE_SCALED"]

_EXP = np.uint32(0x7F800000)
MODE_P, MODE_ADD, MODE_SCALED = 0, 1, 2


@numba.njit(cache=True, nogil=True)
def _max_exponent(bits: np.ndarray) -> np.uint32:
    m = np.uint32(0)
    for i in range(bits.shape[0]):
        e = bits[i] & _EXP
        m = e if e > m else m
    return m


def all_finite(x: np.ndarray) -> bool:
    """True when every float32 element is finite (no NaN/inf): an integer scan of the exponent
    bits, which vectorizes and runs near memory bandwidth."""
    if x.shape[0] == 0:
        return True
    return bool(_max_exponent(x.view(np.uint32)) != _EXP)


@intrinsic
def f32_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """The IEEE-754 bits of a float32 as uint32 (an LLVM bitcast; no memory round trip)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):  # type: ignore[no-untyped-def]
    """The float32 whose IEEE-754 bits are the uint32 ``u`` (an LLVM bitcast)."""
    if u != types.uint32:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def ef_p(g, e, r, mode, i):  # type: ignore[no-untyped-def]
    """Element ``i`` of the error-feedback input ``p`` (see the module docstring). ``mode`` is
    loop-invariant in every caller, so LLVM unswitches the branches out of the loops."""
    if mode == MODE_P:
        return g[i]
    if mode == MODE_ADD:
        return g[i] + e[i]
    return g[i] + r * e[i]


_MAG = np.uint32(0x7FFFFFFF)


@numba.njit(cache=True, nogil=True)
def max_abs_ef(g, e, r, mode):  # type: ignore[no-untyped-def]
    """Largest magnitude bit pattern (``bits & 0x7FFFFFFF``) of ``p`` (:func:`ef_p`), computed
    on the fly without storing ``p``; NaN/inf give ``>= 0x7F800000``."""
    m = np.uint32(0)
    for i in range(g.shape[0]):
        a = f32_bits(ef_p(g, e, r, mode, i)) & _MAG
        m = a if a > m else m
    return m


def p_all_finite(g: np.ndarray, e: np.ndarray, r: np.float32, mode: int) -> bool:
    """True when every element of ``p`` (see :func:`ef_p`) is finite, computed without storing
    ``p``: lets a codec write ``p`` over the residual only once it is known to be accepted."""
    return g.shape[0] == 0 or bool(max_abs_ef(g, e, r, mode) < _EXP)


def ef_args(ratio: float) -> tuple[np.float32, int]:
    """``(r, mode)`` for the kernels: ``p = g + e`` when ``ratio == 1``, else ``g + r * e``."""
    return np.float32(ratio), (MODE_ADD if ratio == 1.0 else MODE_SCALED)


@numba.njit(cache=True, nogil=True)
def fill_p(g: np.ndarray, e: np.ndarray, r: np.float32, mode: int, out: np.ndarray,
           inplace: bool) -> None:
    """Store ``p`` (see :func:`ef_p`) into ``out``, or into ``e`` itself when ``inplace`` (written
    as ``e[i] = f(g[i], e[i])`` so LLVM sees the same array and vectorizes without alias checks)."""
    if inplace:
        for i in range(g.shape[0]):
            e[i] = ef_p(g, e, r, mode, i)
    else:
        for i in range(g.shape[0]):
            out[i] = ef_p(g, e, r, mode, i)


@numba.njit(cache=True, nogil=True)
def block_sums(n: int, block: int) -> np.ndarray:
    """Zeroed float64 sums for the ``ceil(n / block)`` blocks of a blocked reduction, padded
    with zeros to a power of two (at least 1) for :func:`fold`."""
    nblk = (n + block - 1) // block
    q = 1
    while q < nblk:
        q *= 2
    return np.zeros(q)


@numba.njit(cache=True, nogil=True)
def fold(acc: np.ndarray, w: int) -> float:
    """The fixed summation order of the onebit and dithering reductions (their torch paths
    reproduce it): a halving tree over acc[:w], w a power of two (acc[j] += acc[j + w/2], ...,
    the sum in acc[0])."""
    while w > 1:
        w //= 2
        for j in range(w):
            acc[j] += acc[j + w]
    return acc[0]


def blocked_sum_torch(x: torch.Tensor, *, square: bool, rows: int, lanes: int) -> torch.Tensor:
    """float64 sum of ``|x|`` (or of ``x**2`` with ``square``) in the numba kernels' blocked
    order, with torch ops on ``x``'s device: a 0-d tensor, the same bits. Per block of ``rows``
    x ``lanes`` elements (the last one zero-padded), 1. lane-wise adds of the rows in order,
    2. a halving tree over the lanes (:func:`fold`'s order); 3. the same tree over the block
    sums, zero-padded to a power of two (:func:`block_sums`). A deterministic parallel
    reduction, not a sequential ``cumsum``."""
    n, block = x.numel(), rows * lanes
    nblk = max(1, -(-n // block))
    a = torch.zeros(nblk * block, dtype=torch.float64, device=x.device)
    if square:
        a[:n] = x
        a.square_()
    else:
        a[:n] = x.abs()
    a = a.view(nblk, rows, lanes)
    acc = a[:, 0, :].clone()  # 1.
    for r in range(1, rows):
        acc += a[:, r, :]
    w = lanes  # 2.
    while w > 1:
        w //= 2
        acc = acc[:, :w] + acc[:, w:2 * w]
    q = 1 << (nblk - 1).bit_length()  # 3.
    sums = torch.zeros(q, dtype=torch.float64, device=x.device)
    sums[:nblk] = acc[:, 0]
    while q > 1:
        q //= 2
        sums = sums[:q] + sums[q:2 * q]
    return sums[0]

"""Kernels shared by several codecs."""

from __future__ import annotations

import numba
import numpy as np

_EXP = np.uint32(0x7F800000)


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

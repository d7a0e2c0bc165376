"""numba kernels of the layer-wise optimizers (LANS, CLAN, LAMB) for float32 CPU tensors.

One call updates one parameter tensor in two passes over its data instead of the ~12
``torch._foreach_*`` passes of the generic path (:mod:`gradpress.optim._common`):

0. (LANS ``normalize_grad`` only) one read-only pass for ``||g||``.
1. Read ``g, m, v, x``; write the new moments ``m, v``; accumulate ``||x||``, ``||r||`` and
   (LANS) ``||c||``. The directions ``r`` and ``c`` are not stored.
2. Trust ratios from the three norms (scalar work), then read ``g, m, v, x`` again, recompute
   ``r`` and ``c`` element by element and write ``x``.

Every element is computed with the float32 operations, in the order, of the foreach path
(torch 2.x CPU kernels, whose ``lerp_`` and ``addcmul_`` are fused multiply-adds):

* ``g = g / ||g||`` (a float32 division; ``||g|| = 0`` leaves ``g``);
* ``m = lerp(m, g, 1-b1)``: ``fma(w, g-m, m)`` for ``|w| < 0.5``, else ``fma(w-1, g-m, g)``;
* ``v = fma((1-b2)*g, g, v*b2)`` (``mul_`` then ``addcmul_``);
* ``d = sqrt(v) + eps*s`` with ``s = sqrt(1-b2^t)`` (``d = s*(sqrt(vh)+eps)``);
* a direction ``u = x*wd + (k*a)/d`` when ``wd != 0``, else ``u = (a/d)*k`` (``a = m`` with
  ``k = s/(1-b1^t)`` for ``r``; ``a = g`` with ``k = s`` for LANS's ``c``);
* ``x = fma(r, f_r, x)``, then (LANS) ``x = fma(c, f_c, x)``, where ``f = float32(q) *
  float32(-lr*...)`` and ``q`` is the float32 trust ratio.

The moments therefore match the foreach path bit for bit (without gradient normalisation); the
parameters agree to float32 rounding only, for two reasons: the norms are summed in another order
(below), and torch's CPU ``sqrt`` is not correctly rounded (measured here: one ulp off for about a
fifth of random inputs), while ``llvm.sqrt`` here is.

All scalars arrive as ``np.float32`` so no operation widens to float64 by accident, and the
kernels use ``error_model="numpy"`` (IEEE division, no ZeroDivisionError checks in the loops).
The norms are accumulated in float64 over :data:`LANES` interleaved partial sums (lane ``j``
sums the elements ``i = j mod LANES``) added in lane order: the result does not depend on the
SIMD width of the CPU, and since the lanes live on the stack (:func:`_lanes`) the loop over them
vectorizes without reassociating any sum (numba does not run LLVM's SLP vectorizer, so the lane
loop must stay a loop: 64 lanes are too many to unroll).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["LANES", "coeffs", "layerwise_step", "warm"]

#: Interleaved float64 partial sums per norm (see the module docstring).
LANES = 64


@intrinsic
def _fma(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """``a*b + c`` with one rounding (LLVM ``llvm.fma.f32``; exact on every CPU)."""
    if not (a == b == c == types.float32):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fma(args[0], args[1], args[2])

    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def _sqrt(typingctx, a):  # type: ignore[no-untyped-def]
    """Correctly rounded float32 square root as LLVM's ``llvm.sqrt.f32``: unlike a call of
    libm's ``sqrtf`` (which may set errno) it has no side effect, so loops using it vectorize."""
    if a != types.float32:
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        fn = builder.module.declare_intrinsic("llvm.sqrt", [ir.FloatType()])
        return builder.call(fn, args)

    return types.float32(types.float32), codegen


@intrinsic
def _lanes(typingctx):  # type: ignore[no-untyped-def]
    """A zeroed float64 array of :data:`LANES` partial sums on the stack. An ``alloca`` cannot
    alias the tensors, so the loop over the lanes vectorizes. Never let it escape its caller."""
    arrty = types.Array(types.float64, 1, "C")

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        intp = context.get_value_type(types.intp)
        ptr = cgutils.alloca_once(builder, ir.DoubleType(), size=ir.Constant(intp, LANES))
        cgutils.memset(builder, ptr, ir.Constant(intp, 8 * LANES), 0)
        ary = context.make_array(arrty)(context, builder)
        context.populate_array(ary, data=ptr,
                               shape=cgutils.pack_array(builder, [ir.Constant(intp, LANES)]),
                               strides=cgutils.pack_array(builder, [ir.Constant(intp, 8)]),
                               itemsize=ir.Constant(intp, 8), meminfo=None)
        return ary._getvalue()

    return arrty(), codegen


# Indices of the float32 coefficient vector ``h`` built by :func:`coeffs`.
W1, B2, W2, ES, KR, KC, WD, FR, FC, LO, HI = range(11)


def coeffs(beta1: float, beta2: float, eps: float, weight_decay: float, lr: float, s: float,
           kr: float, min_trust: float | None, max_trust: float | None,
           blend: bool, frozen: bool = False) -> np.ndarray:
    """The float32 scalars of one tensor's step, rounded from Python floats as torch does.

    ``s`` is ``sqrt(1-b2^t)`` (1 without bias correction) and ``kr`` the scale of ``m`` in
    the momentum direction (``s/(1-b1^t)``, or 1). ``blend`` selects LANS's learning-rate
    factors ``-lr*b1`` and ``-lr*(1-b1)``; LAMB's is ``-lr``. ``frozen`` keeps ``v`` as it is
    (``b2`` = 1, ``1-b2`` = 0).
    """
    f32 = np.float32
    h = np.empty(11, dtype=np.float32)
    h[W1], h[B2], h[W2] = f32(1.0 - beta1), f32(beta2), f32(1.0 - beta2)
    if frozen:
        h[B2], h[W2] = f32(1.0), f32(0.0)
    h[ES], h[KR], h[KC], h[WD] = f32(eps * s), f32(kr), f32(s), f32(weight_decay)
    h[FR] = f32(-lr * beta1) if blend else f32(-lr)
    h[FC] = f32(-lr * (1.0 - beta1))
    h[LO] = -np.inf if min_trust is None else f32(min_trust)
    h[HI] = np.inf if max_trust is None else f32(max_trust)
    return h


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _direction(a, k, d, x, wd):  # type: ignore[no-untyped-def]
    """``x*wd + (k*a)/d`` (``wd != 0``) or ``(a/d)*k``: the foreach path's two forms."""
    if wd != 0:
        return x * wd + (k * a) / d
    return (a / d) * k


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _norm(acc):  # type: ignore[no-untyped-def]
    """The float32 norm from per-lane float64 sums of squares, added in lane order."""
    t = 0.0
    for j in range(LANES):
        t += acc[j]
    return np.float32(math.sqrt(t))


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _trust(xn, un, lo, hi):  # type: ignore[no-untyped-def]
    """``xn/un`` clamped to ``[lo, hi]``; 1 where either norm is 0 (as ``trust_ratios``)."""
    if not (xn > 0 and un > 0):
        return np.float32(1.0)
    q = xn / un
    if q < lo:
        q = lo
    if q > hi:
        q = hi
    return q


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _l2(a: np.ndarray) -> np.float32:
    """``||a||`` in float32, from per-lane float64 sums of squares."""
    acc = _lanes()
    nb = a.shape[0] // LANES
    for b in range(nb + 1):
        for j in range(LANES if b < nb else a.shape[0] - nb * LANES):
            y = np.float64(a[b * LANES + j])
            acc[j] += y * y
    return _norm(acc)


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _element1(xi, gi, mi, vi, k, blend):  # type: ignore[no-untyped-def]
    """Pass 1 on one element: the new ``m``, ``v`` and the directions ``r``, ``c`` (0 for LAMB).
    ``k`` holds the loop-invariant scalars (see :func:`_pass1`)."""
    small, lw, b2, w2, es, kr, kc, wd = k
    mi = _fma(lw, gi - mi, mi if small else gi)
    vi = _fma(w2 * gi, gi, vi * b2)
    d = _sqrt(vi) + es
    r = _direction(mi, kr, d, xi, wd)
    c = _direction(gi, kc, d, xi, wd) if blend else np.float32(0.0)
    return mi, vi, r, c


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _grad(g, i, gn, scaled):  # type: ignore[no-untyped-def]
    """``g[i] / gn``; ``scaled`` is a constant where inlined: False skips the division by 1."""
    return g[i] / gn if scaled else g[i]


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _run1(x, g, m, v, k, gn, scaled, blend, i0, nk, ax, ar, ac):  # type: ignore[no-untyped-def]
    """Pass 1 on elements ``i0 + j`` for ``j < nk <= LANES``; squares go to lane ``j``."""
    for j in range(nk):
        i = i0 + j
        xi = x[i]
        m[i], v[i], r, c = _element1(xi, _grad(g, i, gn, scaled), m[i], v[i], k, blend)
        ax[j] += np.float64(xi) * np.float64(xi)
        ar[j] += np.float64(r) * np.float64(r)
        ac[j] += np.float64(c) * np.float64(c)


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _loop1(x, g, m, v, k, gn, scaled, blend, ax, ar, ac):  # type: ignore[no-untyped-def]
    """Pass 1 over the whole tensor: full blocks of :data:`LANES`, then the partial one."""
    nb = x.shape[0] // LANES
    for b in range(nb):
        _run1(x, g, m, v, k, gn, scaled, blend, b * LANES, LANES, ax, ar, ac)
    _run1(x, g, m, v, k, gn, scaled, blend, nb * LANES, x.shape[0] - nb * LANES, ax, ar, ac)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _pass1(x, g, m, v, h, gn, blend):  # type: ignore[no-untyped-def]
    """Moments in place; returns the float32 norms of ``x``, ``r`` and ``c``."""
    # torch's lerp: m + w*(g-m) for |w| < 0.5, else g + (w-1)*(g-m), each as one fma.
    small = abs(h[W1]) < 0.5
    lw = h[W1] if small else h[W1] - np.float32(1.0)
    k = (small, lw, h[B2], h[W2], h[ES], h[KR], h[KC], h[WD])
    ax, ar, ac = _lanes(), _lanes(), _lanes()
    if gn != 1:
        _loop1(x, g, m, v, k, gn, True, blend, ax, ar, ac)
    else:
        _loop1(x, g, m, v, k, gn, False, blend, ax, ar, ac)
    return _norm(ax), _norm(ar), _norm(ac)


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _loop2(x, g, m, v, h, gn, scaled, blend, fr, fc):  # type: ignore[no-untyped-def]
    """Pass 2 over the whole tensor (see :func:`_pass2`)."""
    es, kr, kc, wd = h[ES], h[KR], h[KC], h[WD]
    for i in range(x.shape[0]):
        x0 = x[i]
        d = _sqrt(v[i]) + es
        xi = _fma(_direction(m[i], kr, d, x0, wd), fr, x0)
        if blend:
            xi = _fma(_direction(_grad(g, i, gn, scaled), kc, d, x0, wd), fc, xi)
        x[i] = xi


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _pass2(x, g, m, v, h, gn, blend, fr, fc):  # type: ignore[no-untyped-def]
    """``x = fma(r, fr, x)``, then (LANS) ``x = fma(c, fc, x)``, ``r`` and ``c`` recomputed."""
    if gn != 1:
        _loop2(x, g, m, v, h, gn, True, blend, fr, fc)
    else:
        _loop2(x, g, m, v, h, gn, False, blend, fr, fc)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def layerwise_step(x: np.ndarray, g: np.ndarray, m: np.ndarray, v: np.ndarray, h: np.ndarray,
                   normalize: bool, blend: bool) -> tuple[np.float32, np.float32]:
    """One LANS (``blend``) or LAMB step of one flat float32 tensor, in place; returns the
    trust ratios ``(q_r, q_c)`` (``q_c`` is 1 for LAMB). ``h`` comes from :func:`coeffs`."""
    # Pass 0: ||g|| for LANS's gradient normalisation (dividing by 1 where it is 0 is exact).
    gn = _l2(g) if normalize else np.float32(1.0)
    if not gn > 0:
        gn = np.float32(1.0)
    # Pass 1: moments in place; norms of x and of the directions r and c.
    xn, rn, cn = _pass1(x, g, m, v, h, gn, blend)
    # Trust ratios and their learning-rate factors (float32 products, as scaled_by).
    q_r = _trust(xn, rn, h[LO], h[HI])
    q_c = _trust(xn, cn, h[LO], h[HI]) if blend else np.float32(1.0)
    # Pass 2: the update of x.
    _pass2(x, g, m, v, h, gn, blend, q_r * h[FR], q_c * h[FC])
    return q_r, q_c


def warm() -> None:
    """Compile :func:`layerwise_step` (or load it from numba's cache) by running it on a tiny
    tensor, so that a timed first optimizer step is not charged for it (seconds on the first
    run after installing)."""
    z = np.zeros(LANES, dtype=np.float32)
    h = coeffs(0.9, 0.999, 1e-6, 0.0, 1e-3, 1.0, 1.0, None, None, blend=True)
    layerwise_step(z.copy(), z.copy(), z.copy(), z.copy(), h, False, True)

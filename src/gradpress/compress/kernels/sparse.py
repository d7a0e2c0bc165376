"""numba kernels of the sparse codecs (``topk``, ``randomk``) and the counter-based hash they share.

Top-k selection (used by ``topk``), after the sampled-threshold idea of Deep Gradient Compression
(Lin et al., ICLR 2018, "Deep Gradient Compression", sec. 3.1 / "sampling to reduce top-k
selection time"), made exact:

1. Draw a deterministic stratified sample of ``n / 128`` magnitudes (at least ``SAMPLE_MIN``,
   at most ``SAMPLE``; one jittered position per stratum, the stratum bounds stepped without a
   division) and take its ``r``-th largest as a threshold ``t``, with ``r`` four standard
   deviations (plus 4) above the expected number of sampled top-k elements, so that with high
   probability at least ``kk`` elements reach ``t``. The sample only sets the speed: any ``t``
   gives the same, exact result.
2. One pass over the data: per block of ``BLOCK`` elements a vectorised max of the magnitude bits
   (which also yields the global maximum, hence the NaN/inf check for free); only blocks whose max
   reaches ``t`` are rescanned for candidates ``|x| >= t`` (index + magnitude).
3. Too few candidates: lower ``t`` (``r *= 4``) and rescan. Too many (more than the buffer holds,
   e.g. massive ties): fall back to an exact radix select over the whole array (step 5).
4. Among the candidates, ``np.partition`` finds the exact ``kk``-th largest magnitude ``T``;
   emit the candidates ``> T`` plus the first ``kk - #(> T)`` equal to ``T``, in index order.
   Since every element ``>= T`` is a candidate, the result is the exact top-k (ties broken by
   lowest index), already sorted by index.
5. Radix fallback: histogram the high 15 magnitude bits, then the low 16 bits inside the boundary
   bin, giving ``T`` and ``#(> T)`` exactly; then one emitting pass as in step 4.

Top-k indices on the wire (``indices=packed``): ``w``-bit fields, LSB-first: index ``j`` occupies
stream bits ``[j*w, j*w + w)``, stream bit ``b`` is bit ``b % 8`` of byte ``b // 8``; the unused
bits of the last byte are 0 (:func:`pack_indices`, :func:`unpack_indices`).

Magnitudes are compared as the integer bits of ``|x|`` (``bits & 0x7FFFFFFF``), which order like
the floats for all non-NaN values; NaN sorts above inf.

Random-k positions (used by ``randomk``; Stich, Cordonnier, Jaggi, NeurIPS 2018, "Sparsified SGD
with Memory"), stratified so they are sorted, unique and spread evenly:

1. Split ``[0, numel)`` into ``kk`` buckets ``[b*numel//kk, (b+1)*numel//kk)``.
2. ``r = mix32(mix32(b ^ s0) ^ s1)``, where ``(s0, s1)`` are two 32-bit words of
   ``splitmix64(seed, key, step)`` and ``mix32`` is the "lowbias32" integer hash (C. Wellons).
3. Position ``start + (r * size) >> 32`` (Lemire's multiply-shift range reduction).

For ``numel < 2**31`` every step is exact integer arithmetic below 2**63, so
:func:`randomk_positions_torch` reproduces the positions bit for bit with int64 torch ops on any
device.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

__all__ = ["stream_words", "randomk_positions", "randomk_positions_torch", "randomk_gather",
           "topk_select", "sample_positions", "gather", "scatter", "pack_indices", "unpack_indices",
           "MAG_MASK", "EXP_BITS"]

MAG_MASK = np.uint32(0x7FFFFFFF)
EXP_BITS = 0x7F800000
BLOCK = 64
SAMPLE = 1 << 15
SAMPLE_MIN = 1 << 12
FULL_MAX = 1 << 16
_M32 = np.uint64(0xFFFFFFFF)
_C1 = np.uint64(0x7FEB352D)
_C2 = np.uint64(0x846CA68B)
_S15 = np.uint64(15)
_S16 = np.uint64(16)
_S32 = np.uint64(32)
_SAMPLE_S0 = np.uint64(0x9E3779B9)
_SAMPLE_S1 = np.uint64(0x85EBCA6B)
_MASK64 = (1 << 64) - 1


# -- counter-based hashing ----------------------------------------------------------------------
def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_words(seed: int, key: int, step: int) -> tuple[int, int]:
    """Two 32-bit words identifying the random stream of ``(seed, key, step)`` (splitmix64)."""
    z = _splitmix64(int(seed) & _MASK64)
    z = _splitmix64(z ^ (int(key) & _MASK64))
    z = _splitmix64(z ^ (int(step) & _MASK64))
    return z & 0xFFFFFFFF, z >> 32


@numba.njit(cache=True, nogil=True, inline="always")
def _mix32(x: np.uint64) -> np.uint64:
    x ^= x >> _S16
    x = (x * _C1) & _M32
    x ^= x >> _S15
    x = (x * _C2) & _M32
    x ^= x >> _S16
    return x


@numba.njit(cache=True, nogil=True, inline="always")
def _bucket_pos(b: int, n: int, kk: int, s0: np.uint64, s1: np.uint64) -> int:
    start = (b * n) // kk
    size = ((b + 1) * n) // kk - start
    r = _mix32(_mix32(np.uint64(b) ^ s0) ^ s1)
    return start + np.int64((r * np.uint64(size)) >> _S32)


def _mul32_torch(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for int64 ``x < 2**32`` without overflowing int64 (16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32_torch(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32_torch(x, 0x846CA68B)
    return x ^ (x >> 16)


# -- random-k -----------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def randomk_positions(n: int, s0: int, s1: int, out: np.ndarray) -> None:
    """Fill int64 ``out`` (``kk`` long) with the stratified random positions in ``[0, n)``."""
    kk = out.shape[0]
    u0, u1 = np.uint64(s0), np.uint64(s1)
    for b in range(kk):
        out[b] = _bucket_pos(b, n, kk, u0, u1)


def randomk_positions_torch(n: int, kk: int, s0: int, s1: int,
                            device: torch.device | str = "cpu") -> torch.Tensor:
    """Torch-op twin of :func:`randomk_positions`: identical int64 positions on any device."""
    b = torch.arange(kk, dtype=torch.int64, device=device)
    start = b * n // kk
    size = (b + 1) * n // kk - start
    r = _mix32_torch(_mix32_torch(b ^ s0) ^ s1)
    return start + ((r * size) >> 32)


@numba.njit(cache=True, nogil=True)
def randomk_gather(x: np.ndarray, s0: int, s1: int, out: np.ndarray) -> None:
    """``out[b] = x[pos(b)]`` for every bucket, computing positions on the fly (no index array)."""
    n, kk = x.shape[0], out.shape[0]
    u0, u1 = np.uint64(s0), np.uint64(s1)
    for b in range(kk):
        out[b] = x[_bucket_pos(b, n, kk, u0, u1)]


@numba.njit(cache=True, nogil=True)
def randomk_gather_clear(e: np.ndarray, s0: int, s1: int, out: np.ndarray) -> None:
    """``out[b] = e[pos(b)]; e[pos(b)] = 0`` for every bucket (sparse error feedback: each
    position computed once)."""
    n, kk = e.shape[0], out.shape[0]
    u0, u1 = np.uint64(s0), np.uint64(s1)
    for b in range(kk):
        p = _bucket_pos(b, n, kk, u0, u1)
        out[b] = e[p]
        e[p] = 0.0


@numba.njit(cache=True, nogil=True)
def randomk_scatter(vals: np.ndarray, s0: int, s1: int, out: np.ndarray, alpha: float,
                    accumulate: bool) -> None:
    """``out[pos(b)] = vals[b]`` or, with ``accumulate``, ``out[pos(b)] += alpha * vals[b]``."""
    n, kk = out.shape[0], vals.shape[0]
    u0, u1 = np.uint64(s0), np.uint64(s1)
    a = np.float32(alpha)
    for b in range(kk):
        p = _bucket_pos(b, n, kk, u0, u1)
        if accumulate:
            out[p] += a * vals[b]
        else:
            out[p] = vals[b]


# -- top-k: selection ---------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True, inline="always")
def _collect(bits: np.ndarray, lo: int, hi: int, t: np.uint32, idx: np.ndarray, mag: np.ndarray,
             cnt: int) -> int:
    cap = idx.shape[0]
    for i in range(lo, hi):
        v = bits[i] & MAG_MASK
        if v >= t:
            if cnt < cap:
                idx[cnt] = i
                mag[cnt] = v
            cnt += 1
    return cnt


@numba.njit(cache=True, nogil=True)
def _scan(bits: np.ndarray, t: np.uint32, cap: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Step 2: candidates ``|x| >= t`` (first ``cap`` kept, all counted) and the max magnitude."""
    n = bits.shape[0]
    idx = np.empty(cap, np.int32)
    mag = np.empty(cap, np.uint32)
    cnt = 0
    mx = np.uint32(0)
    for blk in range(n // BLOCK):
        base = blk * BLOCK
        m = np.uint32(0)
        for j in range(BLOCK):  # fixed trip count: LLVM vectorises this max
            v = bits[base + j] & MAG_MASK
            m = v if v > m else m
        mx = mx if mx > m else m
        if m >= t:
            cnt = _collect(bits, base, base + BLOCK, t, idx, mag, cnt)
    for i in range(n - n % BLOCK, n):
        v = bits[i] & MAG_MASK
        mx = mx if mx > v else v
    cnt = _collect(bits, n - n % BLOCK, n, t, idx, mag, cnt)
    return idx, mag, cnt, mx


@numba.njit(cache=True, nogil=True)
def _emit(idx: np.ndarray, mag: np.ndarray, cnt: int, t: np.uint32, need_eq: int,
          out: np.ndarray) -> None:
    """Step 4: write the candidates ``> t`` and the first ``need_eq`` equal to ``t``, in order."""
    o = 0
    for i in range(cnt):
        v = mag[i]
        if v > t or (v == t and need_eq > 0):
            if v == t:
                need_eq -= 1
            out[o] = idx[i]
            o += 1


@numba.njit(cache=True, nogil=True)
def _emit_all(bits: np.ndarray, t: np.uint32, need_eq: int, out: np.ndarray) -> None:
    """Like :func:`_emit` over every element of ``bits``."""
    o = 0
    for i in range(bits.shape[0]):
        v = bits[i] & MAG_MASK
        if v > t or (v == t and need_eq > 0):
            if v == t:
                need_eq -= 1
            out[o] = i
            o += 1


@numba.njit(cache=True, nogil=True)
def _kth_and_gt(mag: np.ndarray, cnt: int, kk: int) -> tuple[np.uint32, int]:
    """The ``kk``-th largest of ``mag[:cnt]`` and how many are strictly greater."""
    t = np.partition(mag[:cnt], cnt - kk)[cnt - kk]
    gt = 0
    for i in range(cnt):
        gt += mag[i] > t
    return t, gt


@numba.njit(cache=True, nogil=True)
def _radix_kth(bits: np.ndarray, kk: int) -> tuple[np.uint32, int, np.uint32]:
    """Step 5: exact ``kk``-th largest magnitude, the count above it, and the max magnitude."""
    hi = np.zeros(1 << 15, np.int64)
    mx = np.uint32(0)
    for i in range(bits.shape[0]):
        v = bits[i] & MAG_MASK
        mx = max(mx, v)
        hi[v >> 16] += 1
    above = 0
    b = (1 << 15) - 1
    while above + hi[b] < kk:
        above += hi[b]
        b -= 1
    lo = np.zeros(1 << 16, np.int64)
    for i in range(bits.shape[0]):
        v = bits[i] & MAG_MASK
        if (v >> 16) == b:
            lo[v & 0xFFFF] += 1
    j = (1 << 16) - 1
    while above + lo[j] < kk:
        above += lo[j]
        j -= 1
    return np.uint32((b << 16) | j), above, mx


@numba.njit(cache=True, nogil=True, inline="always")
def _sample_size(n: int) -> int:
    """Step 1's sample size: ``n / 128``, within [SAMPLE_MIN, SAMPLE] (sampling and partitioning
    cost O(size); a smaller sample only loosens the threshold, never changes the result)."""
    return min(SAMPLE, max(SAMPLE_MIN, n >> 7))


@numba.njit(cache=True, nogil=True)
def _sample_positions(n: int, out: np.ndarray) -> None:
    """Step 1's positions: :func:`randomk_positions` with the stream ``(_SAMPLE_S0, _SAMPLE_S1)``
    and ``len(out)`` buckets, the bucket bounds ``b * n // ns`` stepped incrementally (no 64-bit
    division per sample)."""
    ns = out.shape[0]
    q, rm = n // ns, n % ns
    start, frac = 0, 0  # start = b * n // ns, frac = b * n % ns
    for b in range(ns):
        frac += rm
        nxt = start + q
        if frac >= ns:
            frac -= ns
            nxt += 1
        r = _mix32(_mix32(np.uint64(b) ^ _SAMPLE_S0) ^ _SAMPLE_S1)
        out[b] = start + np.int64((r * np.uint64(nxt - start)) >> _S32)
        start = nxt


def sample_positions(n: int) -> np.ndarray:
    """The int64 positions :func:`topk_select` samples in an array of ``n`` (> FULL_MAX)
    elements (for tests that build adversarial inputs)."""
    out = np.empty(_sample_size(n), np.int64)
    _sample_positions(n, out)
    return out


@numba.njit(cache=True, nogil=True)
def _sample_threshold(bits: np.ndarray, r: int, ns: int) -> np.uint32:
    """Step 1: the ``r``-th largest magnitude of a stratified, deterministic sample of ``ns``."""
    pos = np.empty(ns, np.int64)
    _sample_positions(bits.shape[0], pos)
    s = np.empty(ns, np.uint32)
    for i in range(ns):
        s[i] = bits[pos[i]] & MAG_MASK
    return np.partition(s, ns - r)[ns - r]


@numba.njit(cache=True, nogil=True)
def _select_small(bits: np.ndarray, out: np.ndarray) -> np.uint32:
    """Exact selection for small arrays: partition a copy of all magnitudes."""
    n, kk = bits.shape[0], out.shape[0]
    mag = np.empty(n, np.uint32)
    mx = np.uint32(0)
    for i in range(n):
        mag[i] = bits[i] & MAG_MASK
        mx = max(mx, mag[i])
    t, gt = _kth_and_gt(mag, n, kk)
    _emit_all(bits, t, kk - gt, out)
    return mx


@numba.njit(cache=True, nogil=True)
def topk_select(bits: np.ndarray, out: np.ndarray) -> int:
    """Write the indices of the ``len(out)`` largest ``|x|`` (``bits`` = float32 bits), ascending.

    Returns the largest magnitude bits seen (``>= EXP_BITS`` means the input had NaN/inf).
    """
    n, kk = bits.shape[0], out.shape[0]
    if kk == 0:
        return 0
    if n <= FULL_MAX:
        return _select_small(bits, out)
    ns = _sample_size(n)
    ev = kk * ns / n  # expected sampled members of the top-k
    r = int(ev + 4.0 * np.sqrt(ev) + 4.0)  # > 4 sigma above: a retry is very rare
    while r < ns // 2:
        t = max(_sample_threshold(bits, r, ns), np.uint32(1))
        cap = min(n, 2 * (r * n // ns) + 4096)
        idx, mag, cnt, mx = _scan(bits, t, cap)  # step 2
        if cnt > cap:
            break  # step 3: too many ties/candidates: radix
        if cnt >= kk:
            t, gt = _kth_and_gt(mag, cnt, kk)  # step 4
            _emit(idx, mag, cnt, t, kk - gt, out)
            return mx
        if t == 1:  # fewer nonzeros than kk: send them all, fill with the first zeros
            _emit_all(bits, np.uint32(0), kk - cnt, out)
            return mx
        r *= 4  # step 3: too few, lower the threshold
    t, gt, mx = _radix_kth(bits, kk)  # step 5
    _emit_all(bits, t, kk - gt, out)
    return mx


# -- top-k: gather / scatter --------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def gather(x: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[j] = x[idx[j]]``."""
    for j in range(idx.shape[0]):
        out[j] = x[idx[j]]


@numba.njit(cache=True, nogil=True)
def scatter(vals: np.ndarray, idx: np.ndarray, out: np.ndarray, alpha: float,
            accumulate: bool) -> int:
    """``out[idx] = vals`` (or ``+= alpha * vals``) after checking every index is in range.

    Returns -1 when all indices are valid (and writes), else the position of the first bad
    index (and writes nothing).
    """
    n = out.shape[0]
    for j in range(idx.shape[0]):
        if idx[j] < 0 or idx[j] >= n:
            return j
    a = np.float32(alpha)
    for j in range(idx.shape[0]):
        if accumulate:
            out[idx[j]] += a * vals[j]
        else:
            out[idx[j]] = vals[j]
    return -1


# -- top-k: bit-packed indices ------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def pack_indices(idx: np.ndarray, w: int, out: np.ndarray) -> None:
    """Pack int32 ``idx`` (each in ``[0, 2**w)``, ``w <= 31``) as ``w``-bit fields, LSB-first,
    into uint8 ``out`` of ``ceil(len(idx) * w / 8)`` bytes (the last byte zero-padded)."""
    mask = np.uint64((1 << w) - 1)
    acc, nbits, o = np.uint64(0), 0, 0
    for j in range(idx.shape[0]):
        acc |= (np.uint64(idx[j]) & mask) << np.uint64(nbits)  # acc holds < 8 + 31 bits
        nbits += w
        while nbits >= 8:
            out[o] = np.uint8(acc & np.uint64(0xFF))
            acc >>= np.uint64(8)
            nbits -= 8
            o += 1
    if nbits > 0:
        out[o] = np.uint8(acc)


@numba.njit(cache=True, nogil=True)
def unpack_indices(body: np.ndarray, w: int, out: np.ndarray) -> None:
    """Inverse of :func:`pack_indices`: read ``len(out)`` ``w``-bit fields into int32 ``out``
    (reads exactly ``ceil(len(out) * w / 8)`` bytes of ``body``; values are not range-checked)."""
    mask = np.uint64((1 << w) - 1)
    acc, nbits, i = np.uint64(0), 0, 0
    for j in range(out.shape[0]):
        while nbits < w:
            acc |= np.uint64(body[i]) << np.uint64(nbits)
            nbits += 8
            i += 1
        out[j] = np.int32(acc & mask)
        acc >>= np.uint64(w)
        nbits -= w

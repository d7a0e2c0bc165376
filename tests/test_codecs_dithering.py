"""Tests of the ``dithering`` codec (stochastic quantization, codec id 6)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradpress.compress import HEADER_BYTES, build
from gradpress.compress.dithering import Dithering, _hash32_torch, stream_keys
from gradpress.compress.kernels import dithering as K

CONFIGS = [
    "dithering",
    "dithering:partition=natural",
    "dithering:normalize=l2",
    "dithering:s=5,partition=natural,normalize=l2",
    "dithering:s=1",
    "dithering:s=3",
    "dithering:s=15,partition=natural",
    "dithering:s=127",
    "dithering:s=127,partition=natural,normalize=l2",
]


def levels(s: int, natural: bool) -> np.ndarray:
    """The documented level grid, independently of the codec."""
    if natural:
        return np.array([0.0] + [2.0 ** (k - s) for k in range(1, s + 1)])
    return np.arange(s + 1) / s


def norm_of(payload: torch.Tensor) -> float:
    return float(payload[-4:].numpy().view(np.float32)[0])


def randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def check_on_grid(codec: Dithering, x: torch.Tensor, payload: torch.Tensor) -> None:
    """Each decoded value is sign(x) * level * norm with level one of the two levels around
    r = |x| / norm (or zero)."""
    dec = codec.decompress(payload).numpy().astype(np.float64)
    xs = x.numpy().astype(np.float64)
    norm = norm_of(payload)
    grid = levels(codec.s, codec.natural)
    if norm == 0:
        assert not dec.any()
        return
    r = np.abs(xs) / norm
    hi_idx = np.clip(np.searchsorted(grid, r, side="left"), 1, codec.s)
    lo_v, hi_v = grid[hi_idx - 1] * norm, grid[hi_idx] * norm
    mag = np.abs(dec)
    tol = 1e-6 * norm + 2.0 ** -149  # float32 rounding of level * norm (subnormals too)
    on_lo, on_hi = np.abs(mag - lo_v) <= tol, np.abs(mag - hi_v) <= tol
    assert np.all(on_lo | on_hi), "decoded value is not one of the two adjacent levels"
    assert np.all((np.sign(dec) == np.sign(xs)) | (dec == 0))
    assert np.all(mag <= norm)


@pytest.mark.parametrize("spec", CONFIGS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 1000003])
def test_round_trip_sizes_and_grid(spec: str, n: int) -> None:
    codec = build(spec, n)
    b = codec.s.bit_length() + 1
    assert codec.bits == b
    assert codec.payload_bytes == HEADER_BYTES + (n * b + 7) // 8 + 4
    x = randn(n, seed=n)
    payload = codec.compress(x, key=11, step=3)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes
    out = codec.decompress(payload, key=11, step=3)
    assert out.shape == (n,) and out.dtype == torch.float32
    if n:
        expect = x.abs().max() if not codec.l2 else torch.linalg.vector_norm(x.double())
        assert norm_of(payload) == pytest.approx(float(expect), rel=1e-7)
        check_on_grid(codec, x, payload)


@pytest.mark.parametrize("s,bits", [(1, 2), (2, 3), (3, 3), (4, 4), (7, 4), (8, 5), (15, 5),
                                    (16, 6), (63, 7), (64, 8), (127, 8)])
def test_payload_bytes(s: int, bits: int) -> None:
    for n in (1, 9, 1000):
        codec = build(f"dithering:s={s}", n)
        assert codec.payload_bytes == HEADER_BYTES + math.ceil(n * bits / 8) + 4


def test_bits_per_element_of_the_design_table() -> None:
    codec = build("dithering:s=7", 1 << 20)
    assert (codec.payload_bytes - HEADER_BYTES - 4) * 8 / (1 << 20) == 4


def test_layout_linear() -> None:
    """s=7: 4-bit codes (level | sign << 3), element 2j in the low nibble; then the norm."""
    codec = build("dithering:s=7", 5)
    payload = codec.compress(torch.tensor([7.0, -7.0, 0.0, 1.0, -3.0]))
    body = bytes(payload[HEADER_BYTES:].numpy())
    assert body == bytes([0xF7, 0x10, 0x0B]) + np.float32(7.0).tobytes()


def test_layout_natural_3bit() -> None:
    """s=3 natural: levels 0, 1/4, 1/2, 1; 3-bit codes in an LSB-first bit stream."""
    x = [4.0, -2.0, 1.0, 0.0, -4.0, 2.0, 1.0, 4.0, -1.0]
    codes = [3, 4 | 2, 1, 0, 4 | 3, 2, 1, 3, 4 | 1]
    stream = sum(c << (3 * i) for i, c in enumerate(codes))
    expect = stream.to_bytes(math.ceil(3 * len(x) / 8), "little") + np.float32(4.0).tobytes()
    codec = build("dithering:s=3,partition=natural", len(x))
    payload = codec.compress(torch.tensor(x))
    assert bytes(payload[HEADER_BYTES:].numpy()) == expect
    assert codec.decompress(payload).tolist() == x


@pytest.mark.parametrize("spec", ["dithering", "dithering:partition=natural",
                                  "dithering:normalize=l2",
                                  "dithering:partition=natural,normalize=l2",
                                  "dithering:s=1", "dithering:s=127,partition=natural"])
def test_unbiased(spec: str) -> None:
    """mean over steps of decode(encode(x)) -> x, judged by the exact per-element variance of
    the stochastic rounding, (hi - lo)**2 * p * (1 - p) * norm**2 per draw."""
    n, steps = 1000, 400
    x = randn(n, seed=5) * torch.rand(n, generator=torch.Generator().manual_seed(6))
    codec = build(spec, n, seed=123)
    acc = torch.zeros(n, dtype=torch.float64)
    for step in range(steps):
        acc += codec.decompress(codec.compress(x, key=2, step=step)).double()
    mean = acc.numpy() / steps
    xs = x.numpy().astype(np.float64)
    norm = norm_of(codec.compress(x))
    grid = levels(codec.s, codec.natural)
    r = np.abs(xs) / norm
    hi_idx = np.clip(np.searchsorted(grid, r, side="left"), 1, codec.s)
    lo, hi = grid[hi_idx - 1], grid[hi_idx]
    p = (r - lo) / (hi - lo)
    var_mean = (hi - lo) ** 2 * p * (1 - p) * norm ** 2 / steps
    err = mean - xs
    live = var_mean > (1e-6 * norm) ** 2
    assert np.all(np.abs(err[~live]) <= 1e-5 * norm)  # (almost) on a level: (almost) exact
    z = err[live] / np.sqrt(var_mean[live])
    m = z.size
    assert m > n // 2
    # sum of errors: by the CLT over elements, N(0, 1) when unbiased
    assert abs(err[live].sum() / math.sqrt(var_mean[live].sum())) < 5
    # mean squared z-score: 1 when unbiased (a bias b adds b**2 / var); chi-square spread
    assert abs(np.mean(z * z) - 1) < 6 * math.sqrt(2 / m)


@pytest.mark.parametrize("spec", CONFIGS)
def test_numba_and_torch_payloads_identical(spec: str) -> None:
    for n in (1, 7, 8, 1000, 30001):
        x = randn(n, seed=n)
        x[::5] = 0.0
        x[1::7] *= 1e-30  # far below the norm: natural's lowest levels, linear's level 0
        a = build(spec, n, seed=9, backend="numba")
        b = build(spec, n, seed=9, backend="torch")
        pa, pb = a.compress(x, key=4, step=77), b.compress(x, key=4, step=77)
        assert torch.equal(pa, pb), f"{spec} n={n}: payloads differ"
        assert torch.equal(a.decompress(pa), b.decompress(pa))
        acc = randn(n, seed=1)
        ra, rb = acc.clone(), acc.clone()
        a.decompress_add(pa, ra, alpha=0.37)
        b.decompress_add(pa, rb, alpha=0.37)
        assert torch.equal(ra, rb)


@pytest.mark.parametrize("scale", [1e-42, 1e-30, 1e-20, 1e20, 3e38])
@pytest.mark.parametrize("spec", ["dithering", "dithering:s=127,partition=natural",
                                  "dithering:normalize=l2"])
def test_extreme_magnitudes(spec: str, scale: float) -> None:
    """Tiny (subnormal) and huge norms stay on the grid and agree across backends (an l2 norm
    beyond the float32 range is stored as the largest float32)."""
    x = (randn(64, seed=3) * scale).to(torch.float32)
    if not torch.isfinite(x).all():
        x = x.nan_to_num(posinf=3e38, neginf=-3e38)
    a, b = build(spec, 64, backend="numba"), build(spec, 64, backend="torch")
    pa = a.compress(x, step=1)
    assert torch.equal(pa, b.compress(x, step=1))
    check_on_grid(a, x, pa)


def test_determinism_and_streams() -> None:
    x = randn(5000)
    a, b = build("dithering", 5000, seed=1), build("dithering", 5000, seed=1)
    p = a.compress(x, key=3, step=4)
    assert torch.equal(p, a.compress(x, key=3, step=4))
    assert torch.equal(p, b.compress(x, key=3, step=4))  # another instance, same bytes
    body = p[HEADER_BYTES:]
    for other in (a.compress(x, key=3, step=5), a.compress(x, key=2, step=4),
                  build("dithering", 5000, seed=2).compress(x, key=3, step=4)):
        assert not torch.equal(body, other[HEADER_BYTES:])
    assert stream_keys(1, 3, 4) == stream_keys(1, 3, 4) != stream_keys(1, 3, 5)


def test_hash_twins_agree() -> None:
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 2 ** 32, 2000, dtype=np.int64)
    k0, k1 = stream_keys(7, 8, 9)
    ref = K.hash32_np(idx, k0, k1)
    assert np.array_equal(_hash32_torch(torch.from_numpy(idx), k0, k1).numpy(), ref)
    for i in idx[:20]:
        assert K.hash32(np.uint32(i), np.uint32(k0), np.uint32(k1)) == ref[idx == i][0]


@pytest.mark.parametrize("spec", ["dithering", "dithering:s=3,partition=natural",
                                  "dithering:s=127"])
def test_decompress_add(spec: str) -> None:
    n = 10001
    codec = build(spec, n)
    payload = codec.compress(randn(n), key=1, step=2)
    dec = codec.decompress(payload)
    acc = randn(n, seed=4)
    expect = acc.double() + 0.25 * dec.double()
    h = codec.decompress_add(payload, acc, alpha=0.25, key=1, step=2)
    assert h.key == 1 and h.step == 2
    torch.testing.assert_close(acc.double(), expect, rtol=1e-6, atol=1e-6)
    zero = torch.zeros(n)
    codec.decompress_add(payload, zero)
    assert torch.equal(zero, dec)


def test_s1_is_ternary_and_zero_chunk() -> None:
    x = randn(4000)
    codec = build("dithering:s=1", 4000)
    payload = codec.compress(x)
    norm = norm_of(payload)
    assert set(np.unique(codec.decompress(payload).numpy())) <= {-norm, 0.0, norm}
    zero = build("dithering:normalize=l2", 9)
    p0 = zero.compress(torch.zeros(9))
    assert not p0[HEADER_BYTES:].any() and not zero.decompress(p0).any()


@pytest.mark.parametrize("normalize", ["max", "l2"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite(normalize: str, bad: float) -> None:
    x = randn(100)
    x[17] = bad
    codec = build(f"dithering:normalize={normalize}", 100)
    with pytest.raises(ValueError, match="key 5: input has non-finite values"):
        codec.compress(x, key=5)
    allowed = build(f"dithering:normalize={normalize}", 100, nan_policy="allow")
    assert torch.isnan(allowed.decompress(allowed.compress(x))).all()
    assert Dithering.checks_finite


@pytest.mark.parametrize("spec,name", [("dithering:s=0", "s"), ("dithering:s=128", "s"),
                                       ("dithering:s=2.5", "s"), ("dithering:s=many", "s"),
                                       ("dithering:partition=log", "partition"),
                                       ("dithering:normalize=l1", "normalize"),
                                       ("dithering:levels=3", "levels")])
def test_bad_params(spec: str, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        build(spec, 10)


def test_header_mismatch_between_configs() -> None:
    payload = build("dithering:s=7", 10).compress(randn(10))
    with pytest.raises(ValueError, match="fingerprint"):
        build("dithering:s=5", 10).decompress(payload)
    assert build("dithering:s=7,partition=natural", 10).payload_bytes == payload.numel()
    with pytest.raises(ValueError, match="fingerprint"):
        build("dithering:s=7,partition=natural", 10).decompress(payload)


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, st.integers(1, 70),
                    elements=st.floats(width=32, allow_nan=False, allow_infinity=False)),
       spec=st.sampled_from(CONFIGS), step=st.integers(0, 2 ** 40))
def test_property_bounded_and_sign(x: np.ndarray, spec: str, step: int) -> None:
    codec = build(spec, x.size)
    payload = codec.compress(torch.from_numpy(x), step=step)
    dec = codec.decompress(payload).numpy()
    norm = norm_of(payload)
    assert np.all(np.abs(dec) <= norm)
    assert np.all((np.sign(dec) == np.sign(x)) | (dec == 0))

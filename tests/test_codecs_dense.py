"""Dense codecs: ``fp16``, ``bf16`` (16-bit casts) and ``onebit`` (scaled signs)."""

from __future__ import annotations

import math
import platform
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradpress.compress import HEADER_BYTES, build
from gradpress.compress.kernels import cast as KC
from gradpress.compress.kernels import onebit as KO

SIZES = [0, 1, 7, 8, 9, 1000003]
CASTS = {"fp16": torch.float16, "bf16": torch.bfloat16}
SPECS = ["fp16", "bf16", "onebit", "onebit:scaling=0"]


def wide(n: int, seed: int = 0) -> torch.Tensor:
    """Random float32 of both signs with magnitudes from subnormal to ~1e37."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * 10.0 ** rng.uniform(-45, 37, n)
    return torch.from_numpy(x.astype(np.float32))


def onebit_reference(x: torch.Tensor, scaling: bool = True) -> tuple[np.ndarray, float]:
    """(packed sign bits LSB first, float32 scale) computed with numpy."""
    xn = x.numpy()
    bits = np.packbits(np.signbit(xn), bitorder="little")
    mean = np.abs(xn.astype(np.float64)).sum() / max(xn.size, 1)
    scale = np.float32(mean) if scaling else np.float32(1.0)
    return bits, float(scale)


# -- sizes, round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_cast_round_trip_matches_torch(name: str, n: int) -> None:
    x = torch.randn(n) * 3
    codec = build(name, n)
    assert codec.payload_bytes == HEADER_BYTES + 2 * n
    payload = codec.compress(x, key=5, step=2)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes
    expect = x.to(CASTS[name])
    assert torch.equal(payload[HEADER_BYTES:].view(CASTS[name]).view(torch.int16),
                       expect.view(torch.int16))
    assert torch.equal(codec.decompress(payload, key=5, step=2), expect.float())


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scaling", [True, False])
def test_onebit_round_trip(n: int, scaling: bool) -> None:
    x = torch.randn(n)
    codec = build(f"onebit:scaling={int(scaling)}", n)
    assert codec.payload_bytes == HEADER_BYTES + (n + 7) // 8 + 4
    payload = codec.compress(x)
    bits, scale = onebit_reference(x, scaling)
    body = payload[HEADER_BYTES:].numpy()
    np.testing.assert_array_equal(body[:(n + 7) // 8], bits)
    y = codec.decompress(payload)
    if n:
        got = float(np.frombuffer(body[(n + 7) // 8:].tobytes(), np.float32)[0])
        assert got == pytest.approx(scale, rel=1e-6)
        assert torch.equal(y.abs(), torch.full((n,), got))
        assert torch.equal(torch.signbit(y), torch.signbit(x))
    if not scaling:
        assert set(y.unique().tolist()) <= {-1.0, 1.0}


def test_onebit_signs_of_zeros_and_tiny_values() -> None:
    x = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38, 1.0, -2.0, 0.5])
    codec = build("onebit", x.numel())
    y = codec.decompress(codec.compress(x))
    assert torch.signbit(y).tolist() == [False, True, False, True, False, True, False, True, False]
    # bit order: element i -> byte i // 8, bit i % 8 (LSB first)
    body = codec.compress(x)[HEADER_BYTES:]
    assert body[0].item() == 0b10101010 and body[1].item() == 0


def test_onebit_scale_is_mean_abs() -> None:
    x = torch.tensor([1.0, -2.0, 3.0, -6.0])
    y = build("onebit", 4).decompress(build("onebit", 4).compress(x))
    assert y.tolist() == [3.0, -3.0, 3.0, -3.0]


# -- numba and torch kernels agree byte for byte --------------------------------------------------
@pytest.mark.parametrize("n", [1, 7, 9, 255, 257, 4095, 4096, 4097, 3 * 4096 + 77, 1000003])
@pytest.mark.parametrize("spec", SPECS)
def test_numba_and_torch_payloads_identical(spec: str, n: int) -> None:
    for seed in range(2 if n < 10**6 else 1):
        x = wide(n, seed) if "onebit" in spec else torch.randn(n) * 100
        a, b = build(spec, n, backend="numba"), build(spec, n, backend="torch")
        pa, pb = a.compress(x, key=3, step=9), b.compress(x, key=3, step=9)
        assert torch.equal(pa, pb)
        assert torch.equal(a.decompress(pa), b.decompress(pb))


def test_onebit_torch_abs_sum_is_bit_identical() -> None:
    for n in (1, 300, 4096, 50000):
        x = wide(n, n)
        body = np.empty((n + 7) // 8 + 4, np.uint8)
        total = KO.encode(x.numpy(), body, True)
        assert KO.abs_sum_torch(x).item() == total
        assert total == pytest.approx(np.abs(x.numpy().astype(np.float64)).sum(), rel=1e-12)


@pytest.mark.parametrize("spec", ["fp16", "bf16", "onebit", "onebit:scaling=0"])
def test_nan_policy_allow_payloads_identical(spec: str) -> None:
    x = torch.randn(1001)
    x[[3, 10, 500, 7]] = torch.tensor([math.nan, -math.nan, math.inf, -math.inf])
    a = build(spec, 1001, nan_policy="allow", backend="numba")
    b = build(spec, 1001, nan_policy="allow", backend="torch")
    pa, pb = a.compress(x), b.compress(x)
    assert torch.equal(pa, pb)
    y = a.decompress(pa)
    if spec == "onebit":
        assert torch.isnan(y).all()
    elif spec == "onebit:scaling=0":
        assert torch.equal(torch.signbit(y), torch.signbit(x))
    else:
        assert torch.isnan(y[[3, 10]]).all() and y[500] == math.inf and y[7] == -math.inf
        assert torch.equal(y[:3], x[:3].to(CASTS[spec]).float())


# -- casts: rounding exactness --------------------------------------------------------------------
@pytest.mark.parametrize("name, impl", [("fp16", "hw"), ("fp16", "int"), ("bf16", None)])
def test_cast_rounding_matches_torch_on_all_ranges(name: str, impl: str | None) -> None:
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    near = rng.integers(0x33000000, 0x47900000, size=1 << 18, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x477FEFFF, 0x477FF000, 0x477FF001, 0x38800000, 0x387FFFFF, 0x33000000,
                      0x33000001, 0x7F7FFFFF, 0x7F800000, 0, 0x80000000], np.uint32)
    bits = np.concatenate([raw, near, near | np.uint32(1 << 31), edges])
    x = torch.from_numpy(bits.view(np.float32).copy())
    x = x[~torch.isnan(x)]
    out = np.empty(x.numel(), np.uint16)
    if impl is None:
        ok = KC.encode_bf16(x.numpy(), out)
    else:
        ok = int(KC._FP16[impl][0](x.numpy(), out)) != 0x7F800000
    assert ok == bool(torch.isfinite(x).all())
    expect = x.to(CASTS[name]).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("impl", ["hw", "int"])
def test_fp16_decode_add_all_half_values(impl: str) -> None:
    h = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    h = h[~torch.isnan(h)]
    acc = torch.zeros(h.numel())
    KC._FP16[impl][1](h.view(torch.int16).numpy().view(np.uint16), acc.numpy(), np.float32(1))
    assert torch.equal(acc, h.float())


def test_fp16_uses_hardware_conversions_here() -> None:
    # x86-64 with F16C / ARM: the fast path must be taken; elsewhere either path is correct
    # (both are checked against torch above on every value)
    fast = platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")
    assert KC.fp16_impl() in (("hw",) if fast else ("hw", "int"))


# -- decompress_add -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [9, 1000003])
def test_decompress_add_equals_decompress_plus_add(spec: str, n: int, backend: str) -> None:
    codec = build(spec, n, backend=backend)
    payload = codec.compress(torch.randn(n))
    base = torch.randn(n)
    y = codec.decompress(payload)
    acc = base.clone()
    h = codec.decompress_add(payload, acc)
    assert h.numel == n and torch.equal(acc, base + y)
    acc = base.clone()
    codec.decompress_add(payload, acc, alpha=-0.37)
    torch.testing.assert_close(acc, base - 0.37 * y, rtol=1e-6, atol=1e-6)


# -- non-finite input -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_raises(spec: str, backend: str, bad: float) -> None:
    x = torch.randn(5000)
    x[4321] = bad
    codec = build(spec, 5000, backend=backend)
    with pytest.raises(ValueError, match=r"key 7: input has non-finite values.*nan_policy='allow'"):
        codec.compress(x, key=7)
    allowed = build(spec, 5000, backend=backend, nan_policy="allow")
    y = allowed.decompress(allowed.compress(x))
    if spec in CASTS:
        assert torch.equal(y[:4321], x[:4321].to(CASTS[spec]).float())


# -- header and spec validation -------------------------------------------------------------------
def test_header_rejects_wrong_codec_numel_and_truncation() -> None:
    x = torch.randn(100)
    payload = build("fp16", 100).compress(x, key=4)
    with pytest.raises(ValueError, match=r"key 4: codec id 1, expected 2 \(bf16\)"):
        build("bf16", 100).decompress(payload)
    with pytest.raises(ValueError, match="numel 100, expected 101"):
        build("fp16", 101).decompress(payload)
    with pytest.raises(ValueError, match="truncated"):
        build("fp16", 100).decompress(payload[:-1])
    ob = build("onebit", 100).compress(x)
    with pytest.raises(ValueError, match="fingerprint"):
        build("onebit:scaling=0", 100).decompress(ob)
    with pytest.raises(ValueError, match="codec id 3, expected 1"):
        build("fp16", 100).decompress(ob)


@pytest.mark.parametrize("spec, word", [("onebit:scaling=2", "scaling"),
                                        ("onebit:scaling=maybe", "scaling"),
                                        ("onebit:bits=2", "bits"), ("fp16:scaling=1", "scaling")])
def test_bad_spec_values_name_the_parameter(spec: str, word: str) -> None:
    with pytest.raises(ValueError, match=word):
        build(spec, 10)


def test_spec_forms_and_ids() -> None:
    assert build({"compressor": "onebit", "scaling": False}, 3).params == {"scaling": False}
    assert build("onebit:scaling=true", 3).params == {"scaling": True}
    assert [build(s, 1).codec_id for s in ("fp16", "bf16", "onebit")] == [1, 2, 3]


# -- kernels release the GIL and are thread safe --------------------------------------------------
def test_kernels_nogil_and_parallel_use() -> None:
    for k in (KO.encode, KO.decode, KO.decode_add, KC._enc_fp16_hw, KC._enc_fp16_int,
              KC._enc_bf16, KC._dec_add_fp16_hw, KC._dec_add_fp16_int, KC.decode_add_bf16):
        assert k.targetoptions.get("nogil") is True
    xs = [torch.randn(20011) for _ in range(8)]
    codec = build("onebit", 20011)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda t: codec.compress(t), xs))
    for x, p in zip(xs, got):
        assert torch.equal(p, codec.compress(x))


# -- properties -----------------------------------------------------------------------------------
finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)
arrays32 = hnp.arrays(np.float32, st.integers(1, 600),
                      elements=st.one_of(finite32, st.sampled_from([0.0, -0.0, 1e-45, -3.4e38])))


@settings(max_examples=150, deadline=None)
@given(arrays32, st.booleans())
def test_onebit_property_sign_and_magnitude(xn: np.ndarray, scaling: bool) -> None:
    x = torch.from_numpy(xn)
    codec = build(f"onebit:scaling={int(scaling)}", x.numel(), backend="numba")
    payload = codec.compress(x)
    y = codec.decompress(payload)
    _, scale = onebit_reference(x, scaling)
    assert torch.equal(torch.signbit(y), torch.signbit(x))
    mag = y.abs()
    assert torch.equal(mag, mag[:1].expand_as(mag))
    assert mag[0].item() == pytest.approx(scale, rel=1e-6, abs=1e-45)
    twin = build(codec.spec_text, x.numel(), backend="torch")
    assert torch.equal(twin.compress(x), payload)


@settings(max_examples=100, deadline=None)
@given(arrays32, st.sampled_from(["fp16", "bf16"]))
def test_cast_property_matches_torch(xn: np.ndarray, name: str) -> None:
    x = torch.from_numpy(xn)
    codec = build(name, x.numel())
    y = codec.decompress(codec.compress(x))
    assert torch.equal(y.view(torch.int32), x.to(CASTS[name]).float().view(torch.int32))

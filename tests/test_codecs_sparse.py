"""Tests of the sparse codecs ``topk`` and ``randomk`` (gradpress.compress.sparse)."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gradpress.compress import HEADER_BYTES, build
from gradpress.compress.kernels import sparse as K
from gradpress.compress.sparse import pack_indices_torch, resolve_k, unpack_indices_torch

SIZES = [0, 1, 7, 8, 1000003]
TOPK_SPECS = ["topk:k=0.001", "topk:k=0.001,values=fp16", "topk:k=0.25", "topk:k=5"]
N_LARGE = 1 << 18  # above the small-array path: exercises the sampled threshold


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _heavy(n: int, seed: int) -> torch.Tensor:
    """Heavy-tailed data: Student-t with 1.5 degrees of freedom."""
    torch.manual_seed(seed)
    return torch.distributions.StudentT(1.5).sample((n,))


def _selected(codec, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    idx, vals = codec._split(payload[HEADER_BYTES:])
    return idx.long(), vals


def _check_topk_exact(x: torch.Tensor, sel: torch.Tensor, kk: int) -> None:
    """Exactly kk sorted unique indices, and no unselected |x| above a selected one."""
    assert sel.numel() == kk
    assert bool((sel[1:] > sel[:-1]).all())
    if kk and kk < x.numel():
        mask = torch.ones(x.numel(), dtype=torch.bool)
        mask[sel] = False
        assert float(x[sel].abs().min()) >= float(x[mask].abs().max())


def _recall(x: torch.Tensor, sel: torch.Tensor, kk: int) -> float:
    exact = set(torch.topk(x.abs(), kk).indices.tolist())
    return len(exact & set(sel.tolist())) / kk


# -- resolution, sizes, params ------------------------------------------------------------------
@pytest.mark.parametrize("k,numel,expected", [
    (0.01, 0, 0), (0.01, 1, 1), (0.01, 1000, 10), (0.001, 1000003, 1000), (0.5, 7, 4),
    (5.0, 3, 3), (5.0, 1000, 5), (0.999, 8, 8),
])
def test_resolve_k(k: float, numel: int, expected: int) -> None:
    assert resolve_k(k, numel) == expected


@pytest.mark.parametrize("numel", SIZES)
def test_payload_sizes(numel: int) -> None:
    kk = resolve_k(0.001, numel)
    w = max(1, (numel - 1).bit_length())
    assert build("topk:k=0.001", numel).payload_bytes == HEADER_BYTES + 4 * kk + -(-kk * w // 8)
    assert build("topk:k=0.001,values=fp16", numel).payload_bytes == \
        HEADER_BYTES + 2 * kk + -(-kk * w // 8)
    assert build("topk:k=0.001,indices=int32", numel).payload_bytes == HEADER_BYTES + 8 * kk
    assert build("topk:k=0.001,values=fp16,indices=int32", numel).payload_bytes == \
        HEADER_BYTES + 6 * kk
    kr = resolve_k(0.01, numel)
    assert build("randomk:k=0.01", numel).payload_bytes == HEADER_BYTES + 4 * kr
    assert build("topk", numel).kk == resolve_k(0.01, numel)


@pytest.mark.parametrize("spec,names", [
    ("topk:k=0", ["k", "0"]), ("topk:k=1.5", ["k", "1.5"]),
    ("topk:values=int8", ["values", "int8"]), ("topk:foo=1", ["foo"]), ("randomk:k=-1", ["k"]),
    ("randomk:seed=abc", ["seed", "abc"]), ("randomk:bar=2", ["bar"]),
])
def test_bad_params(spec: str, names: list[str]) -> None:
    with pytest.raises(ValueError) as ei:
        build(spec, 100)
    for name in names:
        assert name in str(ei.value)


def test_numel_limit() -> None:
    with pytest.raises(ValueError, match="int32 index range"):
        build("topk", 2**31)


# -- round trips ---------------------------------------------------------------------------------
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("spec", TOPK_SPECS)
def test_topk_round_trip(spec: str, numel: int) -> None:
    codec = build(spec, numel)
    x = torch.randn(numel, generator=_gen(numel))
    payload = codec.compress(x, key=3, step=9)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes
    sel, vals = _selected(codec, payload)
    _check_topk_exact(x, sel, codec.kk)
    y = codec.decompress(payload, key=3, step=9)
    expect = torch.zeros(numel)
    expect[sel] = x[sel].half().float() if "fp16" in spec else x[sel]
    assert torch.equal(y, expect)


@pytest.mark.parametrize("numel", SIZES)
def test_randomk_round_trip(numel: int) -> None:
    codec = build("randomk:k=0.01", numel, seed=5)
    x = torch.randn(numel, generator=_gen(numel))
    y = codec.decompress(codec.compress(x, key=2, step=4))
    sel = codec.indices(2, 4)
    assert sel.numel() == codec.kk
    expect = torch.zeros(numel)
    expect[sel] = x[sel]
    assert torch.equal(y, expect)


def test_input_shapes_and_dtypes() -> None:
    codec = build("topk:k=10", 60)
    x = torch.randn(3, 20, dtype=torch.float64, generator=_gen(1))
    y = codec.decompress(codec.compress(x))
    assert torch.equal(y.nonzero().flatten(), torch.topk(x.flatten().abs(), 10).indices.sort()[0])


# -- top-k selection quality --------------------------------------------------------------------
@pytest.mark.parametrize("dist", ["normal", "heavy"])
@pytest.mark.parametrize("k", [0.001, 0.01])
def test_topk_recall(dist: str, k: float) -> None:
    n = 1 << 20
    x = torch.randn(n, generator=_gen(7)) if dist == "normal" else _heavy(n, 7)
    codec = build(f"topk:k={k}", n)
    sel, _ = _selected(codec, codec.compress(x))
    assert sel.numel() == codec.kk
    assert _recall(x, sel, codec.kk) >= 0.95
    _check_topk_exact(x, sel, codec.kk)


def _sparse_vec(n: int, nnz: int) -> torch.Tensor:
    x = torch.zeros(n)
    x[torch.randperm(n, generator=_gen(nnz))[:nnz]] = torch.randn(nnz, generator=_gen(1))
    return x


@pytest.mark.parametrize("case", ["zeros", "ones", "levels", "few_nonzeros", "many_nonzeros",
                                  "big_k", "sample_adversary"])
def test_topk_degenerate_inputs(case: str) -> None:
    """Ties, zeros and inputs that defeat the sampled threshold still send the exact top-k."""
    n, spec = N_LARGE, "topk:k=0.001"
    if case == "zeros":
        x = torch.zeros(n)
    elif case == "ones":
        x = -torch.ones(n)
    elif case == "levels":
        x = torch.randint(0, 4, (n,), generator=_gen(2)).float()
    elif case == "few_nonzeros":
        x = _sparse_vec(n, 50)
    elif case == "many_nonzeros":
        x = _sparse_vec(n, 5000)
    elif case == "big_k":
        x, spec = torch.randn(n, generator=_gen(3)), "topk:k=0.7"
    else:  # large values exactly at the sampled positions: the threshold first overshoots
        x = torch.rand(n, generator=_gen(4))
        x[torch.from_numpy(K.sample_positions(n))] += 10.0
    codec = build(spec, n)
    sel, _ = _selected(codec, codec.compress(x))
    _check_topk_exact(x, sel, codec.kk)


def test_topk_torch_backend_matches_numba() -> None:
    n = N_LARGE
    x = torch.randn(n, generator=_gen(11))
    for spec in ("topk:k=0.001", "topk:k=0.01,values=fp16"):
        a, b = build(spec, n), build(spec, n, backend="torch")
        pa, pb = a.compress(x, key=1, step=2), b.compress(x, key=1, step=2)
        assert pa.numel() == pb.numel()
        # continuous data has no ties, so the exact torch.topk and the numba path agree
        assert torch.equal(pa, pb)
        assert torch.equal(a.decompress(pa), b.decompress(pb))


def test_topk_deterministic() -> None:
    x = _heavy(N_LARGE, 3)
    a, b = build("topk:k=0.002", N_LARGE), build("topk:k=0.002", N_LARGE)
    assert torch.equal(a.compress(x, key=4, step=1), b.compress(x, key=4, step=1))


def test_topk_fp16_values() -> None:
    codec = build("topk:k=100,values=fp16", 5000)
    x = torch.randn(5000, generator=_gen(5)) * 1e3
    sel, vals = _selected(codec, codec.compress(x))
    assert vals.dtype == torch.float16
    assert torch.equal(vals, x[sel].half())


# -- random-k positions --------------------------------------------------------------------------
def test_randomk_indices_agree_across_instances() -> None:
    a = build("randomk:k=0.01", 100000, seed=7)
    b = build("randomk:k=0.01", 100000, seed=7)
    assert torch.equal(a.indices(3, 10), b.indices(3, 10))
    assert not torch.equal(a.indices(3, 10), a.indices(3, 11))
    assert not torch.equal(a.indices(3, 10), a.indices(4, 10))
    assert not torch.equal(a.indices(3, 10), build("randomk:k=0.01", 100000, seed=8).indices(3, 10))
    # the spec's seed overrides build()'s seed and is part of the fingerprint
    c = build("randomk:k=0.01,seed=7", 100000, seed=123)
    assert torch.equal(a.indices(3, 10), c.indices(3, 10))
    assert a.fingerprint == c.fingerprint


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (8, 8), (1000003, 10007), (2**31 - 1, 5)])
def test_randomk_stratified_sorted_unique(n: int, k: int) -> None:
    codec = build(f"randomk:k={k}", n, seed=1)
    idx = codec.indices(9, 2)
    torch_idx = build(f"randomk:k={k}", n, seed=1, backend="torch").indices(9, 2)
    assert torch.equal(idx, torch_idx)
    b = torch.arange(k, dtype=torch.int64)
    assert bool((idx >= b * n // k).all()) and bool((idx < (b + 1) * n // k).all())
    assert bool((idx[1:] > idx[:-1]).all())


def test_randomk_positions_spread_uniformly() -> None:
    """Within-bucket offsets are close to uniform (mean ~ 1/2 of the bucket)."""
    n, k = 1000000, 10000
    codec = build(f"randomk:k={k}", n)
    idx = codec.indices(0, 0).double()
    frac = (idx - torch.arange(k) * (n // k)) / (n // k)
    assert abs(float(frac.mean()) - 0.5) < 0.02
    assert abs(float(frac.var()) - 1 / 12) < 0.01


def test_randomk_torch_payload_byte_identical() -> None:
    x = torch.randn(1000003, generator=_gen(2))
    a = build("randomk:k=0.01", 1000003, seed=3)
    b = build("randomk:k=0.01", 1000003, seed=3, backend="torch")
    pa, pb = a.compress(x, key=6, step=8), b.compress(x, key=6, step=8)
    assert torch.equal(pa, pb)
    assert torch.equal(a.decompress(pa), b.decompress(pa))


def test_randomk_seed_mismatch_is_detected() -> None:
    a = build("randomk:k=0.01", 1000, seed=1)
    b = build("randomk:k=0.01", 1000, seed=2)
    with pytest.raises(ValueError, match="fingerprint"):
        b.decompress(a.compress(torch.randn(1000)))


# -- decompress_add, non-finite input, corrupt payloads ------------------------------------------
@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("spec", ["topk:k=0.01", "topk:k=0.01,values=fp16", "randomk:k=0.01"])
def test_decompress_add(spec: str, backend: str) -> None:
    n = 100003
    codec = build(spec, n, backend=backend)
    x = torch.randn(n, generator=_gen(8))
    acc = torch.randn(n, generator=_gen(9))
    payload = codec.compress(x, key=1, step=3)
    dense = codec.decompress(payload)
    for alpha in (1.0, 0.5):
        expect = acc + alpha * dense
        got = acc.clone()
        codec.decompress_add(payload, got, alpha=alpha)
        if alpha == 1.0:
            assert torch.equal(got, expect)
        else:
            torch.testing.assert_close(got, expect)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("n", [100, N_LARGE])
def test_topk_non_finite(n: int, backend: str) -> None:
    x = torch.randn(n, generator=_gen(1))
    x[n // 2] = float("nan")
    with pytest.raises(ValueError, match="non-finite values"):
        build("topk:k=0.01", n, backend=backend).compress(x, key=5)
    x[n // 2] = float("inf")
    with pytest.raises(ValueError, match="topk.compress key 5: input has non-finite"):
        build("topk:k=0.01", n, backend=backend).compress(x, key=5)
    codec = build("topk:k=0.01", n, backend=backend, nan_policy="allow")
    assert bool(torch.isinf(codec.decompress(codec.compress(x))).any())


def test_randomk_non_finite() -> None:
    x = torch.randn(100)
    x[3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        build("randomk:k=10", 100).compress(x)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_topk_corrupt_index_rejected(backend: str) -> None:
    codec = build("topk:k=4,indices=int32", 50, backend=backend)
    payload = codec.compress(torch.randn(50))
    payload[HEADER_BYTES:HEADER_BYTES + 4].view(torch.int32)[0] = 50
    with pytest.raises(ValueError, match="out of range"):
        codec.decompress(payload)
    with pytest.raises(ValueError, match="out of range"):
        codec.decompress_add(payload, torch.zeros(50))


# -- properties ------------------------------------------------------------------------------------
_floats = st.floats(-1e6, 1e6, width=32, allow_nan=False, allow_infinity=False)
_k = st.one_of(st.floats(0.001, 0.999), st.integers(1, 400).map(float))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=hnp.arrays(np.float32, st.integers(0, 300), elements=_floats), k=_k,
       values=st.sampled_from(["fp32", "fp16"]))
def test_property_topk_small(x: np.ndarray, k: float, values: str) -> None:
    t = torch.from_numpy(x)
    codec = build(f"topk:k={k},values={values}", t.numel())
    payload = codec.compress(t)
    sel, _ = _selected(codec, payload)
    _check_topk_exact(t, sel, codec.kk)
    y = codec.decompress(payload)
    cast = t[sel].clamp(-65504, 65504).half().float() if values == "fp16" else t[sel]
    assert torch.equal(y[sel], cast)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n=st.integers(K.FULL_MAX + 1, 3 * K.FULL_MAX),
       k=st.sampled_from([0.0005, 0.003, 0.05, 37.0]),
       dist=st.sampled_from(["normal", "heavy", "rounded", "sparse"]))
def test_property_topk_large(seed: int, n: int, k: float, dist: str) -> None:
    x = _heavy(n, seed) if dist == "heavy" else torch.randn(n, generator=_gen(seed))
    if dist == "rounded":
        x = torch.round(x * 4)  # many ties
    elif dist == "sparse":
        x = x * (torch.rand(n, generator=_gen(seed + 1)) < 0.002)
    codec = build(f"topk:k={k}", n)
    sel, _ = _selected(codec, codec.compress(x))
    _check_topk_exact(x, sel, codec.kk)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 10**6), k=_k, seed=st.integers(0, 2**64 - 1),
       key=st.integers(0, 2**32 - 1), step=st.integers(0, 2**40))
def test_property_randomk_indices(n: int, k: float, seed: int, key: int, step: int) -> None:
    codec = build(f"randomk:k={k}", n, seed=seed)
    idx = codec.indices(key, step)
    s0, s1 = K.stream_words(seed, key, step)
    assert torch.equal(idx, K.randomk_positions_torch(n, codec.kk, s0, s1))
    assert idx.numel() == codec.kk
    assert bool((idx[1:] > idx[:-1]).all()) and int(idx[0]) >= 0 and int(idx[-1]) < n


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_topk_fp16_saturates(backend: str) -> None:
    x = torch.tensor([1e6, -2e5, 1.0, 0.5])
    codec = build("topk:k=2,values=fp16", 4, backend=backend)
    y = codec.decompress(codec.compress(x))
    assert y.tolist() == [65504.0, -65504.0, 0.0, 0.0]


# -- topk index layouts: packed (default) and int32 ----------------------------------------------
LAYOUT_SIZES = [1, 2, 3, 255, 256, 257, 16384, 65537]
LAYOUT_KS = ["0.001", "0.3", "1", "7"]


def _tie_free(n: int, seed: int) -> torch.Tensor:
    """Distinct magnitudes (a permutation of 1..n, random signs): one exact top-k, any backend."""
    g = _gen(seed)
    sign = torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    return (torch.randperm(n, generator=g).float() + 1) * 0.37 * sign


def _index_bits(numel: int) -> int:
    return max(1, math.ceil(math.log2(numel))) if numel > 1 else 1


def _expected_decode(x: torch.Tensor, kk: int, fp16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    sel = torch.topk(x.abs(), kk).indices.sort().values
    v = x[sel].clamp(-65504, 65504).half().float() if fp16 else x[sel]
    y = torch.zeros(x.numel())
    y[sel] = v
    return sel, y


@pytest.mark.parametrize("layout", ["packed", "int32"])
@pytest.mark.parametrize("k", LAYOUT_KS)
@pytest.mark.parametrize("numel", LAYOUT_SIZES)
def test_topk_layout_round_trip(numel: int, k: str, layout: str) -> None:
    values = "fp16" if k in ("0.3", "7") else "fp32"
    codec = build(f"topk:k={k},values={values},indices={layout}", numel)
    x = _tie_free(numel, numel)
    payload = codec.compress(x, key=2, step=5)
    assert payload.numel() == codec.payload_bytes
    sel, expect = _expected_decode(x, codec.kk, values == "fp16")
    got, _ = _selected(codec, payload)
    assert torch.equal(got, sel)
    assert torch.equal(codec.decompress(payload, key=2, step=5), expect)
    acc = torch.ones(numel)
    codec.decompress_add(payload, acc, alpha=-1.0)
    assert torch.equal(acc, 1.0 - expect)


@pytest.mark.parametrize("numel", LAYOUT_SIZES + [0, 1 << 20, 2**31 - 1])
def test_topk_payload_size_formula(numel: int) -> None:
    for k in (0.001, 0.01, 5.0):
        for values, vb in (("fp32", 4), ("fp16", 2)):
            kk = resolve_k(k, numel)
            packed = build(f"topk:k={k},values={values}", numel)
            assert packed.params["indices"] == "packed"
            w = _index_bits(numel)
            assert packed.index_bits == w
            assert packed.payload_bytes == HEADER_BYTES + kk * vb + math.ceil(kk * w / 8)
            legacy = build(f"topk:k={k},values={values},indices=int32", numel)
            assert legacy.payload_bytes == HEADER_BYTES + kk * (4 + vb)


def test_topk_packed_beats_333x_against_fp16() -> None:
    """BERT-size chunks: 20-bit indices give ~444x (16 / (0.001 * 36)), not ~333x; the bundled
    tasks' small tensors beat 333x too."""
    fp16 = build("fp16", 1 << 20).payload_bytes
    packed = build("topk:k=0.001,values=fp16", 1 << 20)
    assert packed.index_bits == 20
    assert fp16 / packed.payload_bytes == pytest.approx(16 / (0.001 * 36), rel=0.01)
    legacy = build("topk:k=0.001,values=fp16,indices=int32", 1 << 20)
    assert fp16 / legacy.payload_bytes == pytest.approx(333, rel=0.01)
    for n in (36864, 49152):
        assert build("fp16", n).payload_bytes / build("topk:k=0.001,values=fp16", n) \
            .payload_bytes > 333


def _reference_stream(idx: list[int], w: int) -> bytes:
    """The documented bit stream, built with Python integers: index j at bits [j*w, j*w + w)."""
    word = sum(int(i) << (j * w) for j, i in enumerate(idx))
    return word.to_bytes(math.ceil(len(idx) * w / 8), "little")


@settings(max_examples=60, deadline=None)
@given(w=st.integers(1, 31), data=st.data())
def test_property_pack_indices_matches_reference(w: int, data: st.DataObject) -> None:
    idx = data.draw(st.lists(st.integers(0, 2**w - 1), max_size=70))
    ia = np.array(idx, dtype=np.int32)
    ref = _reference_stream(idx, w)
    out = np.full(len(ref), 0xAB, np.uint8)  # garbage: the pad bits must be written as zeros
    K.pack_indices(ia, w, out)
    assert bytes(out) == ref
    t = pack_indices_torch(torch.from_numpy(ia), w, len(ref))
    assert bytes(t.numpy()) == ref
    back = np.empty(len(idx), np.int32)
    K.unpack_indices(out, w, back)
    assert back.tolist() == idx
    assert unpack_indices_torch(torch.from_numpy(out), w, len(idx)).tolist() == idx


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(numel=st.one_of(st.integers(1, 600), st.integers(600, 70000)), k=_k,
       seed=st.integers(0, 2**16), layout=st.sampled_from(["packed", "int32"]),
       values=st.sampled_from(["fp32", "fp16"]))
def test_property_topk_layout_decode_and_ef(numel: int, k: float, seed: int, layout: str,
                                            values: str) -> None:
    spec = f"topk:k={k},values={values},indices={layout}"
    x = _tie_free(numel, seed) * (1e-3 if seed % 2 else 1.0)
    codec = build(spec, numel)
    _, expect = _expected_decode(x, codec.kk, values == "fp16")
    y = codec.decompress(codec.compress(x))
    assert torch.equal(y, expect)
    # error feedback (fused CPU path): residual == p - decode(payload), exactly, in float64
    ef = build(spec, numel, ef="vanilla")
    p = x
    for step in range(2):
        payload = ef.compress(p if step == 0 else x, key=1, step=step)
        dec = codec.decompress(payload)
        assert torch.equal(ef.residual.double(), p.double() - dec.double())
        p = x + ef.residual  # float32, as the codec computes p = g + e


@pytest.mark.parametrize("layout", ["packed", "int32"])
@pytest.mark.parametrize("numel", [3, 257, 16384, 65537, N_LARGE + 3])
def test_topk_layout_numba_torch_byte_identical(numel: int, layout: str) -> None:
    x = _tie_free(numel, 21)
    for values in ("fp32", "fp16"):
        spec = f"topk:k=0.01,values={values},indices={layout}"
        a, b = build(spec, numel), build(spec, numel, backend="torch")
        pa, pb = a.compress(x, key=4, step=6), b.compress(x, key=4, step=6)
        assert torch.equal(pa, pb)
        assert torch.equal(a.decompress(pa), b.decompress(pa))
        ea, eb = build(spec, numel, ef="vanilla"), build(spec, numel, ef="vanilla",
                                                         backend="torch")
        for step in range(2):  # fused numba EF vs the torch fallback: same bytes and residual
            assert torch.equal(ea.compress(x, step=step), eb.compress(x, step=step))
            assert torch.equal(ea.residual, eb.residual)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("values,vb", [("fp32", 4), ("fp16", 2)])
def test_topk_packed_corrupt_index_names_key_and_range(backend: str, values: str,
                                                        vb: int) -> None:
    n, kk = 50, 4  # w = 6 bits: the fields can hold 50..63, which no encoder writes
    codec = build(f"topk:k={kk},values={values}", n, backend=backend)
    payload = codec.compress(_tie_free(n, 3), key=7)
    payload[HEADER_BYTES + kk * vb] |= 0x3F  # first index field -> 63
    with pytest.raises(ValueError, match=r"key 7: index .*out of range \[0, 50\)"):
        codec.decompress(payload)
    acc = torch.ones(n)
    with pytest.raises(ValueError, match=r"key 7: index .*out of range \[0, 50\)"):
        codec.decompress_add(payload, acc)
    assert torch.equal(acc, torch.ones(n))  # nothing written


def test_topk_int32_payload_rejected_by_packed_codec() -> None:
    x = torch.randn(1000, generator=_gen(4))
    legacy = build("topk:k=10,indices=int32", 1000).compress(x, key=9)
    packed = build("topk:k=10", 1000)
    with pytest.raises(ValueError, match=r"key 9: codec config fingerprint .*indices=packed"):
        packed.decompress(legacy)
    with pytest.raises(ValueError, match="indices=int32"):
        build("topk:k=10,indices=int32", 1000).decompress(packed.compress(x))
    with pytest.raises(ValueError, match="indices.*int16|int16.*indices"):
        build("topk:indices=int16", 1000)


@pytest.mark.parametrize("values", ["fp32", "fp16"])
@pytest.mark.parametrize("numel", [1, 257, 65537])
def test_topk_int32_layout_byte_identical(numel: int, values: str) -> None:
    """``indices=int32`` keeps the pre-packing body: kk int32 indices, then kk values."""
    codec = build(f"topk:k=0.01,values={values},indices=int32", numel)
    x = _tie_free(numel, 8) * 1e3
    body = bytes(codec.compress(x)[HEADER_BYTES:].numpy())
    sel = torch.topk(x.abs(), codec.kk).indices.sort().values.tolist()
    v = x[sel].numpy()
    vals = np.clip(v, -65504, 65504).astype("<f2") if values == "fp16" else v.astype("<f4")
    assert body == struct.pack(f"<{len(sel)}i", *sel) + vals.tobytes()


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("layout", ["packed", "int32"])
def test_topk_misaligned_payload(layout: str, backend: str) -> None:
    """Payloads packed back to back (DDP hook slots) can start at any byte: same bytes, same
    decode, same error-feedback result as an aligned payload."""
    n, spec = 1001, f"topk:k=7,values=fp16,indices={layout}"
    x = _tie_free(n, 5)
    codec = build(spec, n, backend=backend)
    ref = codec.compress(x, key=1)
    for off in (1, 2, 3):
        buf = torch.zeros(off + codec.payload_bytes, dtype=torch.uint8)
        got = codec.compress(x, key=1, out=buf[off:])
        assert torch.equal(got, ref)
        assert torch.equal(codec.decompress(got), codec.decompress(ref))
        ef = build(spec, n, backend=backend, ef="vanilla")
        assert torch.equal(ef.compress(x, key=1, out=buf[off:]), ref)
        assert torch.equal(ef.residual, x - codec.decompress(ref))

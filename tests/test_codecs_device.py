"""The device path of the codecs (issue #30, finding 7): one host synchronisation per compress
into a host payload, none for a decompress from one, none in device mode.

The CPU tests run the device code paths with ``backend="torch"`` on the CPU: the staged compress
(encode into a device buffer, one copy back with the finiteness flag), host-payload decode (host
checks, one copy to the device), device mode (flag in ``last_finite``, state blended with
``torch.where``; simulated on the CPU by switching off staging). Tests whose name contains
``cuda`` need a GPU and skip without one (``benchmarks/gpu_check.py`` runs them).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from gradpress.compress import HEADER_BYTES, build, transfer
from gradpress.compress.dithering import sumsq_torch
from gradpress.compress.kernels import dithering as KD
from gradpress.compress.momentum import NesterovMomentum
from gradpress.ps.errors import PayloadError
from gradpress.ps.protocol import decode_reply

_ALL = ("none", "fp16", "bf16", "onebit", "onebit:scaling=0", "topk:k=0.05",
        "topk:k=7,values=fp16,indices=int32", "randomk:k=0.05", "dithering",
        "dithering:s=5,partition=natural,normalize=l2")
SPECS = list(_ALL)
#: (spec, error feedback): sparse error feedback is for randomk only (it needs the indices)
SPEC_EF = [(s, ef) for s in SPECS for ef in (None, "vanilla", "sparse")
           if ef != "sparse" or s.startswith("randomk")]
N = 3001
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def randn(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


class Counter:
    """Counts calls of the transfer helpers (patched in place, so every caller sees them)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = {"to_host": 0, "host_to": 0}
        for name in self.calls:
            real = getattr(transfer, name)

            def counted(*a, _real=real, _name=name):  # type: ignore[no-untyped-def]
                self.calls[_name] += 1
                return _real(*a)
            monkeypatch.setattr(transfer, name, counted)


# -- CPU: the torch backend runs the device paths ----------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_staged_compress_matches_numba_with_one_transfer(spec, monkeypatch):
    x = randn(N, 1)
    ref = build(spec, N, seed=4).compress(x, key=3, step=2, lr=0.5)  # numba
    codec = build(spec, N, seed=4, backend="torch")
    count = Counter(monkeypatch)
    out = torch.full((codec.payload_bytes,), 7, dtype=torch.uint8)
    assert codec.compress(x, key=3, step=2, lr=0.5, out=out) is out
    assert count.calls == {"to_host": 1, "host_to": 0}
    assert torch.equal(out, ref)
    assert codec.last_finite is None  # a host payload: the flag was read with the body


@pytest.mark.parametrize("spec", SPECS)
def test_host_payload_decode_copies_once_and_matches_numba(spec, monkeypatch):
    x = randn(N, 2)
    numba = build(spec, N, seed=4)
    payload = numba.compress(x, key=1, step=9)
    codec = build(spec, N, seed=4, backend="torch")
    codec.decompress(payload)  # warm-up (dithering's level table: one copy per device)
    count = Counter(monkeypatch)
    out = codec.decompress(payload, key=1, step=9)
    acc, ref_acc = randn(N, 3), randn(N, 3)
    codec.decompress_add(payload, acc, alpha=-0.5)
    assert count.calls == {"to_host": 0, "host_to": 2}
    assert torch.equal(out, numba.decompress(payload))
    numba.decompress_add(payload, ref_acc, alpha=-0.5)
    assert torch.equal(acc, ref_acc)


@pytest.mark.parametrize("spec", SPECS)
def test_numba_path_makes_no_transfer(spec, monkeypatch):
    codec = build(spec, N, seed=4)
    count = Counter(monkeypatch)
    codec.decompress(codec.compress(randn(N)))
    assert count.calls == {"to_host": 0, "host_to": 0}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("ef", [None, "vanilla", "corrected"])
def test_staged_rejection_raises_and_keeps_state(spec, ef):
    """Error text unchanged; the residual and momentum are untouched by a rejected input."""
    codec = build(spec, N, seed=4, ef=ef, backend="torch")
    codec = NesterovMomentum(codec, mu=0.9)
    codec.compress(randn(N), lr=0.1)
    before = [None if t is None else t.clone() for t in (codec.momentum, codec.residual)]
    bad = randn(N, 1)
    bad[5] = float("nan")
    with pytest.raises(ValueError, match=r"input has non-finite values \(NaN/inf\); pass "
                                         r"nan_policy='allow'"):
        codec.compress(bad, key=2, lr=0.2)
    after = (codec.momentum, codec.residual)
    for b, a in zip(before, after):
        assert (a is None and b is None) or torch.equal(a.view(torch.int32), b.view(torch.int32))
    if ef == "corrected":
        assert codec.inner.lr_prev == 0.1


@pytest.mark.parametrize(("spec", "ef"), SPEC_EF)
def test_ef_and_momentum_match_numba_over_steps(spec, ef):
    """Error-feedback identity and payloads: torch backend (staged) == numba, bit for bit."""
    a = NesterovMomentum(build(spec, N, seed=4, ef=ef), mu=0.5)
    b = NesterovMomentum(build(spec, N, seed=4, ef=ef, backend="torch"), mu=0.5)
    for step in range(3):
        x = randn(N, 10 + step)
        pa = a.compress(x, key=6, step=step, lr=0.1)
        pb = b.compress(x, key=6, step=step, lr=0.1, out=torch.empty_like(pa))
        assert torch.equal(pa, pb), f"step {step}"
        assert torch.equal(a.momentum, b.momentum)
        if ef is not None:
            assert torch.equal(a.residual.view(torch.int32), b.residual.view(torch.int32))


@pytest.mark.parametrize("spec", [s for s in SPECS if not s.startswith("randomk")])
def test_error_feedback_identity_float64(spec):
    """p = x + e and e_new = p - D(C(p)) hold exactly (float64 check of float32 values);
    randomk's error feedback is sparse, checked by the sparse EF test."""
    codec = build(spec, N, seed=4, ef="vanilla", backend="torch")
    dec = build(spec, N, seed=4, backend="torch")
    e = torch.zeros(N, dtype=torch.float32)
    for step in range(3):
        x = randn(N, 20 + step)
        payload = codec.compress(x, step=step, out=torch.empty(codec.payload_bytes,
                                                               dtype=torch.uint8))
        p = x.double() + e.double()
        d = dec.decompress(payload).double()
        assert torch.equal((p.float().double() - d).float(), codec.residual)
        e = codec.residual.clone()


@pytest.mark.parametrize(("spec", "ef"), SPEC_EF)
def test_device_mode_defers_the_flag_and_blends_state(spec, ef):
    """Device mode (simulated on the CPU): no raise, last_finite False, state intact; then a
    finite input gives the numba payload and last_finite True."""
    codec = NesterovMomentum(build(spec, N, seed=4, ef=ef, backend="torch"), mu=0.5)
    codec._staged = lambda flat, payload: False  # as if the payload lived on the device
    ref = NesterovMomentum(build(spec, N, seed=4, ef=ef), mu=0.5)
    x0 = randn(N, 30)
    assert torch.equal(codec.compress(x0, step=0), ref.compress(x0, step=0))
    assert bool(codec.last_finite)
    state = [t.clone() for t in (codec.momentum, codec.residual) if t is not None]
    bad = randn(N, 31)
    bad[-1] = float("inf")
    codec.compress(bad, step=1)  # no exception: the caller reads the flag
    assert not bool(codec.last_finite)
    for b, a in zip(state, [t for t in (codec.momentum, codec.residual) if t is not None]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    x2 = randn(N, 32)
    assert torch.equal(codec.compress(x2, step=2), ref.compress(x2, step=2))


@pytest.mark.parametrize(("spec", "ef"), SPEC_EF)
def test_torch_paths_never_read_a_tensor_on_the_host(spec, ef, monkeypatch):
    """No .item()/bool()/int()/float()/.tolist() on a tensor anywhere in the torch-op encode
    and decode paths (on a GPU each would be a hidden synchronisation): staged compress, device
    mode, decompress and decompress_add from a host payload, and decode_reply."""
    codec = NesterovMomentum(build(spec, N, seed=4, ef=ef, backend="torch"), mu=0.5)
    dec = build(spec, N, seed=4, backend="torch")
    x, acc = randn(N, 40), torch.zeros(N)
    host = torch.empty(codec.payload_bytes, dtype=torch.uint8)
    dec.decompress(codec.compress(x, out=host))  # warm-up: caches, level tables

    def forbidden(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError("a tensor value was read on the host")
    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    codec.compress(x, step=1, out=host)
    dec.decompress(host, out=acc)
    dec.decompress_add(host, acc, alpha=0.5)
    decode_reply(dec, host, acc, key=0, step=1, sender="server 0", label="t")
    codec._staged = lambda flat, payload: False
    codec.compress(x, step=2)
    monkeypatch.undo()
    assert bool(codec.last_finite)


def test_allow_policy_reports_no_flag():
    codec = build("onebit", N, nan_policy="allow", backend="torch")
    codec._staged = lambda flat, payload: False
    codec.compress(randn(N))
    assert codec.last_finite is None


@pytest.mark.parametrize("spec", SPECS)
def test_decode_reply_decides_finiteness_from_the_payload(spec):
    x = randn(N, 5)
    x[::97] = float("nan")
    x[1] = float("inf")
    bad = build(spec, N, seed=4, nan_policy="allow").compress(x, key=2, step=3)
    good = build(spec, N, seed=4).compress(randn(N), key=2, step=3)
    for backend in ("numba", "torch"):
        codec = build(spec, N, seed=4, backend=backend)
        decodes_finite = bool(torch.isfinite(codec.decompress(bad)).all())
        assert codec.payload_finite(bad) == decodes_finite
        assert codec.payload_finite(good)
        out = torch.empty(N)
        decode_reply(codec, good, out, key=2, step=3, sender="server 0", label="t")
        if not decodes_finite:
            with pytest.raises(PayloadError, match="reply from server 0 rejected: it decodes to "
                                                   r"non-finite values \(NaN/inf\)"):
                decode_reply(codec, bad, out, key=2, step=3, sender="server 0", label="t")


def test_dithering_invalid_codes_are_not_finite():
    codec = build("dithering:s=5", 64, backend="torch")  # 4-bit codes, levels 0..5 valid
    payload = codec.compress(randn(64))
    assert codec.payload_finite(payload)
    payload[HEADER_BYTES] = 0x07  # element 0: level 7 > s
    assert not codec.payload_finite(payload)
    assert not bool(torch.isfinite(codec.decompress(payload)).all())


@pytest.mark.parametrize("layout", ["packed", "int32"])
def test_topk_bounds_checked_on_host_and_poisoned_on_device(layout):
    codec = build(f"topk:k=4,indices={layout}", 100, backend="torch")
    payload = codec.compress(randn(100))
    iraw = codec._regions(payload[HEADER_BYTES:])[0]
    if layout == "int32":
        iraw.view(torch.int32)[0] = 0  # a valid index 0 must not hide the bad one
        iraw.view(torch.int32)[2] = 100
    else:
        iraw.fill_(0xFF)  # 7-bit indices of 127 > 99
    with pytest.raises(ValueError, match=r"topk payload key 0: index out of range \[0, 100\)"):
        codec.decompress(payload)
    # a device payload skips the host check: element 0 becomes NaN instead of a bad write
    out, acc = torch.zeros(100), torch.ones(100)
    codec._decode(payload[HEADER_BYTES:].clone(), out, None)
    codec._decode_add(payload[HEADER_BYTES:].clone(), acc, 2.0, None)
    assert torch.isnan(out[0]) and torch.isnan(acc[0])
    assert torch.isfinite(out[1:]).all() and torch.isfinite(acc[1:]).all()


@pytest.mark.parametrize("n", [1, 7, 8, 4095, 4096, 4097, 3 * 4096 + 5, 70001])
def test_l2_sum_of_squares_tree_matches_numba(n):
    x = randn(n, n) * torch.logspace(-20, 20, n)  # wide magnitudes: rounding matters
    ref = KD.sumsq(x.numpy())
    assert float(sumsq_torch(x)) == ref  # the same float64 bits
    total = sum(float(v) for v in x.double().square())
    assert abs(ref - total) <= 1e-12 * total


def test_sparse_ef_positions_on_the_residuals_device(monkeypatch):
    codec = build("randomk:k=0.01", N, ef="sparse", seed=2, backend="torch")
    devices = []
    real = type(codec.inner).indices

    def spy(self, key, step, *, device=None):  # type: ignore[no-untyped-def]
        devices.append(device)
        return real(self, key, step, device=device)
    monkeypatch.setattr(type(codec.inner), "indices", spy)
    codec.compress(randn(N), step=0)
    assert devices == [codec.residual.device]  # once per step, on the residual's device
    numba = build("randomk:k=0.01", N, ef="sparse", seed=2)
    numba.compress(randn(N), step=0)
    assert len(devices) == 1  # the numba path gathers and clears in one kernel pass


def test_out_on_another_device_is_rejected():
    codec = build("onebit", 16)
    with pytest.raises(ValueError, match="out must be on the CPU or on the input's device"):
        codec.compress(randn(16), out=torch.empty(codec.payload_bytes, dtype=torch.uint8,
                                                  device="meta"))


# -- CUDA ------------------------------------------------------------------------------------
def _syncs(fn):  # type: ignore[no-untyped-def]
    """Run ``fn`` under sync debug mode "warn"; return (result, synchronising calls). Each
    ``memcpy_and_sync``/``stream_synchronize`` in ATen warns once per call
    (c10/cuda/CUDAFunctions.h); "always" keeps repeated warnings from one place."""
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in rec)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_round_trips_match_the_cpu_backend(spec, dtype):
    x = randn(N, 7).to(dtype)
    cpu = build(spec, N, seed=4)
    gpu = build(spec, N, seed=4)
    host = torch.empty(gpu.payload_bytes, dtype=torch.uint8).pin_memory()
    gpu.compress(x.cuda(), key=1, step=2, out=host)
    ref = cpu.compress(x, key=1, step=2)
    if spec.startswith("topk") and not torch.equal(host, ref):
        # torch.topk may break ties among equal magnitudes differently (documented in
        # sparse.py): the same number of elements, the same magnitudes, each sent exactly
        got, want = cpu.decompress(host), cpu.decompress(ref)
        assert host.numel() == ref.numel()
        assert torch.equal(got.abs().sort().values, want.abs().sort().values)
        exact = x.float().half().float() if "values=fp16" in spec else x.float()
        sent = got != 0
        assert torch.equal(got[sent], exact[sent])
        ref = host  # the device's own selection from here on
    assert torch.equal(host, ref)
    assert torch.equal(gpu.compress(x.cuda(), key=1, step=2).cpu(), ref)  # device mode
    out = gpu.decompress(host, out=torch.empty(N, device="cuda"))
    assert torch.equal(out.cpu(), cpu.decompress(ref))


@needs_cuda
@pytest.mark.parametrize("ef", [None, "vanilla"])
@pytest.mark.parametrize("spec", SPECS)
def test_cuda_sync_counts_per_call(spec, ef):
    codec = build(spec, N, seed=4, ef=ef)
    x = randn(N, 8).cuda()
    host = torch.empty(codec.payload_bytes, dtype=torch.uint8).pin_memory()
    out = torch.empty(N, device="cuda")
    codec.compress(x, out=host)
    codec.decompress(host, out=out)  # warm-up: caches, level tables
    _, n = _syncs(lambda: codec.compress(x, step=1, out=host))
    assert n <= 1, f"compress into a host payload: {n} synchronisations"
    _, n = _syncs(lambda: codec.decompress(host, out=out))
    assert n == 0, f"decompress from a host payload: {n} synchronisations"
    _, n = _syncs(lambda: codec.decompress_add(host, out, alpha=0.5))
    assert n == 0, f"decompress_add from a host payload: {n} synchronisations"
    _, n = _syncs(lambda: codec.compress(x, step=2))
    assert n == 0, f"compress into a device payload: {n} synchronisations"
    torch.cuda.synchronize()


@needs_cuda
@pytest.mark.parametrize("spec", ["onebit", "topk:k=0.05", "dithering:normalize=l2", "fp16"])
def test_cuda_rejection_host_and_device_mode(spec):
    codec = build(spec, N, seed=4, ef="vanilla")
    codec.compress(randn(N).cuda(), step=0)
    residual = codec.residual.clone()
    bad = randn(N, 1)
    bad[3] = float("nan")
    host = torch.empty(codec.payload_bytes, dtype=torch.uint8).pin_memory()
    with pytest.raises(ValueError, match="input has non-finite values"):
        codec.compress(bad.cuda(), step=1, out=host)
    assert torch.equal(codec.residual, residual)
    codec.compress(bad.cuda(), step=1)  # device payload: no raise, the flag says it
    assert not bool(codec.last_finite)
    assert torch.equal(codec.residual, residual)


@needs_cuda
def test_cuda_decode_reply_from_host_payload_without_sync():
    codec = build("onebit", N)
    host = codec.compress(randn(N), key=4, step=1).pin_memory()
    out = torch.empty(N, device="cuda")
    decode_reply(codec, host, out, key=4, step=1, sender="server 0", label="t")  # warm-up
    _, n = _syncs(lambda: decode_reply(codec, host, out, key=4, step=1, sender="server 0",
                                       label="t"))
    assert n == 0
    assert torch.equal(out.cpu(), codec.decompress(host))

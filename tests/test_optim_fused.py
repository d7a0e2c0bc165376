"""The fused numba LANS/LAMB kernels (gradpress.optim.kernels) against the foreach path.

The fused path repeats the foreach path's float32 arithmetic element by element; only the norms
(and hence the trust ratios) are summed in another order, and torch's CPU ``sqrt`` is not
correctly rounded, so the parameters agree to float32 rounding, not bit for bit. The moments do
not depend on the norms: without gradient normalisation they must agree bit for bit wherever
torch's ``lerp_``/``addcmul_`` are fused multiply-adds (checked by a probe).
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

from gradpress.optim import LAMB, LANS, kernels
from helpers import SHAPES, assert_close_list, make_grads, make_params, ref_layerwise, run

#: odd sizes, an empty and a 1-element tensor, one matrix with a partial last lane block
SIZES = [(0,), (1,), (7,), (64,), (65,), (1000,), (4097,), (3, 5, 7), (129, 33)]
STEPS = 20
RTOL, ATOL = 1e-5, 1e-6


def make_case(seed: int = 0, zero_last: bool = True) -> tuple[list[torch.Tensor], list[list]]:
    """float32 parameters (the last one all zero: trust ratio 1) and STEPS gradient lists."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen) for s in SIZES]
    if zero_last:
        params[-1].zero_()
    grads = [[torch.randn(s, generator=gen) * 0.1 for s in SIZES] for _ in range(STEPS)]
    grads[3][2] = torch.zeros(SIZES[2])          # a zero gradient (norm 0)
    return [p.requires_grad_() for p in params], grads


def clone(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in params]


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the tensors stepped by the fused kernel."""
    calls: list[int] = []
    real = kernels.layerwise_step

    def spy(*args):  # type: ignore[no-untyped-def]
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(kernels, "layerwise_step", spy)
    return calls


CONFIGS = [
    (LANS, {}),
    (LANS, {"weight_decay": 0.0}),
    (LANS, {"normalize_grad": False}),                          # CLAN
    (LANS, {"normalize_grad": False, "weight_decay": 0.0}),
    (LANS, {"betas": (0.3, 0.99), "max_trust": 0.5}),           # lerp weight >= 0.5
    (LANS, {"min_trust": 2.0, "max_trust": 3.0, "eps": 1e-4}),
    (LAMB, {}),
    (LAMB, {"weight_decay": 0.0, "bias_correction": False}),
    (LAMB, {"min_trust": 0.5, "max_trust": 0.6}),
]


@pytest.mark.parametrize("cls,kw", CONFIGS,
                         ids=[f"{c.__name__}-{'-'.join(map(str, k.values())) or 'default'}"
                              for c, k in CONFIGS])
def test_fused_matches_foreach(cls, kw, kernel_calls):
    a, seq = make_case()
    b = clone(a)
    opt_a = cls(a, lr=0.01, fused=True, **kw)
    opt_b = cls(b, lr=0.01, fused=False, **kw)
    run(opt_a, a, seq)
    assert len(kernel_calls) == STEPS * len(SIZES)
    run(opt_b, b, seq)
    assert len(kernel_calls) == STEPS * len(SIZES)            # foreach never calls the kernel
    assert_close_list(a, [x.detach().double() for x in b], rtol=RTOL, atol=ATOL)
    for x, y in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_a.state[x][key], opt_b.state[y][key],
                                       rtol=RTOL, atol=ATOL)
        assert opt_a.state[x]["step"] == opt_b.state[y]["step"] == STEPS


def _torch_moments_are_fma() -> bool:
    """Whether torch's CPU lerp_ and addcmul_ round once (fused multiply-add) on this machine."""
    gen = torch.Generator().manual_seed(5)
    m, g, v = (torch.randn(1003, generator=gen) for _ in range(3))
    w = np.float32(0.1)
    lerp = m.clone().lerp_(g, 0.1).numpy()
    addc = v.clone().addcmul_(g, g, value=0.1).numpy()
    f64 = np.float64
    mn, gn, vn = m.numpy(), g.numpy(), v.numpy()
    want_lerp = (mn + f64(w) * (gn - mn)).astype(np.float32)     # exact product, one rounding
    want_addc = (vn + f64(w * gn) * gn).astype(np.float32)
    return np.array_equal(lerp, want_lerp) and np.array_equal(addc, want_addc)


@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_moments_bit_identical_without_normalisation(cls):
    """Bit-identical where torch's CPU lerp_/addcmul_ round once, as the fused kernel does
    (fused multiply-adds); elsewhere they differ by their extra rounding only."""
    a, seq = make_case()
    b = clone(a)
    kw = {"normalize_grad": False} if cls is LANS else {}
    opt_a, opt_b = cls(a, fused=True, **kw), cls(b, fused=False, **kw)
    run(opt_a, a, seq)
    run(opt_b, b, seq)
    fma = _torch_moments_are_fma()
    for x, y in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq"):
            if fma:
                assert torch.equal(opt_a.state[x][key], opt_b.state[y][key]), key
            else:
                torch.testing.assert_close(opt_a.state[x][key], opt_b.state[y][key],
                                           rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("kind,normalize", [("lans", True), ("lans", False), ("lamb", False)])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_both_paths_match_float64_reference(fused, kind, normalize, wd):
    """The reference and fixtures of tests/test_optim.py (missing and zero gradients, a zero
    tensor, per-tensor step counts), in float32."""
    params, seq = make_params(torch.float32), make_grads()
    if kind == "lans":
        opt = LANS(params, lr=0.02, betas=(0.8, 0.95), weight_decay=wd, normalize_grad=normalize,
                   fused=fused)
    else:
        opt = LAMB(params, lr=0.02, betas=(0.8, 0.95), weight_decay=wd, fused=fused)
    run(opt, params, seq)
    want = ref_layerwise(make_params(), seq, 0.02, (0.8, 0.95), 1e-6, [wd] * len(SHAPES), kind,
                         normalize=normalize)
    assert_close_list(params, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("cls", [LANS, LAMB])
@pytest.mark.parametrize("first,second", [(True, False), (False, True)])
def test_state_dict_round_trips_between_paths(cls, first, second):
    a, seq = make_case()
    opt_a = cls(a, lr=0.01, fused=first)
    run(opt_a, a, seq[:5])
    saved = copy.deepcopy(opt_a.state_dict())
    assert all("fused" not in g for g in saved["param_groups"])   # format unchanged
    b = clone(a)
    opt_b = cls(b, lr=0.01, fused=second)
    opt_b.load_state_dict(saved)
    assert opt_b.fused is second
    run(opt_a, a, seq[5:])
    run(opt_b, b, seq[5:])
    assert_close_list(b, [x.detach().double() for x in a], rtol=RTOL, atol=ATOL)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, st in sa["state"].items():
        assert set(st) == set(sb["state"][i]) == {"step", "exp_avg", "exp_avg_sq"}
        assert st["step"] == sb["state"][i]["step"] == STEPS
        assert st["exp_avg"].dtype == sb["state"][i]["exp_avg"].dtype == torch.float32


def test_auto_uses_kernel_per_bucket_and_falls_back(kernel_calls):
    """fused=None: the float32 bucket takes the kernel; a float64 tensor and a bucket holding a
    non-contiguous tensor take the foreach path, exactly as fused=False would."""
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(5, 4, generator=gen), torch.randn(6, generator=gen, dtype=torch.float64)]
    grads = [[torch.randn(5, 4, generator=gen), torch.randn(6, generator=gen,
                                                             dtype=torch.float64)]
             for _ in range(3)]
    auto, off = clone(base), clone(base)
    opt_auto, opt_off = LANS(auto, lr=0.01), LANS(off, lr=0.01, fused=False)
    run(opt_auto, auto, grads)
    assert kernel_calls == [20, 20, 20]
    run(opt_off, off, grads)
    assert torch.equal(auto[1], off[1])               # float64: the very same foreach path
    t = torch.randn(4, 5, generator=gen).t().contiguous().t().requires_grad_()   # not contiguous
    opt = LANS([t], lr=0.01)
    run(opt, [t], [[torch.ones(4, 5)]])
    assert kernel_calls == [20, 20, 20]
    for cls in (LANS, LAMB):              # a non-CPU device (meta stands in for CUDA here)
        p = torch.zeros(5, device="meta", requires_grad=True)
        p.grad = torch.ones(5, device="meta")
        cls([p]).step()
    assert kernel_calls == [20, 20, 20]


def test_fused_true_rejects_unsupported_tensors():
    with pytest.raises(ValueError, match=r"fused=True.*parameter 1 is of dtype torch.float64"):
        LANS([torch.zeros(3, requires_grad=True),
              torch.zeros(3, dtype=torch.float64, requires_grad=True)], fused=True)
    with pytest.raises(ValueError, match=r"LAMB\(fused=True\).*parameter 0 is on device meta"):
        LAMB([torch.zeros(3, device="meta", requires_grad=True)], fused=True)
    opt = LANS([torch.zeros(3, requires_grad=True)], fused=True)
    with pytest.raises(ValueError, match="parameter 1 is not contiguous"):
        opt.add_param_group({"params": [torch.zeros(4, 4).t().requires_grad_()]})
    assert len(opt.param_groups) == 1
    p = torch.zeros(4, 4, requires_grad=True)
    p.grad = torch.ones(4, 4).t()
    with pytest.raises(ValueError, match="the gradient of parameter 0 is not contiguous"):
        LANS([p], fused=True).step()
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match="fused"):
            LANS([torch.zeros(3, requires_grad=True)], fused=bad)


def test_fused_flag_survives_copy_and_pickle():
    for flag in (None, True, False):
        opt = LAMB([torch.zeros(3, requires_grad=True)], fused=flag)
        assert copy.deepcopy(opt).fused is flag
        assert pickle.loads(pickle.dumps(opt)).fused is flag


def test_kernel_returns_clamped_trust_ratios():
    """Direct kernel call: ||x|| = 20, one step with g = 1 gives r = c = 1/(1+eps) (norm ~2),
    so both raw ratios are ~10, clamped to max_trust; a zero x gives ratio 1."""
    for x0, want in ((10.0, 2.0), (0.0, 1.0)):
        x, g = np.full(4, x0, np.float32), np.ones(4, np.float32)
        m, v = np.zeros(4, np.float32), np.zeros(4, np.float32)
        s = (1 - 0.999) ** 0.5
        h = kernels.coeffs(0.9, 0.999, 1e-6, 0.0, 0.1, s, s / 0.1, None, 2.0, blend=True)
        q_r, q_c = kernels.layerwise_step(x, g, m, v, h, False, True)
        assert (float(q_r), float(q_c)) == (want, want)
        np.testing.assert_allclose(x, x0 - 0.1 * want / (1 + 1e-6), rtol=1e-6)

"""Tests of gradpress.optim: LANS/CLAN, LAMB and OneBitAdam against independent references."""

from __future__ import annotations

import copy
import importlib.util
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from gradpress.optim import (
    CLAN_REFERENCE_LR,
    LAMB,
    LANS,
    OneBitAdam,
    OneBitLANSCore,
    _common,
    clan_core,
)
from helpers import SHAPES, assert_close_list, make_grads, make_params, ref_layerwise, run

# The convergence study's variants (benchmarks/study_optim.py): the switches it concluded
# against, kept out of the shipped optimizers but still tested, so its log stays reproducible.
_SPEC = importlib.util.spec_from_file_location(
    "study_optim", Path(__file__).resolve().parents[1] / "benchmarks" / "study_optim.py")
study_optim = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(study_optim)
StudyLANS, StudyOneBitLANS = study_optim.StudyLANS, study_optim.StudyOneBitLANS


# -- a communicate that halves: the average with a second worker whose tensor is 0 ------------
def halving_recorder() -> tuple[list[tuple[str, torch.Tensor]], Any]:
    """A ``communicate`` that records (key, tensor) and returns half the tensor: the "average"
    with a second worker whose tensor is 0."""
    calls: list[tuple[str, torch.Tensor]] = []

    def communicate(key: str, t: torch.Tensor) -> torch.Tensor:
        calls.append((key, t.clone()))
        return 0.5 * t

    return calls, communicate


# -- LANS / LAMB --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("freeze_step", [1, 3])
def test_lans_freeze_variance_after_matches_reference(dtype, tol, freeze_step):
    """v stops after that step (per tensor's own step count; some tensors skip steps)."""
    params, seq = make_params(dtype), make_grads()
    opt = StudyLANS(params, lr=0.02, betas=(0.8, 0.95), weight_decay=0.05,
                    normalize_grad=False, freeze_variance_after=freeze_step)
    run(opt, params, seq)
    want = ref_layerwise(params=make_params(), seq=seq, lr=0.02, betas=(0.8, 0.95), eps=1e-6,
                         wds=[0.05] * len(SHAPES), kind="lans", freeze_step=freeze_step)
    assert_close_list(params, want, rtol=tol, atol=tol)
    free = make_params(dtype)
    run(LANS(free, lr=0.02, betas=(0.8, 0.95), weight_decay=0.05, normalize_grad=False),
        free, seq)
    assert any(not torch.allclose(a, b) for a, b in zip(params, free))   # freezing mattered


def test_lans_freeze_variance_after_keeps_v_and_its_state_loads_into_lans():
    p = torch.nn.Parameter(torch.ones(5))
    opt = StudyLANS([p], lr=0.01, freeze_variance_after=2)
    for step in range(4):
        p.grad = torch.full((5,), float(step + 1))
        opt.step()
        if step == 1:
            v2 = opt.state[p]["exp_avg_sq"].clone()
    torch.testing.assert_close(opt.state[p]["exp_avg_sq"], v2, rtol=0, atol=0)
    saved = opt.state_dict()
    fresh = LANS([p], lr=0.01)
    fresh.load_state_dict(saved)
    p.grad = torch.ones(5)
    fresh.step()                                          # LANS proper again: v moves
    assert not torch.equal(fresh.state[p]["exp_avg_sq"], v2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_lans_rejects_bad_freeze_variance_after(bad):
    with pytest.raises(ValueError, match="freeze_variance_after must be None or an int >= 1"):
        StudyLANS([torch.nn.Parameter(torch.ones(2))], freeze_variance_after=bad)


@pytest.mark.parametrize("factory", [LANS, clan_core, OneBitAdam, OneBitLANSCore])
def test_old_freeze_step_name_is_rejected(factory):
    # one name for the dense phase (dense_steps)
    with pytest.raises(TypeError, match="freeze_step"):
        factory(make_params(), freeze_step=2)

@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_lans_matches_reference(dtype, tol, normalize, wd):
    params, seq = make_params(dtype), make_grads()
    opt = LANS(params, lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=wd,
               normalize_grad=normalize)
    run(opt, params, seq)
    want = ref_layerwise(params=make_params(), seq=seq, lr=0.02, betas=(0.8, 0.95), eps=1e-6,
                         wds=[wd] * len(SHAPES), kind="lans", normalize=normalize)
    assert_close_list(params, want, rtol=tol, atol=tol)
    assert [opt.state[p]["step"] for p in params] == [6, 5, 6, 6]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_lamb_matches_reference(dtype, tol, wd):
    params, seq = make_params(dtype), make_grads()
    opt = LAMB(params, lr=0.02, betas=(0.85, 0.99), eps=1e-6, weight_decay=wd)
    run(opt, params, seq)
    want = ref_layerwise(make_params(), seq, 0.02, (0.85, 0.99), 1e-6, [wd] * len(SHAPES), "lamb")
    assert_close_list(params, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_small_buckets_and_mixed_dtypes_match_reference(cls, monkeypatch):
    monkeypatch.setattr(_common, "MAX_BUCKET_NUMEL", 10)     # several buckets per dtype
    params, seq = make_params(), make_grads()
    params[1] = params[1].detach().float().requires_grad_()   # a float32 tensor among float64
    opt = cls(params, lr=0.02, weight_decay=0.01)
    run(opt, params, seq)
    want = ref_layerwise(make_params(), seq, 0.02, (0.9, 0.999), 1e-6, [0.01] * 4,
                         cls.__name__.lower(), normalize=(cls is LANS))
    assert_close_list(params, want, rtol=2e-5, atol=2e-5)
    assert_close_list(params[:1] + params[2:], want[:1] + want[2:], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [LANS, LAMB])
def test_weight_decay_exclusion_by_param_group(cls):
    params, seq = make_params(), make_grads()
    groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]
    opt = cls(groups, lr=0.01, weight_decay=0.1)
    run(opt, params, seq)
    kind = cls.__name__.lower()
    want = ref_layerwise(make_params(), seq, 0.01, (0.9, 0.999), 1e-6, [0.1, 0.1, 0.0, 0.0], kind,
                         normalize=(cls is LANS))
    assert_close_list(params, want, rtol=1e-12, atol=1e-12)


def test_clan_is_lans_without_normalisation():
    params, seq = make_params(), make_grads()
    opt = clan_core(params, lr=0.01, weight_decay=0.01)
    assert isinstance(opt, LANS) and opt.defaults["normalize_grad"] is False
    run(opt, params, seq)
    want = ref_layerwise(make_params(), seq, 0.01, (0.9, 0.999), 1e-6, [0.01] * 4, "lans")
    assert_close_list(params, want, rtol=1e-12, atol=1e-12)
    assert CLAN_REFERENCE_LR == {"lans": 0.00125, "onebit": 0.0014865, "topk": 0.001051}


def test_lans_normalisation_makes_step_scale_invariant():
    a, b = make_params(), make_params()
    seq = make_grads()
    run(LANS(a, lr=0.01), a, seq)
    run(LANS(b, lr=0.01), b, [[None if g is None else 1000.0 * g for g in gs] for gs in seq])
    assert_close_list(a, [x.detach() for x in b], rtol=1e-9, atol=1e-12)


def test_trust_ratio_clamp():
    x = torch.full((4,), 10.0, dtype=torch.float64, requires_grad=True)
    opt = LAMB([x], lr=0.1, weight_decay=0.0, max_trust=2.0)
    x.grad = torch.ones(4, dtype=torch.float64)
    opt.step()
    # u = 1/(1+eps) per element, ||u|| ~ 2, ||x|| = 20: ratio 10 clamped to 2 -> step 0.2*u.
    torch.testing.assert_close(x.detach(), torch.full((4,), 10.0 - 0.2 / (1 + 1e-6),
                                                      dtype=torch.float64))


def test_p_grad_untouched_and_closure_returns_loss():
    params = make_params()
    grads = [torch.randn(s, dtype=torch.float64) for s in SHAPES]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    loss = LANS(params).step(closure=lambda: torch.tensor(3.0))
    assert float(loss) == 3.0
    for p, g in zip(params, grads):
        assert torch.equal(p.grad, g)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_layers_step_finitely(dtype):
    p = torch.nn.Parameter(torch.full((1000,), 3000.0, dtype=dtype))
    p.grad = torch.full((1000,), 3000.0, dtype=dtype)     # norms ~95k overflow float16
    for cls in (LANS, LAMB):
        cls([p], lr=0.01).step()
    assert torch.isfinite(p.detach()).all() and float(p.detach()[0]) < 3000.0


def test_sparse_gradient_rejected():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.zeros(4).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        LANS([p]).step()


# -- OneBitAdam ----------------------------------------------------------------------------------

def _pair(wd: float, freeze: int):
    """Two copies of the same parameters; OneBitAdam on one, torch Adam/AdamW on the other."""
    a, b = make_params(torch.float32), make_params(torch.float32)
    ours = OneBitAdam(a, lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=wd, dense_steps=freeze)
    ref_cls = torch.optim.AdamW if wd else torch.optim.Adam
    ref = ref_cls(b, lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=wd, foreach=False)
    return a, b, ours, ref


@pytest.mark.parametrize("wd", [0.0, 0.02])
def test_onebit_adam_warmup_equals_torch_adam(wd):
    a, b, ours, ref = _pair(wd, freeze=6)
    seq = make_grads()
    run(ours, a, seq[:5])
    run(ref, b, seq[:5])
    assert not ours.compression_active          # step 6 is still warm-up
    run(ours, a, seq[5:])
    run(ref, b, seq[5:])
    assert_close_list(a, [x.detach().double() for x in b], rtol=1e-6, atol=1e-7)
    assert ours.compression_active              # step 7 would communicate momentum


def test_onebit_adam_compression_stage():
    params = make_params()
    calls, communicate = halving_recorder()

    opt = OneBitAdam(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.01, dense_steps=2,
                     communicate=communicate)
    seq = make_grads(steps=4)
    run(opt, params, seq[:2])
    assert opt.compression_active and not calls
    v_frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    m_prev = [opt.state[p]["exp_avg"].clone() for p in params]
    x_prev = [p.detach().clone() for p in params]
    for p, g in zip(params, seq[2]):
        p.grad = None if g is None else g.clone()
    opt.step()
    # communicate got the local momentum of every tensor with a gradient, keyed by position.
    assert [k for k, _ in calls] == ["0", "2", "3"]
    for (_key, m_sent), i in zip(calls, [0, 2, 3]):
        torch.testing.assert_close(m_sent, 0.9 * m_prev[i] + 0.1 * seq[2][i])
    for i in (0, 2, 3):
        p, st = params[i], opt.state[params[i]]
        assert torch.equal(st["exp_avg_sq"], v_frozen[i])                 # variance frozen
        torch.testing.assert_close(st["exp_avg"], 0.5 * (0.9 * m_prev[i] + 0.1 * seq[2][i]))
        mh = st["exp_avg"] / (1 - 0.9 ** 3)
        vh = v_frozen[i] / (1 - 0.99 ** 2)                                # frozen correction
        want = x_prev[i] - 0.01 * (mh / (vh.sqrt() + 1e-8) + 0.01 * x_prev[i])
        torch.testing.assert_close(p.detach(), want, rtol=1e-12, atol=1e-12)
    assert torch.equal(params[1].detach(), x_prev[1])                     # no gradient: no step


def test_onebit_adam_handles_and_deepspeed_mode():
    params = make_params()

    class Handle:
        def __init__(self, t):
            self.t = t

        def wait(self):
            return self.t.clone()

    opt = OneBitAdam(params, lr=0.01, dense_steps=1, bias_correction=False,
                     communicate=lambda key, m: Handle(m))
    seq = make_grads(steps=3)
    run(opt, params, seq)
    # bias_correction=False, identity communication: DeepSpeed's update, v frozen after step 1.
    xs = [p.detach().double().clone() for p in make_params()]
    for i in range(len(xs)):
        m = torch.zeros_like(xs[i])
        v = None
        for grads in seq:
            g = grads[i]
            if g is None:
                continue
            m = 0.9 * m + 0.1 * g
            v = 0.001 * g * g if v is None else v
            xs[i] = xs[i] - 0.01 * (m / (v.sqrt() + 1e-8))
    assert_close_list(params, xs, rtol=1e-12, atol=1e-12)


def test_onebit_adam_communicate_checks():
    with pytest.raises(TypeError, match="communicate"):
        OneBitAdam(make_params(), communicate=3)
    params = make_params()
    opt = OneBitAdam(params, dense_steps=1, communicate=lambda key, m: m[:1])
    run(opt, params, make_grads(steps=1))
    with pytest.raises(TypeError, match="shape"):
        run(opt, params, make_grads(steps=1))


# -- OneBitLANSCore --------------------------------------------------------------------------------

@pytest.mark.parametrize("normalize", [True, False])
def test_onebit_lans_warmup_equals_lans(normalize):
    a, b = make_params(torch.float32), make_params(torch.float32)
    ours = OneBitLANSCore(a, lr=0.01, weight_decay=0.01, normalize_grad=normalize, dense_steps=4)
    ref = LANS(b, lr=0.01, weight_decay=0.01, normalize_grad=normalize)
    seq = make_grads(steps=4)
    run(ours, a, seq)
    run(ref, b, seq)
    for x, y in zip(a, b):
        assert torch.equal(x, y)                # the warm-up is LANS itself, same kernels
    assert ours.compression_active


@pytest.mark.parametrize("precondition", [True, False])
@pytest.mark.parametrize("blend", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_onebit_lans_compression_stage(normalize, blend, precondition):
    params = make_params()
    calls, communicate = halving_recorder()

    opt = StudyOneBitLANS(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.01, dense_steps=2,
                     normalize_grad=normalize, communicate=communicate, blend=blend,
                     precondition=precondition, variance="frozen")
    seq = make_grads(steps=3)
    run(opt, params, seq[:2])
    assert opt.compression_active and not calls
    v_frozen = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    m_prev = [opt.state[p]["exp_avg"].clone() for p in params]
    x_prev = [p.detach().clone() for p in params]
    run(opt, params, seq[2:])
    assert [k for k, _ in calls] == ["0", "2", "3"]
    for (_key, m_sent), i in zip(calls, [0, 2, 3]):
        g = seq[2][i] / seq[2][i].norm() if normalize else seq[2][i]
        # What travels: the local momentum, divided by the frozen d = sqrt(v) + eps*sqrt(1-b2^2).
        d = v_frozen[i].sqrt() + 1e-6 * (1 - 0.99 ** 2) ** 0.5 if precondition else 1.0
        torch.testing.assert_close(m_sent, (0.9 * m_prev[i] + 0.1 * g) / d)
        p, st = params[i], opt.state[params[i]]
        assert torch.equal(st["exp_avg_sq"], v_frozen[i])                 # variance frozen
        mh = st["exp_avg"] / (1 - 0.9 ** 3)
        vh = v_frozen[i] / (1 - 0.99 ** 2)                                # frozen correction
        r = mh / (vh.sqrt() + 1e-6) + 0.01 * x_prev[i]
        if blend:       # LANS's step 7 with the gradient recovered from the momenta
            gh = (st["exp_avg"] - 0.9 * m_prev[i]) / 0.1
            c = gh / (vh.sqrt() + 1e-6) + 0.01 * x_prev[i]
            xn = x_prev[i].norm()
            want = x_prev[i] - 0.01 * 0.9 * (xn / r.norm()) * r - 0.01 * 0.1 * (xn / c.norm()) * c
        else:           # LAMB-style step
            want = x_prev[i] - 0.01 * (x_prev[i].norm() / r.norm()) * r
        torch.testing.assert_close(p.detach(), want, rtol=1e-12, atol=1e-12)
    assert torch.equal(params[1].detach(), x_prev[1])                     # no gradient: no step


def test_onebit_lans_defaults_are_gp_onebit_lans_algorithm():
    # each worker's own v, LAMB's step after the dense phase: what gp.OneBitLANS builds
    opt = OneBitLANSCore(make_params())
    assert (opt.blend, opt.hold_idle_rows, opt.watch) == (False, False, None)
    assert opt.param_groups[0]["dense_steps"] == 100
    for switch in ("variance", "precondition", "sends", "ef21", "refresh_every"):
        with pytest.raises(TypeError, match=switch):   # the study's, in benchmarks/ only
            OneBitLANSCore(make_params(), **{switch: None})
    with pytest.raises(TypeError, match="freeze_variance_after"):
        LANS(make_params(), freeze_variance_after=2)

def test_onebit_lans_checks():
    with pytest.raises(ValueError, match="dense_steps"):
        OneBitLANSCore(make_params(), dense_steps=0)
    with pytest.raises(ValueError, match="dense_steps"):
        OneBitLANSCore(make_params(), dense_steps=None)
    with pytest.raises(TypeError, match="communicate"):
        OneBitLANSCore(make_params(), communicate="no")
    with pytest.raises(TypeError, match="blend"):
        OneBitLANSCore(make_params(), blend=1)
    with pytest.raises(TypeError, match="ef21 must be a bool, got 'yes'"):
        StudyOneBitLANS(make_params(), ef21="yes")
    with pytest.raises(ValueError, match="sends must be one of momentum, gradient, got 'm'"):
        StudyOneBitLANS(make_params(), sends="m")
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=f"refresh_every must be None or an int >= 1, got "
                                             f"{bad!r}"):
            StudyOneBitLANS(make_params(), refresh_every=bad)
    params = make_params()
    opt = OneBitLANSCore(params, dense_steps=1, communicate=lambda key, m: m[:1])
    run(opt, params, make_grads(steps=1))
    with pytest.raises(TypeError, match="shape"):
        run(opt, params, make_grads(steps=1))


def test_onebit_lans_sends_gradient():
    params = make_params()
    calls, communicate = halving_recorder()

    opt = StudyOneBitLANS(params, lr=0.01, betas=(0.9, 0.99), dense_steps=2, sends="gradient",
                     normalize_grad=False, communicate=communicate, variance="frozen",
                     blend=True)
    seq = make_grads(steps=3)
    run(opt, params, seq[:2])
    v = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    m_prev = [opt.state[p]["exp_avg"].clone() for p in params]
    run(opt, params, seq[2:])
    for (_key, t), i in zip(calls, [0, 2, 3]):
        d = v[i].sqrt() + 1e-6 * (1 - 0.99 ** 2) ** 0.5
        torch.testing.assert_close(t, seq[2][i] / d)                  # the gradient travels
        torch.testing.assert_close(opt.state[params[i]]["exp_avg"],
                                   0.9 * m_prev[i] + 0.1 * 0.5 * seq[2][i])


@pytest.mark.parametrize("ef21", [False, True])
@pytest.mark.parametrize("sends", ["momentum", "gradient"])
def test_onebit_lans_blend_lossless_equals_frozen_lans(sends, ef21):
    # With exact communication the recovered gradient is the gradient: the blend step equals
    # LANS with v frozen at the same step (EF21's estimate is then the average itself).
    a, b = make_params(), make_params()
    ours = StudyOneBitLANS(a, lr=0.01, weight_decay=0.01, dense_steps=2, sends=sends, ef21=ef21,
                      variance="frozen", blend=True)
    ref = StudyLANS(b, lr=0.01, weight_decay=0.01, freeze_variance_after=2, fused=False)
    seq = make_grads(steps=5)
    run(ours, a, seq)
    run(ref, b, seq)
    assert_close_list(a, [x.detach() for x in b], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("blend", [True, False])
def test_onebit_lans_refresh_every_step_is_lans(blend):
    # A refresh at every step after the warm-up updates v with weight 1-b2 each step: LANS.
    a, b = make_params(), make_params()
    calls, communicate = halving_recorder()
    ours = StudyOneBitLANS(a, lr=0.01, weight_decay=0.01, dense_steps=2, refresh_every=1,
                      communicate=communicate, blend=blend, variance="frozen")
    ref = LANS(b, lr=0.01, weight_decay=0.01, fused=False)
    seq = make_grads(steps=5)
    run(ours, a, seq)
    run(ref, b, seq)
    assert not calls and not ours.compression_active   # every step dense
    if blend:
        assert_close_list(a, [x.detach() for x in b], rtol=1e-10, atol=1e-12)
    for p, q in zip(a, b):
        torch.testing.assert_close(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


def _trust(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor | float:
    return x.norm() / u.norm() if x.norm() > 0 and u.norm() > 0 else 1.0


def _local_variance_reference(params, seq, fs, blend, lr=0.01, wd=0.01, b1=0.9, b2=0.999,
                              eps=1e-6):
    """Float64 1-bit LANS with a local v and an identity link (step 5): LANS for the first
    ``fs`` steps, then ``a = m/d`` with ``v`` still updated, the blend from two ``a``."""
    ref = LANS(params, lr=lr, weight_decay=wd, fused=False)
    run(ref, params, seq[:fs])
    a_prev = {}
    for t, grads in enumerate(seq[fs:], start=fs + 1):
        for i, (x, gr) in enumerate(zip(params, grads)):
            st, x = ref.state[x], x.detach()
            g = gr / gr.norm() if gr.norm() > 0 else gr
            if i not in a_prev:   # the warm-up's m/d, bias-corrected at fs
                s_fs = math.sqrt(1 - b2 ** fs)
                a_prev[i] = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + eps * s_fs)
            st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
            st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
            s = math.sqrt(1 - b2 ** t)
            a = st["exp_avg"] / (st["exp_avg_sq"].sqrt() + eps * s)
            r = a * s / (1 - b1 ** t) + wd * x
            if blend:
                c = (a - b1 * a_prev[i]) * s / (1 - b1) + wd * x
                x -= lr * b1 * _trust(x, r) * r + lr * (1 - b1) * _trust(x, c) * c
            else:
                x -= lr * _trust(x, r) * r
            a_prev[i] = a


@pytest.mark.parametrize("blend", [True, False])
def test_onebit_lans_local_variance_lossless_matches_reference(blend):
    a, b = make_params(), make_params()
    ours = OneBitLANSCore(a, lr=0.01, weight_decay=0.01, dense_steps=2,
                      blend=blend)
    seq = make_grads(steps=6)
    seq[2][1] = seq[3][1].clone()      # every tensor at the same step (as in a distributed run)
    run(ours, a, seq)
    _local_variance_reference(b, seq, 2, blend)
    assert ours.compression_active
    assert_close_list(a, [x.detach() for x in b], rtol=1e-10, atol=1e-12)


def test_onebit_lans_blend_per_tensor_matches_each_reference():
    # blend(i) chooses step 4 per tensor: those it picks follow the blended reference, the
    # others the momentum-only one, bit for bit in float64 up to rounding
    a, on, off = make_params(), make_params(), make_params()
    picked = {0, 2}
    ours = OneBitLANSCore(a, lr=0.01, weight_decay=0.01, dense_steps=2,
                      blend=lambda i: i in picked)
    seq = make_grads(steps=6)
    seq[2][1] = seq[3][1].clone()
    run(ours, a, seq)
    _local_variance_reference(on, seq, 2, True)
    _local_variance_reference(off, seq, 2, False)
    for i, x in enumerate(a):
        want = (on if i in picked else off)[i].detach()
        torch.testing.assert_close(x.detach(), want, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(on[0], off[0])            # the blend changes the step
    assert ("shared_momentum" in ours.state[a[1]]) is False


def test_onebit_lans_callable_blend_needs_local_variance():
    with pytest.raises(ValueError, match="callable.*variance='local'.*'frozen'"):
        StudyOneBitLANS(make_params(), variance="frozen", blend=lambda i: True)


def test_onebit_lans_local_variance_sends_m_over_local_d_and_keeps_momentum_in_its_units():
    params = make_params()
    calls, communicate = halving_recorder()
    opt = OneBitLANSCore(params, lr=0.01, weight_decay=0.01, dense_steps=1,
                     communicate=communicate, blend=True)
    seq = make_grads(steps=3)
    seq[2][1] = seq[1][1].clone()
    run(opt, params, seq)
    assert [k for k, _ in calls] == ["0", "1", "2", "3"] * 2
    for i, p in enumerate(params):
        st = opt.state[p]
        d = st["exp_avg_sq"].sqrt() + 1e-6 * math.sqrt(1 - 0.999 ** 3)
        sent = calls[4 + i][1]
        torch.testing.assert_close(st["shared_momentum"], 0.5 * sent)   # what came back
        torch.testing.assert_close(st["exp_avg"], 0.5 * sent * d)      # m = a*d, local units
    restored = OneBitLANSCore(make_params(), dense_steps=1, blend=True)
    restored.load_state_dict(opt.state_dict())
    assert "shared_momentum" in restored.state[restored.param_groups[0]["params"][0]]


@pytest.mark.parametrize("kwargs,needle", [
    ({"variance": "live"}, "variance must be one of frozen, local, got 'live'"),
    ({"variance": "local", "precondition": False}, "got precondition=False"),
    ({"variance": "local", "sends": "gradient"}, "got sends='gradient'"),
    ({"variance": "local", "ef21": True}, "got ef21=True"),
    ({"variance": "local", "refresh_every": 5}, "got refresh_every=5"),
])
def test_onebit_lans_rejects_bad_variance(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        StudyOneBitLANS(make_params(), **kwargs)


def test_onebit_lans_refresh_step_updates_v_for_the_skipped_steps():
    params = make_params()
    calls, communicate = halving_recorder()
    opt = StudyOneBitLANS(params, lr=0.01, betas=(0.9, 0.99), weight_decay=0.0, dense_steps=2,
                     refresh_every=2, communicate=communicate, blend=False, variance="frozen")
    seq = make_grads(steps=5)
    seq[2][1] = seq[3][1].clone()      # every tensor at the same step (as in a distributed run)
    run(opt, params, seq[:2])
    v2 = [opt.state[p]["exp_avg_sq"].clone() for p in params]
    run(opt, params, seq[2:3])                         # step 3: compressed
    assert [k for k, _ in calls] == ["0", "1", "2", "3"] and not opt.compression_active
    m3 = [opt.state[p]["exp_avg"].clone() for p in params]
    x3 = [p.detach().clone() for p in params]
    calls.clear()
    run(opt, params, seq[3:4])                         # step 4: dense refresh, nothing sent
    assert not calls and opt.compression_active
    for i in range(4):
        st, g = opt.state[params[i]], seq[3][i] / seq[3][i].norm()
        v4 = 0.99 ** 2 * v2[i] + (1 - 0.99 ** 2) * g * g   # g stands in for steps 3 and 4
        torch.testing.assert_close(st["exp_avg_sq"], v4)
        torch.testing.assert_close(st["exp_avg"], 0.9 * m3[i] + 0.1 * g)
        assert st["variance_step"] == 4
        r = (st["exp_avg"] / (1 - 0.9 ** 4)) / ((v4 / (1 - 0.99 ** 4)).sqrt() + 1e-6)
        want = x3[i] - 0.01 * (x3[i].norm() / r.norm()) * r
        torch.testing.assert_close(params[i].detach(), want, rtol=1e-12, atol=1e-12)
    m4 = {i: opt.state[params[i]]["exp_avg"].clone() for i in range(4)}
    run(opt, params, seq[4:])                          # step 5: compressed with the new v
    for key, sent in calls:
        i = int(key)
        st, g = opt.state[params[i]], seq[4][i] / seq[4][i].norm()
        d = st["exp_avg_sq"].sqrt() + 1e-6 * (1 - 0.99 ** 4) ** 0.5
        torch.testing.assert_close(sent, (0.9 * m4[i] + 0.1 * g) / d)


def test_onebit_lans_ef21_sends_differences_and_keeps_momenta_local():
    params = make_params()
    calls, communicate = halving_recorder()

    opt = StudyOneBitLANS(params, lr=0.01, betas=(0.9, 0.99), dense_steps=2, ef21=True, blend=False,
                     communicate=communicate, variance="frozen")
    seq = make_grads(steps=4)
    run(opt, params, seq[:2])
    m0 = {i: opt.state[params[i]]["exp_avg"].clone() for i in (0, 2, 3)}
    v = {i: opt.state[params[i]]["exp_avg_sq"].clone() for i in (0, 2, 3)}
    run(opt, params, seq[2:3])
    for key, sent in calls:
        i = int(key)
        st = opt.state[params[i]]
        d = v[i].sqrt() + 1e-6 * (1 - 0.99 ** 2) ** 0.5
        g = seq[2][i] / seq[2][i].norm()
        m1 = 0.9 * m0[i] + 0.1 * g
        # Step 2 (EF21): the estimate starts at the shared momentum / d; the difference travels.
        torch.testing.assert_close(sent, m1 / d - m0[i] / d)
        torch.testing.assert_close(st["ef21_estimate"], m0[i] / d + 0.5 * sent)
        torch.testing.assert_close(st["exp_avg"], m1)   # the local momentum is not replaced
    calls.clear()
    run(opt, params, seq[3:])
    for key, sent in calls:   # the second difference is to the updated estimate
        st = opt.state[params[int(key)]]
        d = st["exp_avg_sq"].sqrt() + 1e-6 * (1 - 0.99 ** 2) ** 0.5
        torch.testing.assert_close(st["ef21_estimate"] - 0.5 * sent + sent, st["exp_avg"] / d)


def test_onebit_lans_ef21_estimate_converges_under_a_contractive_codec():
    # EF21's point: whatever the codec drops stays in the next difference, so with a fixed
    # gradient the estimate converges to the momentum; a codec without residuals does not.
    def sign(key, t):
        return t.abs().mean() * torch.sign(t)

    errs = {}
    for ef21 in (False, True):
        params = make_params()
        opt = StudyOneBitLANS(params, lr=0.0, dense_steps=1, ef21=ef21, communicate=sign,
                         weight_decay=0.0, precondition=False, variance="frozen")
        fixed = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i),
                             dtype=p.dtype) for i, p in enumerate(params)]
        run(opt, params, [fixed] * 120)
        m = opt.state[params[0]]["exp_avg"]
        target = fixed[0] / fixed[0].norm()       # the momentum's limit (normalised gradient)
        got = opt.state[params[0]]["ef21_estimate"] if ef21 else m
        errs[ef21] = float((got - target).norm() / target.norm())
    assert errs[True] < 1e-3 < 0.1 < errs[False], errs


# -- state_dict and validation -------------------------------------------------------------------

@pytest.mark.parametrize("factory", [
    lambda ps: LANS(ps, lr=0.01, weight_decay=0.01),
    lambda ps: clan_core(ps, lr=0.01),
    lambda ps: LAMB(ps, lr=0.01),
    lambda ps: OneBitAdam(ps, lr=0.01, weight_decay=0.01, dense_steps=3),
    lambda ps: StudyOneBitLANS(ps, lr=0.01, weight_decay=0.01, dense_steps=2),
    lambda ps: StudyOneBitLANS(ps, lr=0.01, weight_decay=0.01, dense_steps=2, ef21=True,
                          communicate=lambda key, t: t.abs().mean() * torch.sign(t),
                          variance="frozen"),
    lambda ps: StudyOneBitLANS(ps, lr=0.01, weight_decay=0.01, dense_steps=1, refresh_every=2,
                          communicate=lambda key, t: t.abs().mean() * torch.sign(t),
                          variance="frozen"),
], ids=["lans", "clan", "lamb", "onebit_adam", "onebit_lans", "onebit_lans_ef21",
        "onebit_lans_refresh"])
def test_state_dict_round_trip_continues_identically(factory):
    seq = make_grads(steps=6)
    a = make_params(torch.float32)
    opt_a = factory(a)
    run(opt_a, a, seq[:3])
    saved = copy.deepcopy(opt_a.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_b = factory(b)
    opt_b.load_state_dict(saved)
    run(opt_a, a, seq[3:])
    run(opt_b, b, seq[3:])
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    if isinstance(opt_b, (OneBitAdam, OneBitLANSCore)):
        assert opt_b.compression_active


BAD = [
    ({"lr": -0.1}, "lr"),
    ({"lr": math.nan}, "lr"),
    ({"betas": (1.0, 0.999)}, r"betas\[0\]"),
    ({"betas": (0.9, -0.1)}, r"betas\[1\]"),
    ({"betas": (0.9,)}, "betas"),
    ({"eps": 0.0}, "eps"),
    ({"eps": -1e-8}, "eps"),
    ({"weight_decay": -0.01}, "weight_decay"),
]


@pytest.mark.parametrize("cls", [LANS, LAMB, OneBitAdam, OneBitLANSCore, clan_core])
@pytest.mark.parametrize("kwargs,name", BAD)
def test_invalid_hyperparameters_raise(cls, kwargs, name):
    with pytest.raises(ValueError, match=name):
        cls(make_params(), **kwargs)


@pytest.mark.parametrize("cls,kwargs,name", [
    (LANS, {"min_trust": -1.0}, "min_trust"),
    (LAMB, {"min_trust": 2.0, "max_trust": 1.0}, "min_trust"),
    (LANS, {"normalize_grad": "yes"}, "normalize_grad"),
    (OneBitAdam, {"dense_steps": 0}, "dense_steps"),
    (OneBitAdam, {"dense_steps": 2.5}, "dense_steps"),
])
def test_invalid_specific_hyperparameters_raise(cls, kwargs, name):
    with pytest.raises(ValueError, match=name):
        cls(make_params(), **kwargs)


def test_bad_param_group_is_rejected_and_not_added():
    params = make_params()
    opt = LANS(params[:2])
    with pytest.raises(ValueError, match="lr"):
        opt.add_param_group({"params": params[2:], "lr": -1.0})
    assert len(opt.param_groups) == 1

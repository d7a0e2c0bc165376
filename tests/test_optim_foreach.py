"""The foreach path's per-tensor scalars (issue 30, finding 9): stacked, not lists of 0-d tensors.

Trust ratios and gradient norms are computed on the tensors' device as one 1-D tensor per list
and applied with one multi-tensor op (``gradpress.optim._common.add_scaled_``/``divided``), not
as lists of 0-d tensors, which CUDA's foreach kernels run one tensor at a time. Checked on the
CPU: no ``torch._foreach_*`` call of a step gets a list holding a 0-d tensor, and the result is
bit for bit the one of the old per-tensor formulation, for float32, float64 and bfloat16.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from gradpress.optim import LAMB, LANS, OneBitLANS, _common, lamb, lans, onebit_lans

SIZES = [(0,), (1,), (7,), (65,), (3, 5, 7), (129, 33)]


def _case(dtype: torch.dtype, seed: int = 0) -> tuple[list[torch.Tensor], list[list]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SIZES]
    with torch.no_grad():
        params[2].zero_()  # weight norm 0: trust ratio 1
    grads = [[(torch.randn(s, generator=gen) * 0.1).to(dtype) for s in SIZES] for _ in range(6)]
    grads[2][3] = torch.zeros(SIZES[3], dtype=dtype)  # gradient norm 0
    return params, grads


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list]) -> None:
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.to(p.device, copy=True)
        opt.step()


CONFIGS: list[tuple[str, Any]] = [
    ("lans", lambda ps: LANS(ps, lr=0.01, fused=False)),
    ("lans-nonorm-maxtrust", lambda ps: LANS(ps, lr=0.01, normalize_grad=False, max_trust=0.5,
                                             fused=False)),
    ("lamb", lambda ps: LAMB(ps, lr=0.01, fused=False)),
    ("lamb-wd0", lambda ps: LAMB(ps, lr=0.01, weight_decay=0.0, fused=False)),
    ("onebit-lans-blend", lambda ps: OneBitLANS(ps, lr=0.01, dense_steps=2, blend=True,
                                                fused=False)),
    ("onebit-lans-frozen", lambda ps: OneBitLANS(ps, lr=0.01, dense_steps=2, variance="frozen",
                                                 fused=False)),
]
IDS = [n for n, _ in CONFIGS]


class _ZeroDimLists(TorchFunctionMode):
    """Records every ``torch._foreach_*`` call that gets a list holding a 0-d tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.startswith("_foreach_"):
            self.calls += 1
            for a in (*args, *kwargs.values()):
                if isinstance(a, (list, tuple)) and any(
                        isinstance(t, torch.Tensor) and t.dim() == 0 for t in a):
                    self.bad.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("name,make", CONFIGS, ids=IDS)
def test_no_lists_of_zero_dim_tensors(name: str, make: Any) -> None:
    params, grads = _case(torch.float32)
    params = [p for p in params if p.dim() > 0]  # a 0-d parameter would be a 0-d list entry
    opt = make(params)
    mode = _ZeroDimLists()
    with mode:
        _run(opt, params, [gs[:len(params)] for gs in grads])
    assert mode.calls > 0
    assert mode.bad == [], f"per-tensor (0-d) scalars passed to {sorted(set(mode.bad))}"


def _old_add_scaled_(xs: list[torch.Tensor], us: list[torch.Tensor], s: torch.Tensor) -> None:
    """The formulation before: ``_foreach_addcmul_(x, u, [0-d s_i ...])``."""
    torch._foreach_addcmul_(xs, us, list(s.unbind()))


def _old_divided(ts: list[torch.Tensor], s: torch.Tensor) -> list[torch.Tensor]:
    return list(torch._foreach_div(ts, list(s.unbind())))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name,make", CONFIGS, ids=IDS)
def test_bit_identical_to_per_tensor_scalars(name: str, make: Any, dtype: torch.dtype,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    a, grads = _case(dtype)
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_a, opt_b = make(a), make(b)
    _run(opt_a, a, grads)
    for mod in (lans, lamb, onebit_lans):
        if hasattr(mod, "add_scaled_"):
            monkeypatch.setattr(mod, "add_scaled_", _old_add_scaled_)
        if hasattr(mod, "divided"):
            monkeypatch.setattr(mod, "divided", _old_divided)
    _run(opt_b, b, grads)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (name, x.shape)


def test_host_scalars_and_helpers() -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0])
    got = _common.host_scalars(a, b)
    assert [t.tolist() for t in got] == [[1.0, 2.0], [3.0]]
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in got)
    xs = [torch.zeros(2, 3), torch.zeros(0), torch.ones(4).t()]
    us = [torch.ones(2, 3), torch.ones(0), torch.arange(4.0)]
    _common.add_scaled_(xs, us, torch.tensor([2.0, 5.0, -1.0]))
    assert torch.equal(xs[0], torch.full((2, 3), 2.0))
    assert torch.equal(xs[2], torch.tensor([1.0, 0.0, -1.0, -2.0]))
    us_t = [torch.ones(3, 2).t()]  # not contiguous: ones_like, same result
    x = [torch.zeros(2, 3)]
    _common.add_scaled_(x, us_t, torch.tensor([3.0]))
    assert torch.equal(x[0], torch.full((2, 3), 3.0))
    assert [t.tolist() for t in _common.divided([torch.tensor([4.0])], torch.tensor([2.0]))] \
        == [[2.0]]
    _common.add_scaled_([], [], torch.zeros(0))  # an empty bucket part is a no-op


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,make", CONFIGS, ids=IDS)
def test_cuda_foreach_matches_cpu(name: str, make: Any) -> None:
    """The device path (stacked scalars copied to the host once, multi-tensor ops with CUDA
    lists and CPU scalars) against the CPU: equal to float32 rounding (CUDA fuses other
    multiply-adds and sums the norms in another order)."""
    a, grads = _case(torch.float32)
    b = [p.detach().cuda().requires_grad_() for p in a]
    _run(make(a), a, grads)
    _run(make(b), b, grads)
    for x, y in zip(a, b):
        assert y.is_cuda
        torch.testing.assert_close(y.detach().cpu(), x.detach(), rtol=1e-4, atol=1e-5)

"""The foreach path's per-tensor scalars (issue 30, finding 9): stacked, not lists of 0-d tensors,
and never copied to the host on a device.

Trust ratios and gradient norms are computed on the tensors' device as one 1-D tensor per list
and applied with one multi-tensor op (``gradpress.optim._scalars.add_scaled_``/``divided``), not
as lists of 0-d tensors, which CUDA's foreach kernels run one tensor at a time. Checked on the
CPU: no ``torch._foreach_*`` call of a step gets a list holding a 0-d tensor, and the result is
bit for bit the one of the old per-tensor formulation, for float32, float64 and bfloat16. The
device path (scalars spread over a buffer shaped like the tensors, no host copy) runs on the CPU
through ``_scalars._DEVICE_PATH_ON_CPU`` and gives the same bits; on the meta device, where any
read of a value raises, a whole step runs without a host read or a blocking copy.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._prims_common import (
    is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from gradpress.optim import LAMB, LANS, OneBitLANSCore, _scalars, lamb, lans, onebit_lans

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
    ("onebit-lans-blend", lambda ps: OneBitLANSCore(ps, lr=0.01, dense_steps=2, blend=True,
                                                    fused=False)),
    ("onebit-lans", lambda ps: OneBitLANSCore(ps, lr=0.01, dense_steps=2, fused=False)),
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


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device"])
@pytest.mark.parametrize("name,make", CONFIGS, ids=IDS)
def test_no_lists_of_zero_dim_tensors(name: str, make: Any, device_path: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_scalars, "_DEVICE_PATH_ON_CPU", device_path)
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


def test_host_path_helpers() -> None:
    xs = [torch.zeros(2, 3), torch.zeros(0), torch.ones(4).t()]
    us = [torch.ones(2, 3), torch.ones(0), torch.arange(4.0)]
    _scalars.add_scaled_(xs, us, torch.tensor([2.0, 5.0, -1.0]))
    assert torch.equal(xs[0], torch.full((2, 3), 2.0))
    assert torch.equal(xs[2], torch.tensor([1.0, 0.0, -1.0, -2.0]))
    us_t = [torch.ones(3, 2).t()]  # not contiguous: ones_like, same result
    x = [torch.zeros(2, 3)]
    _scalars.add_scaled_(x, us_t, torch.tensor([3.0]))
    assert torch.equal(x[0], torch.full((2, 3), 3.0))
    assert [t.tolist() for t in _scalars.divided([torch.tensor([4.0])], torch.tensor([2.0]))] \
        == [[2.0]]
    _scalars.add_scaled_([], [], torch.zeros(0))  # an empty bucket part is a no-op
    assert _scalars.divided([], torch.zeros(0)) == []


def test_per_element_views_keep_shape_and_strides() -> None:
    """Each view holds its tensor's scalar and has its shape and, for a dense tensor in another
    order (transposed), its strides, so CUDA's fast route (same sizes and strides in every
    list) stays open; a tensor that is not dense gets a contiguous view (no fast route anyway)."""
    ts = [torch.zeros(2, 3), torch.zeros(0, 4), torch.zeros(4, 3).t(), torch.zeros(5)[::2],
          torch.zeros(1, 1, 7).transpose(0, 2)]
    views = _scalars._per_element(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), ts)
    for i, (v, t) in enumerate(zip(views, ts)):
        assert v.shape == t.shape
        assert torch.equal(v, torch.full(t.shape, float(i + 1)))
    assert views[2].stride() == ts[2].stride() == (1, 3)
    assert views[3].is_contiguous()
    # strides of size-1 dims do not count (``is_diff_stride`` in ATen's ForeachUtils.h skips them)
    assert [st for n, st in zip(ts[4].shape, views[4].stride()) if n != 1] == [1]


def test_sizes_cached_per_device_and_counts() -> None:
    a = _scalars._sizes_on(torch.device("cpu"), (3, 0, 5))
    assert a.dtype == torch.int32 and a.tolist() == [3, 0, 5]
    assert _scalars._sizes_on(torch.device("cpu"), (3, 0, 5)) is a
    assert _scalars._sizes_on(torch.device("cpu"), (3, 5)) is not a
    assert len(_scalars._SIZES) <= _scalars._SIZES_MAX


def test_sizes_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_scalars, "_SIZES", {})
    monkeypatch.setattr(_scalars, "_SIZES_MAX", 3)
    for n in range(1, 6):
        _scalars._sizes_on(torch.device("cpu"), (n,))
    assert [k[2] for k in _scalars._SIZES] == [(3,), (4,), (5,)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_device_path_helpers_match_host_path(dtype: torch.dtype,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    us = [torch.randn(s, generator=gen).to(dtype) for s in [(3, 4), (0,), (7,), (5, 2), ()]]
    us[3] = us[3].t()   # transposed: the views follow its strides
    s = torch.randn(5, generator=gen).to(dtype)
    host_x = [torch.randn(u.shape, generator=gen).to(dtype) for u in us]
    dev_x = [x.clone() for x in host_x]
    host_q = _scalars.divided(us, s)
    _scalars.add_scaled_(host_x, us, s)
    monkeypatch.setattr(_scalars, "_DEVICE_PATH_ON_CPU", True)
    dev_q = _scalars.divided(us, s)
    _scalars.add_scaled_(dev_x, us, s)
    for a, b, c, d in zip(host_x, dev_x, host_q, dev_q):
        assert torch.equal(a, b) and torch.equal(c, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name,make", CONFIGS, ids=IDS)
def test_device_path_bit_identical_to_host_path(name: str, make: Any, dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The device path computes ``x + (1*u)*s`` and ``t/s`` elementwise, the host path
    ``x + (s*1)*u`` and ``t/s`` with host scalars: the same values, bit for bit on the CPU."""
    a, grads = _case(dtype)
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_a, opt_b = make(a), make(b)
    _run(opt_a, a, grads)
    monkeypatch.setattr(_scalars, "_DEVICE_PATH_ON_CPU", True)
    _run(opt_b, b, grads)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (name, x.shape)


def _fast_route_open(lists: list[list[torch.Tensor]]) -> bool:
    """CUDA's condition for the multi-tensor route (``check_fast_path_restrictions`` in
    torch/include/ATen/native/ForeachUtils.h) on the tensor lists of one foreach call: one
    device and dtype, every tensor dense and non-overlapping, and the ``j``-th tensors of all
    lists equal in size and, except along size-1 dims, in stride."""
    first = lists[0]
    for ts in lists:
        for t, u in zip(ts, first):
            if t.shape != u.shape or t.dtype != u.dtype or t.device != u.device \
                    or not is_non_overlapping_and_dense(t):
                return False
            if any(n != 1 and x != y for n, x, y in zip(t.shape, t.stride(), u.stride())):
                return False
    return True


class _FastRoute(TorchFunctionMode):
    """Records every ``torch._foreach_*`` call whose tensor lists would close CUDA's fast route."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.startswith("_foreach_"):
            lists = [list(a) for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))
                     and a and all(isinstance(t, torch.Tensor) for t in a)]
            if lists and not _fast_route_open(lists):
                self.closed.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("name,make", CONFIGS, ids=IDS)
def test_device_path_keeps_the_fast_route_open(name: str, make: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every foreach call of a step on the device path meets CUDA's fast-route condition, with
    a transposed (dense, not contiguous) parameter in the bucket: the per-element scalars
    follow each tensor's strides."""
    monkeypatch.setattr(_scalars, "_DEVICE_PATH_ON_CPU", True)
    params, grads = _case(torch.float32)
    params = [p for p in params if p.dim() > 0]
    params[-1] = params[-1].detach().t().contiguous().t().requires_grad_()  # strides (1, 129)
    assert not params[-1].is_contiguous()
    grads = [[g.t().contiguous().t() if g.dim() == 2 else g for g in gs[:len(params)]]
             for gs in grads]
    opt = make(params)
    mode = _FastRoute()
    with mode:
        _run(opt, params, grads)
    assert mode.closed == [], sorted(set(mode.closed))


def test_fast_route_check_can_fail() -> None:
    x = [torch.zeros(3, 4)]
    assert _fast_route_open([x, [torch.zeros(3, 4)]])
    assert not _fast_route_open([x, [torch.zeros(4, 3).t()]])      # other strides
    assert not _fast_route_open([x, [torch.zeros(3, 8)[:, ::2]]])  # not dense
    assert not _fast_route_open([x, [torch.zeros(())]])             # a 0-d scalar


class _HostReads(TorchDispatchMode):
    """Records every read of a value on the host (``aten._local_scalar_dense``: ``.item()``,
    ``bool(t)``) and every blocking copy between devices (``_to_copy``/``copy_`` without
    ``non_blocking``: on CUDA a ``cudaStreamSynchronize``, in either direction)."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            self.bad.append("item")
        elif func is aten._to_copy.default and kwargs.get("device") is not None:
            if torch.device(kwargs["device"]) != args[0].device \
                    and not kwargs.get("non_blocking", False):
                self.bad.append(f"blocking copy {args[0].device} -> {kwargs['device']}")
        elif func is aten.copy_.default and args[0].device != args[1].device:
            if not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False)):
                self.bad.append(f"blocking copy {args[1].device} -> {args[0].device}")
        return func(*args, **kwargs)


def _meta_case() -> tuple[list[torch.Tensor], list[list]]:
    params, grads = _case(torch.float32)
    params = [p.detach().to("meta").requires_grad_() for p in params]
    return params, [[g.to("meta") for g in gs] for gs in grads[:3]]


def test_meta_device_catches_host_reads() -> None:
    """What the meta test below relies on: a meta tensor has no data, so reading a value on
    the host raises, and the dispatch mode sees a blocking host-to-device copy."""
    m = torch.ones(2, device="meta")
    for read in (lambda: m.sum().item(), m.cpu, m.tolist, lambda: bool(m.sum() > 0)):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()
    mode = _HostReads()
    with mode:
        torch.ones(2).to("meta")
        torch.ones(2).to("meta", non_blocking=True)
    assert mode.bad == ["blocking copy cpu -> meta"]


@pytest.mark.parametrize("name,make", CONFIGS, ids=IDS)
def test_device_path_never_reads_a_device_value(name: str, make: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Three steps (the 1-bit configurations reach their compression stage) on the meta
    device: no value is read on the host (which raises there) and no copy blocks, including
    the one that fills the cache of bucket sizes (emptied first)."""
    monkeypatch.setattr(_scalars, "_SIZES", {})
    params, grads = _meta_case()
    opt = make(params)
    mode = _HostReads()
    with mode:
        _run(opt, params, grads)
    assert mode.bad == []
    assert all(p.device.type == "meta" for p in params)


def test_host_path_on_meta_would_read_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: forcing the host path onto the meta device raises, as the
    per-bucket host copy it replaced would."""
    monkeypatch.setattr(_scalars, "_on_host", lambda t: True)
    params, grads = _meta_case()
    with pytest.raises((RuntimeError, NotImplementedError)):
        _run(LANS(params, lr=0.01, fused=False), params, grads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name,make", CONFIGS, ids=IDS)
def test_cuda_foreach_matches_cpu(name: str, make: Any) -> None:
    """The device path on CUDA against the CPU's host path: equal to float32 rounding (CUDA
    fuses other multiply-adds and sums the norms in another order). No step synchronises:
    ``set_sync_debug_mode("error")`` makes every ``cudaStreamSynchronize`` that a blocking copy
    or ``.item()`` issues raise (``c10::cuda::memcpy_and_sync`` and ``stream_synchronize`` in
    torch/include/c10/cuda/CUDAFunctions.h call ``warn_or_error_on_sync`` first). Written from
    PyTorch's sources; not yet run on a GPU."""
    a, grads = _case(torch.float32)
    b = [p.detach().cuda().requires_grad_() for p in a]
    _run(make(a), a, grads)
    opt = make(b)
    for gs in grads:
        for p, g in zip(b, gs):
            p.grad = g.cuda()       # a blocking copy, outside the checked region
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for x, y in zip(a, b):
        assert y.is_cuda
        torch.testing.assert_close(y.detach().cpu(), x.detach(), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_on_a_side_stream() -> None:
    """LANS stepped under a non-default stream (its bucket sizes cached for that stream) gives
    the bits of a step on the default stream, again without a synchronisation. Written from
    PyTorch's sources; not yet run on a GPU."""
    a, grads = _case(torch.float32)
    a = [p.detach().cuda().requires_grad_() for p in a]
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_a, opt_b = LANS(a, lr=0.01, fused=False), LANS(b, lr=0.01, fused=False)
    side = torch.cuda.Stream()
    for gs in grads:
        for p, q, g in zip(a, b, gs):
            p.grad, q.grad = g.cuda(), g.cuda()
        opt_a.step()
        side.wait_stream(torch.cuda.current_stream())
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.stream(side):
                opt_b.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for x, y in zip(a, b):
        assert torch.equal(x, y)

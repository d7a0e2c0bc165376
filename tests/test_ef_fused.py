"""Fused error feedback is bit-identical to the unfused path, for every codec with a fused hook.

Three ways to run one vanilla/corrected error-feedback step (see ``gradpress.compress.base``):

* ``fused``: the codec's ``_encode_ef_fused`` (``p = g + ratio * e`` never stored);
* ``hook``: ``p`` stored by the wrapper, then the codec's one-pass ``_encode_ef``;
* ``unfused``: ``p`` stored, ``_encode`` then ``_decode_add(body, p, -1)``.

All three must give the same payload bytes and the same float32 residual bits after every step,
for special values (signed zeros, subnormals, fp16 overflow, NaN/inf under ``nan_policy='allow'``),
for rejected input (``'raise'``: same error, residual untouched) and for both backends (the torch
backend has no fused kernels, so there the three paths must coincide trivially).
"""

from __future__ import annotations

import pytest
import torch

from gradpress.compress import build
from gradpress.compress.ef import ErrorFeedback

SIZES = (0, 1, 7, 8, 1000003)
KEY = 5
_ALL = ("onebit", "onebit:scaling=0", "fp16", "bf16", "topk:k=0.01", "topk:k=3,values=fp16",
        "dithering", "dithering:s=3,partition=natural,normalize=l2")
SPECS = list(_ALL)
#: (numel, backend): the torch backend has no fused kernels, so the small sizes cover it (1M
#: elements through torch ops is slow)
SIZE_BACKEND = [(n, b) for n in SIZES for b in ("numba", "torch") if b == "numba" or n <= 8]
#: learning rates per step (corrected EF): ratios 1, 1/3, 0.3/0.07 (not powers of two), 1, 1.4
LRS = (0.1, 0.3, 0.07, 0.07, 0.05)


def make(spec: str, numel: int, kind: str, path: str, **kw) -> ErrorFeedback:
    codec = build(spec, numel, ef=kind, seed=3, **kw)
    assert isinstance(codec, ErrorFeedback)
    if path in ("hook", "unfused"):
        codec.inner._encode_ef_fused = None  # instance attributes hide the hooks from the wrapper
    if path == "unfused":
        codec.inner._encode_ef = None
    return codec


def inputs(numel: int, allow_nan: bool) -> list[torch.Tensor]:
    """Five steps: Gaussian; zeros (so p = e); special values; large Gaussian with NaN/inf (when
    ``allow_nan``); Gaussian again (p = g + e with a non-finite residual, under "allow")."""
    gen = torch.Generator().manual_seed(numel)
    a = torch.randn(numel, generator=gen)
    special = torch.randn(numel, generator=gen) * 1e-3
    vals = torch.tensor([-0.0, 0.0, 1e-45, -3e-39, 7e4, -7e4, 6.1e-5, 2.0**-25, 65519.0, 1e-8])
    special[::3] = vals.repeat(numel // len(vals) + 1)[:len(special[::3])]
    big = torch.randn(numel, generator=gen) * 100
    if allow_nan and numel:
        big[numel // 2] = float("nan")
        big[-1] = float("inf")
        big[0] = float("-inf") if numel > 1 else big[0]
    return [a, torch.zeros(numel), special, big, torch.randn(numel, generator=gen)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def run(codec: ErrorFeedback, xs: list[torch.Tensor], kind: str) -> list[object]:
    """Per step: (payload, residual or None), or the error text of a rejected step."""
    out: list[object] = []
    prev = None
    for step, x in enumerate(xs):
        lr = LRS[step] if kind == "corrected" else None
        try:
            payload = codec.compress(x, key=KEY, step=step, lr=lr).clone()
        except ValueError as err:
            out.append(str(err))
            if prev is not None:  # a rejected step leaves the residual as it was
                assert torch.equal(bits(codec.residual), bits(prev))
            continue
        prev = None if codec.residual is None else codec.residual.clone()
        out.append((payload, prev))
    return out


@pytest.mark.parametrize("nan_policy", ["raise", "allow"])
@pytest.mark.parametrize(("numel", "backend"), SIZE_BACKEND)
@pytest.mark.parametrize("kind", ["vanilla", "corrected"])
@pytest.mark.parametrize("spec", SPECS)
def test_fused_matches_unfused_bit_for_bit(spec, kind, numel, backend, nan_policy):
    xs = inputs(numel, allow_nan=True)
    if nan_policy == "raise" and numel:
        xs[3] = xs[3].clone()
        xs[3][numel // 2] = float("nan")  # rejected by every path, residual kept
    results = {path: run(make(spec, numel, kind, path, nan_policy=nan_policy, backend=backend),
                         xs, kind) for path in ("fused", "hook", "unfused")}
    ref = results["unfused"]
    assert any(isinstance(r, str) for r in ref) == (nan_policy == "raise" and numel > 0)
    for path in ("fused", "hook"):
        for step, (got, want) in enumerate(zip(results[path], ref)):
            what = f"{path} vs unfused, step {step}"
            if isinstance(want, str) or isinstance(got, str):
                assert got == want, what
                continue
            assert torch.equal(got[0], want[0]), f"{what}: payload"
            if want[1] is None:
                assert got[1] is None, what
            else:
                assert torch.equal(bits(got[1]), bits(want[1])), f"{what}: residual"


@pytest.mark.parametrize("spec", SPECS)
def test_fused_hook_is_used_on_cpu(spec):
    """The numba backend runs the fused kernel (it returns a residual buffer), torch does not."""
    codec = build(spec, 4096, ef="vanilla")
    g, e, spare = torch.randn(4096), torch.randn(4096), torch.empty(4096)
    body = torch.empty(codec.payload_bytes - 40, dtype=torch.uint8)
    got = codec.inner._encode_ef_fused(g, e, 1.0, body, spare, KEY, 0)
    assert got is e or got is spare
    tcodec = build(spec, 4096, ef="vanilla", backend="torch")
    assert tcodec.inner._encode_ef_fused(g, e, 1.0, body, spare, KEY, 0) is None
    assert tcodec.inner._encode_ef(g, body, spare, KEY, 0) is False


@pytest.mark.parametrize("spec", SPECS)
def test_rejected_input_keeps_residual_and_buffers(spec):
    codec = build(spec, 1000, ef="vanilla")
    codec.compress(torch.randn(1000), key=KEY, step=0)
    before, ptr = codec.residual.clone(), codec.residual.data_ptr()
    bad = torch.randn(1000)
    bad[999] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        codec.compress(bad, key=KEY, step=1)
    assert codec.residual.data_ptr() == ptr and torch.equal(bits(codec.residual), bits(before))


@pytest.mark.parametrize("numel", [1, 4099])
def test_fill_p_matches_torch_arithmetic(numel):
    """The unfused numba path stores p with ``fill_p``; the torch backend with float32 torch ops:
    the same values (both round ratio to float32, then multiply, then add)."""
    import numpy as np

    from gradpress.compress.kernels.common import ef_args, fill_p

    g, e = torch.randn(numel), torch.randn(numel)
    for ratio in (1.0, 0.3 / 0.07, 1 / 3):
        p = torch.empty(numel)
        fill_p(g.numpy(), e.numpy(), *ef_args(ratio), p.numpy(), False)
        ref = g + e if ratio == 1.0 else torch.mul(e, ratio) + g
        assert torch.equal(bits(p), bits(ref))
        inplace = e.clone()
        fill_p(g.numpy(), inplace.numpy(), *ef_args(ratio), np.empty(0, np.float32), True)
        assert torch.equal(bits(inplace), bits(p))


def test_topk_sampler_adversary_still_exact():
    """The top-k sampler (made cheaper along with the fused paths) reads ``sample_positions``:
    large values exactly there make the first thresholds overshoot; the retries must still give
    the exact top-k, sorted by index."""
    from gradpress.compress.kernels import sparse as K

    n = 1 << 18
    x = torch.rand(n, generator=torch.Generator().manual_seed(9))
    x[torch.from_numpy(K.sample_positions(n))] += 10.0
    codec = build("topk:k=0.001", n)
    idx = codec._split(codec.compress(x)[40:])[0].long()  # indices, whatever the layout
    expected = torch.topk(x.abs(), codec.kk).indices.sort().values
    assert torch.equal(idx, expected)


@pytest.mark.parametrize("spec", [s for s in SPECS if s.startswith("topk")])
def test_topk_keeps_one_residual_buffer_and_rejects_overflow(spec):
    """topk writes p over the residual (no second residual-sized buffer is ever written), and a
    finite input whose sum with the residual overflows is rejected with the residual intact."""
    codec = build(spec, 1000, ef="vanilla")
    codec.compress((torch.rand(1000) - 0.5) * 2 * 3e38, key=KEY, step=0)  # residuals ~3e38
    ptr = codec.residual.data_ptr()
    for step in range(1, 4):
        before = codec.residual.clone()
        big = before.abs().argmax()  # still ~3e38: only k entries are sent per step
        x = torch.randn(1000)
        x[big] = 3e38 * torch.sign(before[big])  # finite, but x + e overflows at `big`
        with pytest.raises(ValueError, match="non-finite"):
            codec.compress(x, key=KEY, step=step)
        assert torch.equal(bits(codec.residual), bits(before))
        x[big] = 0.0
        codec.compress(x, key=KEY, step=step)
        assert codec.residual.data_ptr() == ptr, "the residual moved to another buffer"


def test_p_all_finite():
    import numpy as np

    from gradpress.compress.kernels.common import ef_args, p_all_finite

    g, e = np.ones(9, np.float32), np.ones(9, np.float32)
    assert p_all_finite(g, e, *ef_args(1.0)) and p_all_finite(g[:0], e[:0], *ef_args(1.0))
    e[4] = 3e38
    g[4] = 3e38
    assert not p_all_finite(g, e, *ef_args(1.0))
    assert p_all_finite(g, e, *ef_args(-1.0))  # 3e38 - 3e38 = 0
    g[4] = np.nan
    assert not p_all_finite(g, e, *ef_args(0.5))

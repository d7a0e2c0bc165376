"""The server's fused onebit reduce (``Codec.compress_sum``) is bit-identical to the generic path.

``reduce_pushes`` with onebit pushes and a onebit reply codec (no error feedback, vanilla,
vanilla with a decay, corrected) runs two numba passes that compute every element of the sum
from the pushes' bits and scales (``kernels/onebit_sum.py``). The generic path (``acc = 0``,
decode-add per push, ``acc /= divisor``, compress) is forced by hiding ``fuses_sum`` on the
encoder instance. Both must give the same reply bytes, the same server residual bits and the
same ``lr_prev``, or the same error with the residual untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from gradpress.compress import build
from gradpress.compress.ef import parse_ef
from gradpress.compress.header import HEADER_BYTES
from gradpress.compress.kernels.onebit import BLOCK
from gradpress.ps.errors import PayloadError
from gradpress.ps.reduce import reduce_pushes

KEY = 3
EFS = (None, "vanilla", "vanilla:decay=0.7", "corrected")
LRS = (0.1, 0.3, 0.07)  # corrected EF: ratios 1, 1/3, 0.3/0.07


def server_codec(numel: int, ef: str | None, spec: str = "onebit", **kw):
    return build(spec, numel, ef=None if ef is None else parse_ef(ef).for_server(), seed=1, **kw)


def generic(codec):
    codec.fuses_sum = lambda decoder, device: False  # an instance attribute hides the method
    return codec


def push(numel: int, step: int, bits: np.ndarray, scale: float) -> torch.Tensor:
    """A valid onebit payload whose body is ``bits`` (random, high bits of the last byte
    included: the decoder ignores them) and the float32 ``scale``."""
    p = build("onebit", numel, seed=1).compress(torch.zeros(numel), key=KEY, step=step)
    nbits = (numel + 7) // 8
    body = p[HEADER_BYTES:].numpy()
    body[:nbits] = bits
    body[nbits:nbits + 4] = np.frombuffer(np.float32(scale).tobytes(), np.uint8)
    return p


def reduce(dec, enc, pushes, *, step=0, lr=None, divisor=1, out=None):
    acc = torch.full((dec.numel,), float("nan"))  # scratch
    return reduce_pushes([(f"worker{i}", p) for i, p in enumerate(pushes)], dec, enc, acc,
                         key=KEY, step=step, lr=lr, divisor=divisor, label=f"key {KEY}", out=out)


def outcome(dec, enc, pushes, **kw):
    """The reply, or the error's type and text."""
    try:
        return reduce(dec, enc, pushes, **kw)
    except ValueError as e:
        return type(e), str(e)


def same_state(a, b) -> None:
    ra, rb = a.residual, b.residual
    if ra is None or rb is None:
        assert ra is None and rb is None
    else:
        assert torch.equal(ra.view(torch.int32), rb.view(torch.int32))
    assert getattr(a, "lr_prev", None) == getattr(b, "lr_prev", None)


def assert_same(r1, r2) -> None:
    if isinstance(r1, tuple) or isinstance(r2, tuple):
        assert r1 == r2
    else:
        assert torch.equal(r1, r2)


SCALES = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1.0, 1e-45, 1e-38, 3e38, 1 / 3]))


@settings(max_examples=60, deadline=None)
@given(numel=st.one_of(st.integers(1, 40), st.integers(1, 2 * BLOCK + 300),
                       st.sampled_from([8, 256, BLOCK, BLOCK + 1, 3 * BLOCK - 7])),
       pushers=st.integers(1, 4), divisor=st.sampled_from([1, 2, 3, 4]),
       ef=st.sampled_from(EFS), scales=st.lists(SCALES, min_size=12, max_size=12),
       seed=st.integers(0, 2 ** 16), scaling=st.booleans())
def test_fused_reduce_is_bit_identical_to_the_generic_path(numel, pushers, divisor, ef, scales,
                                                           seed, scaling):
    rng = np.random.default_rng(seed)
    dec = build("onebit", numel, seed=1)
    spec = "onebit" if scaling else "onebit:scaling=0"
    fused, plain = server_codec(numel, ef, spec), generic(server_codec(numel, ef, spec))
    for step in range(3):
        pushes = [push(numel, step, rng.integers(0, 256, (numel + 7) // 8, dtype=np.uint8),
                       scales[(step * 4 + w) % len(scales)]) for w in range(pushers)]
        lr = LRS[step] if ef == "corrected" else None
        calls: list = []
        counted = build("onebit", numel, seed=1)  # counts the generic path's decode-adds
        counted.decompress_add = lambda *a, calls=calls, **k: calls.append(
            dec.decompress_add(*a, **k))
        r1 = outcome(counted, fused, pushes, step=step, lr=lr, divisor=divisor)
        r2 = outcome(dec, plain, pushes, step=step, lr=lr, divisor=divisor)
        assert_same(r1, r2)
        same_state(fused, plain)
        assert not calls if isinstance(r1, torch.Tensor) else calls  # fused unless rejected
        event("fused" if not calls else "rejected")


@pytest.mark.parametrize("ef", EFS)
@pytest.mark.parametrize("divisor", [1, 2, 3, 4])
def test_fused_reduce_of_worker_pushes(ef, divisor):
    """Real worker payloads (error feedback on the workers), all-zero gradients (+0.0 and -0.0
    signs with scale 0) and a numel that is no multiple of 8 or of the block."""
    numel = 2 * BLOCK + 13
    workers = [build("onebit", numel, ef=parse_ef("vanilla"), seed=1) for _ in range(4)]
    dec = build("onebit", numel, seed=1)
    fused, plain = server_codec(numel, ef), generic(server_codec(numel, ef))
    g = torch.Generator().manual_seed(divisor)
    for step in range(4):
        xs = [torch.randn(numel, generator=g) * 10.0 ** w for w in range(4)]
        if step == 1:
            xs = [torch.zeros(numel), -torch.zeros(numel), torch.zeros(numel), xs[3]]
        pushes = [w.compress(x, key=KEY, step=step) for w, x in zip(workers, xs)]
        lr = LRS[step % 3] if ef == "corrected" else None
        for w in (1, 2, 4):
            r1 = reduce(dec, fused, pushes[:w], step=step, lr=lr, divisor=divisor)
            r2 = reduce(dec, plain, pushes[:w], step=step, lr=lr, divisor=divisor)
            assert torch.equal(r1, r2)
            same_state(fused, plain)


def test_fused_path_is_taken_and_leaves_acc_alone():
    numel = 1000
    dec, enc, ref = build("onebit", numel), server_codec(numel, "vanilla"), generic(
        server_codec(numel, "vanilla"))
    rng = np.random.default_rng(0)
    pushes = [push(numel, 0, rng.integers(0, 256, 125, dtype=np.uint8), 0.5) for _ in range(2)]
    expected = reduce(dec, ref, pushes, divisor=2)

    def boom(*a, **k):
        raise AssertionError("the generic decode-add ran")

    dec.decompress_add = boom
    out = torch.empty(dec.payload_bytes, dtype=torch.uint8)
    assert reduce(dec, enc, pushes, divisor=2, out=out) is out
    assert torch.equal(out, expected)
    same_state(enc, ref)
    residual = enc.residual.clone()
    assert enc.compress_sum([pushes[0][:-1]], dec, 1, key=KEY, step=1) is None  # not taken
    assert torch.equal(enc.residual, residual)
    # the DDP hook's way: one error-feedback codec decodes the pushes and encodes the reply
    both = server_codec(numel, "vanilla")
    both.inner.decompress_add = boom
    assert torch.equal(reduce(both, both, pushes, divisor=2), expected)


def test_fuses_sum_only_for_onebit_pushes_on_the_numba_path():
    n, cpu = 64, torch.device("cpu")
    enc = server_codec(n, "vanilla")
    assert enc.fuses_sum(build("onebit", n), cpu)
    assert enc.fuses_sum(enc, cpu)
    assert server_codec(n, None).fuses_sum(build("onebit:scaling=0", n), cpu)
    assert not enc.fuses_sum(build("onebit", n + 1), cpu)
    assert not enc.fuses_sum(build("fp16", n), cpu)
    assert not enc.fuses_sum(build("onebit", n, backend="torch"), cpu)
    assert not enc.fuses_sum(build("onebit", n), torch.device("meta"))
    assert not server_codec(n, "vanilla", backend="torch").fuses_sum(build("onebit", n), cpu)
    assert not server_codec(n, "vanilla", nan_policy="allow").fuses_sum(build("onebit", n), cpu)
    assert not server_codec(0, "vanilla").fuses_sum(build("onebit", 0), cpu)
    assert not build("fp16", n, ef="vanilla").fuses_sum(build("fp16", n), cpu)
    assert not build("onebit", n, ef="vanilla:decay=0.5,anneal=1").fuses_sum(
        build("onebit", n), cpu)


def test_bad_headers_name_the_first_bad_sender_in_rank_order():
    numel = 100
    dec, enc = build("onebit", numel), server_codec(numel, "vanilla")
    w = build("onebit", numel)
    x = torch.randn(numel)
    good = w.compress(x, key=KEY, step=4)
    for bad, word in ((w.compress(x, key=KEY, step=5), "step 5, expected 4"),
                      (w.compress(x, key=9, step=4), "key 9, expected 3"),
                      (build("fp16", numel).compress(x, key=KEY, step=4), "codec id"),
                      (good[:-1], "truncated")):
        with pytest.raises(PayloadError, match=f"key 3: push from worker1 rejected: .*{word}"):
            reduce(dec, enc, [good, bad, w.compress(x, key=KEY, step=6)], step=4)
    assert enc.residual is None  # nothing ran

    asked = []

    def arriving():  # the server's generator: a bad push fails before later ones are waited for
        for i, p in enumerate([good, w.compress(x, key=KEY, step=5), good]):
            asked.append(i)
            yield f"worker{i}", p

    with pytest.raises(PayloadError, match="push from worker1 rejected"):
        reduce_pushes(arriving(), dec, enc, torch.empty(numel), key=KEY, step=4, lr=None,
                      divisor=1, label=f"key {KEY}")
    assert asked == [0, 1]


@pytest.mark.parametrize("ef", ["vanilla", "corrected"])
def test_non_finite_sums_name_the_culprit_and_keep_the_residual(ef):
    numel = BLOCK + 5
    dec = build("onebit", numel)
    fused, plain = server_codec(numel, ef), generic(server_codec(numel, ef))
    rng = np.random.default_rng(1)

    def bits():
        return rng.integers(0, 256, (numel + 7) // 8, dtype=np.uint8)

    same = bits()
    lr = 0.1 if ef == "corrected" else None
    first = [push(numel, 0, bits(), 0.25) for _ in range(3)]
    for enc in (fused, plain):  # a residual to keep
        reduce(dec, enc, first, lr=lr, divisor=3)
    before = fused.residual.clone()
    ok = [push(numel, 1, bits(), 0.25) for _ in range(2)]
    cases = [([ok[0], push(numel, 1, bits(), float("inf")), ok[1]], "worker1 rejected: it has"),
             ([ok[0], ok[1], push(numel, 1, bits(), float("nan"))], "worker2 rejected: it has"),
             ([push(numel, 1, same, 3e38), push(numel, 1, same, 3e38)], "worker1 rejected: it has")]
    for pushes, word in cases:
        for enc in (fused, plain):
            with pytest.raises(PayloadError, match=word):
                reduce(dec, enc, pushes, step=1, lr=0.3 if lr else None, divisor=2)
        assert torch.equal(fused.residual, before)
        same_state(fused, plain)

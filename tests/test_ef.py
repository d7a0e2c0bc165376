"""Error feedback, Nesterov momentum and the server's reduce, for every registered codec.

Besides the registered codecs, a small lossy test codec (bf16 truncation, torch ops) is always
included so the error-feedback arithmetic is exercised even when only ``none`` is registered.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from gradpress.compress import Codec, EFSpec, build, codec_names, parse_ef, read_header
from gradpress.compress.ef import ErrorFeedback
from gradpress.compress.header import Header
from gradpress.compress.momentum import NesterovMomentum
from gradpress.compress.registry import ef_needs_lr
from gradpress.ps.errors import PayloadError
from gradpress.ps.reduce import reduce_pushes

N = 1000
KEY = 3


class TruncCodec(Codec):
    """Test-only lossy codec (not registered): keeps the upper 16 bits of each float32."""

    name = "trunc16"
    codec_id = 250

    def _body_bytes(self) -> int:
        return 2 * self.numel

    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int, step: int) -> None:
        body.view(torch.int16).copy_((x.view(torch.int32) >> 16).to(torch.int16))

    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        out.view(torch.int32).copy_(body.view(torch.int16).to(torch.int32) << 16)


def _specs() -> list[str]:
    names = codec_names()
    extra = {"topk": ["topk:k=0.01,values=fp16"], "dithering": ["dithering:partition=natural"]}
    return names + [s for n in names for s in extra.get(n, [])] + ["trunc16"]


SPECS = _specs()


def make(spec: str, numel: int = N, **kw) -> Codec:
    """``build`` for registered specs; the test codec is wrapped by hand."""
    if spec != "trunc16":
        return build(spec, numel, seed=11, **kw)
    codec: Codec = TruncCodec(numel, {}, backend=kw.get("backend", "auto"))
    if kw.get("ef"):
        codec = ErrorFeedback(codec, kind=kw["ef"])
    if kw.get("momentum"):
        codec = NesterovMomentum(codec, mu=kw.get("mu", 0.9))
    return codec


def grads(steps: int, numel: int = N, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) * (1 + i) for i in range(steps)]


def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy().astype(np.float64)


def assert_ef_identity(res: torch.Tensor, p32: np.ndarray, d: np.ndarray) -> None:
    """``res`` (float32) must be the float32 rounding of ``p32 - d``, computed here in float64.

    Tolerance: the exact p32 - d is rounded once to float32 (<= 1/2 ulp of the result). The
    wrapper subtracts with the codec's decode-accumulate; where that reproduces decode's value
    exactly (stored floats, scale * sign) the result is bit-identical to the float32-rounded
    reference, and a codec whose accumulate rounds the decoded value separately (<= 1/2 ulp of
    |d|) lands at most one float32 step away. So we allow 1 ulp at the scale |p| + |d|.
    """
    expected = (p32 - d).astype(np.float32).astype(np.float64)
    tol = np.spacing(np.float32(1) * (np.abs(p32) + np.abs(d)).astype(np.float32))
    err = np.abs(f64(res) - expected)
    assert np.all(err <= tol), f"max error {err.max()} (tolerance there {tol[err.argmax()]})"


# -- wrapper identity --------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_wrapper_has_inner_wire_identity(spec):
    plain, ef = make(spec), make(spec, ef="vanilla")
    for attr in ("name", "codec_id", "numel", "payload_bytes", "fingerprint", "spec_text"):
        assert getattr(ef, attr) == getattr(plain, attr), attr
    payload = ef.compress(grads(1)[0], key=KEY, step=1)
    assert ef.check_header(payload, key=KEY, step=1).codec_id == plain.codec_id
    torch.testing.assert_close(ef.decompress(payload), plain.decompress(payload), rtol=0, atol=0)


# -- vanilla / corrected identity --------------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("spec", SPECS)
def test_vanilla_ef_identity(spec, backend):
    ef, plain = make(spec, ef="vanilla", backend=backend), make(spec, backend=backend)
    assert ef.residual is None
    e_prev = np.zeros(N)
    for step, x in enumerate(grads(4)):
        payload = ef.compress(x, key=KEY, step=step)
        assert payload.numel() == ef.payload_bytes
        # p = x + e_prev is one float32 addition in the wrapper: round the exact float64 sum
        p32 = (f64(x) + e_prev).astype(np.float32).astype(np.float64)
        assert_ef_identity(ef.residual, p32, f64(plain.decompress(payload, key=KEY, step=step)))
        e_prev = f64(ef.residual)


@pytest.mark.parametrize("spec", SPECS)
def test_corrected_ef_scales_residual_by_lr_ratio(spec):
    ef, plain = make(spec, ef="corrected"), make(spec)
    # powers of two: the ratios (1, 2, 2, 1/4) and ratio * e are exact, so p32 is one rounding
    lrs = [1.0, 0.5, 0.25, 1.0]
    e_prev, lr_prev = np.zeros(N), None
    for step, (x, lr) in enumerate(zip(grads(4), lrs)):
        payload = ef.compress(x, key=KEY, step=step, lr=lr)
        assert read_header(payload).lr == lr
        ratio = 1.0 if lr_prev is None else lr_prev / lr
        p32 = (f64(x) + ratio * e_prev).astype(np.float32).astype(np.float64)
        assert_ef_identity(ef.residual, p32, f64(plain.decompress(payload)))
        e_prev, lr_prev = f64(ef.residual), lr
    assert ef.state_dict()["lr_prev"] == 1.0


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("spec", SPECS)
def test_decayed_ef_identity(spec, backend):
    ef, plain = make(spec, ef="vanilla:decay=0.5", backend=backend), make(spec, backend=backend)
    e_prev = np.zeros(N)
    for step, x in enumerate(grads(4)):
        payload = ef.compress(x, key=KEY, step=step)
        # p = x + 0.5 * e_prev: the halving is exact in float32, so p32 is one rounding
        p32 = (f64(x) + 0.5 * e_prev).astype(np.float32).astype(np.float64)
        assert_ef_identity(ef.residual, p32, f64(plain.decompress(payload, key=KEY, step=step)))
        e_prev = f64(ef.residual)


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("spec", SPECS)
def test_annealed_ef_identity(spec, backend):
    kind = "vanilla:decay=0.5,server_decay=1,anneal=1"
    ef, plain = make(spec, ef=kind, backend=backend), make(spec, backend=backend)
    # B_t = 1 - 0.5 * lr / lr_max: 0.5, 0.75, 0.875, then a new peak 2.0 -> 0.5, 0.75
    lrs, ratios = [1.0, 0.5, 0.25, 2.0, 1.0], [0.5, 0.75, 0.875, 0.5, 0.75]
    e_prev = np.zeros(N)
    for step, (x, lr, ratio) in enumerate(zip(grads(5), lrs, ratios)):
        payload = ef.compress(x, key=KEY, step=step, lr=lr)
        # p = x + float32(B_t * e): B_t and e have few bits, so B_t * e is exact in float64
        scaled = (ratio * e_prev).astype(np.float32).astype(np.float64)
        p32 = (f64(x) + scaled).astype(np.float32).astype(np.float64)
        assert_ef_identity(ef.residual, p32, f64(plain.decompress(payload, key=KEY, step=step)))
        e_prev = f64(ef.residual)
    assert ef.state_dict()["lr_max"] == 2.0
    with pytest.raises(ValueError, match="anneal=1 error feedback .* needs the current"):
        ef.compress(grads(1)[0], key=KEY, step=5)


def check_ef(value) -> str:
    return str(parse_ef(value))


def server_ef(value) -> str:
    return str(parse_ef(value).for_server())


def test_anneal_kinds_and_state():
    kind = check_ef(" Vanilla : decay = 0.8 , server_decay = 1, anneal = 1 ")
    assert kind == "vanilla:decay=0.8,server_decay=1.0,anneal=1"
    assert check_ef("vanilla:decay=0.8,anneal=0") == "vanilla:decay=0.8"
    assert server_ef(kind) == "vanilla:decay=1.0"  # a server's replies carry no lr
    assert server_ef("vanilla:decay=0.8,anneal=1") == "vanilla:decay=0.8"
    assert [ef_needs_lr(k) for k in (kind, "corrected", "vanilla:decay=0.8", "vanilla", "none",
                                     None)] == [True, True, False, False, False, False]
    with pytest.raises(ValueError, match="B = 1 has nothing to anneal"):
        check_ef("vanilla:anneal=1")
    for bad in ("vanilla:decay=0.8,anneal=2", "vanilla:decay=0.8,anneal=1,anneal=1",
                "corrected:anneal=1"):
        with pytest.raises(ValueError, match="and ',anneal=1'"):
            check_ef(bad)
    ef = make("trunc16", ef=kind)
    ef.compress(grads(1)[0], lr=0.5)
    state = ef.state_dict()
    assert state["lr_max"] == 0.5 and state["lr_prev"] == 0.5
    with pytest.raises(ValueError, match="missing \\['lr_max'\\]"):
        make("trunc16", ef=kind).load_state_dict({k: v for k, v in state.items()
                                                  if k != "lr_max"})
    with pytest.raises(ValueError, match="lr_max must be None or > 0"):
        make("trunc16", ef=kind).load_state_dict({**state, "lr_max": 0.0})
    with pytest.raises(ValueError, match="state is for kind 'vanilla:decay=0.8,server_decay"):
        make("trunc16", ef="vanilla:decay=0.8").load_state_dict(state)


def test_decay_one_is_vanilla_and_kinds_are_checked():
    a, b = make("onebit", ef="vanilla:decay=1"), make("onebit", ef="vanilla")
    for step, x in enumerate(grads(3)):
        assert torch.equal(a.compress(x, step=step), b.compress(x, step=step))
    assert check_ef(" Vanilla : decay = 0.90 ") == "vanilla:decay=0.9"
    assert check_ef("corrected") == "corrected"
    for bad in ("vanilla:decay=1.5", "vanilla:decay=-0.1", "vanilla:decay=nan",
                "vanilla:decay=x", "vanilla:dekay=0.5", "corrected:decay=0.5", "vanilla:"):
        with pytest.raises(ValueError, match="'vanilla:decay=B' with B in \\[0, 1\\]"):
            check_ef(bad)
    for bad in ("vanilla:decay=0.9,server_decay=2", "vanilla:decay=0.9,decay=0.8",
                "corrected:server_decay=1", "vanilla:decay=0.9,", "vanilla:server_dekay=1"):
        with pytest.raises(ValueError, match="optionally ',server_decay=S', S in \\[0, 1\\]"):
            check_ef(bad)
    state = make("onebit", ef="vanilla:decay=0.9").state_dict()
    assert state["kind"] == "vanilla:decay=0.9"
    with pytest.raises(ValueError, match="state is for kind 'vanilla:decay=0.9'"):
        make("onebit", ef="vanilla").load_state_dict(state)


def test_server_decay_applies_to_servers_only():
    kind = check_ef(" Vanilla : decay = 0.90 , server_decay = 1 ")
    assert kind == "vanilla:decay=0.9,server_decay=1.0"
    assert parse_ef(kind).factor == 0.9 and server_ef(kind) == "vanilla:decay=1.0"
    assert check_ef("vanilla:server_decay=0.5") == "vanilla:decay=1.0,server_decay=0.5"
    for same in ("vanilla", "vanilla:decay=0.9", "corrected", "sparse", None):
        assert server_ef(same) == check_ef(same)
    # a worker's residuals follow decay=B whatever server_decay says
    a, b = make("onebit", ef=kind), make("onebit", ef="vanilla:decay=0.9")
    for step, x in enumerate(grads(3)):
        assert torch.equal(a.compress(x, step=step), b.compress(x, step=step))
    assert a.state_dict()["kind"] == kind


@pytest.mark.parametrize("lr", [None, 0.0, -1.0, float("nan"), float("inf")])
def test_corrected_ef_requires_positive_lr(lr):
    ef = make("trunc16", ef="corrected")
    with pytest.raises(ValueError, match="lr"):
        ef.compress(grads(1)[0], lr=lr)
    assert ef.lr_prev is None


def test_vanilla_ef_ignores_lr_changes():
    a, b = make("trunc16", ef="vanilla"), make("trunc16", ef="vanilla")
    for step, x in enumerate(grads(3)):
        pa = a.compress(x, step=step, lr=0.1 / (step + 1))
        pb = b.compress(x, step=step)
        assert torch.equal(pa[40:], pb[40:])


def test_rejected_input_leaves_residual_intact():
    ef = make("trunc16", ef="vanilla")
    ef.compress(grads(1)[0])
    before = ef.residual.clone()
    bad = grads(1, seed=5)[0]
    bad[17] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ef.compress(bad)
    assert torch.equal(ef.residual, before)


def test_steady_state_reuses_buffers():
    ef = make("trunc16", ef="vanilla")
    out = torch.empty(ef.payload_bytes, dtype=torch.uint8)
    ptrs = set()
    for step, x in enumerate(grads(6)):
        assert ef.compress(x, step=step, out=out) is out
        ptrs.add(ef.residual.data_ptr())
    assert len(ptrs) <= 2  # the residual and the scratch alternate; nothing new is allocated


def test_bad_kind_and_double_wrap():
    with pytest.raises(ValueError, match="vanilla"):
        ErrorFeedback(make("none"), kind="bogus")
    with pytest.raises(TypeError, match="already has error feedback"):
        ErrorFeedback(make("none", ef="vanilla"))


# -- sparse EF ----------------------------------------------------------------------------------
def test_sparse_ef_rejects_codecs_without_indices():
    for spec in [s for s in SPECS if s.split(":")[0] != "randomk"]:
        with pytest.raises(ValueError, match=repr(make(spec).name)):
            make(spec, ef="sparse")


def test_sparse_ef_touches_only_selected_positions_and_conserves_mass():
    ef, plain = make("randomk:k=0.05", ef="sparse"), make("randomk:k=0.05")
    e_prev = torch.zeros(N)
    sent_total, in_total = 0.0, 0.0
    for step, x in enumerate(grads(5)):
        payload = ef.compress(x, key=KEY, step=step)
        idx = plain.indices(KEY, step)
        mask = torch.zeros(N, dtype=torch.bool)
        mask[idx] = True
        full = e_prev + x  # the wrapper's e += x, the same float32 addition
        sent = plain.decompress(payload)
        assert torch.equal(sent[mask], full[mask]) and not sent[~mask].any()
        assert not ef.residual[mask].any()                       # cleared
        assert torch.equal(ef.residual[~mask], full[~mask])     # carried
        sent_total += f64(sent).sum()
        in_total += f64(x).sum()
        e_prev = ef.residual.clone()
        scale = sum(f64(g).__abs__().sum() for g in grads(step + 1))
        assert abs(sent_total + f64(ef.residual).sum() - in_total) <= 1e-6 * scale


# -- momentum -------------------------------------------------------------------------------------
def test_nesterov_momentum_matches_float64_reference():
    mu = 0.9
    codec = make("none", momentum="nesterov", mu=mu)
    m = np.zeros(N)
    for step, g in enumerate(grads(5)):
        payload = codec.compress(g, step=step)
        m = mu * m + f64(g)
        p = f64(g) + mu * m
        np.testing.assert_allclose(f64(codec.decompress(payload)), p, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(f64(codec.momentum), m, rtol=1e-5, atol=1e-6)


def test_momentum_feeds_error_feedback():
    codec = make("trunc16", ef="vanilla", momentum="nesterov", mu=0.5)
    assert isinstance(codec, NesterovMomentum) and isinstance(codec.inner, ErrorFeedback)
    codec.compress(grads(1)[0])
    assert codec.residual is codec.inner.residual and codec.residual.abs().sum() > 0


@pytest.mark.parametrize("mu", [-0.1, 1.0, float("nan"), "0.9"])
def test_momentum_rejects_bad_mu(mu):
    with pytest.raises(ValueError, match="mu"):
        NesterovMomentum(make("none"), mu=mu)


# -- state ------------------------------------------------------------------------------------
def _state_cases() -> list[tuple[str, dict]]:
    cases = [(s, {"ef": "vanilla"}) for s in SPECS]
    cases += [(s, {"ef": "corrected", "momentum": "nesterov"}) for s in ("none", "trunc16")]
    cases += [(s, {"ef": "vanilla:decay=0.5,anneal=1"}) for s in ("onebit", "trunc16")]
    return [*cases, ("randomk:k=0.05", {"ef": "sparse"})]


@pytest.mark.parametrize(("spec", "kw"), _state_cases())
def test_state_dict_round_trip_continues_identically(spec, kw):
    xs, lrs = grads(6), [0.1, 0.1, 0.05, 0.05, 0.2, 0.1]

    def run(codec, steps):
        return [codec.compress(xs[s], key=KEY, step=s, lr=lrs[s]).clone() for s in steps]

    whole = run(make(spec, **kw), range(6))
    first = make(spec, **kw)
    run(first, range(3))
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = make(spec, **kw)
    resumed.load_state_dict(torch.load(buf))
    for a, b in zip(whole[3:], run(resumed, range(3, 6))):
        assert torch.equal(a, b)


def test_load_state_dict_validates():
    ef = make("trunc16", ef="vanilla")
    ef.compress(grads(1)[0])
    state = ef.state_dict()
    with pytest.raises(ValueError, match="missing \\['lr_prev'\\]"):
        ef.load_state_dict({k: v for k, v in state.items() if k != "lr_prev"})
    with pytest.raises(ValueError, match=r"residual.*\(999,\).*\(1000,\)"):
        make("trunc16", ef="vanilla").load_state_dict({**state, "residual": torch.zeros(999)})
    with pytest.raises(ValueError, match="kind 'vanilla'"):
        make("trunc16", ef="corrected").load_state_dict(state)
    mom = make("none", momentum="nesterov")
    with pytest.raises(ValueError, match="unexpected \\['extra'\\]"):
        mom.load_state_dict({**mom.state_dict(), "extra": 1})


def test_loaded_state_before_first_compress_is_visible():
    ef = make("trunc16", ef="vanilla")
    r = torch.arange(N, dtype=torch.float32)
    ef.load_state_dict({"kind": "vanilla", "residual": r, "lr_prev": None, "inner": {}})
    assert torch.equal(ef.residual, r)


# -- EFSpec ------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["vanilla", "corrected", "sparse", "none", "vanilla:decay=0.9",
                                  "vanilla:decay=1.0", "vanilla:decay=0.8,server_decay=1.0",
                                  "vanilla:decay=0.8,server_decay=1.0,anneal=1",
                                  "vanilla:decay=0.5,anneal=1"])
def test_efspec_round_trips_through_its_text(text):
    spec = parse_ef(text)
    assert str(spec) == text and parse_ef(str(spec)) == spec and parse_ef(spec) is spec
    if spec.enabled:  # the object and its text build the same codec
        codec = "randomk:k=0.1" if spec.kind == "sparse" else "trunc16"
        assert make(codec, ef=text).kind_text == make(codec, ef=spec).kind_text == text


def test_efspec_fields_are_checked_and_none_means_off():
    assert parse_ef(None) == parse_ef("none") == parse_ef(" None ") == EFSpec(kind="none")
    assert not parse_ef(None).enabled and not parse_ef("none").needs_lr
    assert EFSpec(kind="vanilla", decay=0.9) == parse_ef("vanilla:decay=0.9")
    assert str(EFSpec(kind="vanilla", server_decay=1)) == "vanilla:decay=1.0,server_decay=1.0"
    for bad, word in (({"kind": "fancy"}, "unknown ef 'fancy'"),
                      ({"kind": "corrected", "decay": 0.5}, "takes no options"),
                      ({"decay": 1.5}, "EFSpec.decay must be a number in \\[0, 1\\]"),
                      ({"decay": 0.5, "anneal": 1}, "EFSpec.anneal must be a bool")):
        with pytest.raises((ValueError, TypeError), match=word):
            EFSpec(**bad)
    with pytest.raises(TypeError, match="ef must be a str"):
        parse_ef(0.9)
    codec = build("onebit", N, ef=EFSpec(kind="vanilla", decay=0.5))
    assert codec.kind_text == "vanilla:decay=0.5"
    assert build("onebit", N, ef=EFSpec(kind="none")).residual is None
    assert build("onebit:ef=vanilla", N, ef=EFSpec(kind="vanilla")).kind == "vanilla"
    with pytest.raises(ValueError, match="ef given twice with different values"):
        build("onebit:ef=vanilla", N, ef=EFSpec(kind="corrected"))


# -- the server's reduce (gradpress.ps.reduce.reduce_pushes) ---------------------------------
def _reduce(dec, enc, pushes, *, step=0, lr=None, divisor=1, acc=None):
    acc = torch.full((dec.numel,), float("nan")) if acc is None else acc  # overwritten
    return reduce_pushes([(f"worker{i}", p) for i, p in enumerate(pushes)], dec, enc, acc,
                         key=KEY, step=step, lr=lr, divisor=divisor, label=f"key {KEY}")


@pytest.mark.parametrize("spec", SPECS)
def test_reduce_matches_codec_api_reference(spec):
    workers = [make(spec, ef="vanilla") for _ in range(3)]
    dec, enc = make(spec), make(spec, ef="vanilla")
    ref_plain, ref_ef = make(spec), make(spec, ef="vanilla")
    for step in range(3):
        pushes = [w.compress(g, key=KEY, step=step, lr=0.5)
                  for w, g in zip(workers, grads(3, seed=step))]
        reply = _reduce(dec, enc, pushes, step=step, lr=0.5, divisor=3)
        ref = torch.zeros(N)
        for p in pushes:
            ref_plain.decompress_add(p, ref)
        ref.div_(3)
        expected = ref_ef.compress(ref, key=KEY, step=step, lr=0.5)
        assert torch.equal(reply, expected)
        h = read_header(reply)
        assert (h.key, h.step, h.lr) == (KEY, step, 0.5)
        assert torch.equal(enc.residual, ref_ef.residual)


def test_reduce_lossless_is_the_plain_sum_in_rank_order():
    xs = [g * 1e3 ** i for i, g in enumerate(grads(4))]  # magnitudes where the order matters
    enc = make("none")
    pushes = [enc.compress(x, key=KEY) for x in xs]
    for divisor in (1, 4):
        reply = _reduce(make("none"), make("none"), pushes, divisor=divisor)
        ref = sum(xs)  # Python's sum starts at 0, in rank order
        ref = ref / divisor if divisor != 1 else ref
        assert torch.equal(make("none").decompress(reply).view(torch.int32),
                           ref.view(torch.int32))


def test_reduce_sum_keeps_the_server_residual():
    dec, enc = make("none"), make("trunc16", ef="vanilla")
    xs = grads(2)
    reply = _reduce(dec, enc, [make("none").compress(x, key=KEY) for x in xs])
    decoded = make("trunc16").decompress(reply)
    # the reply plus the server residual is exactly the (float32) sum
    torch.testing.assert_close(decoded + enc.residual, xs[0] + xs[1], rtol=0, atol=1e-6)


def test_reduce_errors_name_sender_and_key():
    codec, x = make("trunc16"), grads(1)[0]
    dec, enc = make("trunc16"), make("trunc16", ef="vanilla")
    good = codec.compress(x, key=KEY, step=4)
    for bad, word in ((codec.compress(x, key=KEY, step=5), "step 5, expected 4"),
                      (codec.compress(x, key=9, step=4), "key 9, expected 3"),
                      (make("none").compress(x, key=KEY, step=4), "codec id 0")):
        with pytest.raises(PayloadError, match=f"key 3: push from worker1 rejected: .*{word}"):
            _reduce(dec, enc, [good, bad], step=4)
    nan = x.clone()
    nan[7] = float("nan")
    with pytest.raises(PayloadError, match="push from worker2 rejected: it has non-finite"):
        _reduce(dec, enc, [good, good, TruncCodec(N, {}, nan_policy="allow").compress(
            nan, key=KEY, step=4)], step=4)
    assert not enc.residual.any()  # a rejected round leaves the server residual untouched

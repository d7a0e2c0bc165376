"""Invariants every registered codec must satisfy (they pick up new codecs as they register)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradpress.compress import HEADER_BYTES, build, codec_class, codec_names, parse_spec
from gradpress.compress.ef import ErrorFeedback

NAMES = codec_names()
#: The codecs gradpress ships (docs/reference/api.md); one missing from the registry is a failure.
SHIPPED = ("none", "fp16", "bf16", "onebit", "topk", "randomk", "dithering", "int2", "int3", "int4",
           "int8")
SIZES = (0, 1, 7, 8, 1000003)


def test_every_shipped_codec_is_registered():
    assert set(SHIPPED) <= set(NAMES), f"not registered: {sorted(set(SHIPPED) - set(NAMES))}"


def rand(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_payload_size_is_payload_bytes(name, numel):
    codec = build(name, numel)
    x = rand(numel)
    payload = codec.compress(x, key=1, step=2)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.payload_bytes
    out = torch.empty(codec.payload_bytes, dtype=torch.uint8)
    assert codec.compress(x, key=1, step=2, out=out) is out and torch.equal(out, payload)
    y = codec.decompress(payload, key=1, step=2)
    assert y.dtype == torch.float32 and y.shape == (numel,) and bool(torch.isfinite(y).all())
    assert build(name, numel, ef="vanilla").payload_bytes == codec.payload_bytes


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_under_seed(name):
    x = rand(4099, seed=3)
    a = build(name, 4099, seed=5).compress(x, key=7, step=9)
    b = build(name, 4099, seed=5).compress(x.clone(), key=7, step=9)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_decompress_add_matches_decompress(name):
    codec = build(name, 513)
    payload = codec.compress(rand(513), key=2, step=1)
    acc = rand(513, seed=1)
    expected = acc + (-0.5) * codec.decompress(payload)
    codec.decompress_add(payload, acc, alpha=-0.5, key=2, step=1)
    torch.testing.assert_close(acc, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_input_is_rejected(name):
    x = rand(64)
    x[5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        build(name, 64).compress(x)


@pytest.mark.parametrize("name", NAMES)
def test_header_rejection(name):
    codec = build(name, 100)
    payload = codec.compress(rand(100), key=4, step=6)
    with pytest.raises(ValueError, match="truncated"):
        codec.decompress(payload[:-1].clone())
    with pytest.raises(ValueError, match="truncated"):
        codec.decompress(payload[:HEADER_BYTES - 1].clone())
    with pytest.raises(ValueError, match="numel 100, expected 101"):
        build(name, 101).decompress(payload)
    bad = payload.clone()
    bad[2] = 200  # codec id byte
    with pytest.raises(ValueError, match="codec id 200"):
        codec.decompress(bad)
    bad = payload.clone()
    bad[0] = ord("X")
    with pytest.raises(ValueError, match="magic"):
        codec.decompress(bad)
    with pytest.raises(ValueError, match="key 4, expected 5"):
        codec.decompress(payload, key=5)
    with pytest.raises(ValueError, match="step 6, expected 7"):
        codec.decompress(payload, key=4, step=7)
    with pytest.raises(ValueError, match="from worker3 key 4"):
        codec.check_header(build(name, 101).compress(rand(101), key=4), sender="worker3")


@pytest.mark.parametrize("name", NAMES)
def test_other_codec_payload_is_rejected(name):
    others = [n for n in NAMES if n != name]
    payload = build(others[0], 50).compress(rand(50), key=1)
    with pytest.raises(ValueError, match="codec id"):
        build(name, 50).decompress(payload)


# -- spec parsing -------------------------------------------------------------------------------
def same_codec(a, b) -> bool:
    return (type(a) is type(b) and a.spec_text == b.spec_text and a.fingerprint == b.fingerprint
            and getattr(a, "kind", None) == getattr(b, "kind", None))


@pytest.mark.parametrize("name", NAMES)
def test_string_and_dict_forms_agree(name):
    text = build(f"{name}:ef=vanilla", 64)
    as_dict = build({"compressor": name, "ef": "vanilla"}, 64)
    as_arg = build(name, 64, ef="vanilla")
    assert isinstance(text, ErrorFeedback)
    assert same_codec(text, as_dict) and same_codec(text, as_arg)
    defaults = {p.name: p.default for p in codec_class(name).PARAMS}
    given = ",".join(f"{k}={v}" for k, v in defaults.items() if v is not None)
    full = build(f"{name}:{given}" if given else name, 64)
    assert same_codec(full, build(name, 64))
    assert same_codec(build({"compressor": name, **defaults}, 64), full)


def test_byteps_dict_onebit():
    a = build({"compressor": "onebit", "ef": "vanilla"}, 100)
    assert same_codec(a, build("onebit:ef=vanilla", 100))


def test_unknown_codec_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown codec 'nope'") as e:
        build("nope", 10)
    assert all(n in str(e.value) for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_unknown_param_lists_valid_ones(name):
    with pytest.raises(ValueError, match="unknown parameter") as e:
        build(f"{name}:bogus=1", 10)
    assert all(p.name in str(e.value) for p in codec_class(name).PARAMS)


@pytest.mark.parametrize(("name", "param"),
                         [(n, p.name) for n in NAMES for p in codec_class(n).PARAMS])
def test_bad_param_value_names_param_and_value(name, param):
    with pytest.raises(ValueError, match=f"{param}='@@'"):
        build(f"{name}:{param}=@@", 10)


def test_bad_wrapper_values():
    with pytest.raises(ValueError, match="valid: vanilla, corrected, sparse"):
        build("none:ef=bogus", 10)
    with pytest.raises(ValueError, match="nesterov"):
        build("none", 10, momentum="heavy")
    with pytest.raises(ValueError, match="given twice"):
        build("none:ef=vanilla", 10, ef="corrected")


# -- property tests on spec strings ----------------------------------------------------------
@st.composite
def spec_texts(draw):
    """A valid spec written in one of many equivalent ways (case, spacing, order, defaults)."""
    name = draw(st.sampled_from(NAMES))
    params = [p for p in codec_class(name).PARAMS if p.default is not None]
    chosen = draw(st.lists(st.sampled_from(params), unique_by=lambda p: p.name)) if params else []
    items = [f"{p.name}={p.default}" for p in chosen]
    if draw(st.booleans()):
        items.append("ef=" + draw(st.sampled_from(["vanilla", "corrected", "none"])))
    items = draw(st.permutations(items))
    pad = st.sampled_from(["", " ", "  "])
    body = ",".join(draw(pad) + i + draw(pad) for i in items)
    head = name.upper() if draw(st.booleans()) else name
    return (f"{draw(pad)}{head}:{body}" if body or draw(st.booleans()) else head), name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec_texts())
def test_equivalent_spec_strings_build_the_same_codec(case):
    text, name = case
    codec = build(text, 32)
    inner = codec.inner if isinstance(codec, ErrorFeedback) else codec
    assert same_codec(inner, build(name, 32))
    cs = parse_spec(text)
    assert same_codec(codec, build(dict(compressor=cs.name, **cs.params, **cs.wrappers), 32))


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_arbitrary_spec_strings_build_or_raise_value_error(text):
    try:
        build(text, 16)
    except ValueError:
        pass

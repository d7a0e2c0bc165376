"""The block-scaled integer codecs (int2, int3, int4, int8): format, zero exactness, error
feedback identity, numba/torch bit equality, hostile payloads."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpress.compress import HEADER_BYTES, build
from gradpress.compress.blockint import DEFAULT_BLOCK

BITS = {"int2": 2, "int3": 3, "int4": 4, "int8": 8}


def _rand(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(BITS))
@pytest.mark.parametrize("block", [8, 64, DEFAULT_BLOCK, 4104])
@pytest.mark.parametrize("numel", [1, 8, 127, 10_000])
def test_payload_size_is_a_pure_function(name: str, block: int, numel: int) -> None:
    codec = build(f"{name}:block={block}", numel)
    nblocks = -(-numel // block)
    assert codec.payload_bytes == HEADER_BYTES + 2 * nblocks + (numel * BITS[name] + 7) // 8


def test_int4_is_under_four_and_a_quarter_bits() -> None:
    codec = build("int4", 1 << 20)
    assert 8 * codec.payload_bytes / (1 << 20) < 4.13  # 4 + 16/128, plus the header


@pytest.mark.parametrize("name", sorted(BITS))
def test_error_is_at_most_half_a_step_of_the_block_scale(name: str) -> None:
    x = _rand(4096) * torch.logspace(-30, 10, 4096)  # blocks of very different magnitudes
    codec = build(name, x.numel())
    y = codec.decompress(codec.compress(x))
    levels = (1 << (BITS[name] - 1)) - 1
    blocks = x.view(-1, DEFAULT_BLOCK)
    step = blocks.abs().amax(1, keepdim=True) / levels * (1 + 2 ** -7)  # bf16 rounded up
    assert bool(((y.view_as(blocks) - blocks).abs() <= step / 2 * 1.0001).all())


@pytest.mark.parametrize("name", sorted(BITS))
def test_zero_is_exact_whatever_the_block(name: str) -> None:
    x = _rand(1000)
    x[::3] = 0.0
    x[256:384] = 0.0  # a whole zero block: scale 0
    codec = build(name, 1000)
    payload = codec.compress(x)
    y = codec.decompress(payload)
    assert bool((y[x == 0] == 0).all())
    scales = payload[HEADER_BYTES:HEADER_BYTES + 2 * codec.nblocks].numpy().view(np.uint16)
    assert scales[2] == 0


@pytest.mark.parametrize("name", sorted(BITS))
def test_error_feedback_keeps_a_parameter_without_gradient_still(name: str) -> None:
    ef = build(name, 300, ef="vanilla")
    for step in range(5):
        g = _rand(300, step)
        g[100:200] = 0.0
        y = ef.decompress(ef.compress(g, step=step))
        assert bool((y[100:200] == 0).all()) and bool((ef.residual[100:200] == 0).all())


@pytest.mark.parametrize("name", sorted(BITS))
def test_error_feedback_identity_is_exact(name: str) -> None:
    """p = D(C(p)) + e_new with no rounding: the residual is exact (Sterbenz: the decoded value
    lies within a factor of two of p, or is zero)."""
    ef = build(name, 5000, ef="vanilla")
    e = torch.zeros(5000)
    for step in range(4):
        g = _rand(5000, step) * 10.0 ** (step - 2)
        p = (g + e).double()  # the float32 input error feedback encodes
        y = ef.decompress(ef.compress(g, step=step)).double()
        e = ef.residual.clone()
        assert torch.equal(p, y + e.double())


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(BITS)), numel=st.integers(1, 3000),
       block=st.sampled_from([8, 16, 96, 128, 1024]), scale=st.floats(1e-30, 1e30),
       seed=st.integers(0, 2 ** 16), zeros=st.floats(0.0, 1.0))
def test_numba_and_torch_paths_agree_bit_for_bit(name: str, numel: int, block: int,
                                                 scale: float, seed: int, zeros: float) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * scale
    x[torch.rand(numel, generator=g) < zeros] = 0.0
    spec = f"{name}:block={block}"
    a, b = build(spec, numel, ef="vanilla"), build(spec, numel, ef="vanilla", backend="torch")
    for step in range(2):
        pa, pb = a.compress(x, step=step), b.compress(x, step=step)
        assert torch.equal(pa, pb)
        assert torch.equal(a.residual.view(torch.int32), b.residual.view(torch.int32))
        da, db = a.decompress(pa), b.decompress(pb)
        assert torch.equal(da.view(torch.int32), db.view(torch.int32))
        acc_a, acc_b = x.clone(), x.clone()
        a.decompress_add(pa, acc_a, alpha=-0.37)
        b.decompress_add(pb, acc_b, alpha=-0.37)
        assert torch.equal(acc_a.view(torch.int32), acc_b.view(torch.int32))


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_non_finite_input_is_rejected_and_the_residual_kept(backend: str) -> None:
    ef = build("int4", 400, ef="vanilla", backend=backend)
    ef.compress(_rand(400))
    before = ef.residual.clone()
    bad = _rand(400, 1)
    bad[77] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        ef.compress(bad, step=1)
    assert torch.equal(ef.residual, before)


def test_allowed_nan_reaches_the_receiver_in_its_block_only() -> None:
    codec = build("int4", 512, nan_policy="allow")
    x = _rand(512)
    x[300] = float("inf")
    payload = codec.compress(x)
    y = codec.decompress(payload)
    assert bool(torch.isnan(y[256:384]).all()) and bool(torch.isfinite(y[:256]).all())
    assert not codec.payload_finite(payload)


def test_hostile_scales_and_random_codes_are_seen_or_harmless() -> None:
    codec = build("int4", 1000)
    payload = codec.compress(_rand(1000))
    hostile = payload.clone()
    hostile[HEADER_BYTES:HEADER_BYTES + 2] = torch.tensor([0x80, 0x7F], dtype=torch.uint8)  # inf
    assert codec.payload_finite(payload) and not codec.payload_finite(hostile)
    rng = torch.Generator().manual_seed(1)
    noisy = payload.clone()
    noisy[HEADER_BYTES + 2 * codec.nblocks:] = torch.randint(
        0, 256, (codec.payload_bytes - HEADER_BYTES - 2 * codec.nblocks,), dtype=torch.uint8,
        generator=rng)
    assert bool(torch.isfinite(codec.decompress(noisy)).all())  # every code is a valid value
    with pytest.raises(ValueError, match="truncated"):
        codec.decompress(payload[:-1])


@pytest.mark.parametrize("block", [0, 7, 12, 1 << 17, "x"])
def test_bad_block_is_a_clear_error(block: object) -> None:
    with pytest.raises(ValueError, match="block"):
        build(f"int4:block={block}", 100)


def test_byteps_style_dict_spec() -> None:
    codec = build({"compressor": "int4", "block": 64, "ef": "vanilla"}, 1000)
    assert codec.inner.block == 64 and codec.spec_text == "int4:block=64"

"""Pure partitioning functions: chunk layout, keys by name, balanced key -> server assignment."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpress.ps.config import PSConfig
from gradpress.ps.partition import (
    KEY_BASE,
    KEY_LIMIT,
    assign_balanced,
    chunk_key,
    chunk_layout,
)


@pytest.mark.parametrize("numel,part,expected", [
    (0, 4000, []),
    (1, 4000, [(0, 1)]),
    (1000, 4000, [(0, 1000)]),
    (1001, 4000, [(0, 1000), (1000, 1)]),
    (2503, 4000, [(0, 1000), (1000, 1000), (2000, 503)]),
    (3, 2, [(0, 1), (1, 1), (2, 1)]),  # partitions below one element still make progress
    (10, 4 << 20, [(0, 10)]),
])
def test_chunk_layout_examples(numel: int, part: int, expected: list[tuple[int, int]]) -> None:
    chunks = chunk_layout(numel, part)
    assert [(c.offset, c.numel) for c in chunks] == expected
    assert [c.index for c in chunks] == list(range(len(expected)))


@given(numel=st.integers(0, 10**6), part=st.integers(1, 1 << 22))
@settings(max_examples=200, deadline=None)
def test_chunk_layout_covers_exactly(numel: int, part: int) -> None:
    chunks = chunk_layout(numel, part)
    per = max(1, part // 4)
    assert sum(c.numel for c in chunks) == numel
    pos = 0
    for c in chunks:
        assert c.offset == pos and 1 <= c.numel <= per
        pos += c.numel
    assert all(c.numel == per for c in chunks[:-1])


@pytest.mark.parametrize("bad", [(-1, 4), (5, 0), (1.5, 4), (True, 4)])
def test_chunk_layout_rejects_bad_input(bad: tuple) -> None:
    with pytest.raises(ValueError, match="must be an int"):
        chunk_layout(*bad)


def test_keys_depend_only_on_name_chunk_and_generation() -> None:
    names = [f"layer{i}.weight" for i in range(50)]
    first = {n: chunk_key(n, 0) for n in names}
    shuffled = names[:]
    random.Random(0).shuffle(shuffled)
    assert {n: chunk_key(n, 0) for n in shuffled} == first  # declaration order is irrelevant
    assert chunk_key("w", 0) == chunk_key("w", 0)
    assert len({chunk_key("w", i) for i in range(100)}) == 100
    assert chunk_key("w", 0, generation=1) != chunk_key("w", 0)


@given(name=st.text(min_size=1, max_size=40), index=st.integers(0, 10**6))
@settings(max_examples=200, deadline=None)
def test_keys_are_valid_gloo_tags(name: str, index: int) -> None:
    key = chunk_key(name, index)
    assert KEY_BASE <= key < KEY_LIMIT


def test_chunk_key_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="tensor name"):
        chunk_key("", 0)
    with pytest.raises(ValueError, match="chunk index"):
        chunk_key("w", -1)


def test_assign_balanced_balances_bytes() -> None:
    items = {k: 4000 for k in range(10)} | {100 + k: 7 * k for k in range(20)}
    out = assign_balanced(items, [0, 0, 0])
    loads = [0, 0, 0]
    for k, b in out.items():
        loads[b] += items[k]
    assert set(out) == set(items)
    assert max(loads) - min(loads) <= max(items.values())  # LPT bound


def test_assign_balanced_is_independent_of_input_order_and_uses_loads() -> None:
    items = {k: (k * 37) % 1000 + 1 for k in range(64)}
    reordered = dict(sorted(items.items(), key=lambda kv: -kv[0]))
    assert assign_balanced(items, [0, 0]) == assign_balanced(reordered, [0, 0])
    assert assign_balanced({5: 10}, [100, 0, 50]) == {5: 1}
    assert assign_balanced({5: 10, 6: 10}, [0, 0]) == {5: 0, 6: 1}  # ties: lowest key/bin


def test_assign_balanced_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one bin"):
        assign_balanced({1: 1}, [])
    with pytest.raises(ValueError, match="negative size"):
        assign_balanced({1: -1}, [0])


def test_resolve_codec_merges_call_spec_and_defaults() -> None:
    from gradpress.ps.calls import resolve_codec

    cfg = PSConfig(compression="onebit", ef="vanilla")
    spec, wrappers = resolve_codec(None, None, cfg)  # config defaults
    assert spec.name == "onebit" and wrappers == {"ef": "vanilla"}
    spec, wrappers = resolve_codec("topk:k=0.01,ef=Corrected,momentum=nesterov", None, cfg)
    assert (spec.name, dict(spec.params)) == ("topk", {"k": "0.01"})
    assert wrappers == {"ef": "corrected", "momentum": "nesterov"}
    assert resolve_codec("none", "none", cfg)[1] == {"ef": None}  # "none" switches EF off
    with pytest.raises(ValueError, match="ef given twice"):
        resolve_codec("onebit:ef=vanilla", "corrected", cfg)

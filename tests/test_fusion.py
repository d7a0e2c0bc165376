"""Fusion of small tensors (:mod:`gradpress.ps.fusion`, :mod:`gradpress.torch.fusion`).

In this process: the bucketing rule (examples and a hypothesis property), the fused keys'
names, the :class:`Fuser` against a fake push, the configuration and the plan's fused rows.
Two launches (fusion on, and off with ``GRADPRESS_FUSION_BYTES=0``) train the same models
through ``DistributedOptimizer`` and ``gp.OneBitLANS``: the parameters must be bit-identical
between the launches, the chunks pushed per step must drop, and the plan's bytes and chunks
must equal what was pushed.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradpress as gp
from gradpress.compress import build
from gradpress.ps.calls import Handle
from gradpress.ps.config import PSConfig
from gradpress.ps.fusion import FUSED_PREFIX, FusedKey, Fuser, fused_keys, fusion_groups


# -- the bucketing rule (pure) -----------------------------------------------------------------
def test_groups_respect_the_cap_and_keep_the_order() -> None:
    # 4 bytes an element: 10+10 = 80 B fit a 100 B cap, a third does not
    assert fusion_groups([10, 10, 10, 5], 100) == [range(0, 2), range(2, 4)]
    assert fusion_groups([10, 10, 5], 100) == [range(0, 3)]   # exactly 100 B fits
    assert fusion_groups([], 100) == []


def test_a_tensor_larger_than_the_cap_stands_alone() -> None:
    assert fusion_groups([3, 50, 3, 3], 100) == [range(0, 1), range(1, 2), range(2, 4)]
    assert fusion_groups([50], 100) == [range(0, 1)]
    assert fusion_groups([1, 2, 3], 0) == [range(0, 1), range(1, 2), range(2, 3)]  # off


def test_breaks_split_buckets() -> None:
    assert fusion_groups([1, 1, 1, 1], 100, breaks=["cpu", "cpu", "cuda:0", "cuda:0"]) == [
        range(0, 2), range(2, 4)]
    with pytest.raises(ValueError, match="one label per tensor"):
        fusion_groups([1, 1], 100, breaks=["cpu"])


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_groups_reject_bad_sizes(bad: object) -> None:
    with pytest.raises(ValueError, match="cap_bytes must be an int >= 0"):
        fusion_groups([1], bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"numels\[1\] must be an int >= 0"):
        fusion_groups([1, bad], 100)  # type: ignore[list-item]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=40), st.integers(0, 1000),
       st.lists(st.sampled_from("ab"), min_size=40, max_size=40))
def test_groups_property(numels: list[int], cap: int, labels: list[str]) -> None:
    breaks = labels[:len(numels)]
    groups = fusion_groups(numels, cap, breaks)
    assert groups == fusion_groups(list(numels), cap, list(breaks))  # pure: same input, same
    assert [i for g in groups for i in g] == list(range(len(numels)))  # in order, each once
    for n, g in enumerate(groups):
        assert len(g) >= 1 and len({breaks[i] for i in g}) == 1
        size = sum(4 * numels[i] for i in g)
        assert len(g) == 1 or size <= cap  # the cap holds unless a tensor is alone
        if n + 1 < len(groups):  # greedy: the next tensor did not fit (or is elsewhere)
            nxt = groups[n + 1][0]
            assert size + 4 * numels[nxt] > cap or breaks[nxt] != breaks[g[-1]]


def test_fused_keys_are_named_by_their_members() -> None:
    entries = [("a.bias", 10), ("b.bias", 10), ("big", 1000), ("c.bias", 5)]
    keys = fused_keys(entries, 100)
    assert len(keys) == 1  # "big" and "c.bias" are alone: not fused
    k = keys[0]
    assert k.members == ("a.bias", "b.bias") and k.numels == (10, 10)
    assert k.offsets == (0, 10) and k.numel == 20
    assert k.name.startswith(f"{FUSED_PREFIX}a.bias+1.")
    assert fused_keys(entries, 100) == keys  # every worker computes the same
    assert fused_keys([("a.bias", 10), ("b.bias", 11)], 100)[0].name != k.name  # sizes count
    with pytest.raises(ValueError, match="unique"):
        fused_keys([("a", 1), ("a", 1)], 100)


def test_config_field_and_environment() -> None:
    assert PSConfig().fusion_bytes is None and PSConfig().fusion_cap == 4 << 20
    assert PSConfig(partition_bytes=1024).fusion_cap == 1024  # one chunk by default
    assert PSConfig.from_env({"GRADPRESS_FUSION_BYTES": "0"}).fusion_cap == 0
    assert PSConfig.from_env({"GRADPRESS_FUSION_BYTES": "65536"}).fusion_cap == 65536
    with pytest.raises(ValueError, match=r"PSConfig.fusion_bytes must be an int >= 0, got -1"):
        PSConfig(fusion_bytes=-1)
    with pytest.raises(ValueError, match="GRADPRESS_FUSION_BYTES"):
        PSConfig.from_env({"GRADPRESS_FUSION_BYTES": "lots"})


# -- the Fuser against a fake push -------------------------------------------------------------
class FakePush:
    """Completes every push at once with twice the buffer (in place), recording it."""

    def __init__(self) -> None:
        self.pushed: list[tuple[str, torch.Tensor]] = []

    def __call__(self, buf: torch.Tensor, name: str) -> Handle:
        self.pushed.append((name, buf.clone()))
        buf.mul_(2)
        h = Handle(name, buf, buf.shape, buf.dtype, buf.device, 1)
        h._chunk_done()
        return h


def _fuser() -> tuple[Fuser, FakePush, FusedKey]:
    key = fused_keys([("a", 2), ("b", 3), ("c", 1)], 1000)[0]
    push = FakePush()
    return Fuser([key], push, timeout=5.0), push, key


def test_aligned_members_start_on_blocks_and_pad_with_zeros() -> None:
    key = fused_keys([("a", 3), ("b", 8), ("c", 1)], 1000, align=8)[0]
    assert key.offsets == (0, 8, 16) and key.numel == 17
    assert key.name != fused_keys([("a", 3), ("b", 8), ("c", 1)], 1000)[0].name
    assert fused_keys([("a", 3), ("b", 1)], 1000, exact=True)[0].exact
    push = FakePush()
    fuser = Fuser([key], push, timeout=5.0)
    fuser.add("a", torch.ones(3))
    fuser.add("c", torch.full((1,), 3.0))
    hb = fuser.add("b", torch.full((8,), 2.0))
    assert push.pushed[0][1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0] + [2] * 8 + [3]
    assert hb.wait().tolist() == [4.0] * 8
    with pytest.raises(ValueError, match="align must be an int >= 1, got 0"):
        fused_keys([("a", 1)], 10, align=0)


def test_a_reused_bucket_keeps_its_buffer_only_once_every_result_was_taken() -> None:
    key = fused_keys([("a", 3), ("b", 2)], 1000, align=4)[0]
    push = FakePush()
    fuser = Fuser([key], push, timeout=5.0, reuse=True)
    ha, hb = fuser.add("a", torch.ones(3)), fuser.add("b", torch.ones(2))
    first = push.pushed[0][1]
    assert first.tolist() == [1, 1, 1, 0, 1, 1]  # the gap zeroed on a fresh buffer
    ha.wait()
    hb2 = fuser.add("b", torch.full((2,), 3.0))  # next round before b's result was taken
    assert hb2._round.buf.data_ptr() != ha._round.buf.data_ptr()  # a new buffer
    fuser.flush()  # a missing: zeros
    assert push.pushed[1][1].tolist() == [0, 0, 0, 0, 3, 3]
    hb.wait(), hb2.wait()
    ha3 = fuser.add("a", torch.full((3,), 5.0))
    assert ha3._round.buf.data_ptr() == hb2._round.buf.data_ptr()  # every result taken: reused
    fuser.flush()  # b missing in a reused buffer: zeros, not last round's values
    assert push.pushed[2][1].tolist() == [5, 5, 5, 0, 0, 0]
    assert ha3.wait().tolist() == [10.0] * 3


def test_bucket_rule_per_codec() -> None:
    from gradpress.compress.spec import parse_spec
    from gradpress.torch.fusion import bucket_keys

    entries = [("w1", 100_000, "cpu"), ("b1", 10, "cpu"), ("w2", 100_000, "cpu"),
               ("b2", 10, "cpu")]

    def rule(spec: str | dict, exact: frozenset[str] = frozenset()) -> list[tuple]:
        keys = bucket_keys(entries, limit=4096, spec=parse_spec(spec), cap=1 << 20, exact=exact)
        return [(k.members, k.align, k.exact) for k in keys]

    # block-scaled: everything, backward order, aligned to the codec's block; exact names apart
    assert rule("int4") == [(("b2", "w2", "b1", "w1"), 128, False)]
    assert rule("int4:block=64", frozenset({"b1", "b2"})) == [
        (("w2", "w1"), 64, False), (("b2", "b1"), 1, True)]
    assert rule("none") == [(("b2", "w2", "b1", "w1"), 1, True)]
    # a tensor of the cap or more stands alone; its neighbours still share one bucket
    big = [("a", 10, "cpu"), ("w", 1 << 18, "cpu"), ("b", 10, "cpu")]
    assert [k.members for k in bucket_keys(big, limit=4096, spec=parse_spec("int4"),
                                           cap=1 << 20)] == [("b", "a")]
    # one scale per chunk (onebit), or an error feedback that needs each tensor's lr: the
    # small tensors only
    assert rule("onebit") == [(("b2", "b1"), 1, False)]
    assert rule({"compressor": "int4", "ef": "corrected"}) == [(("b2", "b1"), 128, False)]
    assert rule({"compressor": "onebit", "momentum": "nesterov"}) == []


def test_a_resume_with_another_bucket_layout_is_refused() -> None:
    from gradpress.ps.errors import CheckpointError
    from gradpress.torch.fusion import DENSE_SUFFIX, check_layout

    key = fused_keys([("a", 2), ("b", 3)], 1000, align=8)[0]
    fuser = Fuser([key], FakePush(), timeout=5.0)
    own = ["a", "b", "c"]
    check_layout(fuser, own, {key.name, key.name + DENSE_SUFFIX, "c", "other.x",
                              FUSED_PREFIX + "other.x+1.abc"})  # ours, or not this optimizer's
    for stray in ("a", "b" + DENSE_SUFFIX, fused_keys([("a", 2), ("b", 3)], 1000)[0].name):
        with pytest.raises(CheckpointError, match=re.escape(
                f"state of '{stray}' belongs to another bucket layout than this run's")):
            check_layout(fuser, own, {stray})


def test_fuser_pushes_when_the_last_member_arrives() -> None:
    fuser, push, key = _fuser()
    assert fuser.fuses("b") and not fuser.fuses("d")
    hc = fuser.add("c", torch.tensor([5.0]))       # any arrival order
    ha = fuser.add("a", torch.tensor([1.0, 2.0]))
    assert push.pushed == [] and not ha.done()
    hb = fuser.add("b", torch.tensor([[3.0, 4.0, 6.0]], dtype=torch.bfloat16))
    assert [n for n, _ in push.pushed] == [key.name]
    assert push.pushed[0][1].tolist() == [1.0, 2.0, 3.0, 4.0, 6.0, 5.0]
    assert ha.done() and ha.wait().tolist() == [2.0, 4.0]
    out = hb.wait()
    assert out.shape == (1, 3) and out.dtype == torch.bfloat16 and out.tolist() == [[6, 8, 12]]
    assert hc.wait().tolist() == [10.0]
    assert fuser.names(("", "@dense")) == {key.name, key.name + "@dense"}


def test_fuser_flushes_an_incomplete_bucket_at_wait_and_starts_new_rounds() -> None:
    fuser, push, key = _fuser()
    ha = fuser.add("a", torch.tensor([1.0, 2.0]), suffix="@dense")
    assert ha.wait().tolist() == [2.0, 4.0]  # pushed as it was: the missing members as zeros
    assert push.pushed[0][0] == key.name + "@dense"
    assert push.pushed[0][1].tolist() == [1.0, 2.0, 0.0, 0.0, 0.0, 0.0]
    # a member arriving twice starts the next round; the unfinished one is pushed first
    fuser.add("b", torch.ones(3))
    fuser.add("b", torch.full((3,), 7.0))
    assert [p[1].tolist() for p in push.pushed[1:]] == [[0, 0, 1, 1, 1, 0]]
    fuser.flush()
    assert push.pushed[-1][1].tolist() == [0, 0, 7, 7, 7, 0]
    with pytest.raises(ValueError, match="'c' has 2 elements, but its fused key"):
        fuser.add("c", torch.ones(2))
    with pytest.raises(ValueError, match="'d' is in none of the 1 fused keys"):
        fuser.add("d", torch.ones(1))


def test_fuser_reports_a_failed_push_to_every_member() -> None:
    def broken(buf: torch.Tensor, name: str) -> Handle:
        raise RuntimeError("engine failed")

    fuser = Fuser(fused_keys([("a", 1), ("b", 1)], 100), broken, timeout=1.0)
    ha = fuser.add("a", torch.ones(1))
    with pytest.raises(RuntimeError, match="engine failed"):
        fuser.add("b", torch.ones(1))  # the last member pushes: the error surfaces here
    with pytest.raises(RuntimeError, match="engine failed"):
        ha.wait()                      # ... and to the members waiting


# -- the plan ----------------------------------------------------------------------------------
def _model(layers: int = 6, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(width, 3))


def test_plan_rows_add_up_with_fused_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    m = _model()
    opt = gp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                  compression="onebit", ef="vanilla", min_compress_bytes=2048)
    plan = opt.plan()
    fused = [t for t in plan.tensors if t.fused]
    assert len(fused) == 6 * 3 + 2 and plan.fused_keys == 1  # biases, norms, the last layer
    assert sum(t.chunks for t in fused) == 1
    assert sum(t.bytes_per_step for t in fused) == build("none", sum(
        t.numel for t in fused)).payload_bytes
    assert plan.chunks_per_step == 6 + 1  # six compressed weights and one fused key
    assert "20 fused into 1 key(s)" in plan.format().splitlines()[-1]
    # a smaller cap: more fused keys; 0: none
    monkeypatch.setenv("GRADPRESS_FUSION_BYTES", "512")
    assert opt.plan().fused_keys > 1
    monkeypatch.setenv("GRADPRESS_FUSION_BYTES", "0")
    off = opt.plan()
    assert off.fused_keys == 0 and off.chunks_per_step == 6 + 20
    assert off.bytes_per_step - plan.bytes_per_step == 19 * build("none", 0).payload_bytes
    # worker-side momentum keeps state per key: no fusion
    monkeypatch.delenv("GRADPRESS_FUSION_BYTES")
    mom = gp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                  compression="onebit", momentum="nesterov",
                                  min_compress_bytes=2048)
    assert mom.plan().fused_keys == 0


# -- two launches: fusion on and off -----------------------------------------------------------
WORKER = textwrap.dedent('''
    import json, sys, torch, gradpress as gp
    out, tag = sys.argv[1], sys.argv[2]

    def model():
        torch.manual_seed(0)
        mods = []
        for _ in range(6):
            mods += [torch.nn.Linear(32, 32), torch.nn.LayerNorm(32), torch.nn.Tanh()]
        return torch.nn.Sequential(*mods, torch.nn.Linear(32, 3))

    def run(kind):
        m = model()
        named = [(f"{kind}.{n}", p) for n, p in m.named_parameters()]
        if kind == "dist":
            opt = gp.DistributedOptimizer(
                torch.optim.Adam(m.parameters(), lr=1e-2), named, compression="onebit",
                ef="vanilla", min_compress_bytes=2048, dense_steps=1, nan_policy="skip",
                uncompressed_params=())
        elif kind == "lans":
            opt = gp.OneBitLANS(named, lr=1e-2, compression="onebit", dense_steps=1,
                                min_compress_bytes=2048, uncompressed_params=())
        else:  # every tensor in buckets: int4 (aligned to its blocks, one exact) and none
            opt = gp.DistributedOptimizer(
                torch.optim.AdamW(m.parameters(), lr=1e-2), named, compression=kind,
                uncompressed_params=[f"{kind}.1.weight"] if kind == "int4" else ())
        chunks, pushed, skipped = [], [], []
        for step in range(4):
            g = torch.Generator().manual_seed(100 * step + gp.rank())
            s0 = gp.stats()
            opt.zero_grad()
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 3, (16,), generator=g)
            if kind == "dist" and step == 2 and gp.rank() == 1:
                x[0, 0] = float("inf")  # non-finite gradients: every worker skips the step
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            skipped.append(getattr(opt, "step_skipped", False))
            s1 = gp.stats()
            chunks.append(s1["chunks"] - s0["chunks"])
            pushed.append(s1["bytes_pushed"] - s0["bytes_pushed"])
        plan = opt.plan()
        return {"params": [p.detach().reshape(-1).tolist() for p in m.parameters()],
                "chunks": chunks, "pushed": pushed, "plan_bytes": plan.bytes_per_step,
                "plan_dense": plan.dense_bytes_per_step, "plan_chunks": plan.chunks_per_step,
                "fused_keys": plan.fused_keys, "skipped": skipped}

    gp.init()
    res = {kind: run(kind) for kind in ("dist", "lans", "int4", "none")}
    json.dump(res, open(f"{out}/{tag}{gp.rank()}.json", "w"))
    gp.shutdown()
''')


def _launch(tmp_path: Path, tag: str, env: dict[str, str],
            args: tuple[str, ...] = ("--servers", "1")) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", *args,
           "--", sys.executable, str(script), str(tmp_path), tag]
    base = {k: v for k, v in os.environ.items() if k != "GRADPRESS_FUSION_BYTES"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**base, **env})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return [json.loads((tmp_path / f"{tag}{r}.json").read_text()) for r in range(2)]


@pytest.mark.cluster
def test_fused_pushes_are_bit_identical_and_fewer(tmp_path: Path) -> None:
    on = _launch(tmp_path, "on", {})
    off = _launch(tmp_path, "off", {"GRADPRESS_FUSION_BYTES": "0"})
    for kind in ("dist", "lans"):
        a, b = on[0][kind], off[0][kind]
        assert a["params"] == on[1][kind]["params"] == b["params"] == off[1][kind]["params"]
        assert a["fused_keys"] == 1 and b["fused_keys"] == 0
        assert a["skipped"] == b["skipped"] == [False, False, kind == "dist", False]
        for run in (a, b):  # the plan's bytes and chunks are what was pushed (step 0: dense)
            assert run["pushed"][1:] == [run["plan_bytes"]] * 3, (kind, run)
            assert run["pushed"][0] == run["plan_dense"], (kind, run)
            assert run["chunks"][1:] == [run["plan_chunks"]] * 3, (kind, run)
        # 20 small tensors: one fused key instead of 20 keys a step
        assert b["chunks"][1] - a["chunks"][1] == 19, (a["chunks"], b["chunks"])
        assert a["chunks"][0] < b["chunks"][0]  # the dense step fuses them too
    # every tensor in buckets, large ones too: int4 cuts each member into the blocks it has
    # alone, none sums exactly; 25 tensors of int4 in one bucket, the exact one alone
    for kind, keys, saved in (("int4", 1, 25 - 1), ("none", 1, 26 - 1)):
        a, b = on[0][kind], off[0][kind]
        assert a["params"] == on[1][kind]["params"] == b["params"] == off[1][kind]["params"]
        assert (a["fused_keys"], b["fused_keys"]) == (keys, 0), kind
        assert b["chunks"][1] - a["chunks"][1] == saved, (kind, a["chunks"], b["chunks"])
        for run in (a, b):
            assert run["pushed"] == [run["plan_bytes"]] * 4, (kind, run)
            assert run["chunks"] == [run["plan_chunks"]] * 4, (kind, run)


@pytest.mark.cluster
def test_fused_pushes_through_hierarchical_aggregation(tmp_path: Path) -> None:
    # the node's leader pushes the fused keys of the node's sum; the other worker pushes none
    lead, other = _launch(tmp_path, "hier", {}, ("--colocate", "--hierarchical"))
    for kind in ("dist", "lans"):
        assert lead[kind]["params"] == other[kind]["params"]
        assert lead[kind]["fused_keys"] == 1
        assert lead[kind]["chunks"][1:] == [lead[kind]["plan_chunks"]] * 3
        assert lead[kind]["pushed"][1:] == [lead[kind]["plan_bytes"]] * 3


RESUME = textwrap.dedent('''
    import sys, torch, gradpress as gp
    from gradpress import checkpoint
    ckpt, mode = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    gp.init()
    opt = gp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters())
    if mode == "load":
        checkpoint.load(ckpt, m, opt)
    for step in range(2):
        g = torch.Generator().manual_seed(step + 10 * gp.rank())
        opt.zero_grad()
        m(torch.randn(8, 32, generator=g)).square().mean().backward()
        opt.step()
    if mode == "save":
        checkpoint.save(ckpt, m, opt, step=2)
    gp.shutdown()
''')


@pytest.mark.cluster
def test_a_checkpoint_of_other_buckets_is_refused_at_the_first_step(tmp_path: Path) -> None:
    # saved with every tensor under its own key, resumed with buckets: the residuals of the
    # saved keys would be left unused, so the first step refuses, naming one of them
    script = tmp_path / "resume.py"
    script.write_text(RESUME)

    def launch(mode: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers",
               "1", "--", sys.executable, str(script), str(tmp_path / "ck"), mode]
        base = {k: v for k, v in os.environ.items() if k != "GRADPRESS_FUSION_BYTES"}
        return subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                              env={**base, **env})

    saved = launch("save", {"GRADPRESS_FUSION_BYTES": "0"})
    assert saved.returncode == 0, saved.stderr[-3000:]
    other = launch("load", {})
    assert other.returncode != 0
    assert "CheckpointError: the loaded codec state of '0.bias' belongs to another bucket " \
           "layout than this run's (1 buckets)" in other.stderr, other.stderr[-3000:]

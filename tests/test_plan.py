"""``opt.plan()``: one row per communicated tensor, equal to the real traffic.

Two cluster runs (a few steps each): a launched script that compares each plan with
``gp.stats()["bytes_pushed"]`` per step, and ``gradpress train`` whose report holds the plan.
Everything else runs in this process, before ``gp.init()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import gradpress as gp
from gradpress.compress import build
from gradpress.compress.spec import CodecSpec
from gradpress.tasks import get_task
from gradpress.torch.agreement import auto_min_compress_bytes
from gradpress.torch.plan import Decision, Plan, TensorPlan, plan_rows


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(100, 80), torch.nn.Tanh(),
                               torch.nn.Linear(80, 60), torch.nn.Tanh(), torch.nn.Linear(60, 3))


def _row(plan: Plan, name: str) -> TensorPlan:
    return next(t for t in plan.tensors if t.name == name)


def test_plan_before_init_rows_and_reasons() -> None:
    assert not gp.is_initialized()
    m = _model()
    opt = gp.CLAN(m.named_parameters(), compression="topk:k=0.01,values=fp16", dense_steps=3,
                  min_compress_bytes=16 << 10, uncompressed_params=["2.weight"])
    plan = opt.plan()
    assert isinstance(plan, Plan) and plan.communicates == "gradient"
    assert plan.dense_steps == 3 and plan.ef == "vanilla"
    # the optimizer's parameter order (CLAN's weight-decay groups: matrices first)
    names = [n for g in opt.param_groups for n in (opt._gp_names[p] for p in g["params"])]
    assert [t.name for t in plan.tensors] == names == [t.key for t in plan.tensors]
    big = _row(plan, "0.weight")
    assert big.codec == "topk:k=0.01,values=fp16" and big.compressed
    assert big.reason == "compressed with topk:k=0.01,values=fp16"
    assert big.bytes_per_step == build("topk:k=0.01,values=fp16", 8000).payload_bytes
    assert big.fp32_bytes == 32000 and big.numel == 8000 and big.chunks == 1
    named = _row(plan, "2.weight")
    assert (named.codec, named.reason) == ("exact", "named in uncompressed_params")
    small = _row(plan, "0.bias")
    assert small.codec == "exact"
    assert small.reason == "below min_compress_bytes (16 KiB); in bucket 1 (4 tensors)"
    # the small tensors share one fused key, its header counted on its first member (the
    # last parameter: fused keys follow the reverse parameter order, as backward does)
    assert small.bytes_per_step == 4 * 80 and small.chunks == 0
    first = _row(plan, "4.bias")
    assert first.fused == small.fused and first.chunks == 1
    assert first.bytes_per_step == build("none", 3 + 80 + 60 + 180).payload_bytes - 4 * 320
    assert plan.fused_keys == 1 and plan.chunks_per_step == 3
    assert plan.compressed_tensors == 1  # 2.weight is large enough, but named
    assert plan.bytes_per_step == sum(t.bytes_per_step for t in plan.tensors)
    assert plan.ratio == plan.fp32_bytes / plan.bytes_per_step
    assert plan.dense_bytes_per_step == (build("none", 323).payload_bytes
                                         + build("none", 8000).payload_bytes
                                         + build("none", 4800).payload_bytes)


def test_plan_chunks_and_defaults_follow_the_runtime_config(monkeypatch) -> None:
    monkeypatch.setenv("GRADPRESS_PARTITION_BYTES", str(12 << 10))   # 3072 elements a chunk
    monkeypatch.setenv("GRADPRESS_MIN_COMPRESS_BYTES", str(20 << 10))
    m = _model()
    opt = gp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                  compression="onebit", min_compress_bytes=None)
    plan = opt.plan()
    assert plan.partition_bytes == 12 << 10 and plan.min_compress_bytes == 20 << 10
    big = _row(plan, "0.weight")  # 8000 = 3072 + 3072 + 1856 elements
    assert big.chunks == 3
    assert big.bytes_per_step == sum(build("onebit", n).payload_bytes for n in (3072, 3072, 1856))
    assert _row(plan, "2.weight").reason == "below min_compress_bytes (20 KiB)"  # 19.2 KB
    assert plan.ef == "vanilla"  # a lossy codec gets error feedback unless told otherwise


def test_nothing_compressed_and_the_nonfinite_flag() -> None:
    m = _model()
    opt = gp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                  compression="none", nan_policy="skip",
                                  min_compress_bytes=1 << 20)
    plan = opt.plan()
    assert plan.compressed_tensors == 0
    # every tensor is below 1 MiB: all six share one fused key
    assert {t.reason for t in plan.tensors[:-1]} == {
        "compression is none; in bucket 1 (6 tensors)"}
    flag = plan.tensors[-1]
    assert flag.name == "gradpress.nonfinite" and flag.numel == 1 and flag.codec == "exact"
    assert "nothing is compressed" in plan.format().splitlines()[0]


def test_onebit_lans_plans_the_momentum() -> None:
    m = _model()
    opt = gp.OneBitLANS(m.named_parameters(), compression="onebit", dense_steps=5,
                        min_compress_bytes=16 << 10, uncompressed_params=["4.weight"])
    plan = opt.plan()
    assert plan.communicates == "momentum" and plan.dense_steps == 5
    assert plan.ef == "vanilla:decay=0.8,server_decay=1.0"
    assert all(t.reason.startswith("momentum ") for t in plan.tensors)
    assert all(t.key == f"0.weight.clan_m.{i}" for i, t in enumerate(plan.tensors))
    assert _row(plan, "0.weight").codec == "onebit"
    assert _row(plan, "4.weight").reason == ("momentum named in uncompressed_params; in bucket 1 "
                                             "(4 tensors)")  # small: fused, too
    # the dense phase: bf16 for the tensors not kept exact by name or size, fp32 for the rest
    assert plan.to_dict()["dense_codec"] == "bf16" and "(bf16, " in plan.format()
    none = gp.OneBitLANS(_model().named_parameters(), compression="none", dense_steps=5,
                         min_compress_bytes=16 << 10, uncompressed_params=["4.weight"]).plan()
    assert none.to_dict()["dense_codec"] == "exact"
    half = sum(2 * t.numel for t in plan.tensors
               if t.name != "4.weight" and 4 * t.numel >= 16 << 10)
    assert 0 < none.dense_bytes_per_step - plan.dense_bytes_per_step <= half
    assert none.dense_bytes_per_step - plan.dense_bytes_per_step >= half - 1024  # headers


def test_plan_is_deterministic_and_json_ready() -> None:
    a = gp.CLAN(_model(0).named_parameters(), min_compress_bytes=1 << 10).plan()
    b = gp.CLAN(_model(1).named_parameters(), min_compress_bytes=1 << 10).plan()
    assert a == b and a.to_dict() == b.to_dict() and a.format() == b.format()
    d = json.loads(json.dumps(a.to_dict()))
    assert d["bytes_per_step"] == a.bytes_per_step and len(d["tensors"]) == len(a.tensors)
    assert d["tensors"][0] == {"name": "0.weight", "key": "0.weight", "numel": 8000,
                               "codec": "onebit", "chunks": 1,
                               "bytes_per_step": a.tensors[0].bytes_per_step,
                               "fp32_bytes": 32000, "reason": "compressed with onebit; "
                               "agreement not measured yet (dense phase)", "fused": None}


def test_format_is_a_fixed_width_table() -> None:
    plan = gp.CLAN(_model().named_parameters(), min_compress_bytes=16 << 10).plan()
    lines = plan.format().splitlines()
    assert lines[0].startswith("gradpress plan: the gradient travels compressed after 100 "
                               "dense steps")
    head, rows, total = lines[1], lines[2:-2], lines[-1]
    assert head.split() == ["tensor", "elements", "codec", "pushed/step", "fp32", "reason"]
    assert len(rows) == len(plan.tensors) and set(lines[-2]) == {"-"}
    col = head.index("reason")
    assert all(r[col - 2:col] == "  " and r[col] != " " for r in rows)
    assert total.startswith("total") and "2 of 6 compressed" in total


def test_a_rule_can_decide_per_tensor() -> None:
    def rule(name: str, numel: int, **_: object) -> Decision:
        if name == "a":
            return Decision(codec=CodecSpec("fp16"), reason="relative error 0.001")
        return Decision(codec=None, reason="relative error 0.9: exact")

    rows = plan_rows([("a", "a", 10, False), ("b", "b", 10, False)], spec=CodecSpec("onebit"),
                     min_compress_bytes=0, partition_bytes=1 << 20, decide_fn=rule)
    assert [(r.codec, r.reason) for r in rows] == [("fp16", "relative error 0.001"),
                                                   ("exact", "relative error 0.9: exact")]


WORKER = textwrap.dedent('''
    import json, sys, torch, gradpress as gp

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(100, 80), torch.nn.Tanh(),
                                   torch.nn.Linear(80, 60), torch.nn.Tanh(),
                                   torch.nn.Linear(60, 3))

    def opts():
        m1, m2 = model(), model()
        a = gp.DistributedOptimizer(
            torch.optim.SGD(m1.parameters(), lr=0.1),
            [(f"g.{n}", p) for n, p in m1.named_parameters()], compression="onebit",
            ef="vanilla", min_compress_bytes=16 << 10, uncompressed_params=["g.2.weight"],
            nan_policy="skip", dense_steps=1)
        b = gp.OneBitLANS([(f"m.{n}", p) for n, p in m2.named_parameters()],
                          compression="topk:k=0.01,values=fp16", dense_steps=1,
                          min_compress_bytes=16 << 10, uncompressed_params=())  # not measured
        return (m1, a), (m2, b)

    before = [o.plan().to_dict() for _, o in opts()]   # before init
    gp.init()
    res = {"before": before, "after": [], "pushed": []}
    for tag, (m, opt) in zip("gm", opts()):
        gp.broadcast_parameters({f"{tag}.{k}": v for k, v in m.state_dict().items()})
        pushed = []
        for step in range(3):
            g = torch.Generator().manual_seed(10 * step + gp.rank())
            opt.zero_grad()
            s0 = gp.stats()["bytes_pushed"]
            m(torch.randn(8, 100, generator=g)).square().mean().backward()
            opt.step()
            pushed.append(gp.stats()["bytes_pushed"] - s0)
        res["after"].append(opt.plan().to_dict())
        res["pushed"].append(pushed)
    json.dump(res, open(f"{sys.argv[1]}/plan{gp.rank()}.json", "w"))
    gp.shutdown()
''')


@pytest.mark.cluster
def test_plan_bytes_equal_the_pushed_bytes(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "GRADPRESS_PARTITION_BYTES": str(12 << 10)}  # several chunks
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "1",
           "--", sys.executable, str(script), str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    w0, w1 = (json.loads((tmp_path / f"plan{r}.json").read_text()) for r in range(2))
    assert w0["after"] == w1["after"] == w0["before"] == w1["before"]  # every worker, any time
    for plan, pushed in zip(w0["after"], w0["pushed"]):
        assert plan["compressed_tensors"] >= 1
        assert any(t["chunks"] > 1 for t in plan["tensors"])
        # step 0 is dense; then exactly the plan's bytes per step
        assert pushed == [plan["dense_bytes_per_step"], plan["bytes_per_step"],
                          plan["bytes_per_step"]], plan["communicates"]
    assert w0["pushed"] == w1["pushed"]


@pytest.mark.cluster
def test_train_prints_the_plan_once_and_reports_it(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gradpress.cli", "train", "--task", "digits-cnn", "--steps",
           "3", "--compression", "onebit", "--dense-steps", "2", "--no-progress", "--out",
           str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert p.stdout.count("plan of run run: the gradient travels compressed after 2 dense") == 1
    rep = json.loads((out / "report.json").read_text())
    plan = rep["plan"]
    assert plan["step"] == 2 and plan["dense_steps"] == 2
    # gradpress train's default, as the factories': measured from the model's sizes
    model = get_task("digits-cnn").build_model(0)
    assert plan["min_compress_bytes"] == auto_min_compress_bytes(
        4 * p.numel() for p in model.parameters()) == 36 << 10
    assert plan["compressed_tensors"] == rep["codec"]["compressed_tensors"] > 0
    assert plan["bytes_per_step"] == rep["bytes_per_step"]["push_last"]
    for t in plan["tensors"]:  # and uncompressed_params="auto": measured in the dense phase
        assert t["reason"].startswith(("compressed with onebit; gradients agree",
                                       "below min_compress_bytes (36 KiB); in bucket 1",
                                       "gradients agree")), t
    assert plan["bytes_per_step"] == rep["codec"]["model_wire_bytes"]


@pytest.mark.parametrize("compressed", [True, False])
def test_print_plan(capsys: pytest.CaptureFixture, compressed: bool) -> None:
    from gradpress.train.report import print_plan

    plan = gp.CLAN(_model().named_parameters(), min_compress_bytes=16 << 10).plan()
    print_plan(plan, compressed, run="r1")
    text = capsys.readouterr().out
    if compressed:
        assert text == plan.format("plan of run r1") + "\n"
        assert text.splitlines()[1:] == plan.format().splitlines()[1:]
    else:
        assert text == "plan of run r1: nothing is compressed (compression none), 6 tensors\n"

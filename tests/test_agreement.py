"""Which tensors travel exact, measured in the dense phase (``uncompressed_params="auto"``).

Unit tests of :class:`gradpress.torch.agreement.AgreementMeter`, and one real 2-worker launch
where one tensor's gradient is common to the workers and the other's is independent noise:
gp.OneBitLANS and gp.CLAN keep the noisy one exact, the same on both workers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gradpress.torch.agreement import AGREEMENT_THRESHOLD, AgreementMeter
from helpers import worker_results


def _measure(grads_per_step: list[list[torch.Tensor]]) -> float:
    """The agreement of one tensor whose workers' gradients are given per step."""
    meter = AgreementMeter(["t"])
    parts = []
    for grads in grads_per_step:
        avg = sum(grads) / len(grads)
        for g in grads:  # each worker alone: its gradient, then the average
            m = AgreementMeter(["t"])
            m.add_local("t", g)
            m.add_average("t", avg)
            parts.append(m._sums["t"])
        meter.steps += 1
    meter._sums["t"] = sum(parts)
    w = len(grads_per_step[0])
    return meter.decide(lambda v: v, w).values["t"]


def test_identical_gradients_agree_fully() -> None:
    g = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert _measure([[g, g.clone()] for _ in range(5)]) == pytest.approx(1.0)


@pytest.mark.parametrize("workers", [2, 4])
def test_independent_noise_agrees_about_zero(workers: int) -> None:
    gen = torch.Generator().manual_seed(1)
    steps = [[torch.randn(4096, generator=gen) for _ in range(workers)] for _ in range(20)]
    assert abs(_measure(steps)) < 0.05


def test_signal_plus_noise_measures_the_signal_share() -> None:
    gen = torch.Generator().manual_seed(2)
    mu = torch.randn(4096, generator=gen)
    steps = [[mu + torch.randn(4096, generator=gen) for _ in range(2)] for _ in range(20)]
    assert _measure(steps) == pytest.approx(0.5, abs=0.05)  # ||mu||^2 = sigma^2


def test_one_worker_or_no_step_compresses_everything() -> None:
    m = AgreementMeter(["a", "b"])
    assert m.decide(lambda v: v, 1).exact == frozenset()
    assert AgreementMeter(["a"]).decide(lambda v: v, 2).values == {"a": 1.0}


def test_state_dict_round_trip_and_decision_once() -> None:
    m = AgreementMeter(["a", "b"])
    m.add_local("a", torch.ones(3))
    m.add_average("a", torch.zeros(3))
    m.add_local("b", torch.ones(3))
    m.add_average("b", torch.ones(3))
    m.end_step()
    n = AgreementMeter(["b", "a"])
    n.load_state_dict(m.state_dict())
    calls = []
    r = n.decide(lambda v: calls.append(1) or 2 * v, 2)  # two workers saw the same
    assert r.exact == frozenset({"a"}) and r.values["b"] == pytest.approx(1.0)
    assert n.decide(lambda v: calls.append(1) or v, 2) is r and len(calls) == 1
    assert r.values["a"] < AGREEMENT_THRESHOLD and "exact" in r.reason("a")
    with pytest.raises(ValueError, match="tensors"):
        AgreementMeter(["c"]).load_state_dict(m.state_dict())


WORKER = textwrap.dedent('''
    import sys, torch, gradpress as gp
    out = sys.argv[1]
    gp.init()
    r = gp.rank()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.signal = torch.nn.Parameter(torch.full((64, 64), 0.1))
            self.noise = torch.nn.Parameter(torch.full((64, 64), 0.1))

    res = {}
    common = torch.linspace(-1, 1, 4096).reshape(64, 64)
    for kind, factory in (("onebitlans", gp.OneBitLANS), ("clan", gp.CLAN)):
        m = Net()
        opt = factory([(f"{kind}.{n}", p) for n, p in m.named_parameters()], lr=0.01,
                      dense_steps=6, min_compress_bytes=0)
        for step in range(10):
            opt.zero_grad()
            g = torch.Generator().manual_seed(100 * step + r)
            own = torch.randn(64, 64, generator=g)
            loss = (m.signal * (common + 0.1 * own)).sum() + (m.noise * own).sum()
            loss.backward()
            opt.step()
        a = opt.decide_exact()
        res[kind] = {"exact": sorted(a.exact), "values": dict(a.values), "steps": a.steps,
                     "plan": {t.name: (t.codec, t.reason) for t in opt.plan().tensors},
                     "params": torch.cat([p.detach().reshape(-1) for p in m.parameters()])}
    torch.save(res, f"{out}/worker{r}.pt")
    gp.shutdown()
''')


@pytest.mark.cluster
def test_noisy_tensor_travels_exact_on_every_worker(tmp_path: Path) -> None:
    w0, w1 = worker_results(tmp_path, WORKER)
    for kind in ("onebitlans", "clan"):
        assert w0[kind]["exact"] == [f"{kind}.noise"], w0[kind]
        assert w0[kind]["values"] == w1[kind]["values"]  # decided identically
        assert w0[kind]["steps"] == 6
        assert w0[kind]["values"][f"{kind}.signal"] > 0.9
        assert torch.equal(w0[kind]["params"], w1[kind]["params"])
        codec, reason = w0[kind]["plan"][f"{kind}.noise"]  # the plan says what was measured
        assert codec == "exact" and "agree" in reason, reason
        codec, reason = w0[kind]["plan"][f"{kind}.signal"]
        assert codec == "onebit" and "agree" in reason, reason


def test_auto_min_compress_bytes_compresses_most_bytes_of_any_model() -> None:
    from gradpress.torch.agreement import auto_min_compress_bytes

    # a small model: its matrices (95%+ of the bytes) compressed, biases exact
    assert auto_min_compress_bytes([64 << 10, 64 << 10, 512, 512]) == 64 << 10
    # a large one: every tensor of 1 MiB or more, whatever the share
    assert auto_min_compress_bytes([64 << 20, 2 << 20, 1 << 20, 4096]) == 1 << 20
    assert auto_min_compress_bytes([]) == 1 << 20


@pytest.mark.parametrize("task", ["digits-cnn", "stdlib-mlm"])
def test_auto_min_compress_bytes_on_the_bundled_tasks(task: str) -> None:
    import gradpress as gp
    from gradpress.tasks import get_task

    model = get_task(task).build_model(0)
    auto = gp.OneBitLANS(model.named_parameters(), uncompressed_params=()).plan()
    by_hand = gp.OneBitLANS(model.named_parameters(), uncompressed_params=(),
                            min_compress_bytes=16 << 10).plan()  # gradpress train's default
    assert [t.codec for t in auto.tensors] == [t.codec for t in by_hand.tensors]
    assert auto.compressed_tensors >= 6 and auto.ratio > 10


@pytest.mark.cluster
def test_gradpress_train_uncompressed_params_auto(tmp_path: Path) -> None:
    """`gradpress train --uncompressed-params auto`: measured in the dense phase, and every
    compressible tensor's plan row gives its measured agreement."""
    import json

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gradpress.cli", "train", "--task", "digits-cnn", "--steps", "4",
           "--dense-steps", "2", "--compression", "onebit", "--uncompressed-params", "auto",
           "--no-progress", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    plan = json.loads((out / "report.json").read_text())["plan"]
    reasons = [t["reason"] for t in plan["tensors"] if t["fp32_bytes"] >= 16 << 10]
    assert reasons and all("agree" in r for r in reasons), reasons

"""The health watch of OneBitLANSCore (gradpress.optim.health): a compressed momentum that drifts
from its exact average is seen at the next probe, travels exact for a while and comes back with
fresh residuals; a healthy run is left alone.

One worker in-process: the link is the real one-bit codec with the workers' and the server's
error feedback (``gradpress.compress.build``), keyed by generation as ``gp.OneBitLANS`` keys it.
The drift is provoked: for a few steps the link delivers the opposite of what it should.
"""

from __future__ import annotations

import logging

import pytest
import torch

from gradpress.compress import build
from gradpress.optim import OneBitLANSCore
from gradpress.optim.health import HealthWatch

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DENSE, STEPS = 2, 40
SPIKE = 10  # from this step on, parameter 0's first-generation keys deliver -a: codec state
            # gone bad, which only fresh keys (residuals) cure


class Link:
    """``communicate`` of one worker: ``"<i>"`` through one-bit two ways (fresh codecs per
    generation), ``"<i>.probe"`` and recovering tensors exact; from step ``spike`` on, the
    first-generation keys of parameter 0 deliver the opposite of their average."""

    def __init__(self, spike: int | None = None) -> None:
        self.spike, self.opt, self.codecs = spike, None, {}
        self.exact_while_recovering: list[tuple[int, int]] = []  # (parameter, step)

    def _roundtrip(self, name: str, t: torch.Tensor) -> torch.Tensor:
        flat = t.detach().reshape(-1).float().clone()
        for side in ("worker", "server"):
            if (name, side) not in self.codecs:
                self.codecs[name, side] = build("onebit", flat.numel(),
                                                ef="vanilla:decay=0.8,server_decay=1.0")
            c = self.codecs[name, side]
            flat = c.decompress(c.compress(flat))
        return flat.reshape(t.shape)

    def __call__(self, key: str, t: torch.Tensor) -> torch.Tensor:
        if "." in key:                                   # probes (and rows): exact
            return t.clone()
        i, opt = int(key), self.opt
        step = int(opt.state[opt._param(i)]["step"])
        if opt.recovering(i):
            self.exact_while_recovering.append((i, step))
            return t.clone()
        a = self._roundtrip(f"{key}.g{opt.generation(i)}", t)
        bad = self.spike is not None and i == 0 and step >= self.spike and not opt.generation(i)
        return -a if bad else a


def _run(link: Link, watch: HealthWatch | None) -> tuple[torch.nn.Module, OneBitLANSCore]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = OneBitLANSCore(model.parameters(), lr=0.01, dense_steps=DENSE, communicate=link,
                     hold_idle_rows=True, watch=watch)
    opt.param_names = {0: "fc.weight", 1: "fc.bias"}
    link.opt = opt
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def test_a_provoked_drift_is_seen_recovered_from_and_counted(caplog):
    watch = HealthWatch(every=5, recover_steps=3)
    clean, clean_opt = _run(Link(), watch)
    with caplog.at_level(logging.WARNING, logger="gradpress.optim.health"):
        link = Link(spike=SPIKE)
        model, opt = _run(link, watch)
    st = opt.state[model.weight]
    # probes at steps 7, 12, 17, ...: the bad keys are seen at step 12
    assert [t for t, _ in st["probe_log"]][:3] == [7, 12, 17]
    assert dict(st["probe_log"])[12] < 0 < dict(st["probe_log"])[7]
    assert st["recoveries"] == 1 and opt.generation(0) == 1
    exact = [t for i, t in link.exact_while_recovering if i == 0]
    assert exact == [13, 14, 15]                              # exact for recover_steps
    assert "fc.weight drifted at step 12" in caplog.text
    # after the recovery (fresh residuals) the compressed step agrees with the exact average
    assert all(c > 0 for t, c in st["probe_log"] if t > 12)
    # a healthy run is left alone: every probe positive, nothing recovered
    cst = clean_opt.state[clean.weight]
    assert all(c > 0 for _, c in cst["probe_log"]) and "recoveries" not in cst
    # without the watch the bad keys keep pushing the wrong way: far from the clean run
    blind, _ = _run(Link(spike=SPIKE), None)
    assert (model.weight - clean.weight).norm() < 0.75 * (blind.weight - clean.weight).norm()


def test_watch_state_survives_a_checkpoint_and_settings_are_checked():
    model, opt = _run(Link(spike=SPIKE), HealthWatch(every=5, recover_steps=3))
    fresh = OneBitLANSCore(torch.nn.Linear(16, 4).parameters(), dense_steps=DENSE,
                       hold_idle_rows=True, watch=HealthWatch(every=5))
    fresh.load_state_dict(opt.state_dict())
    assert fresh.generation(0) == opt.generation(0) >= 1
    for bad in ({"every": 0}, {"recover_steps": 1.5}, {"threshold": 2.0}, {"threshold": True}):
        with pytest.raises(ValueError, match="HealthWatch"):
            HealthWatch(**bad)
    with pytest.raises(TypeError, match="watch must be"):
        OneBitLANSCore(model.parameters(), watch="yes")
    assert not OneBitLANSCore(model.parameters()).recovering(0)   # no watch: never recovering

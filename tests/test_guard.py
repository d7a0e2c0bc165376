"""The divergence guard: its rule on plain numbers, and a real run it stops."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradpress.train import TrainConfig
from gradpress.train.guard import DivergenceGuard, TrainingDiverged


def _feed(guard: DivergenceGuard, losses: list[float]) -> int | None:
    """The step at which the guard stops the run (None: it does not)."""
    for step, loss in enumerate(losses, 1):
        try:
            guard.observe(loss, step)
        except TrainingDiverged:
            return step
    return None


def test_stops_at_the_first_window_past_the_threshold() -> None:
    # window means 4, 1, 2.4, 2.6: the threshold is 1 + 0.5 * (4 - 1) = 2.5
    losses = [4.0] * 10 + [1.0] * 10 + [2.4] * 10 + [2.6] * 10
    assert _feed(DivergenceGuard(0.5, window=10), losses) == 40
    assert _feed(DivergenceGuard(0.6, window=10), losses) is None


def test_message_names_the_steps_and_the_values() -> None:
    g = DivergenceGuard(0.5, window=2)
    with pytest.raises(TrainingDiverged) as e:
        _feed_raw(g, [3.0, 3.0, 1.0, 1.0, 2.5, 2.5])
    for words in ("steps 5-6", "2.5", "past 2", "lowest 2-step mean 1", "first 3"):
        assert words in str(e.value), (words, str(e.value))


def _feed_raw(guard: DivergenceGuard, losses: list[float]) -> None:
    for step, loss in enumerate(losses, 1):
        guard.observe(loss, step)


@given(st.lists(st.floats(1e-6, 1e6), min_size=1, max_size=60), st.floats(0.01, 5.0))
def test_a_loss_that_never_rises_is_never_stopped(losses: list[float], fraction: float) -> None:
    assert _feed(DivergenceGuard(fraction, window=3), sorted(losses, reverse=True)) is None


@given(st.floats(1e-3, 1e3), st.floats(0.01, 0.99), st.floats(0.01, 1.0))
def test_climbing_back_to_the_start_is_stopped(first: float, drop: float,
                                               fraction: float) -> None:
    # any scale: fell to drop*first, then back to the first value
    losses = [first] * 5 + [first * drop] * 5 + [first * 1.001] * 5
    assert _feed(DivergenceGuard(fraction, window=5), losses) == 15


def test_infinite_loss_is_stopped_and_state_round_trips() -> None:
    g = DivergenceGuard(0.5, window=2)
    _feed_raw(g, [3.0, 3.0, 1.0, 1.0, 1.0])  # ends inside a window
    h = DivergenceGuard(0.5, window=2)
    h.load_state_dict(json.loads(json.dumps(g.state_dict())))
    assert h.state_dict() == g.state_dict()
    with pytest.raises(TrainingDiverged):
        _feed_raw(h, [float("inf")])


@pytest.mark.parametrize("kw, words", [
    ({"fraction": 0}, "fraction must be a finite number > 0, got 0"),
    ({"fraction": float("nan")}, "got nan"),
    ({"fraction": True}, "got True"),
    ({"fraction": 0.5, "window": 0}, "window must be an int >= 1, got 0"),
])
def test_rejects_bad_input(kw: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        DivergenceGuard(**kw)
    if "window" not in kw:
        with pytest.raises(ValueError, match="TrainConfig.stop_on_divergence"):
            TrainConfig(task="digits-cnn", stop_on_divergence=kw["fraction"])


# A real 2-worker training run whose rank 0 logs a loss that falls for 100 steps, then climbs.
SCRIPT = textwrap.dedent('''
    import torch
    import gradpress as gp
    from gradpress.train import Session

    gp.init()
    s = Session.from_env()
    model = torch.nn.Linear(8, 2)
    opt = s.optimizer(model)
    s.start()
    for step in range(1, s.cfg.steps + 1):
        opt.zero_grad()
        x = torch.randn(4, 8)
        torch.nn.functional.cross_entropy(model(x), x[:, :2].argmax(1)).backward()
        s.step(opt)
        s.log_step(4.0 - 3.0 * min(step, 100) / 100 + 0.05 * max(step - 150, 0))
    s.finish(model)
    gp.shutdown()
''')


@pytest.mark.cluster
def test_stops_a_real_run_and_reports_why(tmp_path: Path) -> None:
    # window means 3.235, 1.735, 1.0, 2.275: past 1 + 0.5 * 2.235 at the end of step 200
    script, out = tmp_path / "diverge.py", tmp_path / "run"
    script.write_text(SCRIPT)
    p = subprocess.run([sys.executable, "-m", "gradpress.cli", "train", "--lr", "0.01",
                        "--optimizer", "adam", "--steps", "400", "--stop-on-divergence", "0.5",
                        "--no-progress", "--out", str(out), "--", sys.executable, str(script)],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode != 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "failed" and rep["steps"] == 200, rep
    assert "TrainingDiverged: training loss diverged" in rep["reason"]
    assert "steps 151-200" in rep["reason"] and "steps 151-200" in p.stdout + p.stderr

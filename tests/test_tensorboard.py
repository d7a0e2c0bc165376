"""TensorBoard scalars of ``gradpress train`` (``gradpress.train.tensorboard``).

The records-to-scalars mapping and the option are checked in this process; the writer on
synthetic records and one real ``gradpress train`` run (digits-cnn, 4 one-bit steps) are read
back with TensorBoard's own ``EventAccumulator``; a second short run with ``--no-tensorboard`` in
the same directory leaves no event files; the script of docs/integrations.md runs as written.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradpress.train import TrainConfig
from gradpress.train import tensorboard as tb
from gradpress.train.cli import _train_config, add_train_arguments, run_train
from gradpress.train.report import read_metrics

STAGES = ("data", "compute", "sync", "update", "eval", "compress", "send", "wait",
          "decompress")


def _step(step: int, loss: float, push: int = 100, dense: int = 1600) -> dict[str, Any]:
    stages = {f"{s}_s": 0.01 * (i + 1) for i, s in enumerate(STAGES)}
    return {"kind": "step", "run": "r", "step": step, "epoch": 0, "loss": loss,
            "lr": 0.001 * step, "time_s": 0.1 * step, "step_s": 0.1, "bytes_pushed": push,
            "bytes_pulled": push, "dense_fp32_bytes": dense, "stages": stages}


def _records() -> list[dict[str, Any]]:
    return [{"kind": "start", "run": "r", "config": {}, "hparams": {}, "workers": 2},
            _step(1, 2.5), _step(2, 2.0, push=0),
            {"kind": "eval", "run": "r", "step": 2, "time_s": 0.3, "primary": "accuracy",
             "metrics": {"accuracy": 0.75, "loss": 1.5}, "higher_is_better": True},
            {"kind": "summary", "run": "r", "status": "completed"}]


def _events(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
            for tag in acc.Tags()["scalars"]}


def _event_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / tb.SUBDIR).glob("events.out.tfevents.*"))


# -- in this process ---------------------------------------------------------------------------
def test_scalars_of_records() -> None:
    start, step1, step2, ev, summary = _records()
    assert tb.scalars(start) == [] and tb.scalars(summary) == []
    got = {tag: (value, step) for tag, value, step in tb.scalars(step1)}
    assert got["train/loss"] == (2.5, 1) and got["train/lr"] == (0.001, 1)
    assert got["comm/bytes_pushed_per_step"] == got["comm/bytes_pulled_per_step"] == (100, 1)
    assert got["comm/dense_fp32_bytes_per_step"] == (1600, 1)
    assert got["comm/compression_ratio"] == (16.0, 1)  # 2 * 1600 / (100 + 100)
    assert got["time/step"] == (0.1, 1)
    assert {f"time/{s}" for s in STAGES} <= set(got)
    assert "comm/compression_ratio" not in {t for t, _, _ in tb.scalars(step2)}  # no bytes
    assert tb.scalars(ev) == [("eval/accuracy", 0.75, 2), ("eval/loss", 1.5, 2)]


def test_option_and_its_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def parse(*argv: str) -> TrainConfig:
        parser = add_train_arguments(argparse.ArgumentParser())
        return _train_config(parser.parse_args(["--task", "digits-cnn", *argv]))

    assert parse().tensorboard is None
    assert parse("--tensorboard").tensorboard is True
    assert parse("--no-tensorboard").tensorboard is False
    with pytest.raises(ValueError, match="TrainConfig.tensorboard"):
        TrainConfig(task="digits-cnn", tensorboard="yes")  # type: ignore[arg-type]
    monkeypatch.setattr(tb, "available", lambda: False)
    assert tb.resolve(None) is False and tb.resolve(False) is False

    def no_launch(cfg: object) -> int:
        raise AssertionError("a cluster was launched")

    monkeypatch.setattr("gradpress.launch.launch", no_launch)
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(
        ["--task", "digits-cnn", "--tensorboard", "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError) as e:
        run_train(args)
    assert "--tensorboard" in str(e.value)
    assert 'pip install "gradpress[tensorboard]"' in str(e.value)
    assert not (tmp_path / "o").exists()  # before anything was created


def test_writer_round_trip(tmp_path: Path) -> None:
    w = tb.TensorBoardWriter(tmp_path / "tb")
    for rec in _records():
        w.write(rec)
    w.close()
    w.close()
    w.write(_step(3, 1.0))  # after close: ignored, no second event file
    assert len(list((tmp_path / "tb").iterdir())) == 1
    ev = _events(tmp_path / "tb")
    assert ev["train/loss"] == [(1, 2.5), (2, 2.0)]
    assert ev["comm/compression_ratio"] == [(1, 16.0)]
    assert ev["eval/accuracy"] == [(2, 0.75)] and ev["eval/loss"] == [(2, 1.5)]
    assert ev["train/lr"] == [(1, pytest.approx(0.001)), (2, pytest.approx(0.002))]


# -- real runs ---------------------------------------------------------------------------------
def _train(out: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "gradpress.cli", "train", "--task", "digits-cnn",
           "--compression", "onebit", "--dense-steps", "0", "--no-progress", "--out", str(out),
           *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.fixture(scope="module")
def tb_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("tb") / "run"
    p = _train(out, "--steps", "4", "--eval-every", "2")  # the default: on when installed
    return out, p.stdout


@pytest.mark.cluster
def test_train_writes_the_metrics_as_tensorboard_scalars(tb_run: tuple[Path, str]) -> None:
    out, stdout = tb_run
    assert f"TensorBoard scalars in {out / 'tensorboard'}" in stdout
    assert len(_event_files(out)) == 1
    rep = json.loads((out / "report.json").read_text())
    assert rep["tensorboard"] == str(out / "tensorboard")
    recs = read_metrics(out / "metrics.jsonl")
    steps = [r for r in recs if r["kind"] == "step"]
    ev = _events(out / "tensorboard")
    assert {"train/loss", "train/lr", "comm/bytes_pushed_per_step", "comm/bytes_pulled_per_step",
            "comm/compression_ratio", "eval/test_accuracy", "eval/test_loss",
            *(f"time/{s}" for s in STAGES)} <= set(ev)
    # the loss of rank 0 (a float32 value: exact in the event file), step by step
    assert ev["train/loss"] == [(r["step"], r["loss"]) for r in steps]
    assert [s for s, _ in ev["train/loss"]] == [1, 2, 3, 4]
    assert ev["train/lr"] == [(r["step"], pytest.approx(r["lr"])) for r in steps]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert ev["eval/test_accuracy"] == [(r["step"], pytest.approx(r["metrics"]["test_accuracy"]))
                                        for r in evals]
    # bytes and ratio: the report's, from the same counters
    push = [v for _, v in ev["comm/bytes_pushed_per_step"]]
    pull = [v for _, v in ev["comm/bytes_pulled_per_step"]]
    dense = [v for _, v in ev["comm/dense_fp32_bytes_per_step"]]
    assert sum(push) / len(push) == pytest.approx(rep["bytes_per_step"]["push"])
    assert sum(pull) / len(pull) == pytest.approx(rep["bytes_per_step"]["pull"])
    assert push[-1] == rep["bytes_per_step"]["push_last"]
    assert 2 * sum(dense) / (sum(push) + sum(pull)) == pytest.approx(rep["model_ratio_vs_fp32"])
    ratios = [v for _, v in ev["comm/compression_ratio"]]
    assert ratios == pytest.approx([2 * d / (a + b) for d, a, b in zip(dense, push, pull)])
    assert all(r > 10 for r in ratios)  # one-bit: about 26x on the wire
    # stage times: per step as in metrics.jsonl; summed, the report's (eval aside: the last
    # evaluation follows the last step record)
    assert ev["time/compute"] == [(r["step"], pytest.approx(r["stages"]["compute_s"]))
                                  for r in steps]
    for s in ("compute", "sync", "compress", "wait"):
        assert sum(v for _, v in ev[f"time/{s}"]) == pytest.approx(rep["stages_s"][f"{s}_s"],
                                                                   rel=1e-5)


@pytest.mark.cluster
def test_no_tensorboard_writes_no_event_files(tb_run: tuple[Path, str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(tb_run[0], out)  # an earlier run's event files must not stay
    p = _train(out, "--steps", "1", "--no-tensorboard")
    assert "TensorBoard" not in p.stdout
    assert _event_files(out) == []
    assert "tensorboard" not in json.loads((out / "report.json").read_text())


def _doc_script() -> str:
    """The script of docs/integrations.md's TensorBoard section."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "integrations.md").read_text()
    section = text[text.index("## TensorBoard"):]
    m = re.search(r"^```python\n(.*?)^```$", section, re.M | re.S)
    assert m, "no python block in the TensorBoard section of docs/integrations.md"
    return m.group(1)


@pytest.mark.cluster
def test_the_documented_script_writes_scalars(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(_doc_script())
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "1",
           "--", sys.executable, "train.py"]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ev = _events(tmp_path / "runs" / "mine" / "tensorboard")
    assert [s for s, _ in ev["train/loss"]] == [1, 2, 3, 4, 5]
    assert all(v > 0 for _, v in ev["comm/bytes_pushed_per_step"])
    assert all(v > 10 for _, v in ev["comm/compression_ratio"])  # one-bit on the big layers

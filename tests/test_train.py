"""``gradpress train`` / ``gradpress demo``: config validation, reports, and real local clusters.

Three cluster runs (each a few steps): a user script through ``Session`` (script mode), the demo
cut to two steps per run, and a bundled-task run stopped with SIGINT. Everything else runs in
this process without workers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from gradpress.train import TrainConfig
from gradpress.train.cli import _train_config, add_train_arguments, prepare_out_dir, run_train
from gradpress.train.hparams import lr_factor
from gradpress.train.report import format_run, plot_runs, read_metrics, run_report
from gradpress.train.session import codec_ratios
from gradpress.train.tensorboard import available as tensorboard_available
from helpers import LineWatch, assert_no_leftovers

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("loss_vs_step.png", "loss_vs_time.png", "bytes_per_step.png")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gradpress.cli", *args]


def _pngs_ok(d: Path, names: tuple[str, ...] = PLOTS) -> None:
    for name in names:
        assert (d / name).read_bytes()[:8] == PNG_MAGIC, name


# -- configuration and bad input (no process starts) -------------------------------------------
@pytest.mark.parametrize("kw, words", [
    ({"task": "mnist"}, ["unknown task 'mnist'", "digits-cnn", "stdlib-lm", "stdlib-mlm"]),
    ({"compression": "zip"}, ["unknown codec 'zip'", "onebit", "topk"]),
    ({"compression": "topk:kk=3"}, ["unknown parameter", "valid parameters: k, values"]),
    ({"optimizer": "rmsprop"}, ["unknown optimizer 'rmsprop'", "clan", "onebit-adam"]),
    ({"ef": "magic", "compression": "onebit"}, ["unknown error feedback", "vanilla"]),
    ({"ef": "sparse", "compression": "onebit"}, ["randomk"]),
    ({"lr": -1.0}, ["TrainConfig.lr", "> 0.0"]),
    ({"workers": 0}, ["TrainConfig.workers", ">= 1"]),
    ({"task": None}, ["either a task"]),
    ({"script": ("python", "x.py")}, ["either a task"]),
    ({"task": None, "script": ("python", "x.py")}, ["(--lr)"]),
    ({"name": "a/b"}, ["TrainConfig.name"]),
    ({"betas": (0.9, 1.0)}, ["TrainConfig.betas", "two numbers in [0, 1)", "(0.9, 1.0)"]),
    ({"betas": (0.9,)}, ["TrainConfig.betas", "two numbers"]),
    ({"optimizer": "sgd-ef", "betas": (0.95, 0.999)}, ["TrainConfig.betas", "Adam-family",
                                                        "'sgd-ef'"]),
    ({"optimizer": "sgd-ef", "dense_steps": 5}, ["TrainConfig.dense_steps", "sgd-ef"]),
    ({"optimizer": "onebit-lans", "dense_steps": 0}, ["TrainConfig.dense_steps", ">= 1"]),
    ({"dense_steps": -1}, ["TrainConfig.dense_steps", ">= 0"]),
    ({"ef": "ef21"}, ["unknown error feedback 'ef21'"]),
    ({"ef": "vanilla:decay=1.5", "compression": "onebit"}, ["TrainConfig.ef", "[0, 1]"]),
    ({"ef": "vanilla:anneal=1"}, ["TrainConfig.ef", "decay=B"]),
    ({"uncompressed_params": "pos.weight"}, ["TrainConfig.uncompressed_params", "tuple"]),
    ({"uncompressed_params": ("pos.weight", "")}, ["TrainConfig.uncompressed_params", "''"]),
])
def test_config_rejects_bad_input(kw: dict, words: list[str]) -> None:
    base = {"task": "digits-cnn"}
    with pytest.raises(ValueError) as e:
        TrainConfig(**{**base, **kw})
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_config_round_trip_and_defaults() -> None:
    cfg = TrainConfig(task="digits-cnn", compression="onebit", optimizer="sgd-ef", steps=5,
                      uncompressed_params=("conv1.*",))
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.effective_ef == "vanilla"
    # the optimizer's default error feedback; none when uncompressed
    assert TrainConfig(task="digits-cnn").effective_ef == "vanilla"
    assert TrainConfig(task="digits-cnn", optimizer="onebit-lans").effective_ef == \
        "vanilla:decay=0.8,server_decay=1.0"
    assert TrainConfig(task="digits-cnn", compression="none").effective_ef is None
    spec = "vanilla:decay=0.8,server_decay=1.0,anneal=1"
    assert TrainConfig(task="digits-cnn", compression="onebit", ef=spec).effective_ef == spec
    assert TrainConfig(task="digits-cnn", compression="onebit", ef="none").effective_ef is None
    cfg = TrainConfig(task="digits-cnn", betas=(0.95, 0.99), dense_steps=7)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    with pytest.raises(ValueError, match="unknown field"):
        TrainConfig.from_dict({"task": "digits-cnn", "lrr": 1})


def _train_args(argv: list[str]) -> argparse.Namespace:
    return add_train_arguments(argparse.ArgumentParser()).parse_args(argv)


def test_options_make_the_config() -> None:
    cfg = _train_config(_train_args(["--task", "stdlib-mlm", "--compression", "onebit",
                                     "--optimizer", "onebit-lans", "--ef",
                                     "vanilla:decay=0.8,server_decay=1,anneal=1",
                                     "--dense-steps", "160",
                                     "--uncompressed-params", "pos.weight", "--no-progress"]))
    assert cfg.effective_ef == "vanilla:decay=0.8,server_decay=1,anneal=1"
    assert (cfg.dense_steps, cfg.uncompressed_params, cfg.progress) == (
        160, ("pos.weight",), False)
    default = _train_config(_train_args(["--task", "stdlib-mlm"]))
    assert default == TrainConfig(task="stdlib-mlm")   # the parser's defaults are the fields'
    script = _train_config(_train_args(["--lr", "0.1", "--", "python", "x.py", "--y"]))
    assert script.script == ("python", "x.py", "--y") and script.task is None


def _help_options() -> list[str]:
    text = add_train_arguments(argparse.ArgumentParser(prog="gradpress train")).format_help()
    return [line.split()[0].rstrip(",") for line in text.splitlines()
            if line.startswith("  -")]


def test_train_help_lists_at_most_25_options_including_help() -> None:
    # issue 39: --name, --betas, --momentum and --min-compress-bytes are config fields only
    opts = _help_options()
    assert "-h" in opts and len(opts) <= 25, opts
    assert not {"--name", "--betas", "--momentum", "--min-compress-bytes"} & set(opts)


def test_train_parser_is_generated_from_the_config_fields() -> None:
    import dataclasses

    from gradpress.train.options import flag_of, option_fields

    # every field is an option but those only Python sets (documented where they are declared)
    python_only = {"name", "momentum", "betas", "min_compress_bytes",
                   "sync_every", "overlap", "outer_lr", "outer_momentum"}  # diloco's
    fields = [f for f in dataclasses.fields(TrainConfig) if f.name not in python_only]
    assert option_fields(TrainConfig) == fields
    opts = set(_help_options())
    for f in fields:
        meta = f.metadata["option"]
        assert meta["help"].strip(), f.name              # ... with its help text
        flag = flag_of(f)
        assert flag in opts or (meta["positional"] and f.name == "script"), flag
    assert len(opts - {"-h"}) == len(fields) - 1          # nothing hand-written besides -h


@pytest.mark.parametrize("old", ["--uncompressed-steps", "--freeze-step", "--ef-decay",
                                 "--server-ef-decay", "--ef-anneal", "--no-blend",
                                 "--no-precondition", "--sends", "--refresh-every",
                                 "--variance", "--beta1", "--beta2"])
def test_removed_options_are_rejected(old: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        _train_args(["--task", "digits-cnn", old, "1"])
    assert "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("old", ["uncompressed_steps", "freeze_step", "ef_decay",
                                 "server_ef_decay", "ef_anneal", "blend", "precondition",
                                 "sends", "refresh_every", "variance", "beta1", "beta2"])
def test_removed_fields_are_rejected(old: str) -> None:
    with pytest.raises(TypeError, match=old):
        TrainConfig(task="digits-cnn", **{old: 1})


def test_bad_input_fails_before_any_process_starts(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    def no_launch(cfg: object) -> int:
        raise AssertionError("a cluster was launched")

    monkeypatch.setattr("gradpress.launch.launch", no_launch)
    for argv, msg in (
            (["--task", "nope"], "valid tasks: digits-cnn, stdlib-lm, stdlib-mlm, stdlib-words"),
            (["--task", "digits-cnn", "--optimizer", "adagrad"], "valid optimizers: clan"),
            (["--task", "digits-cnn", "--compression", "gzip"], "valid codecs: none"),
            (["--task", "stdlib-mlm", "--uncompressed-params", "pos.weight", "position"],
             "--uncompressed-params: 'position' matches no parameter name; names are: "
             "tok.weight, pos.weight"),
    ):
        with pytest.raises(ValueError, match=msg):
            run_train(_train_args([*argv, "--out", str(tmp_path / "o")]))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot be written"):
        run_train(_train_args(["--task", "digits-cnn", "--out", str(blocker / "run")]))
    with pytest.raises(ValueError, match="cannot be written"):
        prepare_out_dir(blocker)


@pytest.mark.cluster
def test_cli_reports_bad_input_as_usage_error(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "gradpress.cli", "train", "--task", "digits-cnn",
           "--optimizer", "adagrad", "--out", str(tmp_path)]  # the `gradpress` command
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "unknown optimizer 'adagrad'; valid optimizers: clan, lans" in p.stderr


# -- schedule, codec byte counts, reports (pure) ----------------------------------------------
def test_lr_schedule() -> None:
    assert [lr_factor(s, 4, 20, "cosine") for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(4, 4, 20, "cosine") == 1.0 and lr_factor(20, 4, 20, "cosine") == 0.0
    assert lr_factor(12, 4, 20, "linear") == 0.5 and lr_factor(99, 0, 20, "constant") == 1.0


def test_codec_ratios_count_payloads() -> None:
    named = [("big", torch.zeros(64, 1024)), ("small", torch.zeros(100))]
    r = codec_ratios(named, "onebit", 16 << 10, 4 << 20)
    assert r["compressed_tensors"] == 1 and r["tensors"] == 2
    assert 30 < r["compressed_vs_fp32"] < 32 and r["model_vs_fp32"] < r["compressed_vs_fp32"]
    t = codec_ratios(named, "topk:k=0.001,values=fp16", 16 << 10, 4 << 20)
    assert t["compressed_vs_fp16"] > 200
    e = codec_ratios(named, "onebit", 16 << 10, 4 << 20, exact={"big"})  # named: uncompressed
    assert e["compressed_tensors"] == 0 and e["model_vs_fp32"] < 1


def _records(n: int, interrupted: bool) -> list[dict]:
    recs = [{"kind": "step", "run": "r", "step": i + 1, "epoch": 0, "loss": 2.0 / (i + 1),
             "lr": 0.1, "time_s": 0.1 * (i + 1), "step_s": 0.1, "bytes_pushed": 100,
             "bytes_pulled": 100, "dense_fp32_bytes": 3200,
             "stages": {"compute_s": 0.05, "sync_s": 0.04, "wait_s": 0.03}} for i in range(n)]
    recs.append({"kind": "eval", "run": "r", "step": n, "time_s": 0.1 * n,
                 "metrics": {"test_accuracy": 0.9, "test_loss": 0.3},
                 "primary": "test_accuracy", "higher_is_better": True})
    if interrupted:
        recs.append({"kind": "end", "run": "r", "status": "interrupted", "step": n,
                     "reason": "SIGTERM", "time_s": 1.0})
    return recs


def test_partial_metrics_give_a_report_and_plots(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in _records(5, interrupted=True))
    path.write_text(text + '{"kind": "step", "run": "r", "st')  # killed mid-line
    recs = read_metrics(path)
    rep = run_report(recs)
    assert rep["status"] == "interrupted" and rep["steps"] == 5
    assert rep["metric"] == {"name": "test_accuracy", "value": 0.9, "higher_is_better": True,
                             "step": 5}
    assert rep["bytes_per_step"]["push"] == 100 and rep["model_ratio_vs_fp32"] == 32.0
    assert rep["model_ratio_vs_fp16"] == 16.0
    assert rep["stages_s"]["compute_s"] == pytest.approx(0.25)
    assert rep["drift_recoveries"] == 0
    steps = [r for r in recs if r["kind"] == "step"]
    steps[1]["drift_recoveries"], steps[3]["drift_recoveries"] = 2, 1  # the health watch's
    assert run_report(recs)["drift_recoveries"] == 3
    assert "test_accuracy 0.9000" in format_run(rep)
    files = plot_runs(tmp_path, {"a": recs, "b": _records(3, interrupted=False)})
    assert [f.name for f in files] == [*PLOTS, "eval_vs_step.png"]
    _pngs_ok(tmp_path)


# -- real clusters ---------------------------------------------------------------------------
SCRIPT = textwrap.dedent('''
    import torch, gradpress as gp
    from gradpress.train import Session
    gp.init()
    s = Session.from_env()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 4))
    opt = s.optimizer(model)
    s.start()
    g = torch.Generator().manual_seed(gp.rank())
    for step in range(s.cfg.steps):
        x = torch.randn(16, 64, generator=g)
        y = x[:, :4].argmax(1)
        opt.zero_grad()
        with s.stage("compute"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        s.step(opt)
        s.log_step(loss.item())
    s.log_eval({"accuracy": 0.5, "loss": float(loss)}, primary="accuracy")
    s.finish(model)
    gp.shutdown()
''')


@pytest.mark.cluster
def test_script_mode_run_directory(tmp_path: Path) -> None:
    script = tmp_path / "my_train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    p = subprocess.run(_cli("train", "--compression", "onebit", "--optimizer", "lamb", "--lr",
                            "0.01", "--steps", "4", "--out", str(out), "--", sys.executable,
                            str(script)), capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "compression ratio, compressed tensors (2 of 4" in p.stdout
    assert {"config.json", "metrics.jsonl", "report.json", *PLOTS} <= set(os.listdir(out))
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "completed" and rep["steps"] == 4
    assert rep["replicas_identical"] is True and rep["workers"] == 2
    assert rep["metric"]["name"] == "accuracy"
    assert rep["hparams"]["lr"] == 0.01 and rep["config"]["optimizer"] == "lamb"
    assert 25 < rep["codec"]["compressed_vs_fp32"] < 32
    assert 1 < rep["model_ratio_vs_fp32"] < rep["codec"]["compressed_vs_fp32"]
    assert rep["bytes_per_step"]["push"] == rep["bytes_per_step"]["pull"] > 0
    assert {"compute_s", "sync_s", "update_s", "compress_s", "wait_s"} <= set(rep["stages_s"])
    _pngs_ok(out)


@pytest.mark.cluster
def test_demo_end_to_end_short(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    p = subprocess.run(_cli("demo", "--steps", "2", "--out", str(out), "--no-progress"),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert [r["run"] for r in rep["runs"]] == ["uncompressed", "int4", "clan-onebit", "diloco"]
    for r in rep["runs"]:
        assert r["status"] == "completed" and r["steps"] == 2 and r["replicas_identical"]
        assert r["metric"]["name"] == "test_accuracy" and 0 <= r["metric"]["value"] <= 1
        assert (out / r["run"] / "report.json").exists()
        events = sorted((out / r["run"] / "tensorboard").glob("events.out.tfevents.*"))
        assert bool(events) == tensorboard_available(), r["run"]
        assert r.get("tensorboard") == (str(out / r["run"] / "tensorboard") if events else None)
    if tensorboard_available():
        assert f"tensorboard --logdir {out}" in p.stdout
    none, int4, onebit, loco = rep["runs"]
    assert loco["diloco"]["outer_steps"] == 1  # 2 steps: no round yet, the closing sync
    assert none["model_ratio_vs_fp32"] < 1.01
    assert onebit["compressed_ratio_vs_fp16"] > 10 and 3.5 < int4["compressed_ratio_vs_fp16"] < 4
    assert "int4" in rep["table"] and rep["table"] in p.stdout
    _pngs_ok(out, (*PLOTS, "eval_vs_step.png"))


@pytest.mark.cluster
@pytest.mark.parametrize("presses", [1, 2], ids=["ctrl-c", "ctrl-c-twice"])
def test_sigint_stops_everything_and_keeps_partial_metrics(tmp_path: Path, presses: int) -> None:
    out, marker = tmp_path / "run", uuid.uuid4().hex
    env = dict(os.environ, GP_TEST_MARKER=marker)
    p = subprocess.Popen(_cli("train", "--task", "digits-cnn", "--steps", "100000",
                              "--compression", "onebit", "--no-progress", "--out", str(out)),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    lines = [LineWatch(p.stdout), LineWatch(p.stderr)]
    try:
        deadline = time.monotonic() + 120
        while sum(r["kind"] == "step" for r in read_metrics(out / "metrics.jsonl")) < 3:
            assert p.poll() is None, [w.text()[-2000:] for w in lines]
            assert time.monotonic() < deadline, "no training steps within 120 s"
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C reaches the foreground process group
        if presses == 2:  # a second Ctrl-C once the launcher is stopping must not lose the report
            lines[1].wait_for("received SIGINT; stopping all processes")
            os.killpg(p.pid, signal.SIGINT)  # the group leader is not reaped yet: it exists
        p.wait(60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    stdout, stderr = (w.close() for w in lines)
    assert p.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert_no_leftovers(marker, 10)
    recs = read_metrics(out / "metrics.jsonl")
    assert sum(r["kind"] == "step" for r in recs) >= 3
    # rank 0 noted it (the record's reason says what ended the worker otherwise)
    assert recs[-1]["kind"] == "end" and recs[-1]["status"] == "interrupted", \
        (recs[-1], stderr[-3000:])
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "interrupted" and rep["steps"] >= 3
    assert "(interrupted)" in stdout
    _pngs_ok(out)

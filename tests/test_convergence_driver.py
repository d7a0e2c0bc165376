"""benchmarks/convergence.py: grid expansion and table aggregation on synthetic reports."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _driver() -> ModuleType:
    spec = importlib.util.spec_from_file_location("convergence",
                                                  ROOT / "benchmarks" / "convergence.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["convergence"] = mod  # dataclasses need the module registered
    spec.loader.exec_module(mod)
    return mod


def _report(value: float, push: int, status: str = "completed") -> dict:
    return {"status": status, "steps": 20, "s_per_step": 0.1,
            "metric": {"name": "accuracy", "value": value, "higher_is_better": True},
            "bytes_per_step": {"push": push, "pull": push, "dense_fp32": 4000.0,
                               "push_last": push, "pull_last": push},
            "codec": {"compressed_tensors": 1, "compressed_fp32_bytes": 3600,
                      "compressed_wire_bytes": 60, "model_wire_bytes": 460}}


def test_grid_commands_and_aggregation(tmp_path: Path) -> None:
    conv = _driver()
    args = conv.parse_args(["--tasks", "digits-cnn", "--codecs", "none", "onebit",
                            "--variants", "base", "chunk16k", "--seeds", "0", "1",
                            "--steps", "20", "--out", str(tmp_path)])
    runs = conv.expand(args)
    assert len(runs) == 2 * 2 * 2
    chunk = next(r for r in runs if r.variant == "chunk16k")
    assert chunk.shell().startswith("GRADPRESS_PARTITION_BYTES=16384 gradpress train")
    assert "--steps 20" in chunk.shell() and f"--seed {chunk.seed}" in chunk.shell()
    onebit = [r for r in runs if r.codec == "onebit" and r.variant == "base"]
    for r, acc in zip(onebit, (0.95, 0.97), strict=True):
        r.out.mkdir(parents=True)
        (r.out / "report.json").write_text(json.dumps(_report(acc, 520)))
    failed = next(r for r in runs if r.codec == "none")
    failed.out.mkdir(parents=True)
    (failed.out / "report.json").write_text(json.dumps(_report(0.5, 4400, "failed")))
    reports = {r.out: rep for r in runs if (rep := conv.completed(r)) is not None}
    rows = conv.aggregate(runs, reports)
    assert len(rows) == 1  # the failed run is not counted
    row = rows[0]
    assert row["mean"] == pytest.approx(96.0) and row["std"] == pytest.approx(1.4142, abs=1e-3)
    assert row["model_vs_fp32"] == pytest.approx(4000 / 520)
    assert row["comp_vs_fp16"] == pytest.approx(1800 / (520 - 400))
    text = conv.table(rows)
    assert "96.00 ± 1.41 (n=2)" in text and "15.0x" in text


def test_unknown_codec_is_an_error(tmp_path: Path) -> None:
    conv = _driver()
    args = conv.parse_args(["--codecs", "twobit", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="twobit"):
        conv.expand(args)


def test_dense_steps_option() -> None:
    from gradpress.defaults import DENSE_STEPS
    from gradpress.train.config import TrainConfig
    from gradpress.train.hparams import resolve_hparams

    cfg = TrainConfig(task="stdlib-mlm", compression="onebit", optimizer="clan")
    hp = resolve_hparams(cfg, _Defaults(), 200)
    assert hp["dense_steps"] == DENSE_STEPS == 100
    assert resolve_hparams(cfg.replace(dense_steps=0), _Defaults(), 200)["dense_steps"] == 0
    assert resolve_hparams(cfg.replace(optimizer="lans"), _Defaults(), 200)["dense_steps"] == 0
    # the 1-bit optimizers: the factories' default, whatever the run's length
    for steps in (200, 5000):
        assert resolve_hparams(cfg.replace(optimizer="onebit-lans"), _Defaults(), steps)[
            "dense_steps"] == DENSE_STEPS
    assert "dense_steps" not in resolve_hparams(cfg.replace(optimizer="sgd-ef"), _Defaults(),
                                                200)
    with pytest.raises(ValueError, match="dense_steps"):
        TrainConfig(task="stdlib-mlm", optimizer="sgd-ef", dense_steps=10)
    with pytest.raises(ValueError, match="dense_steps"):
        TrainConfig(task="stdlib-mlm", dense_steps=-1)


def test_betas_option() -> None:
    from gradpress.train.config import TrainConfig
    from gradpress.train.hparams import resolve_hparams

    cfg = TrainConfig(task="stdlib-mlm", compression="onebit", optimizer="onebit-lans")
    assert resolve_hparams(cfg, _Defaults(), 200)["betas"] == (0.9, 0.999)
    hp = resolve_hparams(cfg.replace(betas=(0.95, 0.99)), _Defaults(), 200)
    assert hp["betas"] == (0.95, 0.99)


def test_study_variants_map_to_todays_options(tmp_path: Path) -> None:
    conv = _driver()

    def cmd(optimizer: str, variant: str) -> str:
        args = conv.parse_args(["--tasks", "stdlib-mlm", "--codecs", "onebit", "--optimizers",
                                optimizer, "--variants", variant, "--seeds", "0", "--steps",
                                "20", "--lr", "0.01", "--out", str(tmp_path)])
        return conv.expand(args)[0].shell()

    # the study's 1-bit LANS defaults of its time (frozen v, blend) are explicit switches
    base = cmd("onebit-lans", "base")
    assert "--task" not in base.split(" -- ")[0]
    assert base.endswith("-- python benchmarks/clan_script.py --task stdlib-mlm --method "
                         "train --variance frozen --blend")
    got = cmd("onebit-lans", "lv-freeze100-noblend-srv1-decay08anneal-wd001")
    for part in ("--dense-steps 100", "--ef vanilla:decay=0.8,server_decay=1.0,anneal=1",
                 "--variance local --no-blend"):
        assert part in got, (part, got)
    assert "--ef none" in cmd("onebit-lans", "ef21") and cmd("onebit-lans", "ef21").endswith(
        "--ef21")
    assert cmd("clan", "warmup100-freeze").endswith("--freeze-variance-after 100")
    assert "--betas 0.9 0.99" in cmd("lans", "b2")
    plain = cmd("clan", "base")   # no switches: the bundled task directly
    assert "--task stdlib-mlm" in plain and " -- " not in plain and "--dense-steps 0" in plain


class _Defaults:
    weight_decay = 0.0
    warmup_steps = 0
    momentum = 0.9

    @staticmethod
    def lr_for(family: str) -> float:
        return 1e-3


def test_baseline_gap_is_paired_by_seed(tmp_path: Path) -> None:
    conv = _driver()
    args = conv.parse_args(["--tasks", "stdlib-mlm", "--codecs", "onebit", "--lr", "0.01",
                            "--seeds", "0", "1", "2", "--steps", "20", "--out", str(tmp_path),
                            "--baseline", "lans_none_base_lr0.02"])
    runs = conv.expand(args)
    base_dir = tmp_path / "stdlib-mlm"
    for seed, (loss, base) in enumerate(((2.2, 2.0), (3.3, 3.0), (1.0, None))):
        runs[seed].out.mkdir(parents=True)
        (runs[seed].out / "report.json").write_text(json.dumps(_report(loss, 520)))
        if base is not None:  # seed 2 has no baseline run: left out of the gap
            d = base_dir / f"lans_none_base_lr0.02_st20_s{seed}"
            d.mkdir(parents=True)
            (d / "report.json").write_text(json.dumps(_report(base, 4400)))
    for rep_path in base_dir.glob("*/report.json"):  # a loss, not an accuracy
        rep = json.loads(rep_path.read_text())
        rep["metric"]["name"] = "val_loss"
        rep_path.write_text(json.dumps(rep))
    reports = {r.out: rep for r in runs if (rep := conv.completed(r)) is not None}
    rows = conv.aggregate(runs, reports)
    conv.add_gaps(rows, args)
    gaps, unit = rows[0]["gap"]
    assert unit == "%" and gaps == pytest.approx([10.0, 10.0])
    assert "| +10.00 ± 0.00% (n=2) |" in conv.table(rows)
    plain = {k: v for k, v in rows[0].items() if k != "gap"}
    assert "vs baseline" not in conv.table([plain])


def test_push_per_step_counts_refresh_steps_after_the_warm_up(tmp_path: Path) -> None:
    conv = _driver()
    rep = {**_report(0.9, 520), "hparams": {"dense_steps": 2}}
    assert conv.compressed_push(rep, tmp_path) == 520  # no metrics: the last step's bytes
    pushed = [4000, 4000, 520, 4000, 520, 520]       # warm-up, then one dense refresh step
    (tmp_path / "metrics.jsonl").write_text("\n".join(
        json.dumps({"kind": "step", "step": i + 1, "bytes_pushed": b})
        for i, b in enumerate(pushed)) + '\n{"kind": "summary"}\n')
    assert conv.compressed_push(rep, tmp_path) == pytest.approx((520 * 3 + 4000) / 4)
    assert conv.wire(rep, tmp_path)["model_vs_fp32"] == pytest.approx(4000 / 1390)

"""benchmarks/no_change.py: what a record keeps from a run directory, and the verdicts of compare
(no training here: the records are written by hand, and the committed baseline is checked for
completeness)."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "benchmarks" / "results" / "no_change" / "baseline-31a72bd.json"


def _load():
    spec = importlib.util.spec_from_file_location("_bench_no_change",
                                                  ROOT / "benchmarks" / "no_change.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


nc = _load()


def _run_dir(tmp_path: Path, losses: list[float]) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    recs = [{"kind": "start", "setup_s": 1.0, "hparams": {"uncompressed_steps": 1}}]
    recs += [{"kind": "step", "step": i + 1, "epoch": 0, "loss": x, "lr": 0.1, "time_s": 0.5 * i,
              "step_s": 0.5, "bytes_pushed": 8, "bytes_pulled": 8, "dense_fp32_bytes": 16,
              "stages": {"compute_s": 0.1}} for i, x in enumerate(losses)]
    recs += [{"kind": "eval", "step": len(losses), "metrics": {"acc": 0.5}, "primary": "acc",
              "higher_is_better": True, "time_s": 3.0},
             {"kind": "summary", "status": "completed", "steps": len(losses), "wall_s": 9.0}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (d / "report.json").write_text(json.dumps({"status": "completed", "steps": len(losses),
                                               "wall_s": 9.0, "s_per_step": 0.5,
                                               "final_train_loss": losses[-1],
                                               "config": {"uncompressed_steps": None}}))
    return d


def _record(tmp_path: Path, name: str, run: dict) -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"meta": {"commit": name}, "runs": {"task/x": run}}))
    return path


def test_collect_keeps_figures_and_drops_timings(tmp_path):
    run = nc.collect(_run_dir(tmp_path, [2.5, 0.1 + 0.2]))
    assert run["per_step"]["loss"] == [2.5, 0.30000000000000004]
    assert run["per_step"]["step"] == [1, 2]
    assert set(run["per_step"]) == {"step", *nc.STEP_KEYS}
    assert run["evals"] == [{"step": 2, "metrics": {"acc": 0.5}, "primary": "acc",
                             "higher_is_better": True}]
    assert run["report"]["final_train_loss"] == 0.30000000000000004
    text = json.dumps(run)
    for timing in ("wall_s", "s_per_step", "time_s", "step_s", "stages", "uncompressed_steps"):
        assert f'"{timing}"' not in text


def test_compare_identical_then_first_differing_step(tmp_path, capsys):
    run = nc.collect(_run_dir(tmp_path, [2.5, 2.0, 1.5]))
    a = _record(tmp_path, "a", run)
    assert nc.compare(a, _record(tmp_path, "b", copy.deepcopy(run)), []) == 0
    assert "identical   task/x (3 steps)" in capsys.readouterr().out
    changed = copy.deepcopy(run)
    changed["per_step"]["loss"][1] = 2.0000000000000004  # one ulp
    b = _record(tmp_path, "b", changed)
    assert nc.compare(a, b, []) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "step 2: loss 2.0 vs 2.0000000000000004" in out
    assert nc.compare(a, b, ["task/*"]) == 0
    assert "deliberately changed" in capsys.readouterr().out


@pytest.mark.parametrize("edit, expected", [
    (lambda r: r["report"].update(final_train_loss=1), "report.final_train_loss: 1.5 vs 1"),
    (lambda r: r["per_step"]["loss"].pop() and r["per_step"]["step"].pop(), "step count 3 vs 2"),
    (lambda r: r["evals"][0]["metrics"].update(acc=0.75), "evals[0].metrics.acc: 0.5 vs 0.75"),
])
def test_compare_names_what_differs(tmp_path, edit, expected):
    run = nc.collect(_run_dir(tmp_path, [2.5, 2.0, 1.5]))
    other = copy.deepcopy(run)
    edit(other)
    assert any(expected in p for p in nc.compare_run(run, other))


def test_compare_missing_run_fails(tmp_path):
    assert nc.compare_run({"per_step": {}}, None) == ["missing in B"]


def test_baseline_record_is_complete():
    doc = json.loads(BASELINE.read_text())
    assert not doc["meta"]["quick"]
    names = {n for n, _ in nc.plan(quick=False)} - {"demo"}
    demo = {"demo/uncompressed", "demo/clan-onebit", "demo/clan-topk0.1%"}
    assert set(doc["runs"]) == names | demo | {"demo"}
    for name in names | demo:
        run = doc["runs"][name]
        assert run["exit_code"] == 0 and run["report"]["status"] == "completed", name
        n = 352 if name.startswith("demo/") else nc.STEPS  # demo: 16 epochs of 22 steps
        assert run["per_step"]["step"] == list(range(1, n + 1)), name
        assert all(isinstance(x, float) for x in run["per_step"]["loss"]), name

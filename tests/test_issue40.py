"""benchmarks/issue40.py: issue 40's targets computed from kept cluster.py records (synthetic
records here: no root, no network)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import issue40


def _run(d: Path, steps: dict[str, float]) -> None:
    d.mkdir(parents=True)
    cpu = {"busy": 1.0, "busy_frac": 0.9, "sys": 0.1, "main": 0.8, "worker_other": 0.1,
           "rest": 0.1}
    speed = {s: {"median_s": v, "best_s": v, "iface_mb": 1.0, "cpu": cpu}
             for s, v in steps.items()}
    (d / "cluster.json").write_text(json.dumps({"results": {"speed": {d.name.split("-")[-2]:
                                                                      speed}}}))
    (d / "record.json").write_text(json.dumps({
        "name": d.name, "command": "python benchmarks/cluster.py", "commit": "a" * 40,
        "machine": {"cpu": "AMD EPYC", "cores": 2}, "started": "2026-12-06T12:00:00+00:00",
        "load_before": [1.0, 1, 1], "load_after": [2.0, 1, 1], "exit_code": 0}))


def test_targets_from_records(tmp_path: Path) -> None:
    for i, ps in enumerate((0.22, 0.20, 0.30), 1):  # medians: PS 0.22, fp16 0.66, hook 0.2
        _run(tmp_path / f"x-mlp-{i}", {"local": 0.1, "ddp-fp16": 0.66, "ddp-powersgd1": 0.3,
                                       "gp-onebit": 0.25, "gp-onebit-coloc": ps,
                                       "gp-ddp-hook": 0.2})
    runs = issue40.load_runs("mlp", "x", tmp_path)
    assert [r["name"] for r in runs] == ["x-mlp-1", "x-mlp-2", "x-mlp-3"]
    rows = {(r[0], r[1]): r[2:] for r in issue40.target_rows({"mlp": runs})}
    assert rows[("mlp: PS path at least 3x faster than DDP fp16", "gp-onebit-coloc")] == \
        ["3.00x (runs 3.00, 3.30, 2.20)", "met"]
    assert rows[("mlp: PS path at least 3x faster than DDP fp16", "gp-onebit")][1] == "not met"
    assert rows[("tfm: PS path within 1.2x of the hook", "gp-onebit")] == ["-", "not run"]
    t = issue40.results_table("mlp", runs)
    assert t["id"] == "cluster-mlp" and len(t["commands"]) == 3
    coloc = next(r for r in t["rows"] if "colocate" in r[0])
    assert coloc[1:3] == ["0.220 (0.220, 0.200, 0.300)", "3.00x"]
    assert "load average 1.0-2.0" in t["machine"]


def test_within_target_is_the_inverse(tmp_path: Path) -> None:
    for i in (1, 2, 3):
        _run(tmp_path / f"x-tfm-{i}", {"ddp-fp16": 0.6, "gp-onebit": 0.6,
                                       "gp-onebit-coloc": 0.5, "gp-ddp-hook": 0.4})
    rows = {(r[0], r[1]): r[2:] for r in issue40.target_rows(
        {"tfm": issue40.load_runs("tfm", "x", tmp_path)})}
    assert rows[("tfm: PS path within 1.2x of the hook", "gp-onebit-coloc")][1] == "not met"
    assert rows[("tfm: PS path within 1.2x of the hook", "gp-onebit")][0].startswith("1.50x")


def test_scaling_arguments_and_table() -> None:
    import scaling

    a = scaling.parse_args([])
    assert a.workers == [2, 4, 6] and "gp-onebit-coloc" in a.systems and a.model == "mlp"
    for bad in (["--workers", "1,2"], ["--workers", "x"], ["--systems", "nope"]):
        try:
            scaling.parse_args(bad)
        except SystemExit:
            continue
        raise AssertionError(bad)
    res = {2: {"ddp-fp16": {"median_s": 0.6, "best_s": 0.5},
               "gp-onebit-coloc": {"median_s": 0.2, "best_s": 0.2},
               "gp-ddp-hook": {"median_s": 0.2, "best_s": 0.2}}}
    rows = scaling.rows(res, {2: {"baseline": 0.5, "compressed": 0.1}})
    assert rows[2].endswith("| 0.600 (0.500) | 0.500 | 1.20 |")
    assert rows[3].startswith("| 2 | 2 |") and rows[3].endswith("| 0.100 | 2.00 |")
    assert rows[4].endswith("| - | - |")  # the hook: no model in the simulator


def test_scaling_simulator_model_of_the_mlp() -> None:
    import scaling

    m = scaling.sim_model("mlp")
    assert m.num_params == 25_185_290 and len(m.ops) == 4
    assert scaling.sim_model("tfm") is None  # not made of linear layers only


def test_scaling_table_from_kept_runs(tmp_path: Path, capsys) -> None:
    import scaling

    for w in (2, 4):
        (tmp_path / f"w{w}.json").write_text(json.dumps({
            "results": {str(w): {"gp-onebit-coloc": {"median_s": 0.1 * w, "best_s": 0.1}}},
            "simulated": {str(w): {"baseline": 1.0, "compressed": 0.1}}}))
    assert scaling.main(["--from", str(tmp_path / "w4.json"), str(tmp_path / "w2.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| 2 | 2 |") and out[3].startswith("| 4 | 4 |")
    assert out[3].endswith("| 0.400 (0.100) | 0.100 | 4.00 |")


def test_no_regression_checks(tmp_path: Path) -> None:
    for i, (one, floor_rest) in enumerate(((0.35, 0.0), (0.36, 0.0), (0.30, 0.3)), 1):
        _run(tmp_path / f"x-vgg-{i}", {"local": 0.2, "ddp-fp32": 1.4, "gp-onebit": one})
        d = tmp_path / f"x-vgg-{i}" / "cluster.json"  # run 3's floor shared the machine
        doc = json.loads(d.read_text())
        doc["results"]["speed"]["vgg"]["local"]["cpu"] = {"rest": floor_rest}
        d.write_text(json.dumps(doc))
    rows = issue40.vgg_rows(issue40.load_runs("vgg", "x", tmp_path), {"gp-onebit": "3.75x"})
    assert rows[0] == ["vgg: gp-onebit speed-up vs DDP fp32", "4.00x (runs 4.00, 3.89, 4.67)",
                       "3.75x", "at or above the published"]
    assert "without x-vgg-3 (its floor disturbed): 1.77x" in rows[1][1] and rows[1][3] == \
        "not met"
    for i, med in enumerate(("24.8", "25.5", "26.0"), 1):
        (tmp_path / f"p-{i}").mkdir()
        (tmp_path / f"p-{i}" / "push_pull.json").write_text(json.dumps(
            [["(a) none", "", "", "speed-up vs none 1.0x (median 1.0x)"],
             ["(a) onebit", "", "", f"speed-up vs none 27.0x (median {med}x)"]]))
    assert issue40.push_pull_row(issue40.push_pull_runs("p", tmp_path))[1:] == \
        ["25.5x (runs 24.8, 25.5, 26.0)", "at least 25x (issue 27)", "met"]
    assert issue40.push_pull_100_rows("p", "25.2x (median 19.8x)", tmp_path)[0][3] == \
        "at or above the published"

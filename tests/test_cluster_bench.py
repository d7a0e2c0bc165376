"""Fast checks of benchmarks/cluster.py that need neither root nor a network: arguments,
models and the target table."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cluster
import cluster_models


def test_defaults_and_quick() -> None:
    a = cluster.parse_args([])
    assert (a.models, a.warmup, a.steps, a.rate) == (["vgg", "bert"], 3, 5, "1gbit")
    assert a.systems == list(cluster.DEFAULT_SYSTEMS) and a.parts == list(cluster.PARTS)
    assert "gp-onebit-coloc" not in a.systems  # the colocated layout is asked for by name
    c = cluster.parse_args(["--systems", "gp-onebit,gp-onebit-coloc"])
    assert c.systems == ["gp-onebit", "gp-onebit-coloc"]
    q = cluster.parse_args(["--quick"])
    assert (q.models, q.warmup, q.steps) == (["vgg"], 2, 3)
    assert cluster.parse_args(["--quick", "--steps", "7"]).steps == 7


@pytest.mark.parametrize("argv", [["--models", "resnet"], ["--systems", "ddp-fp32,x"],
                                  ["--parts", ""], ["--steps", "0"], ["--hosts", "0"]])
def test_bad_arguments_exit(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        cluster.parse_args(argv)


def test_models_are_large_enough() -> None:
    vgg = cluster_models.build_model("vgg")
    assert cluster_models.count_parameters(vgg) >= 30_000_000
    bert = cluster_models.build_model("bert")
    batch = cluster_models.make_batch("bert", 2, seed=1)
    loss = cluster_models.loss_of(bert, "bert", batch)
    assert loss.ndim == 0 and loss.item() > 0
    with pytest.raises(ValueError, match="model must be one of"):
        cluster_models.build_model("resnet")


def test_target_rows() -> None:
    r = {"median_s": 1.0, "best_s": 1.0}
    speed = {"vgg": {"ddp-fp32": {**r, "median_s": 9.0}, "ddp-powersgd": {**r, "median_s": 1.2},
                     "gp-onebit": r}}
    loop = {"gp-none": r, "gp-onebit": {**r, "median_s": 1.1}, "gp-topk": {**r, "median_s": 1.3}}
    rows = cluster.target_rows(speed, loop)
    assert [row.split("|")[-2].strip() for row in rows[2:]] == ["PASS", "FAIL", "PASS", "FAIL"]


def test_cpu_split_and_table() -> None:
    import cluster_worker

    c = cluster_worker.cpu_counters()
    assert {"machine_user", "machine_sys", "machine_idle", "process_user", "process_sys",
            "main_thread", "wall"} <= set(c)
    rank = {"machine_user": 0.5, "machine_sys": 0.1, "machine_idle": 0.2, "process_user": 0.2,
            "process_sys": 0.05, "main_thread": 0.15, "wall": 0.4}
    ranks = [{"seconds": [0.4], "iface_bytes": 0, "cpu": rank}, {"seconds": [0.5],
                                                                 "iface_bytes": 0, "cpu": rank}]
    s = cluster._summary(ranks)["cpu"]
    assert s["busy"] == pytest.approx(0.6) and s["busy_frac"] == pytest.approx(0.75)
    assert s["main"] == pytest.approx(0.3) and s["worker_other"] == pytest.approx(0.2)
    assert s["rest"] == pytest.approx(0.1) and s["sys"] == pytest.approx(0.1)
    rows = cluster.cpu_table({"gp-onebit": {"median_s": 0.5, "cpu": s}})
    assert rows[2] == "| gradpress onebit | 0.500 | 75% | 0.600 (0.100) | 0.300 | 0.200 | 0.100 |"

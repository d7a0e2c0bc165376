"""benchmarks/clan_script.py: a bundled transformer in real 2-worker script runs.

1. ``gp.OneBitLANS`` as a user writes it, with the position embedding exact and a fixed dense
   phase (the setting ``docs/guide.md`` recommends for transformers): after the dense phase
   every matrix but the position embedding travels one-bit, the embedding as exact fp32, and
   the replicas stay identical.
2. ``--method train``: ``gradpress train``'s optimizer with an experiment switch of the
   optimizer class, the way ``benchmarks/convergence.py`` runs the study's variants.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradpress.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, train_args: list[str], *script_args: str) -> dict:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gradpress.cli", "train", "--compression", "onebit",
           "--lr", "0.01", "--steps", "6", "--warmup-steps", "2", "--no-progress", "--out",
           str(out), *train_args, "--", sys.executable,
           str(ROOT / "benchmarks" / "clan_script.py"), *script_args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.mark.cluster
def test_gp_onebit_lans_keeps_the_position_embedding_exact(tmp_path: Path) -> None:
    rep = _run(tmp_path, [], "--dense-steps", "3", "--uncompressed-params", "pos.weight")
    assert rep["status"] == "completed" and rep["steps"] == 6 and rep["replicas_identical"]
    assert rep["metric"]["name"] == "val_loss" and rep["metric"]["step"] == 6
    b = rep["bytes_per_step"]
    pos_fp32_bytes = get_task("stdlib-mlm").build_model(0).pos.weight.numel() * 4
    # the compression stage: the embedding exact, the other matrices one-bit (32x)
    assert pos_fp32_bytes < b["push_last"] < pos_fp32_bytes + b["dense_fp32"] / 16
    assert b["push"] > b["push_last"]  # the 3 dense steps are in the mean


@pytest.mark.cluster
def test_method_train_passes_experiment_switches(tmp_path: Path) -> None:
    rep = _run(tmp_path, ["--optimizer", "onebit-lans", "--dense-steps", "3"],
               "--method", "train", "--variance", "frozen", "--blend")
    assert rep["status"] == "completed" and rep["steps"] == 6 and rep["replicas_identical"]
    assert rep["config"]["task"] == "stdlib-mlm" and rep["hparams"]["dense_steps"] == 3
    b = rep["bytes_per_step"]
    assert b["push_last"] < b["dense_fp32"] / 8   # the momenta travel one-bit after step 3


@pytest.mark.cluster
def test_switches_need_method_train() -> None:
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "clan_script.py"),
                        "--variance", "frozen"], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "need --method train" in p.stderr


def test_switches_become_optimizer_keywords() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("clan_script",
                                                  ROOT / "benchmarks" / "clan_script.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = mod.parse_args(["--method", "train", "--variance", "frozen", "--no-blend",
                           "--no-precondition", "--ef21", "--refresh-every", "50"])
    assert mod.optimizer_options(args) == {"variance": "frozen", "blend": False,
                                           "refresh_every": 50, "precondition": False,
                                           "ef21": True}
    assert mod.optimizer_options(mod.parse_args([])) == {}

"""benchmarks/clan_script.py: gp.CLAN on the bundled transformer in a real 2-worker script run.

The recommendation of docs/convergence.md 2.13 (``uncompressed_params=["pos.weight"]``, a fixed
dense phase) as a user writes it: after the dense phase every matrix but the position
embedding travels one-bit, the embedding as exact fp32, and the replicas stay identical.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gradpress.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, *script_args: str) -> dict:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gradpress.train.cli", "train", "--compression", "onebit",
           "--lr", "0.01", "--steps", "6", "--warmup-steps", "2", "--no-progress", "--out",
           str(out), "--", sys.executable, str(ROOT / "benchmarks" / "clan_script.py"),
           "--warmup-steps", "3", *script_args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_gp_clan_keeps_the_position_embedding_exact(tmp_path: Path) -> None:
    rep = _run(tmp_path, "--uncompressed-params", "pos.weight")
    assert rep["status"] == "completed" and rep["steps"] == 6 and rep["replicas_identical"]
    assert rep["metric"]["name"] == "val_loss" and rep["metric"]["step"] == 6
    b = rep["bytes_per_step"]
    pos_fp32_bytes = get_task("stdlib-mlm").build_model(0).pos.weight.numel() * 4
    # the compression stage: the embedding exact, the other matrices one-bit (32x)
    assert pos_fp32_bytes < b["push_last"] < pos_fp32_bytes + b["dense_fp32"] / 16
    assert b["push"] > b["push_last"]  # the 3 dense steps are in the mean

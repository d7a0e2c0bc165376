"""The torchrun recipe of docs/integrations.md: examples/torchrun_train.py trains for real under
``torchrun`` with colocated servers and with a separate server rank (``GRADPRESS_NUM_SERVERS``),
and under ``gradpress launch``; every layout gives the same bits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, check_training, free_port, results, run_env, torchrun

pytestmark = pytest.mark.cluster  # every test here starts real processes

SCRIPT = ROOT / "examples" / "torchrun_train.py"
STEPS = 60


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("colocated")
    torchrun(2, SCRIPT, ["--steps", str(STEPS), "--out", str(out)], run_env())
    return results(out, 2)


def test_torchrun_colocated_servers(colocated: list[dict]) -> None:
    check_training(colocated, max_ratio=0.1)
    assert all(r["size"] == 2 for r in colocated)


def test_torchrun_separate_server_rank(tmp_path: Path, colocated: list[dict]) -> None:
    # 3 processes: ranks 0-1 are workers, rank 2 serves (its gp.init() serves, then exits 0)
    torchrun(3, SCRIPT, ["--steps", str(STEPS), "--out", str(tmp_path)],
             run_env(GRADPRESS_NUM_SERVERS="1"))
    runs = results(tmp_path, 2)
    check_training(runs, max_ratio=0.1)
    # the servers sum in worker rank order whatever the layout: the same bits as colocated
    assert runs[0]["param_hash"] == colocated[0]["param_hash"]


def test_gradpress_launch_runs_the_same_script(tmp_path: Path,
                                               colocated: list[dict]) -> None:
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "1",
           "--", sys.executable, str(SCRIPT), "--steps", str(STEPS), "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=run_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    runs = results(tmp_path, 2)
    check_training(runs, max_ratio=0.1)
    assert runs[0]["param_hash"] == colocated[0]["param_hash"]


def test_torchrun_two_nodes_with_a_job_secret(tmp_path: Path, colocated: list[dict]) -> None:
    # the multi-node command of docs/integrations.md, both "nodes" on this machine
    port = str(free_port())
    env = run_env(GRADPRESS_SECRET="a-secret-shared-by-every-node")
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(r),
         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
         str(SCRIPT), "--steps", str(STEPS), "--out", str(tmp_path)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    runs = results(tmp_path, 2)
    check_training(runs, max_ratio=0.1)
    assert runs[0]["param_hash"] == colocated[0]["param_hash"]

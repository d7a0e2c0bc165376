"""The torchrun recipe of docs/integrations.md: examples/torchrun_train.py trains for real under
``torchrun`` with colocated servers and with a separate server rank (``GRADPRESS_NUM_SERVERS``),
and under ``gradpress launch``; every layout gives the same bits."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "torchrun_train.py"
STEPS = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_env(**extra: str) -> dict[str, str]:
    """The test's environment, one thread per process, the worktree's sources first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPRESS_")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    return env | {"OMP_NUM_THREADS": "1", "GRADPRESS_TIMEOUT": "60"} | extra


def torchrun(nproc: int, script: Path, args: list[str], env: dict[str, str],
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def results(out: Path, workers: int) -> list[dict]:
    files = sorted(out.glob("rank*.json"))
    assert [f.name for f in files] == [f"rank{r}.json" for r in range(workers)], files
    return [json.loads(f.read_text()) for f in files]


def check_training(runs: list[dict], max_ratio: float, loss_ratio: float = 0.8) -> None:
    """Replicas bit-identical, loss down (the last 10 steps' mean below ``loss_ratio`` times
    the first 10 steps'), bytes below ``max_ratio`` times fp32's."""
    assert len({r["param_hash"] for r in runs}) == 1, [r["param_hash"] for r in runs]
    for r in runs:
        losses = r["losses"]
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        assert last < loss_ratio * first, (first, last)
        s = r["stats"]
        assert 0 < s["bytes_pushed"] < max_ratio * s["dense_fp32_bytes"], s


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

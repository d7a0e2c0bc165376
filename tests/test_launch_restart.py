"""``gradpress launch --checkpoints DIR --max-restarts N`` with a user script: the newest valid
checkpoint is found by its saved step (a corrupt one skipped), and a job whose worker is
SIGKILLed mid-run restarts from it and ends with parameters bit-identical to an uninterrupted
run (two real launches of a small onebit + error-feedback model)."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from gradpress.checkpoint import file_sha256, latest
from helpers import pid_of

SCRIPT = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    import torch
    import gradpress as gp
    import gradpress.checkpoint as ckpt
    from gradpress.train.periodic import params_sha256

    out, total = Path(sys.argv[1]), int(sys.argv[2])
    KILL_AT = 22  # past the step-20 checkpoint
    gp.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 4))
    opt = gp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  named_parameters=model.named_parameters(),
                                  compression="onebit", ef="vanilla", min_compress_bytes=0)
    start = 0
    if ckpt.resume_dir() is not None:
        start = ckpt.load(ckpt.resume_dir(), model, opt)
    else:
        gp.broadcast_parameters(model.state_dict())
    root = ckpt.checkpoints_dir()
    for step in range(start, total):
        g = torch.Generator().manual_seed(step * 100 + gp.rank())  # data: f(step, rank)
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 4, (32,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if root is not None and (step + 1) % 10 == 0:
            ckpt.save(f"{root}/step-{step + 1}", model, opt, step + 1)
        if step + 1 == KILL_AT and root is not None and ckpt.resume_dir() is None \
                and gp.rank() == 1:  # the first attempt stops here, to be killed by the test
            (out / "paused").write_text(str(step + 1))
            time.sleep(120)
            raise SystemExit("worker 1 was not killed within 120 s")
    if gp.rank() == 0:
        (out / "sha").write_text(params_sha256(model))
    gp.shutdown()
''')
TOTAL = 40


def _meta_dir(d: Path, step: int) -> None:
    d.mkdir(parents=True)
    (d / "worker0.pt").write_bytes(b"x" * 100)
    meta = {"format": 1, "tag": "t", "step": step, "num_workers": 2, "num_servers": 1,
            "files": {"worker0.pt": file_sha256(d / "worker0.pt")}}
    (d / "meta.json").write_text(json.dumps(meta))


def test_latest_orders_by_saved_step_and_skips_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _meta_dir(tmp_path / "b", 10)
    _meta_dir(tmp_path / "a", 20)  # names do not matter, the saved step does
    _meta_dir(tmp_path / "c", 30)
    (tmp_path / "c" / "worker0.pt").write_bytes(b"x")  # truncated
    (tmp_path / "d").mkdir()  # a save that did not finish
    with caplog.at_level(logging.WARNING, logger="gradpress.checkpoint"):
        assert latest(tmp_path) == str((tmp_path / "a").resolve())
    assert "skipping checkpoint" in caplog.text and "worker0.pt" in caplog.text
    assert latest(tmp_path / "none") is None


@pytest.mark.cluster
def test_max_restarts_is_checked() -> None:
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--nnodes", "2",
           "--master-port", "1", "--max-restarts", "1", "--", "true"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--max-restarts is for one node" in p.stderr


def _launch(out: Path, marker: str, *extra: str) -> subprocess.Popen:
    (out / "train.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "1",
           *extra, "--", sys.executable, str(out / "train.py"), str(out), str(TOTAL)]
    env = dict(os.environ, OMP_NUM_THREADS="1", GP_TEST_MARKER=marker)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


@pytest.mark.cluster
def test_killed_worker_restarts_from_the_newest_checkpoint(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    p = _launch(ref, uuid.uuid4().hex)
    _, err = p.communicate(timeout=180)
    assert p.returncode == 0, err[-3000:]
    marker = uuid.uuid4().hex
    p = _launch(run, marker, "--checkpoints", str(run / "ckpt"), "--max-restarts", "1")
    try:
        deadline = time.monotonic() + 180
        while not (run / "paused").exists():  # worker 1 waits there after step 22
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "worker 1 did not reach step 22 within 180 s"
            time.sleep(0.05)
        os.kill(pid_of(marker, "worker", 1), signal.SIGKILL)
        _, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, err[-3000:]
    resumed = re.search(r"restart 1 of 1 from \S*/step-(\d+)", err)
    assert resumed is not None, err[-3000:]
    assert int(resumed.group(1)) == 20  # the newest checkpoint before the kill at step 22
    assert (run / "sha").read_text() == (ref / "sha").read_text()

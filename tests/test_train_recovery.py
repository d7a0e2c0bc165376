"""``gradpress train --checkpoint-every / --resume / --max-restarts`` and verified checkpoints.

In-process: checksums refuse truncated and corrupt files (naming the file and both checksums),
``--resume auto`` skips a refused checkpoint, pruning, metrics trimming, options. Real local
clusters (digits-cnn, onebit with error feedback, 1 server, 40 steps, a checkpoint every 20):
one uninterrupted run gives the reference ``params_sha256``; a run resumed from its step-20
checkpoint, a ``--resume auto`` that must fall back past a corrupt step-40 checkpoint, and runs
under ``--max-restarts 1`` whose worker or server is SIGKILLed, or whose worker hangs (SIGSTOP,
noticed by the others' 15 s timeout), after step 22, or whose rank 0 is SIGKILLed at step 3
(before any checkpoint: a restart from the start), all end bit-identical to it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from gradpress.checkpoint import file_sha256, latest, verify
from gradpress.train import TrainConfig
from gradpress.train.periodic import TrainCheckpoints, params_sha256, resolve_resume
from gradpress.train.report import read_metrics
from gradpress.train.restarts import last_step, start_from, trim_metrics
from helpers import pid_of

STEPS, EVERY = 40, 20
RUN = ("--task", "digits-cnn", "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
       "--compression", "onebit", "--dense-steps", "2", "--servers", "1", "--no-progress",
       "--no-tensorboard")


def _train(out: Path, *extra: str, env: dict[str, str] | None = None,
           timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gradpress.cli", "train", *RUN, "--out", str(out), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _fake_checkpoint(d: Path, step: int, files: dict[str, bytes], checksums: bool = True) -> Path:
    """A checkpoint directory as gradpress.checkpoint.save lays it out (files, then meta)."""
    d.mkdir(parents=True)
    for name, data in files.items():
        (d / name).write_bytes(data)
    meta = {"format": 1, "tag": "t", "step": step, "num_workers": 2, "num_servers": 1}
    if checksums:
        meta["files"] = {n: file_sha256(d / n) for n in files}
    (d / "meta.json").write_text(json.dumps(meta))
    return d


FILES = {"worker0.pt": b"w0" * 1000, "worker1.pt": b"w1" * 1000, "server0.pt": b"s0" * 1000}


def test_truncated_or_corrupt_file_is_refused_naming_it(tmp_path: Path) -> None:
    d = _fake_checkpoint(tmp_path / "step-4", 4, FILES)
    assert verify(d)["step"] == 4
    (d / "worker1.pt").write_bytes(FILES["worker1.pt"][:100])  # truncated
    with pytest.raises(ValueError) as e:
        verify(d)
    msg = str(e.value)
    assert "worker1.pt" in msg and "corrupt or truncated" in msg
    assert file_sha256(d / "worker1.pt") in msg  # actual
    assert json.loads((d / "meta.json").read_text())["files"]["worker1.pt"] in msg  # expected
    verify(d, ["worker0.pt", "server0.pt"])  # only the named files
    e2 = _fake_checkpoint(tmp_path / "step-6", 6, FILES)
    data = bytearray((e2 / "server0.pt").read_bytes())
    data[7] ^= 0xFF  # one flipped byte
    (e2 / "server0.pt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"server0\.pt is corrupt or truncated"):
        verify(e2)


def test_metadata_without_checksums_is_refused(tmp_path: Path) -> None:
    d = _fake_checkpoint(tmp_path / "nosums", 3, FILES, checksums=False)
    with pytest.raises(ValueError, match="lists no checksums"):
        verify(d)
    assert latest(tmp_path) is None


def test_auto_resume_skips_refused_and_incomplete_checkpoints(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "out" / "checkpoints"
    _fake_checkpoint(root / "step-2", 2, FILES)
    _fake_checkpoint(root / "step-4", 4, FILES)
    bad = _fake_checkpoint(root / "step-6", 6, FILES)
    (bad / "worker0.pt").write_bytes(b"w0")
    (root / "step-8").mkdir()  # a save that crashed before its meta.json
    (root / "step-8" / "worker0.pt").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="gradpress.checkpoint"):
        assert latest(root) == str((root / "step-4").resolve())
    text = caplog.text
    assert "skipping checkpoint" in text and "step-6" in text and "worker0.pt" in text
    assert "step-8" in text and "meta.json is missing" in text
    assert resolve_resume("auto", tmp_path / "out") == str((root / "step-4").resolve())
    assert resolve_resume("auto", tmp_path / "empty") is None  # nothing yet: from the start
    with pytest.raises(ValueError, match="worker0.pt is corrupt"):
        resolve_resume(str(bad), tmp_path / "out")
    # another number of workers: announced, the workers fold the residuals (gradpress.elastic)
    assert resolve_resume("auto", tmp_path / "out", (4, 1)) == str((root / "step-4").resolve())
    assert "2 workers and 1 servers, this run has 4 workers" in capsys.readouterr().out


def test_prune_keeps_the_newest_two_complete(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (3, 6, 9):
        _fake_checkpoint(root / f"step-{step}", step, FILES)
    (root / "step-1").mkdir()  # an old crashed save
    (root / "step-12").mkdir()  # a save in progress: kept
    cfg = TrainConfig(task="digits-cnn", checkpoint_every=3, out=str(tmp_path))

    class _S:
        pass

    s = _S()
    s.cfg = cfg
    TrainCheckpoints(s, torch.nn.Linear(1, 1), torch.optim.SGD([torch.zeros(1)], lr=1)).prune()
    assert sorted(p.name for p in root.iterdir()) == ["step-12", "step-6", "step-9"]


def test_trim_metrics_keeps_what_precedes_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    recs = [{"kind": "start"}, *({"kind": "step", "step": i} for i in range(1, 8)),
            {"kind": "eval", "step": 5}, {"kind": "plan", "step": 2},
            {"kind": "end", "step": 7, "status": "interrupted"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"kind": "st')  # cut line
    assert last_step(path) == 7
    trim_metrics(path, 5)
    kept = read_metrics(path)
    assert [r.get("step") for r in kept if r["kind"] == "step"] == [1, 2, 3, 4, 5]
    assert {r["kind"] for r in kept} == {"start", "step", "eval", "plan"}


def test_start_from_removes_later_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for step in (4, 8, 12):
        _fake_checkpoint(root / f"step-{step}", step, FILES)
    assert start_from(tmp_path, str(root / "step-8")) == 8  # the run from 8 on is redone
    assert sorted(p.name for p in root.iterdir()) == ["step-4", "step-8"]
    assert start_from(tmp_path, None) == 0  # a fresh run: an earlier run's are no use
    assert list(root.iterdir()) == []


def test_params_sha256_is_bitwise() -> None:
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    assert params_sha256(a) == params_sha256(b)
    with torch.no_grad():
        b.weight.view(-1)[0] = torch.nextafter(b.weight.view(-1)[0], torch.tensor(2.0))
    assert params_sha256(a) != params_sha256(b)


@pytest.mark.parametrize("kw, words", [
    ({"checkpoint_every": -1}, ["checkpoint_every", ">= 0", "-1"]),
    ({"max_restarts": 1.5}, ["max_restarts", "1.5"]),
    ({"resume": ""}, ["resume", "'auto'"]),
])
def test_recovery_options_are_validated(kw: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        TrainConfig(task="digits-cnn", **kw)
    assert all(w in str(e.value) for w in words), str(e.value)
    # a script checkpoints too (gradpress.train.Session.checkpoints)
    assert TrainConfig(script=("python", "x.py"), lr=0.1, checkpoint_every=5,
                       max_restarts=1).checkpoint_every == 5


# -- real clusters ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 40-step run with checkpoints at steps 20 and 40."""
    out = tmp_path_factory.mktemp("reference") / "run"
    p = _train(out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


@pytest.mark.cluster
def test_checkpoints_and_params_sha256_of_a_run(reference: Path) -> None:
    rep = _report(reference)
    assert rep["status"] == "completed" and rep["steps"] == STEPS
    assert len(rep["params_sha256"]) == 64
    assert rep["restarts"] == {"count": 0, "steps_redone": 0}
    root = reference / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-20", "step-40"]
    meta = verify(root / "step-20")
    assert meta["step"] == 20 and set(meta["files"]) == {"worker0.pt", "worker1.pt",
                                                         "server0.pt"}


@pytest.mark.cluster
def test_resumed_run_is_bit_identical(reference: Path, tmp_path: Path) -> None:
    ckpt = shutil.copytree(reference / "checkpoints" / "step-20", tmp_path / "ckpt")
    out = tmp_path / "run"
    p = _train(out, "--resume", str(ckpt))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"resuming from {ckpt}" in p.stdout
    rep = _report(out)
    assert rep["params_sha256"] == _report(reference)["params_sha256"]
    assert rep["steps"] == STEPS - EVERY  # a fresh directory: only the steps run here


@pytest.mark.cluster
def test_auto_resume_falls_back_past_a_corrupt_checkpoint(reference: Path,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(reference / "checkpoints", out / "checkpoints")
    shutil.copy(reference / "metrics.jsonl", out / "metrics.jsonl")
    server = out / "checkpoints" / "step-40" / "server0.pt"
    data = bytearray(server.read_bytes())
    data[len(data) // 2] ^= 0x01
    server.write_bytes(bytes(data))
    explicit = _train(out, "--resume", str(server.parent), timeout=60)
    assert explicit.returncode == 2 and "server0.pt is corrupt or truncated" in explicit.stderr
    p = _train(out, "--resume", "auto")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "skipping checkpoint" in p.stderr and "server0.pt" in p.stderr
    assert "step-20" in p.stdout
    rep = _report(out)
    assert rep["params_sha256"] == _report(reference)["params_sha256"]
    assert rep["steps"] == STEPS  # metrics cut back to step 20, then steps 21-40 again
    # the resumed segment's clock goes on from step 20's: time_s never falls back, and
    # wall_s covers both segments
    times = [r["time_s"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "step"]
    assert times == sorted(times) and times[EVERY] > times[EVERY - 1] > 0, times
    assert rep["wall_s"] >= times[-1] > times[EVERY - 1]


def _starts(out: Path) -> int:
    return sum(r["kind"] == "start" for r in read_metrics(out / "metrics.jsonl"))


# (role, rank, signal, GRADPRESS_TIMEOUT): a hung (stopped) worker is noticed by the others'
# waits timing out, so that case runs with a short timeout; the last case fails at step 3,
# before the first checkpoint, and restarts from the start
FAILURES = {"worker-killed": ("worker", 1, signal.SIGKILL, None),
            "server-killed": ("server", None, signal.SIGKILL, None),
            "worker-hangs": ("worker", 1, signal.SIGSTOP, "15"),
            "before-any-checkpoint": ("worker", 0, signal.SIGKILL, None)}


@pytest.mark.cluster
@pytest.mark.parametrize("failure", list(FAILURES))
def test_failed_job_restarts_bit_identical(reference: Path, tmp_path: Path,
                                           failure: str) -> None:
    role, rank, sig, timeout = FAILURES[failure]
    out, marker = tmp_path / "run", uuid.uuid4().hex
    cmd = [sys.executable, "-m", "gradpress.cli", "train", *RUN, "--out", str(out),
           "--max-restarts", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1", GP_TEST_MARKER=marker,
               **({"GRADPRESS_TIMEOUT": timeout} if timeout else {}))
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        early = failure == "before-any-checkpoint"
        while last_step(out / "metrics.jsonl") < (3 if early else EVERY + 2):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "no step past the checkpoint within 180 s"
            time.sleep(0.01)
        pid = pid_of(marker, role, rank)
        assert pid is not None
        os.kill(pid, sig)
        failed_at, failed_step = time.monotonic(), last_step(out / "metrics.jsonl")
        while not early and _starts(out) < 2:  # the restarted job's rank 0 appends a start
            # record (a restart from the start writes a fresh metrics.jsonl: not timed)
            assert p.poll() is None or p.returncode == 0, p.communicate()
            assert time.monotonic() < deadline, "no restart within 180 s"
            time.sleep(0.05)
        recovery_s = time.monotonic() - failed_at
        stdout, stderr = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "restart 1 of 1" in stdout
    assert ("from the start (step 0)" if failed_step < EVERY else "step-20") in stdout
    rep = _report(out)
    assert rep["params_sha256"] == _report(reference)["params_sha256"]
    assert rep["status"] == "completed" and rep["steps"] == STEPS
    assert rep["restarts"]["count"] == 1
    assert 0 < rep["restarts"]["steps_redone"] <= STEPS - EVERY
    assert early or failed_step >= EVERY
    if not early:
        print(f"{failure}: recovery (failure to the restarted job's first record) "
              f"{recovery_s:.1f} s")
        assert recovery_s < 30 + (float(timeout) if timeout else 0.0)


@pytest.mark.cluster
def test_onebit_lans_resume_keeps_each_workers_optimizer_state(tmp_path: Path) -> None:
    """OneBitLANS keeps a second moment per worker (``per_worker_state``): each worker's own
    optimizer state must come back, not worker 0's broadcast."""
    run = [*RUN, "--optimizer", "onebit-lans", "--steps", "8", "--checkpoint-every", "4"]

    def train(out: Path, *extra: str) -> dict:
        cmd = [sys.executable, "-m", "gradpress.cli", "train", *run, "--out", str(out), *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                           env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        return _report(out)

    full = train(tmp_path / "full")
    ckpt = shutil.copytree(tmp_path / "full" / "checkpoints" / "step-4", tmp_path / "ckpt")
    assert json.loads((ckpt / "meta.json").read_text())["per_worker_optimizer"] is True
    assert train(tmp_path / "res", "--resume", str(ckpt))["params_sha256"] == \
        full["params_sha256"]

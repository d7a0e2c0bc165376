"""Recovery under torchrun's elastic agent (docs/integrations.md, "Recovery with torchrun"):
examples/torchrun_elastic.py with c10d rendezvous on 127.0.0.1; a worker SIGKILLed in the first
attempt, the group restarted by the agent, resumed from the newest checkpoint and bit-identical to
a run that was not killed; two agents of ``--nnodes 1:2``, one killed with its worker (a node
lost), the other going on alone. A checkpoint resumed by fewer and by more workers (the resize
rule of gradpress.elastic), and refused under ``resize="refuse"``; ``gradpress train`` script
mode with checkpoints and ``--max-restarts``. Also the rule itself on state dicts, the attempt
that scopes the store keys and the roll call. Two emulated hosts: tests/test_elastic_hosts.py."""

from __future__ import annotations

import datetime
import json
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_runs import SCRIPT, STEPS, elastic
from gradpress.elastic import ResizeEvent, check_rule, fold_states, reset_state
from gradpress.ps.cluster import store_prefix
from gradpress.ps.config import ClusterConfig
from gradpress.ps.errors import GradpressError
from gradpress.ps.rollcall import PREFIX, roll_call
from helpers import ROOT, free_port, results, run_env


@pytest.mark.cluster
def test_worker_sigkilled_torchrun_restarts_bit_identical(
        tmp_path: Path, uninterrupted: tuple[Path, list[dict]]) -> None:
    text = elastic(2, tmp_path / "ckpt", tmp_path / "out", GP_KILL_AT="25")
    assert "worker 1: SIGKILL before step 25" in text, text[-3000:]
    runs = results(tmp_path / "out", 2)
    assert [r["start"] for r in runs] == [20, 20]  # resumed from step-20, in a later attempt
    want = uninterrupted[1][0]["param_hash"]
    assert [r["param_hash"] for r in runs] == [want, want]


@pytest.mark.cluster
def test_fewer_then_more_workers_resume_with_the_fold_rule(
        tmp_path: Path, uninterrupted: tuple[Path, list[dict]]) -> None:
    ckpt, base = uninterrupted
    shutil.copytree(ckpt / "step-20", tmp_path / "one" / "step-20")
    text = elastic(1, tmp_path / "one", tmp_path / "out1", restarts=0)
    assert "saved by 2 workers and 2 servers, this job has 1 workers and 1 servers: resize " \
           "rule 'fold'" in text, text[-3000:]
    (one,) = results(tmp_path / "out1", 1)
    assert one["start"] == 20 and one["resized"]["rule"] == "fold"
    assert (one["resized"]["saved_workers"], one["resized"]["workers"]) == (2, 1)
    # the task's target: the held-out loss within 5% of the uninterrupted run's
    assert one["held_out_loss"] < 1.05 * base[0]["held_out_loss"], (one, base[0])
    # the group grows again: the 1-worker checkpoint of step 30 resumed by 2 workers
    shutil.copytree(tmp_path / "one" / "step-30", tmp_path / "grow" / "step-30")
    elastic(2, tmp_path / "grow", tmp_path / "out2", restarts=0)
    two = results(tmp_path / "out2", 2)
    assert [r["start"] for r in two] == [30, 30] and two[0]["resized"]["workers"] == 2
    assert two[0]["param_hash"] == two[1]["param_hash"]
    assert two[0]["held_out_loss"] < 1.05 * base[0]["held_out_loss"], (two[0], base[0])


def wait_listening(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait until something listens on 127.0.0.1:``port`` (``proc`` still running)."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        assert proc.poll() is None, f"the first agent exited {proc.returncode} before it listened"
        assert time.monotonic() < deadline, f"nothing listens on port {port} after {timeout} s"
        time.sleep(0.05)


@pytest.mark.cluster
def test_node_lost_the_other_agent_goes_on_with_one_worker(tmp_path: Path) -> None:
    # two torchrun agents ("nodes") of --nnodes 1:2 on loopback; worker 1 SIGKILLs its agent and
    # itself before step 25: the surviving agent restarts alone and resumes the step-20
    # checkpoint of 2 workers with 1 (the fold rule). Both agents run as docs/reliability.md
    # recommends for several nodes, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with the agent's shared
    # store, a node that joins a later round than the first waits forever for a MASTER_ADDR that
    # rank 0 only wrote in round 0 (torch 2.13 caches it), which is what happened whenever the
    # second agent took longer than last_call_timeout to start
    port = str(free_port())
    conf = "last_call_timeout=2,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=2"

    def agent(**env: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2",
               "--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", conf,
               "--monitor-interval", "0.5", str(SCRIPT), "--steps", str(STEPS), "--ckpt",
               str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]
        return subprocess.Popen(cmd, env=run_env(GRADPRESS_TIMEOUT="30",
                                                 TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env),
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    survivor = agent()  # it must host the rendezvous endpoint: the other starts after it does
    wait_listening(int(port), survivor)
    lost = agent(GP_KILL_AT="25", GP_KILL_AGENT="1", GP_KILL_RANK="any")
    try:
        lost_out = lost.communicate(timeout=120)[0]
        out = survivor.communicate(timeout=120)[0]
    finally:
        for p in (survivor, lost):
            if p.poll() is None:
                p.kill()
    assert lost.returncode == -9 and "SIGKILL before step 25" in lost_out, lost_out[-3000:]
    assert survivor.returncode == 0, out[-6000:]
    (one,) = results(tmp_path / "out", 1)
    assert one["start"] == 20 and one["size"] == 1
    assert one["resized"] == {"checkpoint": str((tmp_path / "ckpt" / "step-20").resolve()),
                              "step": 20, "saved_workers": 2, "saved_servers": 2,
                              "workers": 1, "servers": 1, "rule": "fold"}


@pytest.mark.cluster
def test_refuse_names_both_layouts(tmp_path: Path,
                                   uninterrupted: tuple[Path, list[dict]]) -> None:
    shutil.copytree(uninterrupted[0] / "step-20", tmp_path / "ck" / "step-20")
    text = elastic(1, tmp_path / "ck", tmp_path / "out", "--resize", "refuse", restarts=0,
                   expect=1)
    assert "saved by a job with 2 workers and 2 servers, this job has 1 workers and 1 " \
           "servers" in text, text[-3000:]


# -- the rule on state dicts, the attempt ----------------------------------------------------
def _engine(residual: list[float], step: int) -> dict:
    return {"format": 1, "tensors": {"w": {"signature": {"numel": 2}, "chunks": [
        {"numel": 2, "step": step, "codec": {"kind": "vanilla", "lr_prev": 0.1,
                                              "residual": torch.tensor(residual),
                                              "inner": {}}}]}}}


def test_fold_is_the_mean_and_reset_zeroes_only_tensors() -> None:
    folded = fold_states([_engine([1.0, 2.0], 7), _engine([3.0, -2.0], 7),
                          _engine([2.0, 3.0], 7)])
    chunk = folded["tensors"]["w"]["chunks"][0]
    assert torch.equal(chunk["codec"]["residual"], torch.tensor([2.0, 1.0]))
    assert chunk["codec"]["residual"].dtype == torch.float32
    assert chunk["step"] == 7 and chunk["codec"]["lr_prev"] == 0.1  # scalars of worker 0
    reset = reset_state(_engine([1.0, 2.0], 7))["tensors"]["w"]["chunks"][0]
    assert torch.equal(reset["codec"]["residual"], torch.zeros(2)) and reset["step"] == 7
    with pytest.raises(ValueError, match="differs in shape"):
        fold_states([_engine([1.0, 2.0], 7), _engine([1.0], 7)])
    with pytest.raises(ValueError, match="resize must be one of.*'mean'"):
        check_rule("mean")
    with pytest.raises(ValueError, match="'fold' or 'reset'"):
        ResizeEvent(checkpoint="c", step=1, saved_workers=2, saved_servers=2, workers=1,
                    servers=1, rule="refuse")


def test_attempt_scopes_every_store_key() -> None:
    env = {"WORLD_SIZE": "2", "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "3",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert ClusterConfig.from_env(env).attempt == 3
    assert ClusterConfig.from_env({**env, "GRADPRESS_ATTEMPT": "5"}).attempt == 5
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: world rank 0 hosts a fresh store at every start;
    # the restart count differs between an old agent and a replacement node's (cause 2, #42)
    own = {**env, "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert ClusterConfig.from_env(own).attempt == 0 and not ClusterConfig.from_env(own).roll_call
    assert ClusterConfig.from_env({**own, "GRADPRESS_ATTEMPT": "2"}).attempt == 2
    assert ClusterConfig.from_env({"WORLD_SIZE": "1"}).attempt == 0
    assert store_prefix(3) == "gradpress/3/" != store_prefix(0)
    with pytest.raises(ValueError, match="attempt must be an int >= 0"):
        ClusterConfig(role="worker", rank=0, num_workers=1, num_servers=1, attempt=-1)



def test_roll_call_one_attempt_per_group_stale_tickets_ignored() -> None:
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    store.set(PREFIX + "hello/1", "12345")  # what a process of an earlier group left
    store.set(PREFIX + "hello/2", "12346")

    def client() -> dist.TCPStore:  # one connection per "process", as in a job
        return dist.TCPStore("127.0.0.1", store.port, None, False,
                             timeout=datetime.timedelta(seconds=10))

    def group(world: int) -> list[int]:
        with ThreadPoolExecutor(world) as pool:
            return list(pool.map(lambda r: roll_call(client(), r, world, 10.0), range(world)))

    first, second = group(3), group(3)
    assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0]
    with pytest.raises(GradpressError, match="got no answer after 0.3 s from 1$"):
        roll_call(store, 0, 2, 0.3)
    with pytest.raises(GradpressError, match="1: no answer from 0 to the roll call"):
        roll_call(client(), 1, 2, 0.3)
    assert ClusterConfig.from_env({"WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1",
                                   "TORCHELASTIC_USE_AGENT_STORE": "True"}).roll_call
    assert not ClusterConfig.from_env({"WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1",
                                       "TORCHELASTIC_USE_AGENT_STORE": "True",
                                       "GRADPRESS_ATTEMPT": "2"}).roll_call


# -- gradpress train, script mode: checkpoints and --max-restarts ---------------------------
TRAIN_SCRIPT = '''
import os, signal, torch, gradpress as gp
from gradpress.train import Session
from gradpress.train.periodic import params_sha256
gp.init()
s = Session.from_env()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
opt = s.optimizer(model)
ck = s.checkpoints(model, opt)  # resumes when the run does, else broadcasts the parameters
s.start()
while s.steps < s.cfg.steps:
    if s.steps == 15 and gp.rank() == 1 and s.cfg.resume is None and os.environ.get("GP_KILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(1000 * s.steps + gp.rank())  # data position: the step
    x = torch.randn(16, 64, generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), x[:, :4].argmax(1))
    loss.backward()
    s.step(opt)
    s.log_step(loss.item())
    ck.after_step(0, s.steps)
s.finish(model, params_sha256=params_sha256(model))
gp.shutdown()
'''


def _train_script(tmp_path: Path, name: str, **env: str) -> dict:
    script = tmp_path / "script.py"
    script.write_text(TRAIN_SCRIPT)
    out = tmp_path / name
    cmd = [sys.executable, "-m", "gradpress.cli", "train", "--compression", "onebit", "--lr",
           "0.01", "--steps", "20", "--checkpoint-every", "10", "--max-restarts", "1",
           "--no-progress", "--no-tensorboard", "--out", str(out), "--", sys.executable,
           str(script)]
    p = subprocess.run(cmd, env=run_env(**env), cwd=ROOT, capture_output=True, text=True,
                       timeout=150)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return dict(json.loads((out / "report.json").read_text()))


@pytest.mark.cluster
def test_train_script_mode_checkpoints_and_restarts(tmp_path: Path) -> None:
    base = _train_script(tmp_path, "base")
    killed = _train_script(tmp_path, "killed", GP_KILL="1")
    assert base["restarts"]["count"] == 0 and killed["restarts"]["count"] == 1
    assert killed["status"] == "completed" and killed["steps"] == 20
    assert killed["params_sha256"] == base["params_sha256"]

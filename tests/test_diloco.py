"""gp.DiLoCo end to end: real worker and server processes from ``gradpress launch``.

One launch runs every scenario; each worker saves what it saw and the test compares the workers
with each other and with a one-process simulation of the same replicas (exact averages).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

import gradpress as gp
from gradpress.train.restarts import last_step
from helpers import pid_of, worker_results

WORKER = textwrap.dedent('''
    import functools, io, sys, torch, gradpress as gp
    out = sys.argv[1]
    gp.init()
    r, W = gp.rank(), gp.size()
    res = {}
    NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)

    def net():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))

    def data(step, rank):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)

    def inner(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-2)

    def flat(ps):
        return torch.cat([p.detach().reshape(-1) for p in ps])

    def train_step(model, opt, step, rank):
        opt.zero_grad()
        x, y = data(step, rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    def run(tag, steps, model=None, opt=None, loco=None, start=0, **kw):
        model = model or net()
        opt = opt or inner(model)
        loco = loco or gp.DiLoCo(model, opt, prefix=tag, **kw)
        seen, rounds = loco.outer_steps, []
        for step in range(start, steps):
            train_step(model, opt, step, r)
            if loco.outer_steps > seen:  # the global parameters after each outer step
                seen = loco.outer_steps
                rounds.append(flat(loco.parameters()))
        return model, opt, loco, rounds

    def reference(steps, H, outer=None, overlap=False):
        """W replicas in this process; the exchange is the exact average (0 + d0 + d1) / W."""
        models = [net() for _ in range(W)]
        opts = [inner(m) for m in models]
        glob = [torch.nn.Parameter(p.detach().clone()) for p in models[0].parameters()]
        oo = (outer or functools.partial(torch.optim.SGD, lr=1.0))(glob)
        bases = [[p.detach().clone() for p in m.parameters()] for m in models]
        pending = None

        def average(deltas):
            return [sum((d[i] for d in deltas), torch.zeros_like(g)) / W
                    for i, g in enumerate(glob)]

        def outer_step(avg):
            for g, a in zip(glob, avg):
                g.grad = a
            oo.step()

        def deltas():
            return [[b - p.detach() for b, p in zip(bases[w], models[w].parameters())]
                    for w in range(W)]

        def restart(w, ds):
            with torch.no_grad():
                for i, (p, g, b) in enumerate(zip(models[w].parameters(), glob, bases[w])):
                    p.copy_(g if ds is None else g - ds[i])
                    b.copy_(p)

        for step in range(steps):
            for w in range(W):
                train_step(models[w], opts[w], step, w)
            if (step + 1) % H:
                continue
            ds = deltas()
            if overlap:
                if pending is not None:
                    outer_step(pending)
                pending = average(ds)
                for w in range(W):
                    restart(w, ds[w])
            else:
                outer_step(average(ds))
                for w in range(W):
                    restart(w, None)
        ds = deltas()  # sync(): the round in flight, then the local steps since (if any)
        if pending is not None:
            outer_step(pending)
        if steps % H:
            outer_step(average(ds))
        for w in range(W):
            restart(w, None)
        return flat(models[r].parameters())

    # 1. compression="none" is the outer optimizer on the exact average, bit for bit
    for tag, outer, overlap, steps in (
            ("plain", None, False, 7), ("nesterov", NESTEROV, False, 7),
            ("plain_overlap", None, True, 7), ("nest_overlap", NESTEROV, True, 7),
            ("nest_overlap_even", NESTEROV, True, 6)):
        model, opt, loco, _ = run(f"none_{tag}", steps, sync_every=3, compression="none",
                                  outer_optimizer=outer, overlap=overlap)
        loco.sync()
        res[f"none_{tag}"] = flat(model.parameters())
        res[f"none_{tag}_ok"] = torch.tensor(torch.equal(
            res[f"none_{tag}"], reference(steps, 3, outer, overlap)))
        res[f"none_{tag}_global"] = torch.tensor(torch.equal(res[f"none_{tag}"],
                                                             flat(loco.parameters())))
    # 2. int4 (default) and onebit: the global parameters identical after every outer step
    for tag, kw in (("int4", {}), ("int4_overlap", {"overlap": True}),
                    ("onebit", {"compression": "onebit"})):
        model, opt, loco, rounds = run(tag, 9, sync_every=2, **kw)
        with loco:  # leaving the block syncs
            pass
        rounds.append(flat(loco.parameters()))
        res[f"{tag}_rounds"] = torch.stack(rounds)
        res[f"{tag}_outer_steps"] = torch.tensor(loco.outer_steps)
        res[tag] = flat(model.parameters())
        res[f"{tag}_plan"] = torch.tensor(all(
            t.codec.startswith(kw.get("compression", "int4")) for t in loco.plan().tensors))
    # 3. a resume between outer steps (a round in flight) continues bit for bit
    model, opt, loco, _ = run("res", 5, sync_every=2, overlap=True, outer_optimizer=NESTEROV)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "loco": loco.state_dict()}, buf)
    gp.save_server_state(f"{out}/srv")
    model, opt, loco, _ = run("res", 10, model, opt, loco, start=5)
    loco.sync()
    res["resume_straight"] = flat(model.parameters())
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model = net()
    opt = inner(model)
    loco = gp.DiLoCo(model, opt, prefix="res", sync_every=2, overlap=True,
                     outer_optimizer=NESTEROV)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    loco.load_state_dict(saved["loco"])
    gp.load_server_state(f"{out}/srv")
    model, opt, loco, _ = run("res", 10, model, opt, loco, start=5)
    loco.sync()
    res["resume_resumed"] = flat(model.parameters())
    torch.save(res, f"{out}/worker{r}.pt")
    gp.shutdown()
''')


@pytest.mark.cluster
def test_diloco_end_to_end(tmp_path: Path) -> None:
    w0, w1 = worker_results(tmp_path, WORKER)
    for key in w0:  # after sync() every worker holds the same parameters
        assert torch.equal(w0[key], w1[key]), f"replicas differ: {key}"
    for tag in ("plain", "nesterov", "plain_overlap", "nest_overlap", "nest_overlap_even"):
        assert bool(w0[f"none_{tag}_ok"]), f"{tag}: not the outer optimizer on the exact average"
        assert bool(w0[f"none_{tag}_global"]), tag
    assert not torch.equal(w0["none_plain"], w0["none_plain_overlap"])
    for tag in ("int4", "int4_overlap", "onebit"):
        assert int(w0[f"{tag}_outer_steps"]) == 5, tag  # 4 rounds of 2 steps, then the flush
        assert bool(w0[f"{tag}_plan"]) == tag.startswith("int4"), tag  # onebit: small exact
        assert torch.isfinite(w0[tag]).all() and not torch.equal(w0[tag], w0["none_plain"])
    assert torch.equal(w0["resume_straight"], w0["resume_resumed"])


def _model() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


@pytest.mark.parametrize("kw, err, words", [
    ({"sync_every": 0}, ValueError, ["sync_every", "0", ">= 1"]),
    ({"sync_every": 2.5}, ValueError, ["sync_every", "2.5"]),
    ({"sync_every": True}, ValueError, ["sync_every", "True"]),
    ({"overlap": "yes"}, TypeError, ["overlap", "'yes'", "bool"]),
    ({"prefix": ""}, ValueError, ["prefix", "non-empty"]),
])
def test_diloco_rejects_bad_settings(kw: dict, err: type, words: list[str]) -> None:
    m = _model()
    with pytest.raises(err) as e:
        gp.DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_diloco_rejects_an_inner_optimizer_over_other_parameters() -> None:
    m, other = _model(), torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"1 parameter\(s\) that are not trainable parameters"):
        gp.DiLoCo(m, torch.optim.SGD([*m.parameters(), other], lr=0.1))
    with pytest.raises(TypeError, match="inner_optimizer must be a torch.optim.Optimizer"):
        gp.DiLoCo(m, "adamw")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        gp.DiLoCo([torch.ones(2)], torch.optim.SGD(m.parameters(), lr=0.1))  # type: ignore


TRAIN = ("--task", "digits-cnn", "--optimizer", "diloco", "--steps", "110",
         "--checkpoint-every", "60", "--no-progress", "--no-tensorboard")


def _cmd(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gradpress.cli", "train", *TRAIN, "--out", str(out), *extra]


def _train(out: Path, *extra: str) -> dict:
    p = subprocess.run(_cmd(out, *extra), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run: rounds every 50 steps (the default); a checkpoint at step 60
    (10 local steps into a round)."""
    out = tmp_path_factory.mktemp("diloco") / "whole"
    _train(out)
    return out


@pytest.mark.cluster
def test_train_diloco_resumes_mid_round_bit_identical(whole: Path, tmp_path: Path) -> None:
    rep = json.loads((whole / "report.json").read_text())
    assert rep["replicas_identical"] is True
    assert rep["diloco"]["sync_every"] == 50 and rep["diloco"]["overlap"] is False
    # 3 int4 rounds (the last the flush of steps 101-110) in 110 steps: 110 / 3 x 7.7 = 282x
    assert 250 < rep["diloco"]["ratio_vs_per_step_fp32"] < 300
    ckpt = shutil.copytree(whole / "checkpoints" / "step-60", tmp_path / "ckpt")
    resumed = _train(tmp_path / "resumed", "--resume", str(ckpt))
    assert resumed["params_sha256"] == rep["params_sha256"]


@pytest.mark.cluster
def test_train_diloco_worker_killed_restarts_bit_identical(whole: Path, tmp_path: Path) -> None:
    """A worker SIGKILLed after the checkpoint of step 60: the job restarts from it and ends on
    the parameters of the uninterrupted run (nothing lost, nothing counted twice)."""
    out, marker = tmp_path / "run", uuid.uuid4().hex
    p = subprocess.Popen(_cmd(out, "--max-restarts", "1"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1", GP_TEST_MARKER=marker))
    try:
        deadline = time.monotonic() + 180
        while last_step(out / "metrics.jsonl") < 62:
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "no step past the checkpoint within 180 s"
            time.sleep(0.01)
        pid = pid_of(marker, "worker", 1)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "restart 1 of 1" in stdout and "step-60" in stdout
    rep = json.loads((out / "report.json").read_text())
    assert rep["params_sha256"] == json.loads((whole / "report.json").read_text())[
        "params_sha256"]


@pytest.mark.parametrize("kw, words", [
    ({"optimizer": "adam", "sync_every": 5}, ["sync_every", "diloco", "'adam'"]),
    ({"optimizer": "lans", "overlap": True}, ["overlap", "diloco"]),
    ({"optimizer": "diloco", "sync_every": 0}, ["sync_every", ">= 1", "0"]),
    ({"optimizer": "diloco", "outer_lr": 0.0}, ["outer_lr", "> 0"]),
    ({"optimizer": "diloco", "outer_momentum": 1.0}, ["outer_momentum", "< 1"]),
    ({"optimizer": "diloco", "dense_steps": 3}, ["dense_steps", "diloco"]),
])
def test_train_config_checks_the_diloco_settings(kw: dict, words: list[str]) -> None:
    from gradpress.train import TrainConfig

    with pytest.raises(ValueError) as e:
        TrainConfig(task="digits-cnn", **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_train_config_diloco_defaults() -> None:
    from gradpress import defaults
    from gradpress.tasks import get_task
    from gradpress.train import TrainConfig
    from gradpress.train.hparams import resolve_hparams

    cfg = TrainConfig(task="stdlib-mlm", optimizer="diloco")
    assert cfg.compression == "int4" and cfg.overlap is False
    hp = resolve_hparams(cfg, get_task("stdlib-mlm").defaults, 100)
    assert hp["sync_every"] == defaults.DILOCO_SYNC_EVERY
    assert hp["lr"] == get_task("stdlib-mlm").defaults.lr_for("adam")

"""The training session in a real 2-worker run: what its schedule hands to the communication."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster  # every test here starts real processes

# Both scripts start alike: a session's optimizer of a small MLP on 2 workers.
START = textwrap.dedent('''
    import inspect, json, sys
    import torch
    import gradpress as gp
    import gradpress.api
    from gradpress.train import Session

    gp.init()
    s = Session.from_env()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2))
    opt = s.optimizer(model)
''')
# With corrected error feedback every push carries the lr the residual is rescaled by: 1-bit
# LANS pushes its momentum in s.step, DistributedOptimizer pushes gradients from backward hooks.
# The script records, per step, the lr ``s.step`` applied and the lr(s) every push of that step
# carried (push_pull_async wrapped, called through).
SCRIPT = START + textwrap.dedent('''
    pushed = []
    real = gp.push_pull_async

    def recording(*args, **kw):
        pushed.append(inspect.signature(real).bind(*args, **kw).arguments.get("lr"))
        return real(*args, **kw)

    gp.push_pull_async = gp.api.push_pull_async = recording  # the session's, the wrapper's
    steps = []
    s.start()
    for step in range(s.cfg.steps):
        pushed.clear()  # gradients are pushed from backward hooks, momenta in s.step
        opt.zero_grad()
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + gp.rank()))
        loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        loss.backward()
        lr = s.step(opt)
        steps.append({"applied": lr, "pushed": sorted(set(pushed), key=str)})
        s.log_step(loss.item())
    s.finish(model)
    if gp.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(steps, f)
    gp.shutdown()
''')


@pytest.mark.parametrize("args, first", [
    # 1-bit LANS communicates its momentum from step dense_steps on
    (["--optimizer", "onebit-lans", "--dense-steps", "3"], 3),
    # LANS behind DistributedOptimizer: 2 uncompressed steps on the '@dense' keys, then gradients
    (["--optimizer", "lans", "--dense-steps", "2"], 2),
], ids=["momentum", "gradient"])
def test_corrected_error_feedback_gets_the_lr_of_the_step_it_pushes(
        tmp_path: Path, args: list[str], first: int) -> None:
    script, out, rec = tmp_path / "lr.py", tmp_path / "run", tmp_path / "steps.json"
    script.write_text(SCRIPT)
    # the lr rises every step of a 12-step warm-up: a push with last step's lr cannot pass; the
    # session's own exact pushes (warm-up keys, replica check) must not need an lr
    p = subprocess.run([sys.executable, "-m", "gradpress.cli", "train", "--lr", "0.01",
                        *args, "--compression", "onebit", "--ef", "corrected",
                        "--warmup-steps", "12", "--steps", "10",
                        "--no-progress", "--out", str(out), "--", sys.executable, str(script),
                        str(rec)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    steps = json.loads(rec.read_text())
    assert [round(st["applied"] / 0.01 * 12) for st in steps] == list(range(1, 11))
    for st in steps:  # every push carries this step's lr, or none (exact '@dense' keys)
        assert set(st["pushed"]) <= {st["applied"], None}, steps
    # the compressed tensors carry the step's lr; the small exact ones share a fused key,
    # pushed without one (no error feedback to rescale)
    assert all(st["pushed"] == [st["applied"], None] for st in steps[first:]), steps
    assert json.loads((out / "report.json").read_text())["status"] == "completed"


# 1-bit LANS in a session: the dense phase's codec and the blend follow the run's compression
# (bf16 and no blend when a tensor is compressed; fp32 and LANS's blend when none is).
BLEND_SCRIPT = START + textwrap.dedent('''
    s.start()
    pushed = []
    for step in range(s.cfg.steps):
        before = gp.stats()["bytes_pushed"]  # gradients are pushed from backward hooks
        opt.zero_grad()
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * step + gp.rank()))
        torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
        s.step(opt)
        pushed.append(gp.stats()["bytes_pushed"] - before)
        s.log_step(1.0)
    plan = opt.plan().to_dict()
    s.finish(model)
    if gp.rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({"blend": [opt.blend(i) for i in range(4)], "pushed": pushed,
                       "dense_codec": plan["dense_codec"],
                       "dense_bytes": plan["dense_bytes_per_step"]}, f)
    gp.shutdown()
''')


@pytest.mark.parametrize("compression, blend, codec", [("none", True, "exact"),
                                                        ("onebit", False, "bf16")])
def test_onebit_lans_session_blends_and_warms_by_the_runs_compression(
        tmp_path: Path, compression: str, blend: bool, codec: str) -> None:
    script, rec = tmp_path / "blend.py", tmp_path / "rec.json"
    script.write_text(BLEND_SCRIPT)
    p = subprocess.run([sys.executable, "-m", "gradpress.cli", "train", "--lr", "0.01",
                        "--optimizer", "onebit-lans", "--dense-steps", "2", "--compression",
                        compression, "--steps", "3", "--uncompressed-params", "2.bias",
                        "--no-progress", "--out", str(tmp_path / "run"), "--",
                        sys.executable, str(script), str(rec)],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    got = json.loads(rec.read_text())
    assert got["blend"] == [blend] * 4 and got["dense_codec"] == codec
    # the 64x64 weight (16 KiB) goes bf16 in the dense phase of a compressed run
    fp32 = 4 * (64 * 64 + 64 + 64 * 2 + 2)
    # (the last dense step also pushes the agreement measure of uncompressed_params="auto")
    assert got["pushed"][0] == got["dense_bytes"] <= got["pushed"][1] < got["dense_bytes"] + 256
    assert (got["dense_bytes"] < fp32) == (codec == "bf16")


SWAP_SCRIPT = START + textwrap.dedent('''
    s.start()
    opt.zero_grad()
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(gp.rank()))
    torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
    s.step(opt)
    if sys.argv[1] == "swap" and gp.rank() == 1:
        with torch.no_grad():  # two elements trade places: every sum and norm stays the same
            w = model[0].weight.view(-1)
            w[:2] = w[:2].flip(0).clone()
    s.finish(model)
    gp.shutdown()
''')


@pytest.mark.parametrize("swap", [False, True])
def test_replica_check_compares_parameter_hashes(tmp_path: Path, swap: bool) -> None:
    script, out = tmp_path / "swap.py", tmp_path / "run"
    script.write_text(SWAP_SCRIPT)
    p = subprocess.run([sys.executable, "-m", "gradpress.cli", "train", "--lr", "0.01",
                        "--steps", "1", "--no-progress", "--out", str(out), "--",
                        sys.executable, str(script), "swap" if swap else "same"],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert json.loads((out / "report.json").read_text())["replicas_identical"] is not swap

"""One builder (issue 39): ``gradpress train --optimizer M`` and the factory ``gp.M`` build the
same optimizer for the same settings: the same plan, and bit-identical compressed steps.

Both routes run the same script under ``gradpress train`` (2 workers, 1 server, real processes
on loopback), each with its defaults: the CLI's optimizer from the session, the factory called
as a user would, with the run's lr. The model has an embedding with rows no batch uses, so 1-bit
LANS's idle-row hold is part of what must agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gradpress import defaults

pytestmark = pytest.mark.cluster

SCRIPT = textwrap.dedent('''
    import hashlib, json, sys
    import torch
    import gradpress as gp
    from gradpress.train import Session

    route, method, out, exact = sys.argv[1:5]
    gp.init()
    s = Session.from_env()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
    if route == "cli":
        opt = s.optimizer(model)
    else:  # the factory as a user calls it, the run's name prefixing the tensor names
        factory = {"onebit-lans": gp.OneBitLANS, "clan": gp.CLAN}[method]
        kw = {"uncompressed_params": [f"run.{exact}"]} if exact != "auto" else {}
        opt = factory([(f"run.{n}", p) for n, p in model.named_parameters()],
                      lr=s.hparams["lr"], **kw)
        s.set_lr(opt)
    s.start()
    hashes, plan = [], None
    for step in range(s.cfg.steps):
        gen = torch.Generator().manual_seed(1000 * step + gp.rank())
        x = torch.randint(0, 48, (16, 4), generator=gen)   # rows 48-63 never used
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), x.roll(1).reshape(-1))
        loss.backward()
        s.step(opt)
        s.log_step(loss.item())
        if step + 1 >= opt.plan().dense_steps:
            plan = plan or opt.plan().to_dict()
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            hashes.append(hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    s.finish(model)
    if gp.rank() == 0:
        with open(out, "w") as f:
            json.dump({"plan": plan, "hashes": hashes, "stats": gp.stats()["bytes_pushed"]}, f)
    gp.shutdown()
''')


def _run(tmp_path: Path, route: str, method: str, exact: str) -> dict:
    script, rec = tmp_path / "route.py", tmp_path / f"{route}.json"
    script.write_text(SCRIPT)
    # the defaults of both routes (compression, ef, dense steps unset), exact tensors measured
    # ("auto") or named
    p = subprocess.run([sys.executable, "-m", "gradpress.cli", "train", "--optimizer", method,
                        "--lr", "0.01", "--steps", str(defaults.DENSE_STEPS + 3),
                        "--uncompressed-params", exact, "--no-progress", "--out",
                        str(tmp_path / route), "--", sys.executable, str(script), route,
                        method, str(rec), exact],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(rec.read_text())


@pytest.mark.parametrize("method, exact", [("onebit-lans", "auto"), ("clan", "1.bias")])
def test_train_and_the_factory_build_the_same_optimizer(tmp_path: Path, method: str,
                                                        exact: str) -> None:
    cli = _run(tmp_path, "cli", method, exact)
    factory = _run(tmp_path, "factory", method, exact)
    assert cli["plan"] == factory["plan"]
    plan = cli["plan"]
    assert plan["dense_steps"] == defaults.DENSE_STEPS and plan["compressed_tensors"] >= 1
    if method == "onebit-lans":  # the embedding's idle rows are held in both
        assert any("rows" in t["reason"] for t in plan["tensors"]), plan["tensors"]
    # the last dense step and the first three compressed steps, bit for bit
    assert len(cli["hashes"]) == 4 and cli["hashes"] == factory["hashes"]
    assert len(set(cli["hashes"])) == 4  # the parameters moved at every step
    assert cli["stats"] == factory["stats"]

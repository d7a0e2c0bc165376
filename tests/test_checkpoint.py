"""Exact checkpoints: train, save, let the job exit, resume in fresh processes with ``--resume``.

Two launches carry every multi-process scenario (cluster start-up dominates the cost):

* job 1 (2 workers, 2 servers colocated in the workers): per configuration, a reference model
  trained N+M steps without interruption, and a model trained N steps, checkpointed, then
  trained M more steps;
  ``broadcast_optimizer_state`` must keep each worker's residuals;
* job 2 (2 workers, 2 separate server processes, ``--resume``): fresh processes with
  differently initialised models load the checkpoints and train M steps; the parameters must
  be bit-identical to the uninterrupted run. The same job checks the world-size error, a
  checkpoint whose server file was corrupted after the save (refused by its checksum), a
  worker/server state round trip, a shape mismatch naming the tensor, and a failed server load
  naming the servers.

The rest runs in this process (state validation, ``--resume`` checks of the CLI).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gradpress.cli import _resume_env, main
from gradpress.ps.cluster import Layout
from gradpress.ps.codec_state import (
    atomic_save,
    check_worker_state,
    own_keys,
    read_server_states,
    restore_plan,
)

N, M = 4, 3

WORKER = textwrap.dedent('''
    import os, sys, json, torch, gradpress as gp
    import gradpress.checkpoint as ck
    from gradpress.optim import LANS
    out, mode, N, M = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    gp.init()
    r = gp.rank()
    CFGS = {  # randomk last: its optimizer's state is checked after the reference runs
        "onebit": (lambda ps: torch.optim.Adam(ps, lr=1e-2),
                   dict(compression="onebit", ef="vanilla")),
        "topk": (lambda ps: LANS(ps, lr=1e-2),
                 dict(compression="topk:k=0.1", ef="vanilla", nan_policy="skip")),
        # the small tensors (below 1 KiB) travel exact: two share a fused key, one is alone
        "fused": (lambda ps: torch.optim.Adam(ps, lr=1e-2),
                  dict(compression="onebit", ef="vanilla", min_compress_bytes=1024)),
        "randomk": (lambda ps: torch.optim.SGD(ps, lr=0.05),
                    dict(compression="randomk:k=0.25", ef="sparse", momentum="nesterov")),
    }

    def make(tag, cfg, seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(12, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
        mk, kw = CFGS[cfg]
        opt = gp.DistributedOptimizer(mk(m.parameters()), named_parameters=[
            (f"{tag}.{n}", p) for n, p in m.named_parameters()], **{"min_compress_bytes": 0, **kw})
        return m, opt

    def train(m, opt, steps):
        for s in steps:
            g = torch.Generator().manual_seed(1000 * s + r)
            x, y = torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()

    flat = lambda m: torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    res = {}
    if mode == "first":
        for cfg in CFGS:  # uninterrupted reference runs
            m, opt = make(f"ref.{cfg}", cfg, 3)
            gp.broadcast_parameters(m.state_dict())
            train(m, opt, range(N + M))
            res[f"ref.{cfg}"] = flat(m)
        before = opt.state_dict()["gradpress"]["tensors"]
        gp.broadcast_optimizer_state(opt, root_rank=0)
        after = opt.state_dict()["gradpress"]["tensors"]
        w = "ref.randomk.0.weight"
        res["resid"] = before[w]["chunks"][0]["codec"]["inner"]["residual"]
        res["kept"] = torch.tensor(all(torch.equal(
            before[n]["chunks"][i]["codec"]["inner"]["residual"],
            after[n]["chunks"][i]["codec"]["inner"]["residual"])
            for n in before for i in range(len(before[n]["chunks"])) if "ref.randomk" in n))
        runs = {cfg: make(cfg, cfg, 3) for cfg in CFGS}
        for cfg, (m, opt) in runs.items():
            gp.broadcast_parameters(m.state_dict())
            train(m, opt, range(N))
        for cfg, (m, opt) in runs.items():
            ck.save(f"{out}/ck-{cfg}", m, opt, N, extra={"rank": r})
        for cfg, (m, opt) in runs.items():  # saving must not change the run
            train(m, opt, range(N, N + M))
            res[f"cont.{cfg}"] = flat(m)
    else:
        res["resume_dir"] = ck.resume_dir()
        runs = {cfg: make(cfg, cfg, 99) for cfg in CFGS}
        fake = f"{out}/fake{r}"  # one per worker: both write it at once
        os.makedirs(fake, exist_ok=True)
        meta = json.load(open(f"{out}/ck-onebit/meta.json"))
        json.dump({**meta, "num_workers": 3}, open(f"{fake}/meta.json", "w"))
        try:
            ck.load(fake, *runs["onebit"], resize="refuse")
        except ValueError as e:
            res["mismatch"] = str(e)
        try:  # a server file changed after the save (the test flipped a byte): refused
            ck.load(f"{out}/ck-corrupt", *runs["topk"])
        except ValueError as e:
            res["corrupt"] = str(e)
        starts = [ck.load(f"{out}/ck-{cfg}", m, opt) for cfg, (m, opt) in runs.items()]
        res["starts"] = starts
        res["extra"] = ck.extra(f"{out}/ck-onebit")
        for cfg, (m, opt) in runs.items():
            train(m, opt, range(N, N + M))
            res[f"resume.{cfg}"] = flat(m)
        # saved again: the loaded keys not pushed since (the ref.* runs') are still state
        ck.save(f"{out}/ck-again", *runs["onebit"], N + M)
        # worker and server state round trip through save/load
        kw = dict(compression="onebit", ef="corrected", lr=0.1, min_compress_bytes=0)
        xs = [torch.randn(300, generator=torch.Generator().manual_seed(10 * i + r))
              for i in range(4)]
        for x in xs[:2]:
            gp.push_pull(x, "rt", **kw)
        sd = gp.worker_state_dict()
        d = f"{out}/rt"
        gp.save_server_state(d)
        y1 = [gp.push_pull(x, "rt", **kw) for x in xs[2:]]
        gp.load_worker_state_dict(sd)
        gp.load_server_state(d)
        y2 = [gp.push_pull(x, "rt", **kw) for x in xs[2:]]
        res["roundtrip"] = all(torch.equal(a, b) for a, b in zip(y1, y2))
        gp.load_worker_state_dict({"format": 1, "tensors": {"shape": sd["tensors"]["rt"]}})
        try:
            gp.push_pull(torch.ones(7), "shape", **kw)
        except ValueError as e:
            res["shape"] = str(e)
        try:
            gp.load_server_state(f"{out}/empty")
        except Exception as e:
            res["server_error"] = f"{type(e).__name__}: {e}"
    torch.save(res, f"{out}/{mode}{r}.pt")
    gp.shutdown()
''')


def _launch(tmp_path: Path, mode: str, args: list[str]) -> list[dict]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "2",
           "--timeout", "60", *args, "--", sys.executable, str(script), str(tmp_path), mode,
           str(N), str(M)]
    env = {"GRADPRESS_PARTITION_BYTES": "1024", "GRADPRESS_TIMEOUT": "60",
           "GRADPRESS_COMPRESS_THREADS": "1", "GRADPRESS_ENGINE_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150,
                       env={**os.environ, **env})
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return [torch.load(tmp_path / f"{mode}{w}.pt", weights_only=False) for w in range(2)]


def server_keys(directory: Path) -> set[str]:
    return {name for i in range(2) for name in torch.load(
        directory / f"server{i}.pt", weights_only=True)["keys"]}


def meta_sha(directory: Path, name: str) -> str:
    return json.loads((directory / "meta.json").read_text())["files"][name]


@pytest.mark.cluster
def test_resume_is_bit_identical(tmp_path: Path) -> None:
    first = _launch(tmp_path, "first", ["--colocate"])
    assert not torch.equal(first[0]["resid"], first[1]["resid"])  # per-worker residuals differ
    assert all(bool(f["kept"]) for f in first)  # ... and a state broadcast keeps them
    meta = json.loads((tmp_path / "ck-onebit" / "meta.json").read_text())
    assert (meta["step"], meta["num_workers"], meta["num_servers"]) == (N, 2, 2)
    assert meta["spec"] == "onebit:ef=vanilla"
    assert sorted(p.name for p in (tmp_path / "ck-topk").iterdir()) == [
        "meta.json", "server0.pt", "server1.pt", "worker0.pt", "worker1.pt"]

    assert set(meta["files"]) == {"worker0.pt", "worker1.pt", "server0.pt", "server1.pt"}
    corrupt = shutil.copytree(tmp_path / "ck-topk", tmp_path / "ck-corrupt")
    data = bytearray((corrupt / "server1.pt").read_bytes())
    data[len(data) // 2] ^= 0x01
    (corrupt / "server1.pt").write_bytes(bytes(data))

    ckdir = tmp_path / "ck-onebit"
    resumed = _launch(tmp_path, "resume", ["--resume", str(ckdir)])
    for w, res in enumerate(resumed):
        assert res["resume_dir"] == str(ckdir)
        assert res["starts"] == [N, N, N, N]
        assert res["extra"] == {"rank": w}
        for cfg in ("onebit", "topk", "randomk", "fused"):
            assert torch.equal(res[f"resume.{cfg}"], first[w][f"cont.{cfg}"]), cfg
        for cfg in ("onebit", "topk", "fused"):  # randomk draws its indices from the key (the name)
            assert torch.equal(first[w][f"cont.{cfg}"], first[w][f"ref.{cfg}"]), cfg
        assert "3 workers" in res["mismatch"] and "2 workers" in res["mismatch"]
        assert "server1.pt is corrupt or truncated" in res["corrupt"]
        assert "ref.topk.0.weight" in server_keys(tmp_path / "ck-onebit")  # never pushed again
        assert server_keys(tmp_path / "ck-onebit") <= server_keys(tmp_path / "ck-again")
        assert meta_sha(corrupt, "server1.pt") in res["corrupt"]  # the expected checksum
        assert res["roundtrip"]
        assert "'shape'" in res["shape"] and "numel" in res["shape"]
        err = res["server_error"]
        assert "server 0" in err and "server 1" in err and "server0.pt" in err, err


def test_cli_resume_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["launch", "--workers", "2", "--servers", "1", "--resume", str(tmp_path), "--",
            "true"]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2 and "meta.json" in capsys.readouterr().err
    # another size is announced, not refused: the workers' checkpoint.load applies its resize
    # rule (the launch itself is a cluster test's)
    (tmp_path / "meta.json").write_text(json.dumps({"num_workers": 2, "num_servers": 2}))
    assert _resume_env(str(tmp_path), 2, 1) == {"GRADPRESS_RESUME": str(tmp_path)}
    err = capsys.readouterr().err
    assert "2 servers" in err and "1 servers" in err and "resize rule" in err
    assert _resume_env(str(tmp_path), 2, 2) == {"GRADPRESS_RESUME": str(tmp_path)}
    assert capsys.readouterr().err == ""


def test_state_validation(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="mapping"):
        check_worker_state([1])
    with pytest.raises(ValueError, match="format"):
        check_worker_state({"tensors": {}})
    with pytest.raises(ValueError, match="'w'.*step"):
        check_worker_state({"format": 1, "tensors": {"w": {"signature": {}, "chunks": [
            {"step": -1}]}}})
    # a plan whose chunking differs from the saved one: ValueError naming the tensor
    chunk = SimpleNamespace(desc=SimpleNamespace(numel=4, chunk=0), step=0)
    plan = SimpleNamespace(name="layer.w", signature=(4, "none", (), (("ef", None),), True),
                           chunks=[chunk])
    entry = {"signature": {"numel": 4, "codec": "none", "params": {}, "wrappers": {"ef": None},
                           "average": True}, "chunks": [{"numel": 2, "step": 1, "codec": {}}]}
    with pytest.raises(ValueError, match="'layer.w'.*partition_bytes"):
        restore_plan(plan, entry)
    entry["signature"]["codec"] = "onebit"
    with pytest.raises(ValueError, match="'layer.w'.*codec: saved 'onebit', now 'none'"):
        restore_plan(plan, entry)
    # server files of a job with other world sizes are re-sharded (the workers decide whether
    # another size may load, gradpress.elastic); a directory mixing two jobs is refused
    for i in range(2):
        atomic_save({"format": 1, "num_workers": 4, "num_servers": 2, "tag": None,
                     "keys": {f"t{i}": {0: {"step": 3}}}}, tmp_path / f"server{i}.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["server0.pt", "server1.pt"]
    found = read_server_states(tmp_path, Layout(2, 1, False), "server 0", None)
    assert sorted(found) == [("t0", 0), ("t1", 0)]  # both saved servers' keys, on one now
    assert own_keys(tmp_path, 0, "server 0", 1) == {("t0", 0), ("t1", 0)}
    assert own_keys(tmp_path, 1, "server 1", 2) == {("t1", 0)}
    atomic_save({"format": 1, "num_workers": 4, "num_servers": 3, "tag": None, "keys": {}},
                tmp_path / "server1.pt")
    with pytest.raises(ValueError, match="server1.pt.*3 servers.*mixes two jobs"):
        read_server_states(tmp_path, Layout(2, 1, False), "server 0", None)

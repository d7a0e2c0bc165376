"""The measurement behind the resize rule of :mod:`gradpress.elastic`: a job that loses half its
workers (4 -> 2) or doubles (2 -> 4) mid-run, resumed from the checkpoint under each rule,
against uninterrupted runs at both sizes. torchrun runs examples/torchrun_elastic.py (onebit,
vanilla error feedback, colocated servers) on 127.0.0.1.

    python benchmarks/record.py elastic-resize --keep summary.json -- \\
        python benchmarks/elastic_resize.py --out {out}

Steps, per seed:

1. uninterrupted runs of ``--steps`` steps with 4 and with 2 workers (checkpoints every
   ``--at`` steps);
2. for each rule (fold, reset) and each direction, a copy of the other size's checkpoint at
   step ``--at`` resumed by the new size to the end;
3. per run, the held-out loss at the end and the mean training loss of the ``--window`` steps
   after the resize (the uninterrupted run: the same steps).

``summary.json`` holds every run's figures and, per direction and rule, the mean over the seeds
of the held-out loss minus the uninterrupted new-size run's.

``--task digits-cnn`` measures a world that shrinks on a bundled task against its accuracy
target instead (the threshold of ``onebit-digits`` in benchmarks/targets.py, in points of test
accuracy), with ``gradpress train`` (onebit, 1 server):

    python benchmarks/record.py elastic-shrink-digits --keep summary.json -- \\
        python benchmarks/elastic_resize.py --task digits-cnn --steps 120 --at 60 --out {out}

Steps, per seed: 1. an uninterrupted run of ``--steps`` steps with 1 worker (the smaller size);
2. a run with 2 workers and a checkpoint at step ``--at``; 3. that checkpoint resumed by 1
worker to the end (the fold rule); 4. the test accuracy of 3 minus that of 1, in points: within
the target when no seed's is below minus the threshold (as benchmarks/targets.py counts it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "torchrun_elastic.py"
RULES = ("fold", "reset")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(n: int, ckpt: Path, out: Path, args: list[str]) -> dict[str, Any]:
    """Run the example with ``n`` workers (c10d rendezvous on 127.0.0.1); rank 0's result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GRADPRESS_TIMEOUT="60",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           str(n), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}",
           str(SCRIPT), "--ckpt", str(ckpt), "--out", str(out), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout[-2000:]}"
                           f"{p.stderr[-3000:]}")
    return dict(json.loads((out / "rank0.json").read_text()))


def figures(res: dict[str, Any], at: int, window: int) -> dict[str, Any]:
    skip = at - int(res["start"])  # an uninterrupted run: its losses from step 0
    after = res["losses"][skip:skip + window]
    return {"held_out_loss": res["held_out_loss"], "loss_after_resize": statistics.mean(after),
            "resized": res["resized"]}


def one_seed(work: Path, seed: int, a: argparse.Namespace) -> dict[str, Any]:
    common = ["--steps", str(a.steps), "--every", str(a.at), "--seed", str(seed)]
    runs: dict[str, Any] = {}
    for n in (4, 2):  # step 1
        res = torchrun(n, work / f"base{n}", work / f"out-base{n}", common)
        runs[f"uninterrupted-{n}"] = figures(res, a.at, a.window)
    for old, new in ((4, 2), (2, 4)):  # step 2
        for rule in RULES:
            ck = work / f"{old}to{new}-{rule}"
            shutil.copytree(work / f"base{old}" / f"step-{a.at}", ck / f"step-{a.at}")
            res = torchrun(new, ck, work / f"out-{old}to{new}-{rule}",
                           [*common, "--resize", rule])
            runs[f"{old}to{new}-{rule}"] = figures(res, a.at, a.window)  # step 3
    return runs


def train(out: Path, workers: int, seed: int, a: argparse.Namespace,
          *extra: str) -> dict[str, Any]:
    """``gradpress train --task digits-cnn`` (onebit, 1 server); its report."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "gradpress.cli", "train", "--task", "digits-cnn",
           "--compression", "onebit", "--workers", str(workers), "--steps", str(a.steps),
           "--seed", str(seed), "--no-progress", "--no-tensorboard", "--out", str(out), *extra]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr[-3000:]}")
    return dict(json.loads((out / "report.json").read_text()))


def shrink_digits(out: Path, a: argparse.Namespace) -> dict[str, Any]:
    """``--task digits-cnn``: steps 1-4 per seed; the summary."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from targets import TARGETS
    threshold = next(t.threshold for t in TARGETS if t.name == "onebit-digits")
    runs = {}
    for seed in range(a.seeds):
        work = out / f"seed{seed}"
        shutil.rmtree(work, ignore_errors=True)
        small = train(work / "uninterrupted-1", 1, seed, a)  # step 1
        big = train(work / "uninterrupted-2", 2, seed, a, "--checkpoint-every", str(a.at))
        shrunk = train(work / "2to1-fold", 1, seed, a, "--resume",  # steps 2, 3
                       str(work / "uninterrupted-2" / "checkpoints" / f"step-{a.at}"))
        acc = {k: r["final_eval"]["test_accuracy"] for k, r in
               (("uninterrupted-1", small), ("uninterrupted-2", big), ("2to1-fold", shrunk))}
        runs[seed] = {"test_accuracy": acc, "resized": shrunk.get("resized"),
                      "gap_points": 100 * (acc["2to1-fold"] - acc["uninterrupted-1"])}  # 4
        print(json.dumps({seed: runs[seed]}), flush=True)
    return {"task": "digits-cnn", "steps": a.steps, "resize_at": a.at,
            "target": "onebit-digits", "threshold_points": threshold,
            "within_target": all(r["gap_points"] >= -threshold for r in runs.values()),
            "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--at", type=int, default=30, help="the step of the resize")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--task", choices=("example", "digits-cnn"), default="example",
                    help="digits-cnn: a world shrinking 2 -> 1 against the task's target")
    a = ap.parse_args()
    out = Path(a.out)
    if a.task == "digits-cnn":
        out.mkdir(parents=True, exist_ok=True)
        summary = shrink_digits(out, a)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
        return
    per_seed = {}
    for seed in range(a.seeds):
        work = out / f"seed{seed}"
        shutil.rmtree(work, ignore_errors=True)
        per_seed[seed] = one_seed(work, seed, a)
        print(json.dumps({seed: {k: round(v["held_out_loss"], 4)
                                 for k, v in per_seed[seed].items()}}), flush=True)
    gaps = {f"{old}to{new}-{rule}": statistics.mean(
        r[f"{old}to{new}-{rule}"]["held_out_loss"] - r[f"uninterrupted-{new}"]["held_out_loss"]
        for r in per_seed.values()) for old, new in ((4, 2), (2, 4)) for rule in RULES}
    summary = {"steps": a.steps, "resize_at": a.at, "window": a.window,
               "held_out_gap_vs_uninterrupted_new_size": gaps, "runs": per_seed}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(gaps, indent=1))


if __name__ == "__main__":
    main()

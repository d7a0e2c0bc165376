"""Chaos run of ``gradpress train --max-restarts``: kill or stop random processes, compare bits.

Steps:

1. an uninterrupted reference run (digits-cnn, onebit with error feedback, 2 workers,
   ``--servers`` servers, a checkpoint every ``--every`` steps) gives ``params_sha256`` and its
   wall time;
2. the same run under ``--max-restarts N`` (``GRADPRESS_TIMEOUT`` short, so a stopped process is
   noticed): ``--failures`` times, at a random step past the next checkpoint, one failure of the
   ``--kinds`` drawn without replacement from ``--failures`` copies of each: a random worker or
   server sent SIGKILL (``worker-kill``, ``server-kill``) or SIGSTOP (``worker-stop``,
   ``server-stop``), or a node lost (``node-kill``, with ``--servers 2``: every process of a
   random one of the two emulated nodes, worker n and server n as ``gradpress launch --nnodes
   2`` would place them, SIGKILLed at once); with ``--during-write`` the first failure is a
   SIGKILL of worker 1 while a checkpoint is being written (its directory exists, its
   ``meta.json`` not yet); the next failure waits for the restarted job's first record;
3. prints, and writes as JSON, each failure (what, when, the seconds from the failure to the
   restarted job's first record), the seconds lost per failure (wall time over the reference's,
   divided by the failures) and whether the final parameters equal the reference's bit for bit.

Usage::

    python benchmarks/chaos.py --steps 120 --every 20 --failures 3 --seed 0 \\
        --out benchmarks/results/chaos
    python benchmarks/chaos.py --servers 2 --kinds node-kill --failures 3 --seed 0 --out runs/n
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from gradpress.train.report import read_metrics
from gradpress.train.restarts import last_step

KINDS = {"worker-kill": ("worker", signal.SIGKILL), "server-kill": ("server", signal.SIGKILL),
         "worker-stop": ("worker", signal.SIGSTOP), "server-stop": ("server", signal.SIGSTOP),
         "node-kill": ("node", signal.SIGKILL)}
WORKERS = 2


def _cmd(args: argparse.Namespace, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "gradpress.cli", "train", "--task", "digits-cnn",
            "--steps", str(args.steps), "--checkpoint-every", str(args.every),
            "--compression", "onebit", "--dense-steps", "2", "--servers", str(args.servers),
            "--no-progress",
            "--no-tensorboard", "--out", str(out), *extra]


def _pid(marker: str, role: str, rank: int | None) -> int | None:
    """The PID of the job's process with this role (and RANK), from /proc."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"GP_CHAOS={marker}".encode() in env and f"GRADPRESS_ROLE={role}".encode() in env \
                and (rank is None or f"RANK={rank}".encode() in env):
            return int(entry)
    return None


def _starts(out: Path) -> int:
    path = out / "metrics.jsonl"
    return sum(r["kind"] == "start" for r in read_metrics(path)) if path.exists() else 0


def _wait(cond, proc: subprocess.Popen, what: str, limit: float = 300) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended (code {proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {limit:.0f} s")
        time.sleep(0.02)


def _kill_during_write(args, out, proc, marker) -> dict:
    """Step 2, kind "write": SIGKILL worker 1 while the next checkpoint is being written (its
    directory exists, its meta.json not yet), once a complete checkpoint exists to fall back to;
    says whether the kill landed inside the write."""
    _wait(lambda: last_step(out / "metrics.jsonl") > args.every, proc, "the first checkpoint")
    now = last_step(out / "metrics.jsonl")
    ckpt = out / "checkpoints" / f"step-{(now // args.every + 1) * args.every}"
    _wait(ckpt.exists, proc, f"{ckpt.name} to be started")
    pid = _pid(marker, "worker", 1)
    if pid is None:
        raise RuntimeError("no worker 1 found")
    starts = _starts(out)
    os.kill(pid, signal.SIGKILL)
    inside = not (ckpt / "meta.json").exists()
    t0, now = time.monotonic(), last_step(out / "metrics.jsonl")
    _wait(lambda: _starts(out) > starts, proc, "the restarted job's first record")
    return {"role": "worker", "rank": 1, "signal": "SIGKILL", "step": now,
            "during_write": ckpt.name if inside else None,
            "recovery_s": round(time.monotonic() - t0, 2)}


def _fail_once(args, out, proc, marker, rng, kind) -> dict:
    """Steps 2: one failure past the next checkpoint; returns what happened and the recovery."""
    if kind == "write":
        return _kill_during_write(args, out, proc, marker)
    now = last_step(out / "metrics.jsonl")
    at = min(args.steps - 2, (now // args.every + 1) * args.every + rng.randrange(1, args.every))
    _wait(lambda: last_step(out / "metrics.jsonl") >= at, proc, f"step {at}")
    role, sig = KINDS[kind]
    rank = rng.randrange(WORKERS) if role in ("worker", "node") else None
    targets: list[tuple[str, int | None]] = [(role, rank)]
    if role == "node":  # node n: worker n and server n (world rank WORKERS + n)
        targets = [("worker", rank), ("server", WORKERS + (rank or 0))]
    pids = [_pid(marker, r, k) for r, k in targets]
    if None in pids:
        raise RuntimeError(f"no process found for each of {targets}: {pids}")
    starts = _starts(out)
    for pid in pids:  # a node: its worker and its server, at once
        os.kill(pid or 0, sig)
    t0, step = time.monotonic(), last_step(out / "metrics.jsonl")
    _wait(lambda: _starts(out) > starts, proc, "the restarted job's first record")
    return {"kind": kind, "role": role, "rank": rank, "signal": signal.Signals(sig).name,
            "step": step, "recovery_s": round(time.monotonic() - t0, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--failures", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", default="15", help="GRADPRESS_TIMEOUT of the chaos run")
    p.add_argument("--servers", type=int, choices=(1, 2), default=1,
                   help="separate servers (2: two emulated nodes, worker n and server n each)")
    p.add_argument("--kinds", nargs="+", choices=sorted(KINDS), default=list(KINDS)[:4],
                   help="what the failures are drawn from (default: every kind but node-kill)")
    p.add_argument("--out", type=Path, default=Path("runs/chaos"))
    p.add_argument("--during-write", action="store_true",
                   help="the first failure kills worker 1 while a checkpoint is being written")
    args = p.parse_args()
    if "node-kill" in args.kinds and args.servers != 2:
        p.error("--kinds node-kill needs --servers 2 (a node is worker n and server n)")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    shutil.rmtree(args.out, ignore_errors=True)  # the polls must not read an earlier run's files
    t0 = time.monotonic()  # step 1
    subprocess.run(_cmd(args, args.out / "reference"), env=env, check=True,
                   capture_output=True, timeout=900)
    ref_s = time.monotonic() - t0
    marker, rng = uuid.uuid4().hex, random.Random(args.seed)
    out = args.out / "chaos"
    env.update(GP_CHAOS=marker, GRADPRESS_TIMEOUT=args.timeout)
    t0 = time.monotonic()  # step 2
    proc = subprocess.Popen(_cmd(args, out, "--max-restarts", str(args.failures)), env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        kinds = rng.sample(args.kinds * args.failures, args.failures)  # every kind likely
        kinds = ["write"] + kinds[1:] if args.during_write else kinds
        failures = [_fail_once(args, out, proc, marker, rng, k) for k in kinds]
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    chaos_s = time.monotonic() - t0
    ref = json.loads((args.out / "reference" / "report.json").read_text())
    rep = json.loads((out / "report.json").read_text()) if proc.returncode == 0 else {}
    result = {"steps": args.steps, "every": args.every, "timeout_s": float(args.timeout),
              "servers": args.servers, "kinds": args.kinds,
              "failures": failures, "reference_s": round(ref_s, 1), "chaos_s": round(chaos_s, 1),
              "lost_s_per_failure": round((chaos_s - ref_s) / max(1, len(failures)), 1),
              "restarts": rep.get("restarts"), "returncode": proc.returncode,
              "bit_identical": rep.get("params_sha256") == ref["params_sha256"]}
    (args.out / "chaos.json").write_text(json.dumps(result, indent=1))  # step 3
    print(json.dumps(result, indent=1))
    if proc.returncode != 0:
        print(stdout[-2000:], stderr[-2000:], file=sys.stderr)
    return 0 if result["bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())

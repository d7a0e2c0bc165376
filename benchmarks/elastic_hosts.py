"""A node replaced under torchrun's elastic agent on two emulated hosts: recovery time and bits.

Steps:

1. a reference run of ``examples/torchrun_elastic.py`` (``--steps``, a checkpoint every 10
   steps, 2 workers under one agent on 127.0.0.1) gives the parameters' hash;
2. per seed: two hosts (network namespaces joined by veth pairs, ``gradpress.train.netem``),
   one torchrun agent of one worker on each (``--nnodes 2 --max-restarts 2``, c10d rendezvous
   on host 0's address, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the recommended invocation,
   docs/integrations.md); host 1's worker waits before a step drawn from the seed
   (``GP_HOLD_AT``); every process of host 1 is SIGKILLed at once (a node lost) and a new agent
   is started on host 1 right after (a spare node taking its place, as a scheduler would);
3. recovery: seconds from the SIGKILL to the moment both workers of the new group have joined
   and loaded the checkpoint (their ``resumed from`` line); detection included (host 0's worker
   sees its peer's connection close; the rendezvous drops the dead agent after
   ``keep_alive_interval`` x ``keep_alive_max_attempt`` = 2 s); plus the wall time of the run,
   whether both agents exited 0 and whether the final parameters equal the reference's.

Usage (root: network namespaces)::

    python benchmarks/elastic_hosts.py --seeds 0 1 2 --out runs/elastic-hosts
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gradpress.train import netem

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "torchrun_elastic.py"
CONF = "last_call_timeout=2,join_timeout=60,keep_alive_interval=1,keep_alive_max_attempt=2"
RESUMED = re.compile(r"worker \d: resumed from \S+ at step (\d+)")
TIMEOUT_S = 180.0


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPRESS_")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    return env | {"OMP_NUM_THREADS": "1", "GRADPRESS_TIMEOUT": "30"} | extra


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _hash(out: Path) -> list[str]:
    return [json.loads(f.read_text())["param_hash"] for f in sorted(out.glob("rank*.json"))]


def reference(tmp: Path, steps: int) -> str:
    """Step 1: the uninterrupted run's parameter hash."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
           str(SCRIPT), "--steps", str(steps), "--ckpt", str(tmp / "ckpt"), "--out",
           str(tmp / "out")]
    p = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    if p.returncode != 0:
        raise SystemExit(f"the reference run failed ({p.returncode}):\n{p.stderr[-3000:]}")
    hashes = _hash(tmp / "out")
    if len(set(hashes)) != 1 or len(hashes) != 2:
        raise SystemExit(f"the reference run's replicas differ: {hashes}")
    return hashes[0]


def _agent(cl: netem.EmulatedCluster, i: int, tmp: Path, steps: int, log: Path,
           **env: str) -> subprocess.Popen:
    cmd = cl.hosts[i].cmd([
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--max-restarts", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
        f"{cl.addresses[0]}:29400", "--local-addr", cl.addresses[i], "--rdzv-conf",
        f"{CONF},is_host={'true' if i == 0 else 'false'}", "--monitor-interval", "0.5",
        str(SCRIPT), "--steps", str(steps), "--ckpt", str(tmp / "ckpt"), "--out",
        str(tmp / "out")])
    with open(log, "w") as f:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=_env(
            GLOO_SOCKET_IFNAME=cl.device, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env))


def _until(what: str, done: Callable[[], bool], procs: list[subprocess.Popen],
           timeout: float) -> float:
    """Poll ``done()`` until true (its time.monotonic()); SystemExit after ``timeout`` s or when
    an agent of ``procs`` exits first."""
    deadline = time.monotonic() + timeout
    while not done():
        if any(p.poll() is not None for p in procs):
            raise SystemExit(f"an agent exited while waiting for {what}: "
                             f"{[p.poll() for p in procs]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} after {timeout:g} s")
        time.sleep(0.02)
    return time.monotonic()


def replaced(seed: int, steps: int, want: str, keep: Path | None) -> dict:
    """Step 2-3 for one seed."""
    step = random.Random(seed).randrange(11, steps - 1)
    tmp = Path(tempfile.mkdtemp(prefix=f"gp-elastic-hosts-{seed}-"))
    t_start = time.monotonic()
    try:
        with netem.emulated_cluster(2, None) as cl:
            logs = [tmp / "agent0.log", tmp / "agent1.log", tmp / "agent1-new.log"]
            procs = [_agent(cl, 0, tmp, steps, logs[0]),
                     _agent(cl, 1, tmp, steps, logs[1], GP_HOLD_AT=str(step), GP_KILL_RANK="any")]
            try:
                _until("a held worker", lambda: any((tmp / "out").glob("held-rank*")), procs,
                       TIMEOUT_S)
                pids = subprocess.run(["ip", "netns", "pids", cl.hosts[1].name], check=True,
                                      capture_output=True, text=True).stdout.split()
                t_kill = time.monotonic()
                for pid in pids:
                    os.kill(int(pid), signal.SIGKILL)
                procs[1].wait(timeout=10)
                procs.append(_agent(cl, 1, tmp, steps, logs[2]))

                def both_resumed() -> bool:
                    return (RESUMED.search(logs[0].read_text()) is not None
                            and RESUMED.search(logs[2].read_text()) is not None)

                t_resumed = _until("both workers resumed", both_resumed,
                                   [procs[0], procs[2]], TIMEOUT_S)
                codes = [procs[0].wait(timeout=TIMEOUT_S), procs[2].wait(timeout=TIMEOUT_S)]
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.wait()
        starts = sorted({int(m.group(1)) for log in (logs[0], logs[2])
                         for m in RESUMED.finditer(log.read_text())})
        hashes = _hash(tmp / "out")
        row = {"seed": seed, "held_at": step, "resumed_at": starts,
               "recovery_s": round(t_resumed - t_kill, 2),
               "wall_s": round(time.monotonic() - t_start, 1), "exit_codes": codes,
               "bit_identical": len(hashes) == 2 and set(hashes) == {want}}
        if keep is not None:  # the agents' logs only (small)
            keep.mkdir(parents=True, exist_ok=True)
            for log in logs:
                shutil.copy(log, keep / f"seed{seed}-{log.name}")
        return row
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True, help="writes elastic_hosts.json here")
    ap.add_argument("--keep-logs", action="store_true", help="copy the agents' logs to --out")
    a = ap.parse_args(argv)
    netem.check_environment()
    a.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gp-elastic-hosts-ref-") as ref:
        t0 = time.monotonic()
        want = reference(Path(ref), a.steps)
        ref_s = round(time.monotonic() - t0, 1)
    rows = []
    for seed in a.seeds:
        rows.append(replaced(seed, a.steps, want, a.out if a.keep_logs else None))
        print(json.dumps(rows[-1]), flush=True)
    summary = {"steps": a.steps, "rdzv_conf": CONF, "reference_s": ref_s, "runs": rows,
               "max_recovery_s": max(r["recovery_s"] for r in rows),
               "all_bit_identical": all(r["bit_identical"] for r in rows)}
    (a.out / "elastic_hosts.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    ok = summary["all_bit_identical"] and all(r["exit_codes"] == [0, 0] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

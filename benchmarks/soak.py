"""Soak, memory and failure benchmark of the parameter-server runtime (docs/reliability.md).

Usage::

    python benchmarks/soak.py [--parts soak,big,failure] [--tensors 2000] [--steps 200]
                              [--numel 100000000] [--big-codecs none,fp16,onebit,onebit+ef]
                              [--json FILE]

Every job is 2 workers + 1 server started by ``gradpress launch`` on loopback; each worker is
this script (``--worker CONFIG``) and writes its figures as JSON into a temporary directory.

soak     ``--tensors`` tensors of log-uniform sizes in [1, 2**17] elements, a third each
         ``none``, ``onebit`` with error feedback and ``topk:k=0.01`` with error feedback
         (``min_compress_bytes=0``), pushed as one batch per step for ``--steps`` steps. Per
         worker: VmRSS after every step, its least-squares slope over the steps after the
         first 10% (KiB per step; target: about zero) and the growth over those steps; threads
         alive after every step (target: constant) and after ``shutdown`` (target: none).
big      one model of ``--numel`` elements in tensors of 4 Mi elements, one launch per codec:
         after ``init`` and a warm-up push_pull the worker reads VmRSS and resets its peak
         (``/proc/self/clear_refs`` = 5), then allocates the gradients and runs 3 steps.
         peak/grad = (VmHWM - that VmRSS) / (4 * numel): everything the step needs, the
         gradient itself included (target <= 3). ``--big-results``: ``inplace`` averages
         each gradient in place (``out=t``, what ``DistributedOptimizer`` does), ``new``
         returns new result tensors (one more gradient-sized buffer while they are held).
failure  time from SIGKILL of a process to the exit of every other process, with
         ``GRADPRESS_TIMEOUT=10``: a worker killed while its peer computes (no launcher: the
         watchdog must end the busy worker), and a server killed under the launcher.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve()
CODECS = {"none": ("none", "none"), "fp16": ("fp16", "none"), "onebit": ("onebit", "none"),
          "onebit+ef": ("onebit", "vanilla"), "topk+ef": ("topk:k=0.01", "vanilla")}


# == worker side (runs inside `gradpress launch`) ===============================================
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"/proc/self/status has no field {field!r}")


def _soak(gp: object, cfg: dict) -> dict:
    import torch

    shared = torch.Generator().manual_seed(0)  # sizes and codecs: the same on every worker
    g = torch.Generator().manual_seed(1 + gp.rank())  # type: ignore[attr-defined]
    logs = torch.rand(cfg["tensors"], generator=shared) * 17 * math.log(2)
    sizes = [max(1, int(math.exp(v))) for v in logs]
    specs = [list(CODECS.values())[[0, 3, 4][i % 3]] for i in range(len(sizes))]
    grads = [torch.randn(n, generator=g) for n in sizes]
    rss, threads, seconds = [], [], []
    for _ in range(cfg["steps"]):
        t0 = time.perf_counter()
        hs = [gp.push_pull_async(t, f"t{i}", compression=c, ef=e,  # type: ignore[attr-defined]
                                 min_compress_bytes=0)
              for i, (t, (c, e)) in enumerate(zip(grads, specs))]
        for h in hs:
            h.wait()
        seconds.append(time.perf_counter() - t0)
        rss.append(_status_kb("VmRSS"))
        threads.append(threading.active_count())
        if gp.rank() == 0 and len(rss) % 20 == 0:  # type: ignore[attr-defined]
            print(f"soak: step {len(rss)}, {seconds[-1]:.2f} s, RSS {rss[-1] / 1024:.1f} MiB",
                  file=sys.stderr, flush=True)
    return {"rss_kb": rss, "threads": threads, "seconds": seconds,
            "grad_bytes": 4 * sum(sizes)}


def _big(gp: object, cfg: dict) -> dict:
    import torch

    codec, ef = CODECS[cfg["codec"]]
    gp.push_pull(torch.randn(4096), "warm", compression=codec, ef=ef,  # type: ignore[attr-defined]
                 min_compress_bytes=0)  # plans, kernels compiled
    base = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    chunk = 4 << 20
    sizes = [chunk] * (cfg["numel"] // chunk) + ([cfg["numel"] % chunk] if cfg["numel"] % chunk
                                                 else [])
    grads = [torch.randn(n) for n in sizes]
    t0 = time.perf_counter()
    for _ in range(3):
        hs = [gp.push_pull_async(t, f"m{i}", compression=codec, ef=ef,  # type: ignore[attr-defined]
                                 min_compress_bytes=0, out=t if cfg["inplace"] else None)
              for i, t in enumerate(grads)]
        ys = [h.wait() for h in hs]
        del ys
    return {"peak_added": 1024 * (_status_kb("VmHWM") - base), "grad_bytes": 4 * cfg["numel"],
            "step_s": (time.perf_counter() - t0) / 3}


def worker_main(config: str) -> None:
    """Entry point of a worker: run the part named in the JSON ``config``, write the figures."""
    import gradpress as gp

    cfg = json.loads(Path(config).read_text())
    gp.init()
    res = _soak(gp, cfg) if cfg["part"] == "soak" else _big(gp, cfg)
    rank = gp.rank()
    gp.shutdown()
    res["threads_left"] = [t.name for t in threading.enumerate()
                           if t is not threading.main_thread()]
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(res))


# == driver side ================================================================================
def _launch(cfg: dict, tmp: Path, timeout: float) -> list[dict]:
    out = tmp / cfg["name"]
    out.mkdir()
    cfg = dict(cfg, out=str(out))
    path = out / "config.json"
    path.write_text(json.dumps(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", GRADPRESS_TIMEOUT="120")
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "1",
           "--", sys.executable, str(HERE), "--worker", str(path)]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=timeout)
    if p.returncode != 0:  # (stderr, progress included, goes to the terminal)
        raise RuntimeError(f"{cfg['name']}: launch exited {p.returncode}:\n{p.stdout}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _slope(ys: list[int]) -> float:
    """Least-squares slope of ``ys`` against their index."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / max(
        1e-9, sum((x - mx) ** 2 for x in range(n)))


def part_soak(args: argparse.Namespace, tmp: Path) -> dict:
    res = _launch({"part": "soak", "name": "soak", "tensors": args.tensors,
                   "steps": args.steps}, tmp, 3600)
    rows = []
    skip = max(1, args.steps // 10)
    for r, w in enumerate(res):
        tail = w["rss_kb"][skip:]
        half = len(tail) // 2
        rows.append({"rank": r, "slope_kib_per_step": _slope(tail),
                     "slope_halves": [_slope(tail[:half]), _slope(tail[half:])],
                     "rss_every_10_kib": w["rss_kb"][::10],
                     "growth_kib": tail[-1] - tail[0], "rss_first_kib": w["rss_kb"][0],
                     "rss_last_kib": w["rss_kb"][-1], "threads": sorted(set(w["threads"])),
                     "threads_left": w["threads_left"],
                     "median_step_s": sorted(w["seconds"])[len(w["seconds"]) // 2],
                     "grad_mib": w["grad_bytes"] / 2**20})
        print(f"soak worker {r}: {args.tensors} tensors ({rows[-1]['grad_mib']:.0f} MiB), "
              f"{args.steps} steps, median {rows[-1]['median_step_s']:.3f} s/step; RSS "
              f"{rows[-1]['rss_first_kib'] / 1024:.0f} -> {rows[-1]['rss_last_kib'] / 1024:.0f} "
              f"MiB; slope over steps {skip}..{args.steps}: "
              f"{rows[-1]['slope_kib_per_step']:+.2f} KiB/step (halves "
              f"{rows[-1]['slope_halves'][0]:+.2f}, {rows[-1]['slope_halves'][1]:+.2f}; growth "
              f"{rows[-1]['growth_kib']:+d} KiB); threads alive {rows[-1]['threads']}, after "
              f"shutdown {rows[-1]['threads_left']}", flush=True)
    return {"workers": rows}


def part_big(args: argparse.Namespace, tmp: Path) -> dict:
    out = {}
    for results in args.big_results.split(","):
        if results not in ("inplace", "new"):
            raise SystemExit(f"--big-results: expected inplace and/or new, got {results!r}")
        for name in args.big_codecs.split(","):
            res = _launch({"part": "big", "name": f"big-{name.replace('+', '_')}-{results}",
                           "codec": name, "numel": args.numel,
                           "inplace": results == "inplace"}, tmp, 1800)
            ratios = [w["peak_added"] / w["grad_bytes"] for w in res]
            out[f"{name}/{results}"] = {"peak_over_grad": ratios,
                                        "step_s": [w["step_s"] for w in res]}
            print(f"big {name:10s} {results:7s}: {args.numel / 1e6:.0f}M elements, peak/grad "
                  f"per worker {', '.join(f'{x:.2f}' for x in ratios)} with the gradient "
                  f"(target <= 3), {', '.join(f'{x - 1:.2f}' for x in ratios)} without; "
                  f"{max(r['step_s'] for r in res):.2f} s/step", flush=True)
    return out


FAIL_TRAIN = """
import os, signal, sys, time
import torch
import gradpress as gp
gp.init()
r = gp.rank()
for step in range(10**6):
    gp.push_pull(torch.full((100000,), float(r)), "w", compression="onebit", ef="vanilla",
                 min_compress_bytes=0)
    if step == 20:
        open(os.path.join(sys.argv[1], f"ready{r}"), "w").close()
        if r == 0 and os.environ.get("BUSY"):
            time.sleep(3600)  # computing: only the watchdog can end this process
"""


def _wait_file(path: Path, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {limit} s")
        time.sleep(0.02)


def _manual_kill(tmp: Path, script: Path) -> float:
    """No launcher: SIGKILL worker 1 while worker 0 computes; seconds until all exited."""
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="3",
                GRADPRESS_NUM_WORKERS="2", GRADPRESS_NUM_SERVERS="1", GRADPRESS_COLOCATE="0",
                GRADPRESS_TIMEOUT="10", OMP_NUM_THREADS="1", BUSY="1")
    cmds = [[sys.executable, str(script), str(tmp)]] * 2 + \
        [[sys.executable, "-m", "gradpress.ps.server"]]
    procs = [subprocess.Popen(c, env=dict(base, RANK=str(r), GRADPRESS_ROLE="server" if r == 2
                                          else "worker"), stderr=subprocess.DEVNULL)
             for r, c in enumerate(cmds)]
    _wait_file(tmp / "ready1", 300)
    _wait_file(tmp / "ready0", 300)
    t0 = time.monotonic()
    procs[1].send_signal(signal.SIGKILL)
    for p in procs:
        p.wait(300)
    return time.monotonic() - t0


def _launcher_kill(tmp: Path, script: Path) -> float:
    """Under the launcher: SIGKILL the server mid-training; seconds until the launcher exited."""
    env = dict(os.environ, GRADPRESS_TIMEOUT="10", OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2",
                          "--servers", "1", "--", sys.executable, str(script), str(tmp)],
                         env=env, stderr=subprocess.DEVNULL)
    _wait_file(tmp / "ready0", 300)
    pids = subprocess.run(["pgrep", "-P", str(p.pid), "-f", "gradpress.ps.server"],
                          capture_output=True, text=True).stdout.split()
    t0 = time.monotonic()
    os.kill(int(pids[0]), signal.SIGKILL)
    p.wait(300)
    return time.monotonic() - t0


def part_failure(args: argparse.Namespace, tmp: Path) -> dict:
    script = tmp / "fail_train.py"
    script.write_text(FAIL_TRAIN)
    (tmp / "manual").mkdir()
    (tmp / "launcher").mkdir()
    res = {"worker_killed_no_launcher_s": _manual_kill(tmp / "manual", script),
           "server_killed_launcher_s": _launcher_kill(tmp / "launcher", script)}
    print(f"failure (GRADPRESS_TIMEOUT=10): worker killed, no launcher, peer busy computing: "
          f"all exited after {res['worker_killed_no_launcher_s']:.2f} s; server killed under "
          f"the launcher: launcher exited after {res['server_killed_launcher_s']:.2f} s",
          flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--parts", default="soak,big,failure")
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--numel", type=int, default=100_000_000)
    ap.add_argument("--big-codecs", default="none,fp16,onebit,onebit+ef,topk+ef")
    ap.add_argument("--big-results", default="inplace,new",
                    help="big: results written into the gradient (out=t, as "
                         "DistributedOptimizer does) and/or into new tensors")
    ap.add_argument("--json", help="write all figures to this file")
    args = ap.parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    parts = {"soak": part_soak, "big": part_big, "failure": part_failure}
    unknown = set(args.parts.split(",")) - set(parts)
    if unknown:
        ap.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {', '.join(parts)}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="gp-soak-") as tmp:
        for name in args.parts.split(","):
            results[name] = parts[name](args, Path(tmp))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

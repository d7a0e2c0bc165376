"""Benchmark of the parameter-server runtime (``gp.push_pull``), each number from one run.

Usage (as root: parts (a) uses a network namespace)::

    python benchmarks/push_pull.py [--quick] [--parts a,b,c,d] [--rate 1gbit]
                                   [--topology ns|cluster] [--json FILE]

Gradients: ``--tensors`` float32 tensors of ``--mib`` MiB (default 25 x 4 MiB = 100 MiB; quick:
4 x 4 MiB), random normal, different on every worker. Every ``push_pull`` uses
``min_compress_bytes=0`` and ``ef="vanilla"`` (``ef="none"`` for the ``none`` codec). Every
worker is this script (``--worker CONFIG``) started by ``gradpress launch``; results come back
as JSON files in a temporary directory.

(a) speed: 2 workers + 1 server inside a namespace whose loopback is rate-limited to ``--rate``
    (``netem.rate_limited_namespace``; ``--topology cluster``: one host namespace per worker on
    its own veth link, each host running one worker and one server). Per codec: seconds per
    step (gp.barrier(), then push_pull_async of every tensor, then wait for all; the slowest
    worker), best of ``--steps`` steps (median shown too: other jobs share the cores). The
    codecs alternate step by step, so load changes hit all of them alike. Also shown: CPU
    seconds per step of all three processes (user + system, /proc/<pid>/stat) and minor page
    faults per worker step. Target: ``none`` / ``onebit`` >= 10 (best-of-steps times).
(b) pipeline efficiency of ``onebit`` on plain loopback, from the per-chunk stage trace
    (``GRADPRESS_TRACE``): per worker and step, the step span is first compress start to last
    decompress end; *time on the wire* is the length of the union of the chunks' ``push+pull``
    intervals (payload sent -> reply received: network plus server turnaround), i.e. the time
    during which at least one chunk is in flight. Efficiency = wire / span (median over steps
    and workers). A pipeline that overlaps compression with communication keeps the wire busy
    except while the first chunk is compressed and the last decompressed. Target >= 0.7.
(c) bytes per worker per step (``bytes_pushed + bytes_pulled`` from ``gp.stats()``, delta over
    one step) with 2, 3 and 4 workers and 1 server on loopback: must be identical.
(d) memory on loopback, one launch per codec: after ``gp.init``, the gradients, the codec
    kernels' compilation and a tiny warm-up push_pull, each worker reads VmRSS and resets its
    peak (``/proc/self/clear_refs`` = 5); rank 0 does the same for the server process (the
    launcher's child running ``gradpress.ps.server``). After the steps: added = VmHWM - that
    VmRSS, relative to the gradient bytes (worker) and to the fp32 bytes of the keys the server
    owns (server). Target <= 2x for the compressed codecs (``none`` is reported only). The
    gradients are averaged in place (``push_pull(t, ..., out=t)``, as ``DistributedOptimizer``
    does); results in new tensors would add the caller's 1x (``benchmarks/soak.py`` measures
    both).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NONE, ONEBIT, TOPK = "none", "onebit", "topk:k=0.001,values=fp16"
CODECS = (NONE, ONEBIT, TOPK)
SPEEDUP_TARGET, EFFICIENCY_TARGET, MEMORY_TARGET = 10.0, 0.7, 2.0
MiB = 1 << 20


# == worker side (runs inside `gradpress launch`) ===============================================
def _status_kb(pid: int | str, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"/proc/{pid}/status has no field {field!r}")


def _reset_peak(pid: int | str) -> None:
    """Reset VmHWM of ``pid`` to its current RSS (Linux clear_refs, value 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _server_pids() -> list[int]:
    """Server processes started by the same launcher as this worker (its siblings)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmdline = (d / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == os.getppid() and b"gradpress.ps.server" in cmdline:
            pids.append(int(d.name))
    return sorted(pids)


def _proc_usage(pid: int | str) -> tuple[float, int]:
    """(CPU seconds user+system, minor page faults) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


class _Worker:
    """One worker of a benchmark part; ``cfg`` comes from the driver's JSON file."""

    def __init__(self, cfg: dict) -> None:
        import torch

        import gradpress as gp

        self.gp, self.cfg = gp, cfg
        gp.init()
        self.rank = gp.rank()
        g = torch.Generator().manual_seed(1000 + self.rank)
        self.grads = [torch.randn(cfg["numel"], generator=g) for _ in range(cfg["tensors"])]

    def step(self, codec: str, tag: str = "g", inplace: bool = False) -> list:
        ef = "none" if codec == NONE else "vanilla"
        hs = [self.gp.push_pull_async(t, name=f"{tag}/{codec}/{i}", compression=codec, ef=ef,
                                      min_compress_bytes=0, out=t if inplace else None)
              for i, t in enumerate(self.grads)]
        return [h.wait() for h in hs]

    def timed_step(self, codec: str) -> dict:
        """One step, started together on all workers: seconds, bytes pushed+pulled, CPU
        seconds and minor page faults of this worker (rank 0: also of the server)."""
        self.gp.barrier()
        procs = ["self", *self.servers]
        s0, u0 = self.gp.stats(), [_proc_usage(p) for p in procs]
        t0 = time.perf_counter()
        self.step(codec)
        dt = time.perf_counter() - t0
        s1, u1 = self.gp.stats(), [_proc_usage(p) for p in procs]
        return {"seconds": dt, "bytes": sum(s1[k] - s0[k] for k in ("bytes_pushed",
                                                                     "bytes_pulled")),
                "cpu": [b[0] - a[0] for a, b in zip(u0, u1)],
                "faults": [b[1] - a[1] for a, b in zip(u0, u1)]}

    def speed(self) -> dict:
        """Parts (a)-(c): per codec, per step: seconds, bytes, CPU seconds, page faults."""
        codecs, res = self.cfg["codecs"], {}
        self.servers = _server_pids() if self.rank == 0 else []
        for c in codecs:  # warm-up: plans, key agreement, kernel compilation
            self.timed_step(c)
        s0 = self.gp.stats()
        for _ in range(self.cfg["steps"]):
            for c in codecs:  # interleaved: load changes hit every codec alike
                r = self.timed_step(c)
                d = res.setdefault(c, {"bytes": r["bytes"], "seconds": [], "cpu": [],
                                       "faults": []})
                for k in ("seconds", "cpu", "faults"):
                    d[k].append(r[k])
        s1 = self.gp.stats()
        res["stage_s"] = {k: (s1[k] - s0[k]) / self.cfg["steps"] for k in s1 if k.endswith("_s")}
        return res

    def memory(self) -> dict:
        """Part (d): peak memory added by the steps, for this worker (and rank 0: the server)."""
        from gradpress.compress import build

        codec = self.cfg["codecs"][0]
        ef = "none" if codec == NONE else "vanilla"
        build(codec, 4096, ef=ef).compress(self.grads[0][:4096])  # compile the kernels
        self.gp.push_pull(self.grads[0][:4096], name="warm", compression=codec, ef=ef,
                          min_compress_bytes=0)  # the server compiles its kernels too
        self.gp.barrier()
        servers = _server_pids() if self.rank == 0 else []
        base = {p: _status_kb(p, "VmRSS") for p in ["self", *servers]}
        for p in base:
            _reset_peak(p)
        self.gp.barrier()
        for _ in range(self.cfg["steps"]):
            ys = self.step(codec, inplace=True)  # as DistributedOptimizer: averaged in place
            del ys
        self.gp.barrier()
        peak = {p: _status_kb(p, "VmHWM") for p in base}
        kept = {p: _status_kb(p, "VmRSS") for p in base}
        return {"worker_added": 1024 * (peak["self"] - base["self"]),
                "worker_kept": 1024 * (kept["self"] - base["self"]),
                "server_added": [1024 * (peak[p] - base[p]) for p in servers],
                "server_kept": [1024 * (kept[p] - base[p]) for p in servers]}

    def run(self) -> None:
        part = self.cfg["part"]
        res = self.memory() if part == "memory" else self.speed()
        out = Path(self.cfg["out_dir"]) / f"{self.cfg['name']}.rank{self.rank}.json"
        out.write_text(json.dumps(res))
        self.gp.shutdown()


# == driver side ================================================================================
def _gradpress_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("gradpress")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("gradpress")
    return [found] if found else [sys.executable, "-c",
                                  "import sys; from gradpress.cli import main; sys.exit(main())"]


class Driver:
    """Starts the launches of every part and turns their JSON files into rows."""

    def __init__(self, args: argparse.Namespace, out_dir: Path) -> None:
        self.args, self.out_dir = args, out_dir
        self.numel = args.mib * MiB // 4
        self.grad_bytes = 4 * self.numel * args.tensors

    def launch(self, name: str, part: str, codecs: tuple[str, ...], workers: int, steps: int,
               netns: object = None, env: dict | None = None) -> list[dict]:
        """Run one job of ``workers`` workers + 1 server; returns every worker's result."""
        cfg = {"name": name, "part": part, "codecs": list(codecs), "steps": steps,
               "numel": self.numel, "tensors": self.args.tensors, "out_dir": str(self.out_dir)}
        path = self.out_dir / f"{name}.cfg.json"
        path.write_text(json.dumps(cfg))
        worker = [sys.executable, str(Path(__file__).resolve()), "--worker", str(path)]
        full_env = {**os.environ, "GRADPRESS_TIMEOUT": "900", **self.args.job_env, **(env or {})}
        if netns is not None and hasattr(netns, "hosts"):
            self._launch_cluster(netns, worker, full_env, name)
        else:
            cmd = [*_gradpress_cmd(), "launch", "--workers", str(workers), "--servers", "1",
                   "--", *worker]
            cmd = netns.cmd(cmd) if netns is not None else cmd
            self._wait([subprocess.Popen(cmd, env=full_env, stderr=subprocess.PIPE, text=True)],
                       name)
        return [json.loads((self.out_dir / f"{name}.rank{r}.json").read_text())
                for r in range(workers)]

    def _launch_cluster(self, cl: object, worker: list[str], env: dict, name: str) -> None:
        hosts = cl.hosts  # type: ignore[attr-defined]
        env = {**env, "GLOO_SOCKET_IFNAME": cl.device}  # type: ignore[attr-defined]
        procs = []
        for i, ns in enumerate(hosts):
            cmd = [*_gradpress_cmd(), "launch", "--nnodes", str(len(hosts)), "--node-rank",
                   str(i), "--master-addr", cl.addresses[0], "--master-port", "29500",  # type: ignore[attr-defined]
                   "--workers-per-node", "1", "--servers-per-node", "1", "--", *worker]
            procs.append(subprocess.Popen(ns.cmd(cmd), env=env, stderr=subprocess.PIPE,
                                          text=True))
        self._wait(procs, name)

    def _wait(self, procs: list[subprocess.Popen], name: str) -> None:
        errors = []
        for p in procs:
            _, err = p.communicate(timeout=3600)
            if p.returncode != 0:
                errors.append(f"exit {p.returncode}: ...{err[-3000:]}")
        if errors:
            raise RuntimeError(f"benchmark job {name!r} failed:\n" + "\n".join(errors))

    # -- parts ----------------------------------------------------------------------------------
    def part_a(self) -> list[list[str]]:
        import netem

        a = self.args
        ctx = netem.emulated_cluster(2, a.rate) if a.topology == "cluster" \
            else netem.rate_limited_namespace(a.rate, tag="pp")
        with ctx as net:
            res = self.launch("speed", "speed", CODECS, 2, a.steps, netns=net)
        steps = range(a.steps)
        per_step = {c: [max(r[c]["seconds"][i] for r in res) for i in steps] for c in CODECS}
        best = {c: min(v) for c, v in per_step.items()}
        who = "workers + the server on rank 0's host" if a.topology == "cluster" \
            else "2 workers + server"
        rows = []
        for c in CODECS:
            ratio, med = best[NONE] / best[c], statistics.median(per_step[NONE]) / \
                statistics.median(per_step[c])
            cpu = sum(sum(r[c]["cpu"][i]) for r in res for i in steps) / a.steps
            faults = statistics.median(r[c]["faults"][i][0] for r in res for i in steps)
            verdict = "" if c != ONEBIT else "PASS" if ratio >= SPEEDUP_TARGET else "FAIL"
            rows.append([f"(a) {c}", f"{best[c]:.3f} s/step (median "
                         f"{statistics.median(per_step[c]):.3f})",
                         f"{res[0][c]['bytes'] / 1e6:.2f} MB/worker/step; CPU {cpu:.2f} s/step "
                         f"({who}); {faults / 1e3:.1f}k page faults/worker/step",
                         f"speed-up vs none {ratio:.1f}x (median {med:.1f}x)",
                         ">= 10x" if c == ONEBIT else "", verdict])
        return rows

    def part_b(self) -> list[list[str]]:
        trace = self.out_dir / "trace.json"
        res = self.launch("pipeline", "speed", (ONEBIT,), 2, self.args.steps,
                          env={"GRADPRESS_TRACE": str(trace)})
        effs, spans = [], []
        for r in range(2):
            events = json.loads((self.out_dir / f"trace.worker{r}.json").read_text())
            for eff, span in _efficiencies(events["traceEvents"]):
                effs.append(eff)
                spans.append(span)
        eff = statistics.median(effs)
        st = res[0]["stage_s"]
        detail = (f"step span {statistics.median(spans) * 1e3:.0f} ms; per step (sums over "
                  f"chunks) compress {st['compress_s'] * 1e3:.0f} ms, decompress "
                  f"{st['decompress_s'] * 1e3:.0f} ms, reply wait {st['wait_s'] * 1e3:.0f} ms")
        return [["(b) onebit loopback", f"efficiency {eff:.2f}", detail, "", ">= 0.7",
                 "PASS" if eff >= EFFICIENCY_TARGET else "FAIL"]]

    def part_c(self) -> list[list[str]]:
        per = {}
        for w in (2, 3, 4):
            res = self.launch(f"bytes{w}", "speed", CODECS, w, 1)
            per[w] = {c: [r[c]["bytes"] for r in res] for c in CODECS}
        rows = []
        for c in CODECS:
            vals = [b for w in per for b in per[w][c]]
            ok = len(set(vals)) == 1
            cells = ", ".join(f"W={w}: {per[w][c][0] / 1e6:.3f}" for w in per)
            rows.append([f"(c) {c}", f"MB/worker/step {cells}", "", "", "constant",
                         "PASS" if ok else "FAIL"])
        return rows

    def part_d(self) -> list[list[str]]:
        rows = []
        for c in (ONEBIT,) if self.args.quick else (ONEBIT, TOPK, NONE):
            res = self.launch(f"mem-{c.split(':')[0]}", "memory", (c,), 2, self.args.steps)
            g = self.grad_bytes  # the one server owns every key: its keys hold g bytes too
            worker = max((r["worker_added"], r["worker_kept"]) for r in res)
            server = (res[0]["server_added"][0], res[0]["server_kept"][0])
            for who, (peak, kept) in (("worker", worker), ("server", server)):
                ratio = peak / g
                verdict = "" if c == NONE else "PASS" if ratio <= MEMORY_TARGET else "FAIL"
                rows.append([f"(d) {c} {who}", f"peak {ratio:.2f}x",
                             f"{peak / 1e6:.0f} MB added at peak, {kept / 1e6:.0f} MB still "
                             f"resident after the steps ({kept / g:.2f}x)", "",
                             "<= 2x" if c != NONE else "(reported)", verdict])
        return rows


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _efficiencies(events: list[dict]) -> list[tuple[float, float]]:
    """(wire / span, span seconds) per step of one worker's trace; step 0 (warm-up) skipped."""
    steps: dict[int, dict[str, list]] = {}
    for ev in events:
        if ev.get("ph") != "X" or ev["args"].get("step", 0) == 0:
            continue
        d = steps.setdefault(ev["args"]["step"], {"compress": [], "push+pull": [],
                                                  "decompress": []})
        if ev["name"] in d:
            d[ev["name"]].append((ev["ts"] / 1e6, (ev["ts"] + ev["dur"]) / 1e6))
    out = []
    for d in steps.values():
        if d["compress"] and d["decompress"]:
            span = max(e for _, e in d["decompress"]) - min(s for s, _ in d["compress"])
            out.append((_union(d["push+pull"]) / span, span))
    return out


def _machine() -> str:
    import platform

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    load = os.getloadavg()[0]
    return f"{os.cpu_count()} cores ({cpu}), load average {load:.1f}, Linux {platform.release()}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one worker of it)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 x 4 MiB, fewer steps")
    p.add_argument("--parts", default="a,b,c,d", help="subset of a,b,c,d")
    p.add_argument("--rate", default="1gbit", help="link rate of part (a) (tc syntax)")
    p.add_argument("--topology", choices=("ns", "cluster"), default="ns")
    p.add_argument("--tensors", type=int, help="number of gradient tensors (25; quick 4)")
    p.add_argument("--mib", type=int, default=4, help="MiB per tensor (4)")
    p.add_argument("--steps", type=int, help="timed steps per codec (5; quick 2)")
    p.add_argument("--job-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment variable of every job (e.g. "
                        "GRADPRESS_COMPRESS_THREADS=2); repeatable")
    p.add_argument("--json", help="also write the rows as JSON to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _Worker(json.loads(Path(args.worker).read_text())).run()
        return 0
    args.tensors = args.tensors or (4 if args.quick else 25)
    args.steps = args.steps or (2 if args.quick else 5)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    bad = sorted(set(parts) - set("abcd"))
    if bad or args.tensors < 1 or args.mib < 1 or args.steps < 1:
        p.error(f"--parts must be a subset of a,b,c,d (got {args.parts!r}); --tensors, --mib "
                f"and --steps must be >= 1")
    if any("=" not in kv for kv in args.job_env):
        p.error(f"--job-env expects KEY=VALUE, got {args.job_env!r}")
    args.job_env = dict(kv.split("=", 1) for kv in args.job_env)
    sys.path.insert(0, str(HERE))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gp-pushpull-") as tmp:
        drv = Driver(args, Path(tmp))
        print(f"push_pull benchmark: {args.tensors} x {args.mib} MiB float32 = "
              f"{drv.grad_bytes / MiB:.0f} MiB of gradients, ef=vanilla, min_compress_bytes=0, "
              f"{args.steps} timed steps; machine: {_machine()}", flush=True)
        rows = []
        for part in parts:
            rows += getattr(drv, f"part_{part}")()
    print("| measurement | value | detail | ratio | target | result |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.quick:
        print("quick run: the targets are set for the full 100 MiB run; with 16 MiB the fixed "
              "per-step costs (barrier, Python, thread hand-offs) weigh more")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 1 if any(r[-1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

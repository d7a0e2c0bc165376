"""End-to-end training step time on an emulated cluster: gradpress against torch DDP.

Run as root (network namespaces): ``sudo .venv/bin/python benchmarks/cluster.py [--quick]``.

1. **speed** (per model): builds an emulated cluster with ``benchmarks/netem.py`` (one network
   namespace per host, joined by veth pairs to a bridge, a ``tbf`` at ``--rate`` on both ends of
   every veth; falls back to one rate-limited namespace when veth/bridge are unavailable) and
   trains the same model, batch, optimizer and number of steps with every system: torch DDP
   fp32 (gloo), DDP + ``fp16_compress_hook``, DDP + PowerSGD hook (rank 4), gradpress ``none``,
   gradpress CLAN ``onebit``, gradpress CLAN ``topk:k=0.001,values=fp16`` and DDP + gradpress's
   two-way ``onebit`` hook; and ``local``, the same processes training alone without any
   communication (the compute floor: a step of a system minus it is what communication costs
   that system, printed beside the speed-up). One worker per host; the gradpress systems add
   one server per host (``gradpress launch --nnodes N --node-rank R ...`` in each host
   namespace), except ``gp-onebit-coloc`` and ``gp-int4-coloc`` (asked for by name in
   ``--systems``): the same onebit or int4 job with each host's server as threads inside its
   worker (``launch --colocate``), the layout ``gradpress launch`` recommends on a node without
   spare cores. The DDP systems
   are torchrun-style processes (``MASTER_ADDR`` = host 0's address).
2. **loopback**: gradpress ``none``, ``onebit`` and ``topk`` on the plain loopback of this
   machine (no namespace, no limit): does the pipeline hide the compression cost?
3. **scaling**: gradpress ``none`` and ``onebit`` with 2 and 4 workers and 1 and 2 servers in
   one rate-limited namespace (``gradpress launch`` needs >= 1 server per node, so 1 server
   implies one node): step time and bytes per worker.

A step is forward, backward and optimizer step; its time is that of the slowest worker; the
table gives the median over the timed steps (best step in brackets) and speed-ups against DDP
fp32 measured in the same run. Namespaces are removed afterwards, also on failure or Ctrl-C.

``--profile`` adds, per model of the speed part, a per-stage profile of a step of worker 0
(``benchmarks/profile_trace.py``): the gradpress systems run with ``GRADPRESS_TRACE`` and their
worker and server traces are aggregated over the timed steps; the other systems get the
stages their step marks give (forward + backward, synchronisation, update).

Each model of the speed part also gets a table of where the machine's CPU went during the
timed steps (``/proc/stat`` and the workers' own CPU times, per step): on this machine every
process of the emulated cluster (workers, servers, the kernel's network work) shares the same
cores, so when they are busy all the time a system's time above the floor is its extra
core-seconds divided by the cores, not the network.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cluster_models import MODELS  # noqa: E402
from cluster_worker import GP_COLOCATED, GP_SYSTEMS  # noqa: E402

SYSTEMS = ("local", "ddp-fp32", "ddp-fp16", "ddp-powersgd", "ddp-powersgd1", "gp-none",
           "gp-onebit", "gp-topk", "gp-ddp-hook", "gp-int4", "gp-int4-hook", "gp-onebit-coloc",
           "gp-int4-coloc")
#: What runs by default (the ``-coloc`` systems are asked for by name).
DEFAULT_SYSTEMS = SYSTEMS[:-2]
LABELS = {"local": "no communication (compute floor)", "ddp-fp32": "DDP fp32 (gloo)",
          "ddp-fp16": "DDP + fp16 hook",
          "ddp-powersgd": "DDP + PowerSGD hook (rank 4)",
          "ddp-powersgd1": "DDP + PowerSGD hook (rank 1)", "gp-none": "gradpress none",
          "gp-onebit": "gradpress onebit", "gp-topk": "gradpress topk 0.1% fp16",
          "gp-onebit-coloc": "gradpress onebit, servers in the workers (--colocate)",
          "gp-int4-coloc": "gradpress int4, servers in the workers (--colocate)",
          "gp-ddp-hook": "DDP + gradpress two-way onebit hook",
          "gp-int4": "gradpress int4 (the default)", "gp-int4-hook": "DDP + gradpress int4 hook"}
BATCH = {"vgg": 8, "bert": 4, "tfm": 4, "mlp": 8}
PARTS = ("speed", "loopback", "scaling")
SCALING = ((2, 1), (4, 1), (2, 2), (4, 2))  # (workers, servers)


@dataclass(frozen=True)
class Net:
    """Where the processes of a job run: one command prefix per host, addresses, device."""

    prefixes: tuple[tuple[str, ...], ...]
    addresses: tuple[str, ...]
    device: str
    what: str


def _bytes_or_auto(text: str) -> int | str:
    """``--min-compress-bytes``: an int >= 0 or ``auto``."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an int >= 0 or 'auto', got {text!r}")
    return int(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments (validated; ``--quick`` fills smaller defaults)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="vgg only, 2 warm-up + 3 timed steps")
    p.add_argument("--parts", default=",".join(PARTS), help=f"subset of {','.join(PARTS)}")
    p.add_argument("--models", help="comma-separated subset of vgg,bert,tfm,mlp (default vgg,bert; "
                   "quick vgg)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"systems of the speed part, a subset of {','.join(SYSTEMS)} "
                        f"(default: all but the -coloc ones)")
    p.add_argument("--scaling-systems", default="gp-none,gp-onebit",
                   help="gradpress systems of the scaling part (gp-none,gp-onebit)")
    p.add_argument("--rate", default="1gbit", help="per-host link rate (tc syntax; 1gbit)")
    p.add_argument("--hosts", type=int, default=2, help="hosts of the speed part (2)")
    p.add_argument("--topology", choices=("cluster", "ns"), default="cluster",
                   help="per-host namespaces (cluster) or one rate-limited namespace (ns)")
    p.add_argument("--optimizer", choices=("clan", "sgd"), default="clan",
                   help="optimizer of every system (clan: LANS without normalisation)")
    p.add_argument("--batch", type=int, help="per-worker batch (vgg 8, bert 4, tfm 4, mlp 8)")
    p.add_argument("--warmup", type=int, help="untimed steps (3; quick 2)")
    p.add_argument("--steps", type=int, help="timed steps (5; quick 3)")
    p.add_argument("--min-compress-bytes", type=_bytes_or_auto, default="auto",
                   help="tensors below this travel uncompressed (auto: gradpress's default, "
                        "sized by the model; the DDP hook, which sees buckets, takes its own "
                        "default then)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job (600)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--profile", action="store_true",
                   help="speed part: per-stage profile of a step from the gradpress traces "
                        "(benchmarks/profile_trace.py)")
    args = p.parse_args(argv)
    args.models = [m for m in (args.models or ("vgg" if args.quick else "vgg,bert")).split(",")
                   if m]
    args.systems = [s for s in args.systems.split(",") if s]
    args.parts = [s for s in args.parts.split(",") if s]
    args.scaling_systems = [s for s in args.scaling_systems.split(",") if s]
    args.warmup = 2 if args.quick and args.warmup is None else 3 if args.warmup is None \
        else args.warmup
    args.steps = 3 if args.quick and args.steps is None else 5 if args.steps is None \
        else args.steps
    for name, vals, ok in (("--models", args.models, MODELS),
                           ("--systems", args.systems, SYSTEMS), ("--parts", args.parts, PARTS),
                           ("--scaling-systems", args.scaling_systems, GP_SYSTEMS)):
        if not vals or set(vals) - set(ok):
            p.error(f"{name} must be a non-empty subset of {','.join(ok)}, got {vals!r}")
    if args.profile and "speed" not in args.parts:
        p.error("--profile profiles the speed part: --parts must include speed")
    for name in ("hosts", "warmup", "steps", "batch"):
        v = getattr(args, name)
        if v is not None and v < (0 if name == "warmup" else 1):
            p.error(f"--{name} must be >= {0 if name == 'warmup' else 1}, got {v}")
    return args


class Driver:
    """Starts the jobs of every part and reads back their results."""

    def __init__(self, args: argparse.Namespace, out_dir: Path) -> None:
        self.args, self.out_dir, self.jobs = args, out_dir, 0

    def _cfg(self, name: str, system: str, model: str, device: str) -> Path:
        a = self.args
        cfg = {"name": name, "system": system, "model": model, "device": device,
               "batch": a.batch or BATCH[model], "optimizer": a.optimizer, "warmup": a.warmup,
               "steps": a.steps, "min_compress_bytes": a.min_compress_bytes,
               "out_dir": str(self.out_dir)}
        path = self.out_dir / f"{name}.cfg.json"
        path.write_text(json.dumps(cfg))
        return path

    def job(self, net: Net, system: str, model: str, wpn: int = 1, spn: int = 1) -> dict:
        """Run ``system`` on ``net`` with ``wpn`` workers (and ``spn`` servers) per host."""
        self.jobs += 1
        name, port = f"job{self.jobs}-{system}-{model}", str(29500 + self.jobs)
        worker = [sys.executable, str(HERE / "cluster_worker.py"),
                  str(self._cfg(name, system, model, net.device))]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": net.device,
               "GRADPRESS_TIMEOUT": str(int(self.args.timeout)),
               "GRADPRESS_SECRET": secrets.token_hex(32),
               "PYTHONPATH": os.pathsep.join(filter(None, (str(HERE),
                                                           os.environ.get("PYTHONPATH"))))}
        if self.args.profile and system in GP_SYSTEMS:
            env["GRADPRESS_TRACE"] = str(self.out_dir / f"{name}.trace.json")
        nodes, procs = len(net.prefixes), []
        for h, prefix in enumerate(net.prefixes):
            if system in GP_SYSTEMS:
                cmd = [*_gradpress_cmd(), "launch", "--nnodes", str(nodes),
                       "--node-rank", str(h), "--master-addr", net.addresses[0],
                       "--master-port", port, "--workers-per-node", str(wpn),
                       "--servers-per-node", str(spn),
                       *(["--colocate"] if system in GP_COLOCATED else []), "--", *worker]
                procs.append(subprocess.Popen([*prefix, *cmd], env=env, stderr=subprocess.PIPE,
                                              text=True))
                continue
            for local in range(wpn):
                denv = {**env, "RANK": str(h * wpn + local), "WORLD_SIZE": str(nodes * wpn),
                        "LOCAL_RANK": str(local), "MASTER_ADDR": net.addresses[0],
                        "MASTER_PORT": port}
                procs.append(subprocess.Popen([*prefix, *worker], env=denv,
                                              stderr=subprocess.PIPE, text=True))
        self._wait(procs, name)
        ranks = [json.loads((self.out_dir / f"{name}.rank{r}.json").read_text())
                 for r in range(nodes * wpn)]
        out = _summary(ranks)
        if self.args.profile:
            out["profile"] = _profile(self.out_dir, name, [r["marks"] for r in ranks])
        return out

    def _wait(self, procs: list[subprocess.Popen], name: str) -> None:
        deadline, errors = time.monotonic() + self.args.timeout, []
        for p in procs:
            try:
                _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise RuntimeError(f"job {name} did not finish within {self.args.timeout} "
                                   f"s") from None
            if p.returncode != 0:
                errors.append(f"exit {p.returncode}: ...{err[-2500:]}")
        if errors:
            raise RuntimeError(f"job {name} failed:\n" + "\n".join(errors))


def _gradpress_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("gradpress")
    return [str(exe)] if exe.exists() else [
        sys.executable, "-c", "import sys; from gradpress.cli import main; sys.exit(main())"]


def _profile(out_dir: Path, name: str, marks: list[list[list[float]]]) -> dict:
    """Worker 0's step profile from the job's traces, or its marks only (no traces);
    ``marks``: each worker's step marks."""
    import profile_trace as pt

    windows = [[pt.Window(*m) for m in rank] for rank in marks]
    worker = out_dir / f"{name}.trace.worker0.json"
    if not worker.exists():
        return pt.marks(windows[0])
    servers = [s for f in sorted(out_dir.glob(f"{name}.trace.*.json"))  # colocated: in workers'
               for s in pt.spans_of(json.loads(f.read_text())) if s.name in pt.SERVER_STAGES]
    mine = pt.spans_of(json.loads(worker.read_text()))
    return asdict(pt.profile(mine, servers, windows[0], windows[1:]))


def _summary(ranks: list[dict]) -> dict:
    per_step = [max(r["seconds"][i] for r in ranks) for i in range(len(ranks[0]["seconds"]))]
    out = {"median_s": statistics.median(per_step), "best_s": min(per_step),
           "steps_s": per_step, "iface_mb": max(r["iface_bytes"] for r in ranks) / 1e6}
    if "gp_bytes" in ranks[0]:
        out["gp_mb"] = max(r["gp_bytes"] for r in ranks) / 1e6
        out["stage_s"] = ranks[0]["stage_s"]
    if "cpu" in ranks[0]:
        out["cpu"] = _cpu_split(ranks)
    return out


def _cpu_split(ranks: list[dict]) -> dict:
    """Core-seconds per timed step (rank 0's window for the machine-wide counters): the whole
    machine, the workers' main threads, the workers' other threads, and everything else."""
    m = ranks[0]["cpu"]
    busy = m["machine_user"] + m["machine_sys"]
    procs = sum(r["cpu"]["process_user"] + r["cpu"]["process_sys"] for r in ranks)
    main = sum(r["cpu"]["main_thread"] for r in ranks)
    return {"busy": busy, "busy_frac": busy / max(busy + m["machine_idle"], 1e-9),
            "sys": m["machine_sys"], "main": main, "worker_other": procs - main,
            "rest": busy - procs}


# -- networks ------------------------------------------------------------------------------------
def _cluster_net(stack: object, hosts: int, rate: str, topology: str) -> Net:
    """An emulated cluster of ``hosts`` (or one rate-limited namespace); registered on ``stack``
    so it is removed on exit."""
    import netem

    if topology == "cluster":
        try:
            cl = stack.enter_context(netem.emulated_cluster(hosts, rate))  # type: ignore
            return Net(tuple(tuple(ns.cmd([])) for ns in cl.hosts), cl.addresses, cl.device,
                       f"{hosts} host namespaces, each with its own {rate} veth link to a bridge")
        except netem.NetemError as e:
            print(f"cluster unavailable ({e}); falling back to one namespace", flush=True)
    ns = stack.enter_context(netem.rate_limited_namespace(rate, tag="cl"))  # type: ignore
    return Net((tuple(ns.cmd([])),) * hosts, ("127.0.0.1",) * hosts, "lo",
               f"{hosts} 'hosts' in one namespace sharing a {rate} loopback")


LOOPBACK = Net(((),), ("127.0.0.1",), "lo", "plain loopback, no namespace, no limit")


# -- parts ---------------------------------------------------------------------------------------
def part_speed(drv: Driver, net: Net) -> dict:
    """Part 1: every system on every model; speed-ups against DDP fp32 of the same model."""
    out = {}
    for model in drv.args.models:
        out[model] = {}
        for system in drv.args.systems:
            r = drv.job(net, system, model)
            out[model][system] = r
            print(f"  {model} {system}: {r['median_s']:.3f} s/step", flush=True)
    return out


def part_loopback(drv: Driver) -> dict:
    """Part 2: gradpress none/onebit/topk, 2 workers + 2 servers on the plain loopback."""
    res = {}
    for system in ("gp-none", "gp-onebit", "gp-topk"):
        res[system] = drv.job(LOOPBACK, system, "vgg", wpn=2, spn=2)
        del res[system]["iface_mb"]  # the host's lo also carries other programs' traffic
        print(f"  loopback {system}: {res[system]['median_s']:.3f} s/step", flush=True)
    return res


def part_scaling(drv: Driver, net: Net) -> dict:
    """Part 3: 2/4 workers x 1/2 servers, gradpress systems (none, onebit), one namespace."""
    res = {}
    for w, s in SCALING:
        for system in drv.args.scaling_systems:
            r = drv.job(net, system, "vgg", wpn=w, spn=s)
            res[f"{w}x{s}/{system}"] = r
            print(f"  scaling W={w} S={s} {system}: {r['median_s']:.3f} s/step", flush=True)
    return res


# -- tables --------------------------------------------------------------------------------------
def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def speed_table(res: dict, base_key: str = "ddp-fp32") -> list[str]:
    """Rows of one speed table; speed-ups against ``res[base_key]`` when present."""
    base = res.get(base_key)
    floor = res.get("local", {}).get("median_s")
    rows = [f"| system | s/step median (best) | speed-up vs {LABELS[base_key]} | communication "
            "s/step (step - compute floor) | MB/step on host link (rx+tx) | gradpress "
            "MB/worker/step |", "|---|---|---|---|---|---|"]
    for system, r in res.items():
        up = f"{base['median_s'] / r['median_s']:.2f}x" if base else "-"
        comm = "-" if floor is None or system == "local" else _comm_cell(r, base, floor)
        link = f"{r['iface_mb']:.1f}" if "iface_mb" in r else "-"
        gp = f"{r['gp_mb']:.2f}" if "gp_mb" in r else ""
        rows.append(f"| {LABELS[system]} | {r['median_s']:.3f} ({r['best_s']:.3f}) | {up} | "
                    f"{comm} | {link} | {gp} |")
    return rows


def _comm_cell(r: dict, base: dict | None, floor: float) -> str:
    """Seconds a step spends beyond the compute floor, and that of DDP fp32 over it."""
    extra = r["median_s"] - floor
    if base is None or extra <= 0:
        return f"{extra:.3f}"
    return f"{extra:.3f} ({(base['median_s'] - floor) / extra:.1f}x less than DDP fp32)"


def target_rows(speed: dict, loop: dict) -> list[str]:
    """The issue's targets: onebit >= 8x DDP fp32 and >= 1.5x PowerSGD (vgg, limited link);
    compressed <= 1.2x none on the plain loopback."""
    rows = ["| target | measured | result |", "|---|---|---|"]
    vgg = speed.get("vgg", {})
    if "gp-onebit" in vgg:
        one = vgg["gp-onebit"]["median_s"]
        for other, goal in (("ddp-fp32", 8.0), ("ddp-powersgd", 1.5)):
            if other in vgg:
                ratio = vgg[other]["median_s"] / one
                rows.append(f"| vgg: gradpress onebit >= {goal}x faster than {LABELS[other]} "
                            f"| {ratio:.2f}x | {_verdict(ratio >= goal)} |")
    if loop:
        none = loop["gp-none"]["median_s"]
        for system in ("gp-onebit", "gp-topk"):
            ratio = loop[system]["median_s"] / none
            rows.append(f"| loopback: {LABELS[system]} <= 1.2x gradpress none | {ratio:.2f}x "
                        f"| {_verdict(ratio <= 1.2)} |")
    return rows


def scaling_table(res: dict) -> list[str]:
    rows = ["| workers | servers | system | s/step median (best) | MB/worker/step (gp.stats) "
            "| MB/step through the link |", "|---|---|---|---|---|---|"]
    for key, r in res.items():
        ws, system = key.split("/")
        w, s = ws.split("x")
        rows.append(f"| {w} | {s} | {LABELS[system]} | {r['median_s']:.3f} ({r['best_s']:.3f}) "
                    f"| {r['gp_mb']:.2f} | {r['iface_mb']:.1f} |")
    return rows


def cpu_table(res: dict) -> list[str]:
    """Where the machine's CPU went during each system's timed steps: when the cores are busy
    all the time, a system's step is longer than the floor by about (its core-seconds per step
    minus the floor's) / cores, whatever the network."""
    rows = ["| system | s/step | cores busy | core-s/step (of it kernel) | workers' main threads "
            "| workers' other threads | rest (servers, network, other jobs) |",
            "|---|---|---|---|---|---|---|"]
    for system, r in res.items():
        c = r.get("cpu")
        if c is not None:
            rows.append(f"| {LABELS[system]} | {r['median_s']:.3f} | {c['busy_frac']:.0%} "
                        f"| {c['busy']:.3f} ({c['sys']:.3f}) | {c['main']:.3f} "
                        f"| {c['worker_other'] + 0.0:.3f} | {c['rest'] + 0.0:.3f} |")
    return rows


def profile_table(res: dict) -> list[str]:
    """The ``--profile`` table of one model: a column per system, the floor first."""
    import profile_trace as pt

    profs = {s: r["profile"] for s, r in res.items() if "profile" in r and s != "local"}
    floor = res.get("local", {}).get("profile")
    return pt.profile_rows(profs, floor)


def machine() -> str:
    """Cores, CPU model, load average and kernel of this machine."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    return (f"{os.cpu_count()} cores ({cpu}), load average {os.getloadavg()[0]:.1f}, "
            f"Linux {platform.release()}")


def main(argv: list[str] | None = None) -> int:
    """Run the parts, print the tables; exit 1 if a target failed."""
    from contextlib import ExitStack

    args = parse_args(argv)
    t0, results, lines = time.perf_counter(), {}, []
    print(f"cluster benchmark: models {args.models}, optimizer {args.optimizer}, "
          f"{args.warmup} warm-up + {args.steps} timed steps, rate {args.rate}; machine: "
          f"{machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gp-cluster-") as tmp, ExitStack() as stack:
        drv = Driver(args, Path(tmp))
        if "speed" in args.parts:
            net = _cluster_net(stack, args.hosts, args.rate, args.topology)
            print(f"speed: {net.what}", flush=True)
            results["speed"] = part_speed(drv, net)
            for model, res in results["speed"].items():
                lines += [f"\n{model} at {args.rate} per host ({net.what}):", "",
                          *speed_table(res)]
                lines += [f"\nCPU per step, {model} (core-seconds, {os.cpu_count()} cores):",
                          "", *cpu_table(res)]
                if args.profile:
                    lines += [f"\nprofile of a step, {model} (worker 0, seconds):", "",
                              *profile_table(res)]
        if "loopback" in args.parts:
            results["loopback"] = part_loopback(drv)
            lines += ["\nloopback (vgg, 2 workers + 2 servers, no limit):", "",
                      *speed_table(results["loopback"], "gp-none")]
        if "scaling" in args.parts:
            net = _cluster_net(stack, 1, args.rate, "ns")
            results["scaling"] = part_scaling(drv, net)
            lines += [f"\nscaling (vgg, one namespace, {args.rate} loopback):", "",
                      *scaling_table(results["scaling"])]
    targets = target_rows(results.get("speed", {}), results.get("loopback", {}))
    print("\n".join([*lines, "\ntargets:", "", *targets]))
    print(f"total {time.perf_counter() - t0:.0f} s; load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results},
                                              indent=1, default=str))
    return 1 if any(r.endswith("FAIL |") for r in targets) else 0


if __name__ == "__main__":
    sys.exit(main())

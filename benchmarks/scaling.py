"""How step time grows with the number of workers, per-worker link fixed, beside the simulator.

Run as root (network namespaces)::

    python benchmarks/scaling.py [--workers 2,4,6] [--model mlp] [--steps 5] [--json FILE]
    python benchmarks/scaling.py --from W2.json W4.json W6.json   # one table of kept runs

Steps:

1. For each number of workers W: an emulated cluster of W hosts (``benchmarks/netem.py``: one
   network namespace per host, each with its own ``--rate`` veth link to a bridge, so the link
   per worker is fixed), one worker per host; ``benchmarks/cluster.py``'s speed part trains
   ``--model`` with every system of ``--systems`` one after the other (default: the compute
   floor ``local``, DDP + fp16 hook, DDP + PowerSGD rank 1, gradpress's PS path with its
   servers in the workers (``gp-onebit-coloc``: W servers, one per host, the layout ``gradpress
   launch`` recommends on a machine without spare cores) and DDP + gradpress's two-way hook).
2. The simulator's prediction beside each measured point where it has a model of the system
   (:mod:`gradpress.sim.pipeline`): the PS path (``onebit:ef=vanilla``, colocated servers, one
   per node) and dense fp16 (its baseline: a PS exchange of fp16 gradients, the same bytes per
   worker as DDP's fp16 ring allreduce) on W nodes of one device each at ``--rate``, the
   model's tensors in forward order (only models made of linear layers: ``mlp``), its compute
   the measured floor of the same W (so the simulator predicts the communication on top of
   it), 2 compression threads per worker and 2 engine threads per server (gradpress's defaults
   on 2 cores). PowerSGD and the hook: no model ("-").
3. One table: workers, servers, system, measured s/step (median of the timed steps), the
   prediction and measured / predicted.

Every host of the emulated cluster shares the same machine's cores: the simulator gives every
worker and server its own CPUs, so on a small machine the measured steps grow with W where the
prediction does not (the compute floor of W workers is W workers' compute on the machine's
cores); the table shows by how much.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cluster  # noqa: E402

SYSTEMS = ("local", "ddp-fp16", "ddp-powersgd1", "gp-onebit-coloc", "gp-ddp-hook")
#: system -> (simulated run, colocated servers): which prediction stands beside it.
SIMULATED = {"gp-onebit": "compressed", "gp-onebit-coloc": "compressed",
             "ddp-fp16": "baseline"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", default="2,4,6", help="numbers of workers (2,4,6)")
    p.add_argument("--model", default="mlp", choices=cluster_models_names(),
                   help="model (mlp; the simulator models mlp only)")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"systems, a subset of {','.join(cluster.SYSTEMS)}")
    p.add_argument("--rate", default="1gbit", help="link rate per host (1gbit)")
    p.add_argument("--steps", type=int, default=5, help="timed steps (5)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job (600)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--from", dest="from_json", nargs="+", metavar="JSON",
                   help="measure nothing: print the table of these --json files together "
                        "(e.g. the records of one W each)")
    args = p.parse_args(argv)
    try:
        args.workers = [int(w) for w in args.workers.split(",") if w]
    except ValueError:
        p.error(f"--workers: expected comma-separated ints, got {args.workers!r}")
    if not args.workers or min(args.workers) < 2:
        p.error("--workers: at least 2 each")
    args.systems = [s for s in args.systems.split(",") if s]
    if not args.systems or set(args.systems) - set(cluster.SYSTEMS):
        p.error(f"--systems must be a non-empty subset of {','.join(cluster.SYSTEMS)}")
    return args


def cluster_models_names() -> tuple[str, ...]:
    from cluster_models import MODELS

    return MODELS


def sim_model(name: str) -> Any:
    """The simulator's :class:`~gradpress.sim.models.Model` of a benchmark model made of linear
    layers (forward MACs per sample = in x out), or None for other models."""
    import torch

    from cluster_models import build_model
    from gradpress.sim.models import Model, Op, Tensor

    net = build_model(name)
    ops = []
    for mod_name, mod in net.named_modules():
        own = list(mod.named_parameters(recurse=False))
        if not own:
            continue
        if not isinstance(mod, torch.nn.Linear):
            return None
        ops.append(Op(mod_name, float(mod.in_features * mod.out_features),
                      tuple(Tensor(f"{mod_name}.{n}", p.numel()) for n, p in own)))
    return Model(name=name, ops=tuple(ops), sample="sample", batch_per_gpu=1,
                 samples_per_s=1.0, source="benchmarks/cluster_models.py")


def predict(model: Any, workers: int, rate: str, floor_s: float) -> dict[str, float]:
    """Simulated seconds per step: ``baseline`` (dense fp16) and ``compressed`` (onebit)."""
    from gradpress.sim.cli import parse_bandwidth
    from gradpress.sim.pipeline import SimConfig, compare

    cfg = SimConfig(model=model, bandwidth=parse_bandwidth(rate), nodes=workers,
                    gpus_per_node=1, compression="onebit:ef=vanilla", baseline="fp16",
                    compute_ms=floor_s * 1e3, worker_threads=2, server_threads=2,
                    servers_per_node=1)
    c = compare(cfg)
    return {"baseline": c.baseline.iteration_ms / 1e3,
            "compressed": c.compressed.iteration_ms / 1e3}


def measure(args: argparse.Namespace, workers: int, out_dir: Path) -> dict[str, dict]:
    """cluster.py's speed part on ``workers`` hosts, one worker (and server) per host."""
    cargs = cluster.parse_args(["--parts", "speed", "--models", args.model, "--systems",
                                ",".join(args.systems), "--hosts", str(workers), "--rate",
                                args.rate, "--steps", str(args.steps), "--warmup",
                                str(args.warmup), "--timeout", str(args.timeout)])
    with ExitStack() as stack:
        net = cluster._cluster_net(stack, workers, args.rate, "cluster")
        print(f"W={workers}: {net.what}", flush=True)
        drv = cluster.Driver(cargs, out_dir)
        drv.jobs = 100 * workers  # distinct job names and ports per W
        return cluster.part_speed(drv, net)[args.model]


def rows(results: dict[int, dict[str, dict]], preds: dict[int, dict[str, float]]) -> list[str]:
    out = ["| workers | servers | system | s/step measured (best) | simulator s/step "
           "| measured / simulated |", "|---|---|---|---|---|---|"]
    for w, res in results.items():
        for system, r in res.items():
            servers = str(w) if system.startswith("gp-onebit") else "-"
            kind = SIMULATED.get(system)
            p = preds.get(w, {}).get(kind) if kind else None
            sim = "-" if p is None else f"{p:.3f}"
            ratio = "-" if p is None else f"{r['median_s'] / p:.2f}"
            out.append(f"| {w} | {servers} | {cluster.LABELS[system]} | {r['median_s']:.3f} "
                       f"({r['best_s']:.3f}) | {sim} | {ratio} |")
    return out


def speedups(results: dict[int, dict[str, dict]]) -> list[str]:
    """Per W: each gradpress system's speed-up over DDP + fp16 and PowerSGD rank 1."""
    out = []
    for w, res in results.items():
        for system in ("gp-onebit", "gp-onebit-coloc", "gp-ddp-hook"):
            if system not in res:
                continue
            ups = [f"{res[b]['median_s'] / res[system]['median_s']:.2f}x vs {cluster.LABELS[b]}"
                   for b in ("ddp-fp16", "ddp-powersgd1") if b in res]
            out.append(f"W={w} {system}: {', '.join(ups)}")
    return out


def load(paths: list[str]) -> tuple[dict[int, dict[str, dict]], dict[int, dict[str, float]]]:
    """The results and predictions of ``--json`` files, merged (by W)."""
    results: dict[int, dict[str, dict]] = {}
    preds: dict[int, dict[str, float]] = {}
    for path in paths:
        doc = json.loads(Path(path).read_text())
        results.update({int(w): r for w, r in doc["results"].items()})
        preds.update({int(w): p for w, p in doc["simulated"].items()})
    return dict(sorted(results.items())), preds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        results, preds = load(args.from_json)
        print("\n".join([*rows(results, preds), "", *speedups(results)]))
        return 0
    t0 = time.perf_counter()
    print(f"scaling: {args.model}, workers {args.workers}, {args.rate} per host, "
          f"{args.warmup} + {args.steps} steps; machine: {cluster.machine()}", flush=True)
    model = sim_model(args.model)
    results: dict[int, dict[str, dict]] = {}
    preds: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="gp-scaling-") as tmp:
        for w in args.workers:
            results[w] = measure(args, w, Path(tmp))
            if model is not None and "local" in results[w]:
                preds[w] = predict(model, w, args.rate, results[w]["local"]["median_s"])
    print("\n" + "\n".join([*rows(results, preds), "", *speedups(results)]))
    print(f"total {time.perf_counter() - t0:.0f} s; load average now {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "results": {str(w): r for w, r in results.items()},
             "simulated": {str(w): p for w, p in preds.items()}}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

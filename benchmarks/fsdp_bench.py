"""FSDP2 on a rate-limited link: FSDP2's own reduce-scatter (fp32, and a bf16 reduce dtype)
against gradpress's one-bit one, with ``reshard_after_forward`` False and True.

    python benchmarks/fsdp_bench.py --out DIR [--rate 1gbit] [--mb 100] [--steps 6]
    python benchmarks/record.py fsdp-1gbit -- python benchmarks/fsdp_bench.py --out {out}

Steps:

1. For each ``reshard_after_forward`` and system (``fp32``, ``bf16``: FSDP2 with
   ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)`` and fp32 parameters, ``onebit``:
   ``gradpress.fsdp`` with vanilla error feedback), start 2 ranks (gloo) inside a fresh network
   namespace whose loopback is limited to ``--rate`` (:mod:`gradpress.train.netem`).
2. Each rank trains an MLP of ``--mb`` MB of fp32 parameters (layers of 2048 x 2048, each its
   own ``fully_shard``) for ``--warmup`` + ``--steps`` steps on random data.
3. Measured, not computed: seconds per step (wall clock of the timed steps, rank 0), bytes per
   step on the namespace's loopback (``tx_bytes`` of ``lo``: every byte both ranks sent, TCP/IP
   headers included), and of that the bytes that flowed during the reduce-scatters (the
   counter read before and after each reduce-scatter call on rank 0; both ranks run them in
   lockstep on the CPU).
4. Writes ``DIR/fsdp_bench.json`` (one row per run) and prints a table with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("fp32", "bf16", "onebit")
WIDTH = 2048


def lo_tx() -> int:
    return int(Path("/sys/class/net/lo/statistics/tx_bytes").read_text())


def _measured(inner: Any, box: dict[str, float]) -> Any:
    """``inner`` (a ReduceScatter) with the loopback bytes and seconds of its calls counted."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    class Measured(ReduceScatter):
        def allocate(self, size: Any, *, dtype: Any, device: Any) -> Any:
            return inner.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, op: Any,
                     async_op: bool = False) -> Any:
            b, t = lo_tx(), time.perf_counter()
            r = inner(output_tensor, input_tensor, group, op, async_op)
            box["rs_bytes"] += lo_tx() - b
            box["rs_seconds"] += time.perf_counter() - t
            return r

    return Measured()


def worker(args: argparse.Namespace) -> None:
    """Steps 2-3 on one rank."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    import gradpress.fsdp

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layers = max(1, round(args.mb * 2**20 / 4 / (WIDTH * WIDTH)))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    mpp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if args.system == "bf16" else \
        MixedPrecisionPolicy()
    for layer in model:
        fully_shard(layer, reshard_after_forward=args.raf, mp_policy=mpp)
    fully_shard(model, reshard_after_forward=args.raf, mp_policy=mpp)
    box = {"rs_bytes": 0.0, "rs_seconds": 0.0}
    state = gradpress.fsdp.FSDPCompressionState("onebit", "vanilla")
    for index, (name, m) in enumerate(model.named_modules()):
        if isinstance(m, FSDPModule) and m is not model:
            comm = gradpress.fsdp.CompressedReduceScatter(state, name, index) \
                if args.system == "onebit" else DefaultReduceScatter()
            m.set_custom_reduce_scatter(_measured(comm, box))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, WIDTH)
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            dist.barrier()
            box.update(rs_bytes=0.0, rs_seconds=0.0)
            b0, t0 = lo_tx(), time.perf_counter()
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    seconds, total = time.perf_counter() - t0, lo_tx() - b0
    if rank == 0:
        row = {"system": args.system, "reshard_after_forward": args.raf, "layers": layers,
               "params_mb": layers * (WIDTH * WIDTH + WIDTH) * 4 / 2**20, "steps": args.steps,
               "s_per_step": seconds / args.steps, "bytes_per_step": total / args.steps,
               "rs_bytes_per_step": box["rs_bytes"] / args.steps,
               "rs_s_per_step": box["rs_seconds"] / args.steps,
               "gradpress_stats": state.stats()}
        Path(args.row).write_text(json.dumps(row))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(ns: Any, args: argparse.Namespace, system: str, raf: bool, out: Path) -> dict:
    """Step 1: the two ranks of one run inside namespace ``ns``."""
    row = out / f"{system}-raf{int(raf)}.json"
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, __file__, "--worker", "--system", system, "--row", str(row),
               "--mb", str(args.mb), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--batch", str(args.batch)] + (["--raf"] if raf else [])
        procs.append(subprocess.Popen(ns.cmd(cmd), env=env))
    for p in procs:
        if p.wait(timeout=900) != 0:
            raise RuntimeError(f"{system} raf={raf}: a rank exited with {p.returncode}")
    return json.loads(row.read_text())


def table(rows: list[dict]) -> list[str]:
    lines = ["| reshard_after_forward | system | s/step | vs fp32 | bytes/step (MB) | "
             "reduce-scatter bytes/step (MB) | vs fp32 |", "|---|---|---|---|---|---|---|"]
    for raf in (False, True):
        base = next(r for r in rows if r["system"] == "fp32" and r["reshard_after_forward"] == raf)
        for r in (r for r in rows if r["reshard_after_forward"] == raf):
            lines.append(f"| {raf} | {r['system']} | {r['s_per_step']:.2f} | "
                         f"{base['s_per_step'] / r['s_per_step']:.2f}x faster | "
                         f"{r['bytes_per_step'] / 1e6:.1f} | {r['rs_bytes_per_step'] / 1e6:.2f} | "
                         f"{base['rs_bytes_per_step'] / r['rs_bytes_per_step']:.1f}x fewer |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="fsdp_bench_out")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--mb", type=float, default=100.0, help="fp32 parameter MB")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--raf", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from gradpress.train.netem import rate_limited_namespace
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with rate_limited_namespace(args.rate, tag="fsdp") as ns:
        for raf in (False, True):
            for system in SYSTEMS:
                rows.append(run_one(ns, args, system, raf, out))
                print(json.dumps(rows[-1]), flush=True)
    (out / "fsdp_bench.json").write_text(json.dumps({"rate": args.rate, "rows": rows}, indent=1))
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Seconds per CPU optimizer step of LANS/CLAN (fused numba kernel and foreach path) and Adam.

Usage::

    python benchmarks/optim_step.py [--sets 34m,1m] [--reps 5] [--threads N]

Parameter sets (float32, contiguous, on the CPU): ``34m`` is two 4096x4096 matrices and a few
small tensors (33.8M elements, the size of the VGG model of ``benchmarks/cluster.py``), ``1m``
one 1000x1000 matrix and a few small tensors (1.03M). Every system steps the same parameters
and gradients with its own optimizer state:

* ``LANS fused`` / ``LANS foreach``: :class:`gradpress.optim.LANS` (``normalize_grad=True``)
  with ``fused=True`` / ``fused=False``;
* ``CLAN fused`` / ``CLAN foreach``: the same with ``normalize_grad=False`` (what
  :func:`gradpress.optim.clan_core` builds);
* ``Adam foreach``: ``torch.optim.Adam(foreach=True)``;
* ``copy``: ``np.copyto`` of the parameter bytes into a preallocated buffer, the yardstick.

Timing: one warm-up step each (numba compiles or loads its cache), then ``--reps`` rounds; in
every round each system is timed with :func:`gradpress.sim.rates.best_time` (one untimed call,
then one timed call), so load from other processes hits all systems alike. Reported: the best
time per system, its ratio to the copy of the same round set, and the speed-up of the fused
path over foreach. The fused kernel runs on one thread; torch's foreach ops and Adam use
torch's intra-op threads (``--threads``, default torch's own setting, printed in the header).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

import numpy as np
import torch

from gradpress.optim import LANS
from gradpress.sim.rates import best_time

SETS: dict[str, list[tuple[int, ...]]] = {
    "34m": [(4096, 4096), (4096, 4096), (4096,), (4096,), (1024, 256), (256,), (10, 1024),
            (10,)],
    "1m": [(1000, 1000), (1000,), (64, 500), (64,), (10, 64), (10,)],
}
SYSTEMS = ("LANS fused", "LANS foreach", "CLAN fused", "CLAN foreach", "Adam foreach")


def make_params(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Random parameters with random gradients (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.randn(s, generator=gen).requires_grad_()
        p.grad = torch.randn(s, generator=gen) * 1e-3
        params.append(p)
    return params


def make_optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The optimizer of system ``name`` (see the module docstring)."""
    if name == "Adam foreach":
        return torch.optim.Adam(params, lr=1e-3, foreach=True)
    kind, path = name.split()
    return LANS(params, lr=1e-3, weight_decay=0.01, normalize_grad=(kind == "LANS"),
                fused=(path == "fused"))


def measure(shapes: list[tuple[int, ...]], reps: int) -> dict[str, float]:
    """Best seconds per step of every system and of the copy, interleaved round by round."""
    params = make_params(shapes)
    numel = sum(p.numel() for p in params)
    src, dst = np.random.default_rng(0).random(numel, dtype=np.float32), np.empty(numel,
                                                                                  np.float32)
    fns: dict[str, Callable[[], object]] = {"copy": lambda: np.copyto(dst, src)}
    for name in SYSTEMS:
        fns[name] = make_optimizer(name, params).step
    for fn in fns.values():      # warm-up: compilation, state allocation, page faults
        fn()
    best = dict.fromkeys(fns, math.inf)
    for _ in range(reps):
        for name, fn in fns.items():
            best[name] = min(best[name], best_time(fn, 1))
    return best


def table(results: dict[str, tuple[int, dict[str, float]]]) -> str:
    """The markdown table of all sets."""
    lines = ["| set | elements | system | s/step (best) | x copy | fused speed-up |",
             "|---|---|---|---|---|---|"]
    for set_name, (numel, best) in results.items():
        copy = best["copy"]
        lines.append(f"| {set_name} | {numel:,} | copy ({4 * numel / copy / 1e9:.1f} GB/s) "
                     f"| {copy:.3g} | 1.00 | |")
        for name in SYSTEMS:
            t = best[name]
            kind, path = name.split()
            speedup = (f"{best[kind + ' foreach'] / t:.1f}x"
                       if path == "fused" and kind != "Adam" else "")
            lines.append(f"| {set_name} | {numel:,} | {name} | {t:.3g} | {t / copy:.1f} "
                         f"| {speedup} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="34m,1m", help=f"comma list of {', '.join(SETS)}")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds (best is reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = ap.parse_args(argv)
    names = [s for s in args.sets.split(",") if s]
    unknown = [s for s in names if s not in SETS]
    if unknown or args.reps < 1:
        ap.error(f"--sets must name some of {', '.join(SETS)} and --reps be >= 1, "
                 f"got {args.sets!r}, {args.reps}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} torch thread(s), "
          f"{os.cpu_count()} CPU(s), load {os.getloadavg()[0]:.1f}, best of {args.reps}")
    results = {}
    for name in names:
        shapes = SETS[name]
        results[name] = (sum(math.prod(s) for s in shapes), measure(shapes, args.reps))
    print(table(results))


if __name__ == "__main__":
    main()

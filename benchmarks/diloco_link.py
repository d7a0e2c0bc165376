"""DiLoCo behind a slow link: time to accuracy and step time, against the per-step routes.

Issue 52's speed study, through ``gradpress demo``'s machinery: every process of one local
cluster (2 workers, 1 server) in a network namespace whose loopback is limited to ``--bandwidth``
(default 10mbit; needs root, ``ip`` and ``tc``), digits-cnn, the same samples for every run:

1. ``sync``: AdamW on exact fp32 averages every step (the baseline whose final test accuracy is
   the target);
2. ``int4``: AdamW on two-way int4 gradients every step (the default per-step route);
3. ``onebit``: AdamW on two-way one-bit gradients every step;
4. ``diloco``: AdamW inside ``gp.DiLoCo``, one int4 outer step every ``--sync-every`` steps;
5. ``diloco-overlap``: the same, each round sent while the next one computes.

The demo's table gives each run's time to the baseline's final accuracy and its speed-up, and
its link lines the bytes a step needs on the link against the compute (forward and backward)
a step. Keep the record::

    python benchmarks/record.py diloco-10mbit --keep '*.json' -- \\
        python benchmarks/diloco_link.py --out {out}
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gradpress.train.cli import run_demo
from gradpress.train.config import TrainConfig

RUNS = (("sync", "adam", "none", {}), ("int4", "adam", "int4", {}),
        ("onebit", "adam", "onebit", {}),
        ("diloco", "diloco", "int4", {}), ("diloco-overlap", "diloco", "int4", {"overlap": True}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/diloco-link")
    ap.add_argument("--bandwidth", default="10mbit")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--sync-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    demo_args = argparse.Namespace(out=args.out, bandwidth=args.bandwidth, tensorboard=False)

    def configs(out: Path, tensorboard: bool) -> list[TrainConfig]:
        return [TrainConfig(name=name, task="digits-cnn", optimizer=opt, compression=spec,
                            epochs=args.epochs, seed=args.seed, out=str(out / name),
                            progress=False, tensorboard=False,
                            **({"sync_every": args.sync_every} if opt == "diloco" else {}),
                            **extra)
                for name, opt, spec, extra in RUNS]

    return run_demo(demo_args, configs)


if __name__ == "__main__":
    sys.exit(main())

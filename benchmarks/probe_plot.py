"""Plot the health watch's probes: each compressed momentum's cosine with its exact average.

Reads ``probes.json`` (written by ``clan_script.py --save-model``) of each run directory and
draws one panel per run, one line per tensor (the token embedding and the output layer
named), the watch's threshold dashed::

    python benchmarks/probe_plot.py RUN [RUN ...] --out docs/img/health-probes.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from gradpress.optim.health import DEFAULT_THRESHOLD

NAMED = {"tok.weight": "token embedding", "out.weight": "output layer"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    fig, axes = plt.subplots(1, len(args.runs), figsize=(5 * len(args.runs), 3.6), sharey=True,
                             squeeze=False)
    for ax, run in zip(axes[0], args.runs):
        probes = json.loads((run / "probes.json").read_text())
        for name, log in sorted(probes.items()):
            steps, cos = zip(*log) if log else ((), ())
            label = NAMED.get(name)
            ax.plot(steps, cos, lw=1.6 if label else 0.8, label=label,
                    color=None if label else "0.6", marker="." if label else None)
        ax.axhline(DEFAULT_THRESHOLD, ls="--", color="red", lw=1, label="threshold")
        ax.set_title(run.name, fontsize=8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("cos(compressed step, exact average)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Issue 51's record: the default (int4) against the uncompressed optimizer, and the frontier of
bits against accuracy.

Usage::

    python benchmarks/targets.py --targets int4-lm-800 ... --out benchmarks/results/targets
    python benchmarks/frontier.py [--out benchmarks/results/targets]

1. For every issue 51 target of ``benchmarks/targets.py`` (``int4-*``, 3 seeds) and every
   frontier point (``frontier-*``, one seed: int2, int3, int8 and one-bit gradients behind
   LANS), read the runs' reports (``targets.evaluate``: gap paired by seed against the
   uncompressed run of the same optimizer, whole-run bytes against fp32 from the codecs'
   payload sizes, ``model_ratio_vs_fp32``).
2. Write ``benchmarks/results/int4-default/README.md``: the targets (met, not met, incomplete,
   not run), the frontier table (bits per element against the gap, per task, int4 from seed 0
   of its target), the commands, the commit and the machine.
3. Plot the frontier into ``docs/img/frontier.png`` (gap against bits per element).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
import targets as tg
from convergence import completed

HERE = Path(__file__).resolve().parent
RECORD = HERE / "results" / "int4-default" / "README.md"
PLOT = HERE.parent / "docs" / "img" / "frontier.png"
#: The frontier's tasks: short name -> the issue 51 target whose seed 0 is the int4 point.
TASKS = {"lm-800": "int4-lm-800", "digits": "int4-digits", "words-1000": "int4-words-1000"}


def issue51() -> list[tg.Target]:
    return [t for t in tg.TARGETS if t.optimizer != "onebit-lans"]


def _row(o: tg.Outcome) -> str:
    t = o.target
    gaps = ", ".join(f"s{s} {tg._gap(g, t.unit)}" for s, g in sorted(o.gaps.items())) or "-"
    ratios = ", ".join(f"{r:.2f}x" for _, r in sorted(o.ratios.items())) or "-"
    return (f"| {t.name} | {t.task} | {tg.length(t)} | {t.optimizer} vs {t.base_optimizer} | "
            f"{tg.requirement(t)} | {gaps} | {ratios} | {o.status} |")


def frontier_points(out: Path) -> dict[str, list[tuple[str, float, float]]]:
    """Task -> [(codec, bits per element, gap)] of the completed seed-0 pairs."""
    points: dict[str, list[tuple[str, float, float]]] = {}
    for short, name in TASKS.items():
        base_target = next(t for t in tg.TARGETS if t.name == name)
        chosen = [base_target] + [t for t in tg.FRONTIER if t.name.startswith(f"frontier-{short}-")]
        for t in chosen:
            base, method = (completed(r) for r in tg.pair(t, 0, out))
            if base is None or method is None:
                continue
            bits = 32.0 / float(method["model_ratio_vs_fp32"])
            points.setdefault(short, []).append((t.codec, bits, tg.gap(method, base, t.unit)))
    return points


def plot(points: dict[str, list[tuple[str, float, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for short, pts in points.items():
        pts = sorted(pts, key=lambda p: p[1])
        unit = "pts" if short == "digits" else "%"
        ax.plot([p[1] for p in pts], [p[2] for p in pts], "o-", label=f"{short} ({unit})")
        for codec, x, y in pts:
            ax.annotate(codec, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bits per element over the whole run (fp32 = 32)")
    ax.set_ylabel("gap to the uncompressed optimizer (loss % / accuracy points)")
    ax.set_title("LANS on two-way compressed gradients, seed 0")
    ax.legend(fontsize=8)
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def render(out: Path, argv: list[str]) -> str:
    outcomes = [tg.evaluate(t, out) for t in issue51()]
    points = frontier_points(out)
    m = record.machine()
    head = record.git("rev-parse", "--short=10", "HEAD")
    lines = [
        "# Issue 51: the default (int4) against the uncompressed optimizer",
        "",
        f"Written by `{shlex.join(['python', 'benchmarks/frontier.py', *argv])}` at commit "
        f"{head}, on one {m['cores']}-core {m['cpu']} machine ({m['memory']}); 2 workers and 1 "
        "server, processes on that machine. Each run's report.json is beside its baseline in "
        "`benchmarks/results/targets/<task>/`; the commands are "
        "`python benchmarks/targets.py --targets NAME --out benchmarks/results/targets`.",
        "",
        "The method is the optimizer as it is (`gradpress train --optimizer lans` or `adam`, "
        "`--dense-steps 0`, the defaults otherwise: `int4` with vanilla error feedback on "
        "workers and servers, every tensor compressed, the small ones in fused keys); the "
        "baseline the same optimizer with `--compression none`. Gap paired by seed: 100 x "
        "(val_loss / baseline's - 1), or test accuracy minus the baseline's in points. Bytes: "
        "the whole run's payloads (headers included) against fp32.",
        "",
        "## Targets (3 seeds each)",
        "",
        "| target | task | steps | optimizer | requirement (every seed) | gap by seed | "
        "bytes vs fp32 | result |",
        "|---|---|---|---|---|---|---|---|",
        *(_row(o) for o in outcomes),
        "",
        "## The frontier (seed 0; int4 is seed 0 of its target)",
        "",
        "| task | codec | bits per element | gap |",
        "|---|---|---|---|",
    ]
    for short, pts in points.items():
        unit = "points" if short == "digits" else "%"
        for codec, bits, g in sorted(pts, key=lambda p: p[1]):
            lines.append(f"| {short} | {codec} | {bits:.2f} | {tg._gap(g, unit)} |")
    if points:
        plot(points)
        lines += ["", "![frontier](../../../docs/img/frontier.png)"]
    return "\n".join(lines + attempts(out)) + "\n"


def attempts(out: Path) -> list[str]:
    """Step 2, last part: the runs in ``attempts/`` (stdlib-mlm 800 seed 1, where int4 missed
    its target), each against the recorded LANS baseline of its seed."""
    import json

    found = sorted((RECORD.parent / "attempts").glob("*/report.json"))
    if not found:
        return []
    lines = ["", "## Attempts on stdlib-mlm 800, seed 1 (int4: +7.68%)", "",
             "Each is one `gradpress train --task stdlib-mlm --optimizer lans --lr 0.01 "
             "--steps 800 --weight-decay 0.01 --dense-steps 0 --seed 1` with the settings "
             "in its `config.json` (`attempts/<name>/`), against `lans_none_st800_s1`.", "",
             "| attempt | compression | exact by name | gap | bytes vs fp32 |",
             "|---|---|---|---|---|"]
    for path in found:
        rep = json.loads(path.read_text())
        seed = int(rep["config"]["seed"])
        base = json.loads((out / "stdlib-mlm" / f"lans_none_st800_s{seed}" / "report.json")
                          .read_text())
        exact = ", ".join(rep["config"].get("uncompressed_params") or []) or "-"
        lines.append(f"| {path.parent.name} | {rep['config']['compression']} | {exact} | "
                     f"{tg._gap(tg.gap(rep, base, '%'), '%')} | "
                     f"{float(rep['model_ratio_vs_fp32']):.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "targets",
                   help="where the runs are (default benchmarks/results/targets)")
    args = p.parse_args(argv)
    text = render(args.out, list(argv if argv is not None else sys.argv[1:]))
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

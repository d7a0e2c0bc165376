"""The parameter-server path against the DDP hook, before and after buckets: a summary of
interleaved ``benchmarks/cluster.py`` records.

Each record ``PREFIX-tfm-b<B>-<variant>-<i>`` is one run of::

    python benchmarks/record.py PREFIX-tfm-bB-VARIANT-I --keep '*.json' -- sh -c \\
        "PYTHONPATH=<variant's src> python benchmarks/cluster.py --parts speed --models tfm \\
         --batch B --systems local,gp-int4-hook,gp-int4,gp-int4-coloc --steps 5 \\
         --json {out}/cluster.json"

(the variants: ``old``, the sources before buckets, from a ``git worktree`` of that commit;
``new``, this checkout; others as named), run one after the other, variants interleaved, with
nothing else on the machine. Per batch and variant this prints the medians over the runs of:
each system's s/step (a run's median over its timed steps), the PS path's step over the hook's
step measured in the same run, and the core-seconds per step of the whole machine.

    python benchmarks/ps_buckets.py --prefix buckets2 [--out benchmarks/results/ps-buckets]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

RECORDS = Path(__file__).resolve().parent / "results" / "records"
SYSTEMS = ("local", "gp-int4-hook", "gp-int4", "gp-int4-coloc")
#: What each series of records compared (the variants' sources: their commits).
SERIES = {
    "buckets": "old: 73c199b (one key per tensor, small tensors fused); new: 28ec380 (every "
               "tensor of int4 in buckets of 4 MiB, a new buffer per round). The first round "
               "of this series was dropped: a test run overlapped it.",
    "buckets2": "old and new as above; reuse: 51bec98 (buckets keep their buffer from step to "
                "step).",
    "buckets3": "capfour: 51bec98 at the default cap (GRADPRESS_FUSION_BYTES unset: 4 MiB); "
                "capone: the same with GRADPRESS_FUSION_BYTES=1048576.",
}
NAME = re.compile(r"(?P<prefix>[\w-]+)-tfm-b(?P<batch>\d+)-(?P<variant>[a-z]+)-(?P<run>\d+)$")


def collect(prefix: str) -> dict[tuple[int, str], list[dict]]:
    """(batch, variant) -> the runs' ``results.speed.tfm`` of the records of ``prefix``."""
    out: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for d in sorted(RECORDS.glob(f"{prefix}-tfm-b*")):
        m = NAME.match(d.name)
        if not m or m["prefix"] != prefix or not (d / "cluster.json").is_file():
            continue
        rec = json.loads((d / "record.json").read_text())
        if rec.get("exit_code") != 0:
            continue
        speed = json.loads((d / "cluster.json").read_text())["results"]["speed"]["tfm"]
        out[(int(m["batch"]), m["variant"])].append(speed)
    return out


def table(runs: dict[tuple[int, str], list[dict]]) -> list[str]:
    """A markdown table: per batch and variant, medians over the runs."""
    lines = ["| batch | variant | runs | " + " | ".join(f"{s} s/step" for s in SYSTEMS)
             + " | PS / hook | PS colocated / hook | core-s/step: hook, PS, PS colocated |",
             "|---|---|---|" + "---|" * (len(SYSTEMS) + 3)]
    for (batch, variant), rs in sorted(runs.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        def med(f: Callable[[dict], float], rs: list[dict] = rs) -> float:
            return statistics.median(f(r) for r in rs)

        steps = [f"{med(lambda r, s=s: r[s]['median_s']):.3f}" for s in SYSTEMS]
        ps = med(lambda r: r["gp-int4"]["median_s"] / r["gp-int4-hook"]["median_s"])
        co = med(lambda r: r["gp-int4-coloc"]["median_s"] / r["gp-int4-hook"]["median_s"])
        cpu = ", ".join(f"{med(lambda r, s=s: r[s]['cpu']['busy']):.2f}"
                        for s in SYSTEMS[1:])
        lines.append(f"| {batch} | {variant} | {len(rs)} | " + " | ".join(steps)
                     + f" | {ps:.2f}x | {co:.2f}x | {cpu} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", action="append", required=True,
                   help="record name prefix (repeatable)")
    p.add_argument("--out", type=Path, help="also write the tables to OUT/README.md")
    args = p.parse_args(argv)
    text = []
    for prefix in args.prefix:
        runs = collect(prefix)
        if not runs:
            raise SystemExit(f"no records {RECORDS}/{prefix}-tfm-b*")
        text += [f"### {prefix}", "", SERIES.get(prefix, ""), "", *table(runs), ""]
    print("\n".join(text))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        head = ["# The PS path against the DDP hook, before and after buckets", "",
                "Transformer encoder `tfm` of `benchmarks/cluster.py` (12 layers, d=384, 148 "
                "tensors), 2 emulated hosts at 1 Gbit/s (network namespaces), one worker per "
                "host, int4 everywhere; PS: one server process per host; colocated: servers "
                "as threads in the workers. Records: `benchmarks/results/records/<series>-tfm-"
                "b<batch>-<variant>-<run>/` (command, commit, machine: a 2-core AMD EPYC VM). "
                "Medians over the runs of each run's median step; the ratios are taken within "
                "each run. Made by `" + " ".join(["python", "benchmarks/ps_buckets.py", *(
                    f"--prefix {x}" for x in args.prefix), "--out", str(args.out)]) + "`.", ""]
        (args.out / "README.md").write_text("\n".join(head + text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

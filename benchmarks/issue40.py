"""Issue 40's targets from the kept records of ``benchmarks/cluster.py`` runs.

Usage::

    python benchmarks/issue40.py                     # print the tables and the targets
    python benchmarks/issue40.py --write-results     # also put the cluster-tfm / cluster-mlp
                                                     # tables into benchmarks/results/
                                                     # performance.json (then results_md.py)

Steps:

1. For each model (``tfm``, ``mlp``), read ``benchmarks/results/records/<prefix>-<model>-<n>/``
   (``record.json`` and the ``cluster.json`` that ``cluster.py --json`` wrote; default prefix
   ``issue40-coloc``): one run each, interleaved with the other model's runs; every run
   measures all its systems one after the other in one invocation.
2. Per system: the run's median step time (what ``cluster.py`` prints), the median over the
   runs, and the per-step CPU of the run (``cluster.py``'s CPU table: core-seconds the machine
   was busy, the workers' main threads, the workers' other threads, everything else: server
   processes, the kernel's network work, other jobs).
3. The targets of the issue, each as the ratio of the medians over the runs and the ratio
   within each run (the systems of one run share the machine's state), met or not met.

No figure is typed here: every one is computed from the records and printed with its run
values; ``--write-results`` writes them, formatted as printed, into the results tables.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "results" / "records"
RESULTS = ROOT / "benchmarks" / "results" / "performance.json"
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = ("tfm", "mlp")
#: Which system is "the PS path" of the targets: the layout gradpress launch recommends on the
#: machine of the records (no spare cores: servers inside the workers), and the separate one.
PS = ("gp-onebit-coloc", "gp-onebit")
#: (model, numerator, denominator, at least, what): numerator / denominator >= at least, a
#: speed-up of the denominator's system; "at most" targets are written as their inverse.
TARGETS = (
    ("tfm", "gp-ddp-hook", "PS", 1 / 1.2, "PS path within 1.2x of the hook"),
    ("tfm", "ddp-fp16", "PS", 3.0, "PS path at least 3x faster than DDP fp16"),
    ("mlp", "ddp-fp16", "PS", 3.0, "PS path at least 3x faster than DDP fp16"),
    ("mlp", "ddp-powersgd1", "PS", 1.25, "PS path at least 1.25x faster than PowerSGD rank 1"),
    ("mlp", "ddp-fp16", "gp-ddp-hook", 3.0, "the hook at least 3x faster than DDP fp16"),
    ("mlp", "ddp-powersgd1", "gp-ddp-hook", 1.25,
     "the hook at least 1.25x faster than PowerSGD rank 1"),
)


def load_runs(model: str, prefix: str, records: Path = RECORDS) -> list[dict[str, Any]]:
    """The runs of ``model``: ``{"name", "record", "results"}`` per record
    ``<prefix>-<model>-<n>``, in run order."""
    return load_series(f"{prefix}-{model}", model, records)


def load_series(series: str, model: str, records: Path = RECORDS) -> list[dict[str, Any]]:
    """The runs of the records ``<series>-<n>`` (n a number) of ``model``."""
    import re

    runs = []
    dirs = [d for d in records.glob(f"{series}-*") if re.fullmatch(rf"{re.escape(series)}-\d+",
                                                                     d.name)]
    for d in sorted(dirs, key=lambda p: int(p.name.rsplit("-", 1)[1])):
        rec_path, res_path = d / "record.json", d / "cluster.json"
        if not (rec_path.is_file() and res_path.is_file()):
            raise ValueError(f"{d}: expected record.json and cluster.json")
        rec = json.loads(rec_path.read_text())
        if rec.get("exit_code") not in (0, 1):  # 1: a target of cluster.py's own table failed
            raise ValueError(f"{d}: the run failed (exit code {rec.get('exit_code')})")
        res = json.loads(res_path.read_text())["results"]["speed"][model]
        runs.append({"name": d.name, "record": rec, "results": res})
    return runs


def systems_of(runs: list[dict[str, Any]]) -> list[str]:
    """The systems every run measured, in the order of the first run."""
    return [s for s in runs[0]["results"] if all(s in r["results"] for r in runs)]


def medians(runs: list[dict[str, Any]], system: str) -> list[float]:
    return [r["results"][system]["median_s"] for r in runs]


def ratio(runs: list[dict[str, Any]], num: str, den: str) -> tuple[float, list[float]]:
    """``num``'s step over ``den``'s: of the medians over the runs, and per run."""
    a, b = medians(runs, num), medians(runs, den)
    return statistics.median(a) / statistics.median(b), [x / y for x, y in zip(a, b)]


def cpu(runs: list[dict[str, Any]], system: str, key: str) -> float:
    """The median over the runs of one CPU column (core-seconds per step)."""
    return statistics.median(r["results"][system]["cpu"][key] for r in runs)


def speed_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    """Per system: label, step median over the runs (per-run medians), vs DDP fp16, vs
    PowerSGD rank 1, host-link MB/step (median), core-s/step (median)."""
    import cluster

    out = []
    for s in systems_of(runs):
        m = medians(runs, s)
        per_run = ", ".join(f"{x:.3f}" for x in m)
        row = [cluster.LABELS[s], f"{statistics.median(m):.3f} ({per_run})"]
        for base in ("ddp-fp16", "ddp-powersgd1"):
            row.append(f"{ratio(runs, base, s)[0]:.2f}x" if base in systems_of(runs) else "-")
        row.append(f"{statistics.median(r['results'][s]['iface_mb'] for r in runs):.1f}")
        row.append(f"{cpu(runs, s, 'busy'):.3f}")
        out.append(row)
    return out


def cpu_rows(runs: list[dict[str, Any]]) -> list[list[str]]:
    """Per system, medians over the runs: cores busy, core-s/step, of it above the floor, the
    workers' main threads, their other threads, the rest (servers, kernel network, others)."""
    import cluster

    floor = cpu(runs, "local", "busy") if "local" in systems_of(runs) else None
    out = []
    for s in systems_of(runs):
        busy = cpu(runs, s, "busy")
        out.append([cluster.LABELS[s], f"{cpu(runs, s, 'busy_frac'):.0%}", f"{busy:.3f}",
                    "-" if floor is None or s == "local" else f"{busy - floor:+.3f}",
                    f"{cpu(runs, s, 'main'):.3f}", f"{cpu(runs, s, 'worker_other'):.3f}",
                    f"{cpu(runs, s, 'rest'):.3f}"])
    return out


def target_rows(all_runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """Per target and PS layout: measured (per run) and met / not met."""
    out = []
    for model, num, den, least, what in TARGETS:
        runs = all_runs.get(model)
        for d in (PS if den == "PS" else (den,)):
            if not runs or d not in systems_of(runs) or num not in systems_of(runs):
                out.append([f"{model}: {what}", d, "-", "not run"])
                continue
            med, per = ratio(runs, num, d)
            if least < 1:  # "within 1.2x": the PS step over the hook's
                shown, per_shown, ok = 1 / med, [1 / p for p in per], med >= least
            else:
                shown, per_shown, ok = med, per, med >= least
            out.append([f"{model}: {what}", d,
                        f"{shown:.2f}x (runs {', '.join(f'{p:.2f}' for p in per_shown)})",
                        "met" if ok else "not met"])
    return out


def vgg_rows(runs: list[dict[str, Any]], published: dict[str, str]) -> list[list[str]]:
    """The VGG row of the README (onebit's and PowerSGD rank 4's speed-up over DDP fp32) and
    onebit's step over the floor: median over the runs (per run), beside the published
    figure of the cluster-vgg table."""
    out = []
    for s in ("gp-onebit", "gp-onebit-coloc", "ddp-powersgd", "gp-ddp-hook"):
        if s not in systems_of(runs) or "ddp-fp32" not in systems_of(runs):
            continue
        med, per = ratio(runs, "ddp-fp32", s)
        pub = published.get(s, "-")
        verdict = "-" if pub == "-" else \
            ("at or above the published" if round(med, 2) >= float(pub.rstrip("x"))
             else "below the published")
        out.append([f"vgg: {s} speed-up vs DDP fp32", f"{med:.2f}x (runs "
                    f"{', '.join(f'{x:.2f}' for x in per)})", pub, verdict])
    if "local" in systems_of(runs) and "gp-onebit" in systems_of(runs):
        med, per = ratio(runs, "gp-onebit", "local")
        quiet = [r for r in runs if not disturbed_floor(r)]
        left = [r["name"] for r in runs if disturbed_floor(r)]
        note = f"; without {', '.join(left)} (its floor disturbed): " \
            f"{ratio(quiet, 'gp-onebit', 'local')[0]:.2f}x" if left and quiet else ""
        judged = ratio(quiet, "gp-onebit", "local")[0] if quiet else med
        out.append(["vgg: gp-onebit step / compute floor", f"{med:.2f}x (runs "
                    f"{', '.join(f'{x:.2f}' for x in per)}){note}", "at most 1.35x (issue 27)",
                    "met" if judged <= 1.35 else "not met"])
    return out


#: Core-seconds per step outside the workers during the compute floor above which another
#: process shared the machine (the floor runs nothing else: its "rest" is about 0).
FLOOR_REST_LIMIT = 0.05


def disturbed_floor(run: dict[str, Any]) -> bool:
    """Whether the run's compute floor (``local``) shared the machine with another process."""
    return run["results"].get("local", {}).get("cpu", {}).get("rest", 0.0) > FLOOR_REST_LIMIT


def push_pull_runs(prefix: str, records: Path = RECORDS) -> list[tuple[str, float]]:
    """``(record, onebit's speed-up over none of the median steps, as push_pull.py printed
    it)`` of each ``push_pull.py --parts a --json`` record ``<prefix>-N``."""
    import re

    out = []
    for d in sorted(records.glob(f"{prefix}-*"), key=lambda p: p.name):
        rows = json.loads((d / "push_pull.json").read_text())
        found = [re.search(r"\(median ([0-9.]+)x\)", r[3]) for r in rows
                 if r[0] == "(a) onebit"]
        if len(found) != 1 or found[0] is None:
            raise ValueError(f"{d}: no '(a) onebit' row with a median speed-up")
        out.append((d.name, float(found[0].group(1))))
    return out


def push_pull_row(runs: list[tuple[str, float]]) -> list[str]:
    """The 25 MB push_pull target: onebit at least 25x faster than none (medians)."""
    per = [x for _, x in runs]
    med = statistics.median(per)
    return ["push_pull 25 MB: onebit's speed-up over none (median steps)", f"{med:.1f}x (runs "
            f"{', '.join(f'{x:.1f}' for x in per)})", "at least 25x (issue 27)",
            "met" if med >= 25 else "not met"]


def push_pull_100_rows(prefix: str, published: str,
                       records: Path = RECORDS) -> list[list[str]]:
    """The results table's push_pull row (100 MiB, 25 x 4 MiB tensors): onebit's speed-up over
    none as push_pull.py printed it (best steps, medians in brackets), one row per record
    ``<prefix>-N``, beside the published cell."""
    out = []
    for d in sorted(records.glob(f"{prefix}-*"), key=lambda p: p.name):
        rows = json.loads((d / "push_pull.json").read_text())
        got = [r[3].replace("speed-up vs none ", "") for r in rows if r[0] == "(a) onebit"]
        if len(got) != 1:
            raise ValueError(f"{d}: no '(a) onebit' row")
        best, pub = float(got[0].split("x")[0]), float(published.split("x")[0])
        out.append([f"push_pull 100 MiB ({d.name}): onebit's speed-up over none", got[0],
                    published, "at or above the published" if best >= pub
                    else "below the published"])
    return out


#: The VGG A/B on one machine: (record series, what ran) of each side.
AB = (("issue40-vgg-ab-39086c0", "39086c0 (the published VGG row's commit)"),
      ("issue40-vgg-ab-head", "this branch"))


def ab_rows(records: Path = RECORDS) -> list[list[str]]:
    """Per side of the A/B: onebit's speed-up over DDP fp32, its step over the floor and its
    time above the floor, medians over the runs (per run)."""
    out = []
    for series, what in AB:
        runs = load_series(series, "vgg", records)
        if not runs:
            continue
        up, ups = ratio(runs, "ddp-fp32", "gp-onebit")
        fl, fls = ratio(runs, "gp-onebit", "local")
        above = [a - b for a, b in zip(medians(runs, "gp-onebit"), medians(runs, "local"))]
        out.append([what, f"{up:.2f}x ({', '.join(f'{x:.2f}' for x in ups)})",
                    f"{fl:.2f}x ({', '.join(f'{x:.2f}' for x in fls)})",
                    f"{statistics.median(above):.3f} ({', '.join(f'{x:.3f}' for x in above)})"])
    return out


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


SPEED_HEAD = ["system", "s/step, median of runs (runs)", "speed-up vs DDP + fp16 hook",
              "speed-up vs DDP + PowerSGD hook (rank 1)", "MB/step on host link",
              "core-s/step"]
CPU_HEAD = ["system", "cores busy", "core-s/step", "over the floor", "workers' main threads",
            "workers' other threads", "rest (servers, kernel network, other jobs)"]
TITLES = {
    "tfm": "End-to-end training step, transformer encoder (12 layers, d=384, 22.1M parameters "
           "in 148 tensors), 2 emulated hosts at 1 Gbit/s each (network namespaces on one "
           "2-core machine)",
    "mlp": "End-to-end training step, MLP (25.2M parameters, 100 MB of fp32 gradients), 2 "
           "emulated hosts at 1 Gbit/s each (network namespaces on one 2-core machine)",
}
SETTINGS = {
    "tfm": "batch 4 x 64 tokens per worker",
    "mlp": "batch 8 per worker",
}


def results_table(model: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``cluster-<model>`` table of performance.json from the runs."""
    recs = [r["record"] for r in runs]
    commits = sorted({r["commit"][:7] for r in recs})
    loads = [x for r in recs for x in (r["load_before"][0], r["load_after"][0])]
    cpus = sorted({r["machine"]["cpu"] for r in recs})
    dates = sorted({r["started"][:10] for r in recs})
    names = ", ".join(r["name"] for r in runs)
    return {
        "id": f"cluster-{model}",
        "title": TITLES[model],
        "source": {"path": "benchmarks/results/issue40/README.md",
                   "section": f"records {names}"},
        "date": ", ".join(dates),
        "commit": ", ".join(commits),
        "machine": f"2 emulated hosts: network namespaces joined by 1 Gbit/s veth links, on "
                   f"one {recs[0]['machine']['cores']}-core {' / '.join(cpus)} machine (no GPU), "
                   f"load average {min(loads)}-{max(loads)}",
        "setting": f"{len(runs)} interleaved runs (records {names}), each measuring every "
                   f"system one after the other; one worker per host (the gradpress PS path: "
                   f"and one server per host, as a process or, colocated, as threads inside the "
                   f"worker), {SETTINGS[model]}, the same optimizer (CLAN, fused step) in "
                   f"every system, gradpress at its defaults (`min_compress_bytes=\"auto\"`). "
                   f"s/step: the median over the runs of each run's median over 5 timed steps "
                   f"(each run's in brackets); speed-ups: ratios of those medians; MB and "
                   f"core-seconds: medians over the runs.",
        "commands": [r["command"] for r in recs],
        "columns": SPEED_HEAD,
        "rows": speed_rows(runs),
    }


def write_results(tables: list[dict[str, Any]], path: Path = RESULTS) -> None:
    """Replace (or add after cluster-bert) the tables of the same ids in performance.json."""
    doc = json.loads(path.read_text())
    ids = [t["id"] for t in doc["tables"]]
    for t in tables:
        if t["id"] in ids:
            doc["tables"][ids.index(t["id"])] = t
        else:
            at = ids.index("cluster-bert") + 1 if "cluster-bert" in ids else len(ids)
            doc["tables"].insert(at, t)
        ids = [x["id"] for x in doc["tables"]]
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefix", default="issue40-coloc", help="record names: PREFIX-MODEL-N")
    p.add_argument("--checks-prefix", default="issue40",
                   help="the no-regression records: PREFIX-vgg-N (cluster.py) and "
                        "PREFIX-pushpull25-N (push_pull.py --parts a --tensors 1 --mib 24)")
    p.add_argument("--write-results", action="store_true",
                   help="put the cluster-MODEL tables into benchmarks/results/performance.json")
    args = p.parse_args(argv)
    all_runs = {m: runs for m in MODELS if (runs := load_runs(m, args.prefix))}
    if not all_runs:
        print(f"no records {args.prefix}-MODEL-N under {RECORDS}", file=sys.stderr)
        return 1
    for model, runs in all_runs.items():
        names = ", ".join(r["name"] for r in runs)
        print(f"\n{model}: {len(runs)} runs ({names})\n")
        print("\n".join(table(SPEED_HEAD, speed_rows(runs))))
        print(f"\nCPU per step, {model} (core-seconds, medians over the runs):\n")
        print("\n".join(table(CPU_HEAD, cpu_rows(runs))))
    print("\ntargets of issue 40 (ratios of the medians over the runs; per run in brackets):\n")
    print("\n".join(table(["target", "PS system", "measured", "result"],
                          target_rows(all_runs))))
    checks = []
    vgg_runs = load_runs("vgg", args.checks_prefix)
    if vgg_runs:
        import readme_figures
        import results_md

        sections = results_md.load_results()
        pub = {s: readme_figures.cell(sections, "cluster-vgg", "speed-up vs DDP fp32",
                                      system=lbl)
               for s, lbl in (("gp-onebit", "gradpress onebit"),
                              ("ddp-powersgd", "DDP + PowerSGD hook (rank 4)"),
                              ("gp-ddp-hook", "DDP + gradpress two-way onebit hook"))}
        checks += vgg_rows(vgg_runs, pub)
    if pp := push_pull_runs(f"{args.checks_prefix}-pushpull25"):
        checks.append(push_pull_row(pp))
    if any(RECORDS.glob(f"{args.checks_prefix}-pushpull100-*")):
        import readme_figures
        import results_md

        pub_pp = readme_figures.cell(results_md.load_results(), "push-pull",
                                     "speed-up vs none", codec="onebit")
        checks += push_pull_100_rows(f"{args.checks_prefix}-pushpull100", pub_pp)
    if checks:
        print(f"\nno-regression checks ({args.checks_prefix}-vgg-N, "
              f"{args.checks_prefix}-pushpull25-N, {args.checks_prefix}-pushpull100-N):\n")
        print("\n".join(table(["check", "measured", "published / target", "result"], checks)))
    if ab := ab_rows():
        print("\nVGG A/B on this machine (records " + ", ".join(f"{a}-N" for a, _ in AB)
              + "; min_compress_bytes 1 MiB, runs interleaved):\n")
        print("\n".join(table(["code", "onebit speed-up vs DDP fp32 (runs)",
                                "onebit step / floor (runs)",
                                "onebit s/step above the floor (runs)"], ab)))
    if args.write_results:
        write_results([results_table(m, r) for m, r in all_runs.items()])
        print(f"\nwrote {', '.join(f'cluster-{m}' for m in all_runs)} into "
              f"{RESULTS.relative_to(ROOT)}; now run python benchmarks/results_md.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())

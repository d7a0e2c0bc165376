"""Proof of no change: record the demo's and the bundled tasks' losses and figures, compare two.

Usage::

    python benchmarks/no_change.py record --src PATH --out FILE.json [--quick] [--work DIR]
    python benchmarks/no_change.py compare A.json B.json [--expect-changed NAME ...]

``record`` runs the checkout whose ``src`` directory is ``--src`` (set as ``PYTHONPATH``, which
every worker and server process inherits) through its command line only, with options that
every version of ``gradpress`` since 0.1 accepts:

* ``demo``: ``gradpress demo --no-progress`` at full length (three digits-cnn runs in one
  cluster: uncompressed, CLAN onebit, CLAN topk 0.1% fp16);
* ``task/NAME``: ``gradpress train --task NAME --steps 200 --no-progress`` for every bundled
  task, default options;
* ``variant/...``: a few runs for 200 steps that exercise the compressed path (see ``VARIANTS``).

From each run directory it keeps what must not change: every per-step record of
``metrics.jsonl`` (loss, lr, epoch, bytes pushed, pulled and dense; floats as their exact
``repr``), the eval records, the summary's step counts, and the figures of ``report.json`` named
in ``REPORT_KEYS`` (final eval, final training loss, bytes on the wire, compression ratios,
replica check). Timings (wall, per step, per stage), the configuration echo and the resolved
hyper-parameters are left out: the first vary from run to run, the others are named after options
that this refactor renames (``uncompressed_steps``, ``freeze_step``); their effect is covered by
the per-step lr and bytes, which show the schedule and where compression begins. Every process
runs with one torch thread (``OMP_NUM_THREADS=1``) so that the float results do not depend on
the number of cores of the machine.

A record takes about 8 minutes on two busy cores (the demo about 1, each stdlib-mlm run about
2). ``benchmarks/results/no_change/`` holds the record of the code before the public-surface
refactor and how to check a later checkout against it.

``compare`` prints per run whether losses and figures are bit-identical, else the first step
where they differ, and exits 1 on any difference; runs named (or matched, fnmatch patterns) by
``--expect-changed`` are listed as deliberately changed instead.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STEPS = 200
QUICK_STEPS = 20
TASKS = ("digits-cnn", "stdlib-mlm")
#: compressed runs (name, task, extra options), each for STEPS steps
VARIANTS = (
    ("digits-cnn/onebit-clan", "digits-cnn", ("--compression", "onebit", "--optimizer", "clan")),
    ("digits-cnn/topk-2servers", "digits-cnn",
     ("--compression", "topk:k=0.001,values=fp16", "--servers", "2")),
    ("digits-cnn/onebit-adam", "digits-cnn", ("--compression", "onebit", "--optimizer",
                                              "onebit-adam")),
    ("digits-cnn/onebit-ef-none", "digits-cnn", ("--compression", "onebit", "--ef", "none",
                                                 "--seed", "1")),
    ("stdlib-mlm/onebit-clan", "stdlib-mlm", ("--compression", "onebit", "--optimizer", "clan")),
    ("stdlib-mlm/onebit-lans", "stdlib-mlm", ("--compression", "onebit", "--optimizer",
                                              "onebit-lans")),
)
#: per-step fields of metrics.jsonl that must not change
STEP_KEYS = ("loss", "lr", "epoch", "bytes_pushed", "bytes_pulled", "dense_fp32_bytes")
#: fields of the summary record of metrics.jsonl that must not change
SUMMARY_KEYS = ("status", "steps", "task", "epochs", "steps_per_epoch", "batch_size",
                "total_steps", "replicas_identical", "params", "codec")
#: figures of report.json that must not change
REPORT_KEYS = ("status", "steps", "params", "replicas_identical", "metric", "final_eval", "evals",
               "final_train_loss", "bytes_per_step", "bytes_total", "model_ratio_vs_fp32",
               "model_ratio_vs_fp16", "codec", "compressed_ratio_vs_fp32",
               "compressed_ratio_vs_fp16")
TIMEOUT_S = 1800


# -- record -------------------------------------------------------------------------------------
def plan(quick: bool) -> list[tuple[str, list[str]]]:
    """The runs of a record: (name, gradpress arguments without ``--out``)."""
    steps = str(QUICK_STEPS if quick else STEPS)
    demo = ["demo", "--no-progress"] + (["--steps", steps] if quick else [])
    runs = [("demo", demo)]
    runs += [(f"task/{t}", ["train", "--task", t, "--steps", steps, "--no-progress"])
             for t in TASKS]
    runs += [(f"variant/{name}", ["train", "--task", task, "--steps", steps, "--no-progress",
                                  *extra]) for name, task, extra in VARIANTS]
    return runs


def entry_point(src: Path) -> str:
    """``module:function`` of the ``gradpress`` script in the checkout's pyproject.toml."""
    pyproject = src.parent / "pyproject.toml"
    text = pyproject.read_text() if pyproject.is_file() else ""
    m = re.search(r'^gradpress\s*=\s*"([\w.]+:\w+)"', text, re.MULTILINE)  # [project.scripts]
    return m.group(1) if m else "gradpress.cli:main"


def run_env(src: Path) -> dict[str, str]:
    """The environment of every run: ``PYTHONPATH=src`` and one torch thread per process."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def check_import(src: Path, env: dict[str, str]) -> str:
    """Where ``gradpress`` is imported from under ``env``; ValueError if not from ``src``."""
    out = subprocess.run([sys.executable, "-c", "import gradpress; print(gradpress.__file__)"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(src.resolve()):
        raise ValueError(f"--src {str(src)!r}: gradpress is imported from {out!r} instead; "
                         "expected a checkout's src directory holding the gradpress package")
    return out


def git_commit(src: Path) -> str | None:
    """The commit (with ``+dirty`` for local changes) of the checkout holding ``src``."""
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if dirty else "")


def run_one(entry: str, args: list[str], out: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``gradpress ARGS --out OUT``; the exit code, the seconds taken and the output's tail."""
    mod, func = entry.split(":")
    code = f"import sys; from {mod} import {func} as m; sys.exit(m())"
    cmd = [sys.executable, "-c", code, *args, "--out", str(out)]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-2000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = None, f"timed out after {e.timeout} s"
    return {"exit_code": rc, "seconds": round(time.perf_counter() - t0, 1), "tail": tail}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl (none if it is missing)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def collect(run_dir: Path) -> dict[str, Any]:
    """The figures of one run directory that must not change."""
    recs = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in recs if r.get("kind") == "step"]
    per_step = {"step": [r.get("step") for r in steps]}
    per_step.update({k: [r.get(k) for r in steps] for k in STEP_KEYS})
    evals = [{k: r.get(k) for k in ("step", "metrics", "primary", "higher_is_better")}
             for r in recs if r.get("kind") == "eval"]
    summaries = [r for r in recs if r.get("kind") == "summary"]
    summary = {k: summaries[-1].get(k) for k in SUMMARY_KEYS} if summaries else None
    report_path = run_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    return {"per_step": per_step, "evals": evals, "summary": summary,
            "report": {k: report.get(k) for k in REPORT_KEYS} if report else None}


def run_dirs(name: str, out: Path) -> dict[str, Path]:
    """The run directories one command wrote: the demo's three, or ``out`` itself."""
    if name != "demo":
        return {name: out}
    return {f"demo/{d.name}": d for d in sorted(out.iterdir()) if (d / "metrics.jsonl").is_file()}


def record(src: Path, out_file: Path, quick: bool, work: Path) -> int:
    """Run every run of :func:`plan` on the checkout ``src`` and write the figures to JSON."""
    env, entry = run_env(src), entry_point(src)
    meta = {"src": str(src), "commit": git_commit(src), "imported": check_import(src, env),
            "entry_point": entry, "quick": quick, "steps": QUICK_STEPS if quick else STEPS,
            "python": platform.python_version(), "torch": _torch_version(env),
            "machine": platform.machine(), "threads": env["OMP_NUM_THREADS"]}
    runs: dict[str, Any] = {}
    commands: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name, args in plan(quick):
        out = work / name.replace("/", "__")
        res = run_one(entry, args, out, env)
        print(f"{name}: exit {res['exit_code']} in {res['seconds']} s", flush=True)
        commands[name] = {"args": args, **res}
        if res["exit_code"] != 0:
            print(res["tail"], file=sys.stderr)
        for run, d in (run_dirs(name, out) if out.is_dir() else {}).items():
            runs[run] = {"exit_code": res["exit_code"], **collect(d)}
        if name == "demo" or name not in runs:  # the demo's own status, or a run that failed
            runs[name] = {"exit_code": res["exit_code"], "status": _status(out)}
    meta["record_s"] = round(time.perf_counter() - t0, 1)
    doc = {"meta": meta, "commands": commands, "runs": runs}
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(runs)} runs in {meta['record_s']} s -> {out_file}")
    return 0 if all(c["exit_code"] == 0 for c in commands.values()) else 1


def _status(out: Path) -> str | None:
    """The ``status`` of ``out/report.json`` (None without one)."""
    path = out / "report.json"
    return json.loads(path.read_text()).get("status") if path.is_file() else None


def _torch_version(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                          env=env, capture_output=True, text=True, check=True).stdout.strip()


# -- compare ------------------------------------------------------------------------------------
def first_step_difference(a: dict[str, list], b: dict[str, list]) -> str | None:
    """The first step where two per-step tables differ (field, step, both values), else None."""
    steps_a, steps_b = a.get("step", []), b.get("step", [])
    n = min(len(steps_a), len(steps_b))
    for i in range(n):
        for k in sorted(set(a) | set(b)):
            va, vb = _at(a.get(k), i), _at(b.get(k), i)
            if va != vb or type(va) is not type(vb):
                return f"step {steps_a[i]}: {k} {va!r} vs {vb!r}"
    if len(steps_a) != len(steps_b):
        return f"step count {len(steps_a)} vs {len(steps_b)} (equal up to step {n})"
    return None


def _at(col: list | None, i: int) -> Any:
    return col[i] if col is not None and i < len(col) else "<missing>"


def diff_paths(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths (``report.final_eval.test_loss``) where two JSON values differ, bit for bit."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b)):
            out += diff_paths(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in diff_paths(x, y, f"{path}[{i}]")]
    same = a == b and type(a) is type(b)
    return [] if same else [f"{path.lstrip('.')}: {_short(a)} vs {_short(b)}"]


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 80 else s[:77] + "..."


def compare_run(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    """Why run ``a`` and run ``b`` are not bit-identical (empty when they are)."""
    if a is None or b is None:
        return ["missing in " + ("A" if a is None else "B")]
    problems = []
    step = first_step_difference(a.get("per_step", {}), b.get("per_step", {}))
    if step:
        problems.append(f"per-step records differ first at {step}")
    rest = {k: v for k, v in a.items() if k != "per_step"}
    other = {k: v for k, v in b.items() if k != "per_step"}
    problems += diff_paths(rest, other)
    return problems


def compare(a_file: Path, b_file: Path, expect_changed: list[str]) -> int:
    """Print the verdict per run; 1 on a difference not named in ``expect_changed``."""
    a, b = json.loads(a_file.read_text()), json.loads(b_file.read_text())
    for key in ("quick", "steps", "torch", "machine", "threads"):
        if a["meta"].get(key) != b["meta"].get(key):
            print(f"warning: meta.{key} differs: {a['meta'].get(key)!r} vs {b['meta'].get(key)!r}")
    print(f"A: {a_file} (commit {a['meta'].get('commit')})\n"
          f"B: {b_file} (commit {b['meta'].get('commit')})")
    failed = changed = 0
    for name in sorted(set(a["runs"]) | set(b["runs"])):
        problems = compare_run(a["runs"].get(name), b["runs"].get(name))
        expected = any(fnmatch.fnmatchcase(name, pat) for pat in expect_changed)
        if not problems:
            n = len((a["runs"][name].get("per_step") or {}).get("step", []))
            what = f"{n} steps" if n else "exit code and status"
            print(f"  identical   {name} ({what})" + ("  [expected a change]" if expected
                                                      else ""))
            continue
        changed += expected
        failed += not expected
        print(f"  {'CHANGED' if expected else 'DIFFERENT':11s} {name}"
              + (" (deliberately changed)" if expected else ""))
        for p in problems[:8]:
            print(f"      {p}")
        if len(problems) > 8:
            print(f"      ... and {len(problems) - 8} more")
    verdict = "FAIL" if failed else "OK"
    print(f"{verdict}: {failed} run(s) differ unexpectedly, {changed} deliberately changed")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """``record`` or ``compare``, see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the checkout and write its figures to JSON")
    r.add_argument("--src", type=Path, required=True, help="the checkout's src directory")
    r.add_argument("--out", type=Path, required=True, help="JSON file to write")
    r.add_argument("--quick", action="store_true",
                   help=f"{QUICK_STEPS} steps per run, demo included: a smoke check of this "
                        "script only (the clan runs do not leave their dense phase)")
    r.add_argument("--work", type=Path, help="keep the run directories here (default: a "
                                             "temporary directory, removed afterwards)")
    c = sub.add_parser("compare", help="compare two records")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--expect-changed", nargs="+", default=[], metavar="NAME",
                   help="runs (names or fnmatch patterns) that are changed on purpose")
    args = parser.parse_args(argv)
    if args.cmd == "compare":
        return compare(args.a, args.b, args.expect_changed)
    src = args.src.expanduser().resolve()
    if args.work is not None:
        return record(src, args.out, args.quick, args.work)
    work = Path(tempfile.mkdtemp(prefix="gradpress-no-change-"))
    try:
        return record(src, args.out, args.quick, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

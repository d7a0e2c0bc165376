"""The accuracy targets of issues 26 and 38 ("accuracy at the defaults", "accuracy that
transfers"): one command reruns them.

Usage::

    python benchmarks/targets.py --write          # run what is missing (hours), write the table
    python benchmarks/targets.py --dry-run        # only the commands of the missing runs
    python benchmarks/targets.py --targets onebit-mlm-800 --seeds 0 --collect-only  # no runs

Steps:

1. Each target of :data:`TARGETS` (task, length, the recommended method's codec, threshold)
   becomes two ``gradpress train`` runs per seed on 2 workers: the baseline, uncompressed LANS
   on the bundled task (``--task``), and the method, ``gp.OneBitLANS`` at its defaults in
   script mode (``benchmarks/clan_script.py``), with the task's lr warm-up given explicitly
   (script mode has no task, hence no warm-up of its own). digits-cnn runs the task's default
   epochs: ``--epochs`` for the baseline, the same as ``--steps`` for the method (a script's
   session counts steps only). Run directories:
   ``OUT/<task>/<optimizer>_<codec>_st<steps>[_<schedule>][_lr<x>x][_w<n>][_b<n>]_s<seed>``;
   targets share their baselines. A target may set the lr schedule, an lr scale, the workers
   and the per-worker batch of both runs (issue 38's); on a task with embedding rows never in
   training (``stdlib-words``) the runs keep their final models (``--checkpoint-every``,
   ``--save-model``).
2. Run every run without a completed ``report.json``, one after the other (unless
   ``--collect-only``; ``--dry-run`` prints the commands only), with ``convergence.execute``.
3. Per seed, the method's gap to the baseline of the same seed: ``100 * (val_loss /
   baseline val_loss - 1)`` for the transformers, ``test accuracy - baseline`` in points for
   digits-cnn. A target is met when every seed's gap is within its threshold and, where
   required, every method run's whole-run ratio vs fp32 (``model_ratio_vs_fp32``) is at least
   ``min_ratio``, and, where the task has rows never in training, the method's mean norm of
   those rows is within :data:`ROW_TOLERANCE` of the baseline's. The lr sweep's targets
   (``stable_only``) ask only that no method run diverges (:func:`diverged`) where its
   baseline does not; their gaps are reported all the same. A target is incomplete while a run
   is missing, and not run while all are.
4. Print one table (and the commands of the first seed); with ``--write``, put it as the table
   ``targets`` into ``benchmarks/results/accuracy.json`` and re-render ``docs/results.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
import results_md
import row_drift
from convergence import CODECS, STUDY_SCRIPT, Run, completed, execute, lr_for

#: Worker processes of every run (``gradpress train``'s default).
WORKERS = 2
#: Weight decay of both kinds of runs.
WEIGHT_DECAY = 0.01
#: The headline metric of each unit, a key of the report's ``final_eval``.
METRIC = {"%": "val_loss", "points": "test_accuracy"}
#: How a gap of each unit is written.
SUFFIX = {"%": "%", "points": " pts"}
#: Codec spec -> the grid's short name, which names run directories (``topk``).
SHORT = {spec: name for name, spec in CODECS.items()}
#: The rows of symbols absent from training may move this much (their mean norm, as a
#: fraction of LANS's) where a task has them (issue 38).
ROW_TOLERANCE = 0.10
#: A run diverged when its final validation loss is this many times its best evaluation, or
#: is not finite (the lr sweep's requirement, issue 38).
DIVERGED = 1.10
#: Where ``--write`` puts the table.
TABLE_ID, RESULTS_FILE = "targets", "accuracy.json"


@dataclass(frozen=True)
class Target:
    """One accuracy target: the method within ``threshold`` of LANS on every seed."""

    name: str
    task: str
    steps: int | None  # None: the task's default length (its epochs on WORKERS workers)
    codec: str         # the method's compression spec
    threshold: float   # the gap allowed: percent of val_loss, or points of accuracy
    unit: str          # "%" or "points"
    seeds: tuple[int, ...] = (0, 1, 2)
    min_ratio: float | None = None  # whole-run bytes vs fp32 the method must reach
    schedule: str | None = None     # the lr schedule of both runs (None: gradpress train's)
    lr_scale: float = 1.0           # times the grid's lr, on both runs (the lr sweep)
    workers: int = WORKERS
    batch_size: int | None = None   # per worker, on both runs (None: the task's)
    stable_only: bool = False       # only: no divergence where LANS does not (the lr sweep)
    #: The method's optimizer: ``onebit-lans`` (``gp.OneBitLANS`` through the script), or an
    #: optimizer run as it is behind ``gradpress train``'s codec (issue 51's default route).
    optimizer: str = "onebit-lans"
    base_optimizer: str = "lans"    # the uncompressed baseline's optimizer

    @property
    def suffix(self) -> str:
        """What the run directories add for a schedule, lr scale or worker count of its own."""
        return ((f"_{self.schedule}" if self.schedule else "")
                + (f"_lr{self.lr_scale:g}x" if self.lr_scale != 1.0 else "")
                + (f"_w{self.workers}" if self.workers != WORKERS else "")
                + (f"_b{self.batch_size}" if self.batch_size else ""))


_TOPK = "topk:k=0.001,values=fp16"
#: The targets of issue 26, then issue 38's.
TARGETS: tuple[Target, ...] = (
    Target("none-mlm", "stdlib-mlm", 800, "none", 1.0, "%"),
    Target("none-lm", "stdlib-lm", 800, "none", 1.0, "%"),
    # issue 38 withdrew the 800-step byte target (a fixed dense phase cannot pay for itself)
    Target("onebit-mlm-800", "stdlib-mlm", 800, "onebit", 3.0, "%"),
    *(Target(f"onebit-mlm-{n}", "stdlib-mlm", n, "onebit", 3.0, "%", min_ratio=8.0)
      for n in (1600, 3200)),
    Target("topk-mlm-1600", "stdlib-mlm", 1600, _TOPK, 5.0, "%"),
    Target("onebit-lm-800", "stdlib-lm", 800, "onebit", 3.0, "%"),
    Target("onebit-digits", "digits-cnn", None, "onebit", 1.0, "points"),
    # issue 38: a post-LN word-level model nobody tuned on, at a constant lr (no schedule)
    Target("onebit-words-1000", "stdlib-words", 1000, "onebit", 3.0, "%", min_ratio=4.0,
           schedule="constant"),
    # the lr sweep: wherever LANS does not diverge, the defaults do not either (gaps reported)
    *(Target(f"onebit-words-1000-lr{x:g}x", "stdlib-words", 1000, "onebit", 3.0, "%",
             schedule="constant", lr_scale=x, stable_only=True) for x in (0.5, 2.0)),
    Target("onebit-words-1000-w4", "stdlib-words", 1000, "onebit", 3.0, "%",
           schedule="constant", workers=4, batch_size=8),  # the same global batch
    Target("onebit-words-4000", "stdlib-words", 4000, "onebit", 3.0, "%", min_ratio=8.0,
           schedule="constant"),
    # issue 38: 4x the longest target above, at a constant lr
    *(Target(f"onebit-{short}-12800", task, 12800, "onebit", 3.0, "%", min_ratio=8.0,
             schedule="constant")
      for short, task in (("mlm", "stdlib-mlm"), ("lm", "stdlib-lm"), ("words", "stdlib-words"))),
    # issue 51: the default, LANS as it is on two-way int4 gradients, against LANS; issue 38's
    # 12800-step targets are withdrawn (above: the record of the 32x option)
    *(Target(f"int4-mlm-{n}", "stdlib-mlm", n, "int4", 1.0, "%", min_ratio=7.5,
             optimizer="lans") for n in (800, 1600, 3200)),
    Target("int4-lm-800", "stdlib-lm", 800, "int4", 1.0, "%", min_ratio=7.5, optimizer="lans"),
    Target("int4-digits", "digits-cnn", None, "int4", 0.3, "points", min_ratio=7.5,
           optimizer="lans"),
    Target("int4-words-1000", "stdlib-words", 1000, "int4", 1.0, "%", min_ratio=7.5,
           schedule="constant", optimizer="lans"),
    *(Target(f"int4-words-1000-lr{x:g}x", "stdlib-words", 1000, "int4", 1.0, "%",
             min_ratio=7.5, schedule="constant", lr_scale=x, optimizer="lans")
      for x in (0.5, 2.0)),
    Target("int4-words-1000-w4", "stdlib-words", 1000, "int4", 1.0, "%", min_ratio=7.5,
           schedule="constant", workers=4, batch_size=8, optimizer="lans"),
    Target("int4-words-4000", "stdlib-words", 4000, "int4", 1.0, "%", min_ratio=7.5,
           schedule="constant", optimizer="lans"),
    # issue 51: the same with AdamW as the wrapped optimizer, against AdamW uncompressed
    Target("int4-adamw-mlm-800", "stdlib-mlm", 800, "int4", 1.0, "%", min_ratio=7.5,
           optimizer="adam", base_optimizer="adam"),
)
#: Issue 51's frontier: bits against the gap, one seed per task (``--targets frontier-...``).
FRONTIER: tuple[Target, ...] = tuple(
    Target(f"frontier-{short}-{codec}", task, steps, codec, 1.0 if unit == "%" else 0.3, unit,
           seeds=(0,), optimizer="lans", schedule=schedule)
    for short, task, steps, unit, schedule in (
        ("lm-800", "stdlib-lm", 800, "%", None), ("digits", "digits-cnn", None, "points", None),
        ("words-1000", "stdlib-words", 1000, "%", "constant"))
    for codec in ("int2", "int3", "int8", "onebit"))


@dataclass(frozen=True)
class FactoryRun(Run):
    """The method's run: ``gp.OneBitLANS`` at its defaults through ``clan_script.py``."""

    warmup_steps: int = 0

    def command(self, python: str = "python", script: str = STUDY_SCRIPT) -> list[str]:
        """``gradpress train`` in script mode (the lr warm-up explicit: no task, no default);
        ``extra`` holds ``schedule`` and ``workers`` where a target sets them, and
        ``save-model`` for the script."""
        spec = CODECS[self.codec]
        extra = dict(self.extra)
        save = extra.pop("save-model", None)
        cli = [x for k, v in extra.items() for x in (f"--{k}", str(v))]
        return ["gradpress", "train", "--optimizer", self.optimizer, "--compression", spec,
                "--lr", f"{self.lr:g}", "--steps", str(self.steps),
                "--warmup-steps", str(self.warmup_steps), "--weight-decay", f"{WEIGHT_DECAY:g}",
                *cli, "--seed", str(self.seed), "--no-progress", "--out", str(self.out),
                "--", python, script, "--task", self.task, "--compression", spec,
                *(["--save-model", str(save)] if save else [])]


@cache
def _task(name: str) -> Any:
    from gradpress.tasks import get_task

    return get_task(name)


def length(t: Target) -> int:
    """Optimizer steps of the target's runs (a task's default length on WORKERS workers)."""
    if t.steps is not None:
        return t.steps
    task = _task(t.task)
    return task.defaults.total_steps(task.steps_per_epoch(WORKERS, task.defaults.batch_size))


def pair(t: Target, seed: int, out: Path) -> tuple[Run, Run]:
    """Step 1: the (baseline, method) runs of one seed."""
    steps, root = length(t), out / t.task
    epochs = _task(t.task).defaults.epochs if t.steps is None else None
    lr = lr_for(t.task, t.base_optimizer, "none") * t.lr_scale
    own = {k: v for k, v in (("schedule", t.schedule), ("workers", t.workers),
                             ("batch-size", t.batch_size))
           if v is not None and (k, v) != ("workers", WORKERS)}
    name = f"st{steps}{t.suffix}_s{seed}"
    rows = hasattr(_task(t.task), "unseen_in_training")  # benchmarks/row_drift.py's runs
    base_out = root / f"{t.base_optimizer}_none_{name}"
    base = Run(t.task, t.base_optimizer, "none", "base", seed, lr, None if epochs else steps,
               epochs, base_out, {"weight-decay": WEIGHT_DECAY, **own,
                                  **({"checkpoint-every": steps} if rows else {})})
    codec = SHORT[t.codec]
    if t.optimizer != "onebit-lans":  # the optimizer as it is, behind the codec (issue 51)
        lr = lr_for(t.task, t.optimizer, t.codec) * t.lr_scale
        return base, replace(base, optimizer=t.optimizer, codec=codec, lr=lr,
                             out=root / f"{t.optimizer}_{codec}_{name}")
    method_out = root / f"onebit-lans_{codec}_{name}"
    method = FactoryRun(t.task, "onebit-lans", codec, "factory", seed,
                        lr_for(t.task, "onebit-lans", codec) * t.lr_scale, steps, None,
                        method_out,
                        {**own, **({"save-model": method_out / "model.pt"} if rows else {})},
                        warmup_steps=_task(t.task).defaults.warmup_steps)
    return base, method


def all_runs(targets: Sequence[Target], out: Path) -> list[Run]:
    """Every run of ``targets``, each once (targets share baselines), in target order."""
    return list({r.out: r for t in targets for s in t.seeds for r in pair(t, s, out)}.values())


def value(rep: Mapping[str, Any], unit: str) -> float:
    """The report's final val_loss, or test accuracy in percent (KeyError: not in it)."""
    ev = rep.get("final_eval") or {rep["metric"]["name"]: rep["metric"]["value"]}
    v = float(ev[METRIC[unit]])
    return 100.0 * v if unit == "points" else v


def gap(method: Mapping[str, Any], base: Mapping[str, Any], unit: str) -> float:
    """Step 3: percent of the baseline's loss, or points of accuracy (negative: worse)."""
    m, b = value(method, unit), value(base, unit)
    return m - b if unit == "points" else 100.0 * (m / b - 1.0)


@dataclass(frozen=True)
class Outcome:
    """One target's result over its seeds."""

    target: Target
    done: int                       # completed runs
    total: int                      # runs needed
    gaps: dict[int, float]          # seed -> gap, for the seeds with both runs done
    ratios: dict[int, float]        # seed -> the method's whole-run ratio vs fp32
    status: str                     # "met", "not met (...)", "incomplete" or "not run"
    rows: dict[int, float] = field(default_factory=dict)  # seed -> unseen-row norm vs LANS


def within(t: Target, g: float) -> bool:
    """Whether a gap meets the target (a loss: <= threshold; an accuracy: >= -threshold; up to
    rounding: 2.06 / 2.0 - 1 is a little more than 0.03)."""
    return g <= t.threshold + 1e-9 if t.unit == "%" else g >= -t.threshold - 1e-9


def evaluate(t: Target, out: Path) -> Outcome:
    """Step 3: read the target's reports and judge it."""
    done, gaps, ratios, rows = 0, {}, {}, {}
    for seed in t.seeds:
        runs = pair(t, seed, out)
        base, method = (completed(r) for r in runs)
        done += (base is not None) + (method is not None)
        if method is not None:
            ratios[seed] = float(method["model_ratio_vs_fp32"])
        if base is not None and method is not None:
            gaps[seed] = gap(method, base, t.unit)
            drift = unseen_rows(*runs)
            if drift is not None:
                rows[seed] = drift
    total = 2 * len(t.seeds)
    if done < total:
        return Outcome(t, done, total, gaps, ratios, "incomplete" if done else "not run", rows)
    why = ([f"seed {s} diverged where LANS did not" for s in gaps
            if diverged(pair(t, s, out)[1]) and not diverged(pair(t, s, out)[0])]
           if t.stable_only else
           [f"seed {s} at {_gap(g, t.unit)}" for s, g in gaps.items() if not within(t, g)])
    why += [f"seed {s} unseen rows {r:.2f}x LANS's norm" for s, r in rows.items()
            if abs(r - 1.0) > ROW_TOLERANCE]
    if t.min_ratio is not None and min(ratios.values()) < t.min_ratio:
        why.append(f"bytes {min(ratios.values()):.2f}x < {t.min_ratio:g}x")
    return Outcome(t, done, total, gaps, ratios, f"not met ({'; '.join(why)})" if why else "met",
                   rows)


def diverged(run: Run) -> bool:
    """Whether a completed run's final validation loss is past :data:`DIVERGED` times its best
    evaluation (``evals`` of its report), or not finite."""
    rep = completed(run)
    if rep is None or "final_eval" not in rep:
        return False
    final = float(rep["final_eval"]["val_loss"])
    best = min([float(e["val_loss"]) for e in rep.get("evals", [])] + [final])
    return not math.isfinite(final) or final > DIVERGED * best


def unseen_rows(base: Run, method: Run) -> float | None:
    """The method's mean norm of the embedding rows never in training over the baseline's
    (``benchmarks/row_drift.py``), for tasks that have such rows and runs that kept models."""
    task = _task(base.task)
    if not hasattr(task, "unseen_in_training"):
        return None
    try:
        b, m = (row_drift.measured(r.out, task.unseen_in_training) for r in (base, method))
    except FileNotFoundError:
        return None
    return m["unseen_row_norm"] / b["unseen_row_norm"]


def _gap(g: float, unit: str) -> str:
    return f"{g:+.2f}{SUFFIX[unit]}"


def requirement(t: Target) -> str:
    """The target in words."""
    if t.stable_only:
        return (f"no divergence where LANS has none (final val_loss > {DIVERGED:g}x the run's "
                f"best); gap reported")
    text = f"gap {'≤ +' if t.unit == '%' else '≥ -'}{t.threshold:g}{SUFFIX[t.unit]}"
    return text + (f"; ≥ {t.min_ratio:g}x vs fp32" if t.min_ratio else "")


COLUMNS = ["target", "task", "steps", "codec", "requirement (every seed)", "runs",
           "gap per seed", "gap (mean ± std)", "method vs fp32", "unseen rows vs LANS",
           "result"]


def row(o: Outcome) -> list[str]:
    """One table row (``-`` where nothing is measured yet)."""
    t, gaps = o.target, list(o.gaps.values())
    per = ", ".join(f"s{s} {_gap(g, t.unit)}" for s, g in o.gaps.items()) or "-"
    mean = "-"
    if gaps:
        sd = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        mean = f"{statistics.fmean(gaps):+.2f} ± {sd:.2f}{SUFFIX[t.unit]} (n={len(gaps)})"
    r = list(o.ratios.values())
    ratio = f"{statistics.fmean(r):.2f}x (min {min(r):.2f}x)" if r else "-"
    rows = ", ".join(f"s{s} {v:.2f}x" for s, v in o.rows.items()) or "-"
    return [t.name, t.task, str(length(t)), t.codec, requirement(t), f"{o.done}/{o.total}",
            per, mean, ratio, rows, o.status]


def markdown(rows: Sequence[Sequence[str]]) -> str:
    """The rows as a markdown table."""
    lines = [COLUMNS, ["---"] * len(COLUMNS), *rows]
    return "\n".join("| " + " | ".join(r) + " |" for r in lines)


def commands(targets: Sequence[Target], out: Path) -> list[str]:
    """The command lines of each target's first seed (baseline, then method), each once."""
    lines = [r.shell() for t in targets for r in pair(t, t.seeds[0], out)]
    return list(dict.fromkeys(lines))


def ratio_note(outcomes: Sequence[Outcome]) -> str:
    """Which lengths meet their byte-ratio requirement (the lowest of their method runs)."""
    parts = []
    for o in (o for o in outcomes if o.target.min_ratio is not None):
        low, need = min(o.ratios.values(), default=None), o.target.min_ratio
        parts.append(f"{o.target.name} " + ("not measured" if low is None else
                     f"{low:.2f}x ({'meets' if low >= need else 'misses'} {need:g}x)"))
    return ("Whole-run bytes vs fp32 of the method runs (dense phase included), lowest seed: "
            + "; ".join(parts) + ".") if parts else ""


def results_table(outcomes: Sequence[Outcome], argv: Sequence[str], out: Path) -> dict[str, Any]:
    """Step 4: the ``targets`` table of accuracy.json."""
    targets = [o.target for o in outcomes]
    m, head = record.machine(), record.git("rev-parse", "--short=10", "HEAD")
    if not head:
        raise ValueError("targets.py --write: no commit to record (git rev-parse HEAD failed; "
                         "run it in a git checkout)")
    return {
        "id": TABLE_ID,
        "title": "The accuracy targets of issues 26 and 38: the defaults against LANS",
        "source": {"path": "benchmarks/targets.py", "section": "the targets of issues 26, 38"},
        "date": datetime.date.today().isoformat(),
        "commit": f"{head} (the commit the table was written at; each run's own commit is not "
                  "kept)",
        "machine": f"{WORKERS} workers and 1 server, processes on one {m['cores']}-core "
                   f"{m['cpu']} machine ({m['memory']}, {m.get('gpu') or 'no GPU'}), the one the "
                   "table was written on; runs kept from earlier tables may come from another "
                   "machine of the same size",
        "setting": "2 workers, 1 server; per seed, uncompressed LANS (`--task`, the task's "
                   "lr warm-up) against `gp.OneBitLANS` with nothing but its defaults and the "
                   "codec shown (`benchmarks/clan_script.py` in script mode, `--warmup-steps` "
                   "set to the task's), weight decay 0.01 on both, lr from convergence.py's "
                   "table. Gap paired by seed: 100 x (val_loss / LANS's - 1), or test accuracy "
                   "minus LANS's in points for digits-cnn. Issue 38's targets (stdlib-words, a "
                   "post-LN word-level model nobody tuned on, and the 12800-step ones) run at a "
                   "constant lr (`--schedule constant`), some at 0.5x/2x the lr or on 4 workers "
                   "of batch 8; where the task has embedding rows never in training, their mean "
                   "norm must stay within 10% of LANS's (`benchmarks/row_drift.py`). A target is "
                   "met when every seed is inside it; incomplete while a run is missing, not run "
                   "while all are.",
        "commands": [shlex.join(["python", "benchmarks/targets.py",
                                 *(a for a in argv if a != "--collect-only")]),
                     *commands(targets, out)],
        "columns": COLUMNS, "rows": [row(o) for o in outcomes],
        "notes": ratio_note(outcomes)}


def write(table: Mapping[str, Any], results: Path, page: Path) -> None:
    """Step 4: replace (or add first) the table in ``results/accuracy.json``, keeping the rows
    of the targets this run did not evaluate (other tables reference them); render ``page``."""
    path = results / RESULTS_FILE
    data = json.loads(path.read_text())
    ids = [t["id"] for t in data["tables"]]
    if TABLE_ID in ids:
        rows = {r[0]: r for r in data["tables"][ids.index(TABLE_ID)]["rows"]}
        rows.update({r[0]: r for r in table["rows"]})
        order = [t.name for t in TARGETS]
        merged = sorted(rows.values(), key=lambda r: order.index(r[0]) if r[0] in order
                        else len(order))
        data["tables"][ids.index(TABLE_ID)] = {**table, "rows": merged}
    else:
        data["tables"].insert(0, dict(table))
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    page.write_text(results_md.render(results_md.load_results(results)))


def select(names: Sequence[str] | None, seeds: Sequence[int] | None) -> list[Target]:
    """The targets named (all by default), with ``seeds`` if given."""
    known = {t.name: t for t in (*TARGETS, *FRONTIER)}
    bad = [n for n in names or () if n not in known]
    if bad:
        raise ValueError(f"unknown target(s) {bad}; valid: {', '.join(known)}")
    chosen = [known[n] for n in names] if names else list(TARGETS)
    return [replace(t, seeds=tuple(seeds)) for t in chosen] if seeds else chosen


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", nargs="+", metavar="NAME", help="default: all")
    p.add_argument("--seeds", nargs="+", type=int, help="default: each target's (0 1 2)")
    p.add_argument("--out", type=Path, default=Path("runs/targets"),
                   help="root of the run directories (default runs/targets)")
    p.add_argument("--dry-run", action="store_true", help="print the missing runs' commands")
    p.add_argument("--collect-only", action="store_true", help="only tabulate existing runs")
    p.add_argument("--write", action="store_true",
                   help="write the table into benchmarks/results/accuracy.json and "
                        "re-render docs/results.md")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None, results: Path = results_md.RESULTS,
         page: Path = results_md.PAGE) -> int:
    """The command line; ``--write`` goes to ``results``/accuracy.json and ``page``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    try:
        targets = select(args.targets, args.seeds)
    except ValueError as e:
        print(f"targets.py: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run or not args.collect_only:
        execute(all_runs(targets, args.out), dry=args.dry_run)
    if args.dry_run:
        return 0
    outcomes = [evaluate(t, args.out) for t in targets]
    print(markdown([row(o) for o in outcomes]))
    print("\nCommands (first seed):\n\n" + "\n".join(
        f"    {c}" for c in commands(targets, args.out)))
    if args.write:
        write(results_table(outcomes, argv, args.out), results, page)
        print(f"wrote table {TABLE_ID!r} into {results / RESULTS_FILE}; rendered {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Convergence benchmark: codecs x optimizers x seeds through ``gradpress train``, one table.

Usage (each row of ``benchmarks/results/convergence-log-2026.md`` prints the command that
reproduces it)::

    python benchmarks/convergence.py --tasks digits-cnn --codecs none onebit topk \\
        --optimizers clan --seeds 0 1 2
    python benchmarks/convergence.py --tasks stdlib-mlm --codecs onebit --optimizers clan \\
        --steps 200 --variants base warmup50 corrected chunk16k
    python benchmarks/convergence.py --quick          # a tiny grid, about two minutes
    python benchmarks/convergence.py --collect-only   # table from the runs already on disk
    python benchmarks/convergence.py --tasks stdlib-mlm --codecs onebit --steps 200 \\
        --variants warmup50 --baseline lans_none_base_lr0.02   # gap to LANS, paired by seed

Steps:

1. Expand the grid (task x optimizer x codec x variant x seed) into run configurations; each
   gets a run directory ``OUT/<task>/<label>_s<seed>`` and a ``gradpress train`` command line
   (variants that use an optimizer's experiment switches run the bundled task through
   ``benchmarks/clan_script.py --method train``, see :func:`split_options`).
2. Run every configuration whose directory lacks a completed ``report.json`` (one after the
   other: each run already uses every core), unless ``--collect-only``.
3. Read the reports, group the seeds of one configuration, and print (and with ``--md`` write)
   a markdown table: metric mean +- std over seeds, lr, bytes per step per worker (push, after
   any uncompressed warm-up), the whole-model ratio measured on the wire, the ratio of the
   compressed tensors against fp16 (measured: the bytes of the small uncompressed tensors are
   taken off the measured total), and the command of the first seed; with ``--baseline``,
   also each row's gap to the baseline run of the same task, length and seed (mean +- std
   over the seeds both have: percent of the metric, or points for accuracies).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Short codec names of the grid -> codec specs (the issue's list).
CODECS: dict[str, str] = {
    "none": "none", "fp16": "fp16", "onebit": "onebit",
    "topk": "topk:k=0.001,values=fp16", "randomk": "randomk:k=0.01",
    "dithering": "dithering:s=7", "int2": "int2", "int3": "int3", "int4": "int4", "int8": "int8",
}
#: Optimizers behind a gradient codec (``--dense-steps`` is their dense phase; they ran with
#: the option ``uncompressed-steps`` when the study began).
GRADIENT_OPTIMIZERS = ("clan", "lans", "lamb", "adam")
#: Options of the variants that are experiment switches of the optimizer classes, not
#: ``gradpress train`` options: they go to ``benchmarks/clan_script.py --method train``.
STUDY_SWITCHES = ("no-blend", "no-precondition", "sends", "refresh-every", "variance")
#: The study's 1-bit LANS defaults when it began (``--optimizer onebit-lans`` then; today's
#: ``onebit-lans`` is the local second moment without the blend): every variant keeps its
#: meaning.
STUDY_DEFAULTS = {"onebit-lans": {"variance": "frozen", "blend": True}}
#: The script that runs a bundled task with experiment switches.
STUDY_SCRIPT = "benchmarks/clan_script.py"
#: 1-bit LANS's best settings on stdlib-mlm (benchmarks/results/convergence-log-2026.md 2.8):
#: position embedding exact, each worker's own second moment, residuals decaying with the
#: momentum.
_POS_LV_DECAY = {"uncompressed-params": "pos.weight", "variance": "local", "ef-decay": 0.9}
#: The same without the blend and with the servers' residuals kept (2.10); 2.11 varies ef-decay.
_SRV1 = {**_POS_LV_DECAY, "no-blend": True, "server-ef-decay": 1.0}
#: gp.CLAN's settings of 2.10 (every matrix compressed, 100 dense steps); 2.11 varies ef-decay.
_CLAN_SRV1 = {"variance": "local", "freeze-step": 100, "no-blend": True, "ef-decay": 0.9,
              "server-ef-decay": 1.0}
#: Remedy variants (``--variants``): extra ``gradpress train`` options and environment.
VARIANTS: dict[str, dict[str, Any]] = {
    "base": {},
    "noblend": {"args": {"no-blend": True}},
    "noprec": {"args": {"no-precondition": True}},
    "sendgrad": {"args": {"sends": "gradient"}},
    "noblend-noprec": {"args": {"no-blend": True, "no-precondition": True}},
    "ef21": {"args": {"ef": "ef21"}},
    "ef21-noblend": {"args": {"ef": "ef21", "no-blend": True}},
    "freeze100": {"args": {"freeze-step": 100}},
    "freeze320": {"args": {"freeze-step": 320}},
    "pos": {"args": {"uncompressed-params": "pos.weight"}},
    "r50": {"args": {"refresh-every": 50}},
    "pos-r50": {"args": {"uncompressed-params": "pos.weight", "refresh-every": 50}},
    "pos-r100": {"args": {"uncompressed-params": "pos.weight", "refresh-every": 100}},
    "pos-noblend": {"args": {"uncompressed-params": "pos.weight", "no-blend": True}},
    "decay": {"args": {"ef-decay": 0.9}},
    "lv": {"args": {"variance": "local"}},
    "lv-decay": {"args": {"variance": "local", "ef-decay": 0.9}},
    "pos-lv": {"args": {"uncompressed-params": "pos.weight", "variance": "local"}},
    "pos-lv-decay": {"args": _POS_LV_DECAY},
    "pos-lv-decay-noblend": {"args": {**_POS_LV_DECAY, "no-blend": True}},
    "pos-lv-decay08": {"args": {**_POS_LV_DECAY, "ef-decay": 0.8}},
    "pos-lv-decay-noblend-srv1": {"args": _SRV1},
    "pos-lv-decay05-noblend-srv1": {"args": {**_SRV1, "ef-decay": 0.5}},
    "pos-lv-decay07-noblend-srv1": {"args": {**_SRV1, "ef-decay": 0.7}},
    "pos-lv-decay08-noblend-srv1": {"args": {**_SRV1, "ef-decay": 0.8}},
    "pos-lv-decay08-noblend-srv1-freeze100": {"args": {**_SRV1, "ef-decay": 0.8,
                                                       "freeze-step": 100}},
    "pos-lv-decay08-noblend-srv1-freeze160": {"args": {**_SRV1, "ef-decay": 0.8,
                                                       "freeze-step": 160}},
    "pos-lv-decay08-noblend-srv1-freeze160-wd001": {"args": {**_SRV1, "ef-decay": 0.8,
                                                             "freeze-step": 160,
                                                             "weight-decay": 0.01}},
    "pos-lv-decay08anneal-noblend-srv1-freeze160-wd001": {
        "args": {**_SRV1, "ef-decay": 0.8, "ef-anneal": True, "freeze-step": 160,
                 "weight-decay": 0.01}},
    "wd001": {"args": {"weight-decay": 0.01}},
    "pos-lv-noblend-freeze160-wd001": {"args": {"uncompressed-params": "pos.weight",
                                                "variance": "local", "no-blend": True,
                                                "freeze-step": 160, "weight-decay": 0.01}},
    "pos-lv-decay-chunk16k": {"args": _POS_LV_DECAY,
                              "env": {"GRADPRESS_PARTITION_BYTES": str(16 << 10)}},
    "pos-lv-decay-chunk4k": {"args": _POS_LV_DECAY,
                             "env": {"GRADPRESS_PARTITION_BYTES": str(4 << 10)}},
    "lv-freeze100": {"args": {"variance": "local", "freeze-step": 100}},
    "lv-freeze100-noblend": {"args": {"variance": "local", "freeze-step": 100,
                                      "no-blend": True}},
    "lv-freeze100-noblend-srv1": {"args": _CLAN_SRV1},
    "lv-freeze100-noblend-srv1-decay08": {"args": {**_CLAN_SRV1, "ef-decay": 0.8}},
    "lv-freeze160-noblend-srv1-decay08": {"args": {**_CLAN_SRV1, "ef-decay": 0.8,
                                                   "freeze-step": 160}},
    "lv-freeze100-noblend-srv1-decay08-wd001": {"args": {**_CLAN_SRV1, "ef-decay": 0.8,
                                                         "weight-decay": 0.01}},
    "lv-freeze100-noblend-srv1-decay08anneal-wd001": {
        "args": {**_CLAN_SRV1, "ef-decay": 0.8, "ef-anneal": True, "weight-decay": 0.01}},
    "pos-lv-b95": {"args": {"uncompressed-params": "pos.weight", "variance": "local",
                            "beta1": 0.95, "ef-decay": 0.95}},
    "pos-lv-b98": {"args": {"uncompressed-params": "pos.weight", "variance": "local",
                            "beta1": 0.98, "ef-decay": 0.98}},
    "pos-decay": {"args": {"uncompressed-params": "pos.weight", "ef-decay": 0.9}},
    "pos-decay-r50": {"args": {"uncompressed-params": "pos.weight", "ef-decay": 0.9,
                               "refresh-every": 50}},
    "warmup50": {"args": {"uncompressed-steps": 50}},
    "warmup100": {"args": {"uncompressed-steps": 100}},
    "warmup100-freeze": {"args": {"uncompressed-steps": 100, "freeze-step": 100}},
    "warmup50-freeze": {"args": {"uncompressed-steps": 50, "freeze-step": 50}},
    "b2": {"args": {"beta2": 0.99}},
    "warmup100-corrected": {"args": {"uncompressed-steps": 100, "ef": "corrected"}},
    "warmup100-chunk16k": {"args": {"uncompressed-steps": 100},
                           "env": {"GRADPRESS_PARTITION_BYTES": str(16 << 10)}},
    "warmup100-b2": {"args": {"uncompressed-steps": 100, "beta2": 0.99}},
    "nowarmup": {"args": {"uncompressed-steps": 0}},
    "corrected": {"args": {"ef": "corrected"}},
    "noef": {"args": {"ef": "none"}},
    "chunk16k": {"env": {"GRADPRESS_PARTITION_BYTES": str(16 << 10)}},
    "chunk64k": {"env": {"GRADPRESS_PARTITION_BYTES": str(64 << 10)}},
    "warmup50-chunk16k": {"args": {"uncompressed-steps": 50},
                          "env": {"GRADPRESS_PARTITION_BYTES": str(16 << 10)}},
}
#: Learning rates used unless ``--lr`` is given: (task, optimizer, codec) -> lr; ``*`` matches
#: any codec. Chosen per method (see benchmarks/results/convergence-log-2026.md).
LRS: dict[tuple[str, str, str], float] = {
    ("digits-cnn", "clan", "*"): 4e-3, ("digits-cnn", "clan", "topk"): 8e-3,
    ("digits-cnn", "lans", "*"): 4e-3,
    ("digits-cnn", "adam", "*"): 1e-3, ("digits-cnn", "onebit-adam", "*"): 1e-3,
    ("digits-cnn", "sgd-ef", "*"): 3e-3,
    ("stdlib-mlm", "clan", "*"): 1e-2, ("stdlib-mlm", "lans", "*"): 1e-2,
    ("stdlib-mlm", "onebit-lans", "*"): 1e-2, ("digits-cnn", "onebit-lans", "*"): 4e-3,
    ("stdlib-mlm", "adam", "*"): 1e-3, ("stdlib-mlm", "onebit-adam", "*"): 1e-3,
    ("stdlib-mlm", "sgd-ef", "*"): 0.1,
    # stdlib-lm: stdlib-mlm's rates, not tuned for it
    ("stdlib-lm", "lans", "*"): 1e-2, ("stdlib-lm", "onebit-lans", "*"): 1e-2,
    ("stdlib-lm", "clan", "*"): 1e-2,
    # stdlib-words (issue 38, frozen when written): stdlib-lm's rate, not tuned for it
    ("stdlib-words", "lans", "*"): 1e-2, ("stdlib-words", "onebit-lans", "*"): 1e-2,
}


@dataclass(frozen=True)
class Run:
    """One ``gradpress train`` run of the grid."""

    task: str
    optimizer: str
    codec: str
    variant: str
    seed: int
    lr: float
    steps: int | None
    epochs: int | None
    out: Path
    extra: Mapping[str, Any] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def group(self) -> tuple[Any, ...]:
        """Key shared by the seeds of one configuration."""
        return (self.task, self.optimizer, self.codec, self.variant, self.lr, self.steps,
                self.epochs)

    def command(self, python: str = "python", script: str = STUDY_SCRIPT) -> list[str]:
        """The ``gradpress train`` command line of this run (``python script`` runs the task
        when the variant uses experiment switches)."""
        extra = dict(self.extra)
        if self.optimizer in GRADIENT_OPTIMIZERS and self.codec != "none":
            extra.setdefault("uncompressed-steps", 0)  # explicit: the CLI default may change
        cli, study = split_options(self.optimizer, extra)
        cmd = ["gradpress", "train"] + ([] if study else ["--task", self.task])
        cmd += ["--optimizer", self.optimizer, "--compression", CODECS[self.codec],
                "--lr", f"{self.lr:g}"]
        if self.steps is not None:
            cmd += ["--steps", str(self.steps)]
        if self.epochs is not None:
            cmd += ["--epochs", str(self.epochs)]
        for k, v in cli.items():
            cmd += [f"--{k}"] if v is True else [f"--{k}", *str(v).split()]
        cmd += ["--seed", str(self.seed), "--no-progress", "--out", str(self.out)]
        if study is not None:
            cmd += ["--", python, script, "--task", self.task, "--method", "train", *study]
        return cmd

    def shell(self) -> str:
        """The command as one shell line (environment first)."""
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.command())


def split_options(optimizer: str, extra: Mapping[str, Any]
                  ) -> tuple[dict[str, Any], list[str] | None]:
    """A variant's options as (``gradpress train`` options, ``clan_script.py`` switches or
    None). The study's option names of its time map to today's: ``ef-decay``,
    ``server-ef-decay`` and ``ef-anneal`` into the ``--ef`` spec; ``uncompressed-steps`` and a
    1-bit optimizer's ``freeze-step`` into ``--dense-steps``; ``freeze-step`` of clan/lans
    (the second moment's freeze) into ``--freeze-variance-after``; ``beta1``/``beta2`` into
    ``--betas``; ``ef ef21`` into ``--ef none`` plus ``--ef21``."""
    cli, study = {}, dict(STUDY_DEFAULTS.get(optimizer, {}))
    decay = {k: extra[k] for k in ("ef-decay", "server-ef-decay", "ef-anneal") if k in extra}
    for k, v in extra.items():
        if k in decay:
            continue
        if k == "ef" and v == "ef21":
            cli["ef"], study["ef21"] = "none", True
        elif k == "uncompressed-steps" or (k == "freeze-step" and optimizer.startswith("onebit")):
            cli["dense-steps"] = v
        elif k == "freeze-step":
            study["freeze-variance-after"] = v
        elif k in ("beta1", "beta2"):
            b1, b2 = extra.get("beta1", 0.9), extra.get("beta2", 0.999)
            cli["betas"] = f"{b1!r} {b2!r}"
        elif k in STUDY_SWITCHES:
            study["blend" if k == "no-blend" else k] = False if k == "no-blend" else v
        else:
            cli[k] = v
    if decay:  # as TrainConfig wrote the kind from them
        kind = f"vanilla:decay={float(decay.get('ef-decay', 1.0))!r}"
        if "server-ef-decay" in decay:
            kind += f",server_decay={float(decay['server-ef-decay'])!r}"
        cli["ef"] = kind + (",anneal=1" if decay.get("ef-anneal") else "")
    return cli, _switches(study) if study else None


def _switches(study: Mapping[str, Any]) -> list[str]:
    """``clan_script.py`` switches of ``study`` (``blend`` True/False: ``--blend``/``--no-blend``,
    ``no-precondition``/``ef21`` flags, the others with their value)."""
    out: list[str] = []
    for k, v in study.items():
        if k == "blend":
            out.append("--blend" if v else "--no-blend")
        elif v is True:
            out.append(f"--{k}")
        else:
            out += [f"--{k}", str(v)]
    return out


def lr_for(task: str, optimizer: str, codec: str) -> float:
    """The grid's learning rate of (task, optimizer, codec) from :data:`LRS`."""
    for key in ((task, optimizer, codec), (task, optimizer, "*")):
        if key in LRS:
            return LRS[key]
    raise ValueError(f"no learning rate for task {task!r}, optimizer {optimizer!r}, codec "
                     f"{codec!r}; give --lr")


def length_suffix(args: argparse.Namespace) -> str:
    """The run-label part naming the run length (``_st200``, ``_ep16``, or both)."""
    return (f"_st{args.steps}" if args.steps else "") + (f"_ep{args.epochs}" if args.epochs
                                                          else "")


def expand(args: argparse.Namespace) -> list[Run]:
    """Step 1: the grid as runs."""
    for what, names, valid in (("codec", args.codecs, CODECS), ("variant", args.variants,
                                                                 VARIANTS)):
        bad = [n for n in names if n not in valid]
        if bad:
            raise ValueError(f"unknown {what}(s) {bad}; valid: {', '.join(valid)}")
    runs = []
    for task in args.tasks:
        for opt in args.optimizers:
            for codec in args.codecs:
                for var in args.variants:
                    lr = args.lr if args.lr is not None else lr_for(task, opt, codec)
                    v = VARIANTS[var]
                    label = f"{opt}_{codec}_{var}_lr{lr:g}" + length_suffix(args)
                    for seed in args.seeds:
                        runs.append(Run(task, opt, codec, var, seed, lr, args.steps,
                                        args.epochs, Path(args.out) / task / f"{label}_s{seed}",
                                        dict(v.get("args", {})), dict(v.get("env", {}))))
    return runs


def completed(run: Run) -> dict[str, Any] | None:
    """The run's report if it completed, else None."""
    path = run.out / "report.json"
    if not path.is_file():
        return None
    rep = json.loads(path.read_text())
    return rep if rep.get("status") == "completed" else None


def execute(runs: Sequence[Run], dry: bool = False) -> None:
    """Step 2: run what is not done yet (a failed run is reported and skipped)."""
    import os

    todo = [r for r in runs if completed(r) is None]
    for i, r in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {r.shell()}", flush=True)
        if dry:
            continue
        script = str(Path(__file__).with_name("clan_script.py"))
        cmd = [sys.executable, "-m", "gradpress.cli",  # this interpreter's
               *r.command(python=sys.executable, script=script)[1:]]
        proc = subprocess.run(cmd, env={**os.environ, **r.env},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            print(f"  failed (exit {proc.returncode}): {proc.stderr[-800:]}", flush=True)


def compressed_push(rep: Mapping[str, Any], run_dir: Path) -> float:
    """Mean bytes pushed per step after the uncompressed warm-up (so a run's dense refresh
    steps count), from the run's ``metrics.jsonl``; the last step's without it."""
    hp = rep.get("hparams") or {}
    # dense_steps; reports written before the rename have freeze_step / uncompressed_steps
    start = max(hp.get(k) or 0 for k in ("dense_steps", "freeze_step", "uncompressed_steps"))
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    pushed = [r["bytes_pushed"] for r in rows if r.get("kind") == "step" and r["step"] > start]
    return statistics.fmean(pushed) if pushed else float(rep["bytes_per_step"]["push_last"])


def wire(rep: Mapping[str, Any], run_dir: Path) -> dict[str, float | None]:
    """Bytes per step per worker (push, mean after the warm-up) and the measured ratios of one
    report."""
    bps, codec = rep["bytes_per_step"], rep.get("codec") or {}
    push, dense = compressed_push(rep, run_dir), float(bps["dense_fp32"])
    small = codec.get("model_wire_bytes", 0) - codec.get("compressed_wire_bytes", 0)
    comp = push - small
    comp16 = codec.get("compressed_fp32_bytes", 0) / 2
    return {"push": push, "model_vs_fp32": dense / push if push else None,
            "comp_vs_fp16": comp16 / comp if codec.get("compressed_tensors") and comp > 0
            else None}


def _fmt(values: Sequence[float], digits: int) -> str:
    if not values:
        return "-"
    m = statistics.fmean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{m:.{digits}f} ± {s:.{digits}f} (n={len(values)})"


def aggregate(runs: Sequence[Run], reports: Mapping[Path, Mapping[str, Any]]
              ) -> list[dict[str, Any]]:
    """Step 3: one row per configuration, seeds pooled (runs without a report are left out)."""
    groups: dict[tuple[Any, ...], list[Run]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    rows = []
    for key, members in groups.items():
        reps = [reports[r.out] for r in members if r.out in reports]
        if not reps:
            continue
        metric = reps[0]["metric"]
        scale = 100.0 if "acc" in metric["name"] else 1.0
        vals = [scale * float(rep["metric"]["value"]) for rep in reps]
        w = wire(reps[0], next(r.out for r in members if r.out in reports))
        rows.append({"task": key[0], "optimizer": key[1], "codec": key[2], "variant": key[3],
                     "lr": key[4], "steps": reps[0].get("steps"), "metric": metric["name"],
                     "values": vals, "seeds": [r.seed for r in members if r.out in reports],
                     "mean": statistics.fmean(vals),
                     "std": statistics.stdev(vals) if len(vals) > 1 else 0.0, **w,
                     "s_per_step": statistics.fmean(float(r["s_per_step"]) for r in reps),
                     "command": members[0].shell()})
    return rows


def add_gaps(rows: Sequence[dict[str, Any]], args: argparse.Namespace) -> None:
    """Step 3, ``--baseline``: each row's gap to the baseline run label (same task, length and
    seed), as ``row["gap"]`` = (per-seed gaps, unit); a row without a paired seed gets none."""
    for row in rows:
        acc = "acc" in row["metric"]
        gaps = []
        for seed, value in zip(row["seeds"], row["values"], strict=True):
            path = (Path(args.out) / row["task"] / f"{args.baseline}{length_suffix(args)}_s{seed}"
                    / "report.json")
            rep = json.loads(path.read_text()) if path.is_file() else {}
            if rep.get("status") != "completed":
                continue
            base = float(rep["metric"]["value"]) * (100.0 if acc else 1.0)
            gaps.append(value - base if acc else 100.0 * (value / base - 1.0))
        row["gap"] = (gaps, " pts" if acc else "%")


def _gap(row: Mapping[str, Any]) -> str:
    gaps, unit = row.get("gap") or ([], "")
    if not gaps:
        return "-"
    s = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
    return f"{statistics.fmean(gaps):+.2f} ± {s:.2f}{unit} (n={len(gaps)})"


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a markdown table (a "vs baseline" column when rows carry ``gap``)."""
    gap = any("gap" in r for r in rows)
    head = ("| task | optimizer | codec | variant | lr | steps | metric (mean ± std) | "
            + ("vs baseline | " if gap else "")
            + "push B/step | model vs fp32 | compressed vs fp16 | s/step |")
    lines = [head, "|" + "---|" * (12 if gap else 11)]
    for r in rows:
        digits = 2 if "acc" in r["metric"] else 4
        ratio = f"{r['comp_vs_fp16']:.1f}x" if r["comp_vs_fp16"] else "-"
        model = f"{r['model_vs_fp32']:.1f}x" if r["model_vs_fp32"] else "-"
        lines.append(f"| {r['task']} | {r['optimizer']} | {r['codec']} | {r['variant']} | "
                     f"{r['lr']:g} | {r['steps']} | {r['metric']} {_fmt(r['values'], digits)} "
                     + (f"| {_gap(r)} " if gap else "")
                     + f"| {r['push']:.0f} | {model} | {ratio} | {r['s_per_step']:.3f} |")
    return "\n".join(lines)


def commands(rows: Sequence[Mapping[str, Any]]) -> str:
    """One reproducing command per row (first seed; change ``--seed`` for the others)."""
    return "\n".join(f"    {r['command']}" for r in rows)


#: Tensor shapes for ``--wire``: the bundled tasks' largest and BERT-base's (768 hidden).
WIRE_SHAPES = {"digits-cnn stage2 conv 64x64x3x3": 36864, "stdlib-mlm in_proj 384x128": 49152,
               "BERT-base attention 768x768": 589824, "BERT-base FFN 3072x768": 2359296}


def wire_table(spec: str = "topk:k=0.001,values=fp16") -> str:
    """Bytes of real ``compress`` outputs (what goes on the wire, header included) against fp16,
    for the tensors of :data:`WIRE_SHAPES` (chunks of 4 MiB, the default partition)."""
    import torch

    from gradpress.compress import build
    from gradpress.ps.partition import chunk_layout

    lines = ["| tensor | elements | fp16 bytes | " + spec + " bytes | ratio vs fp16 |",
             "|---|---|---|---|---|"]
    for name, numel in WIRE_SHAPES.items():
        ours = fp16 = 0
        for c in chunk_layout(numel, 4 << 20):
            x = torch.randn(c.numel)
            ours += build(spec, c.numel, seed=0).compress(x).numel()
            fp16 += build("fp16", c.numel).compress(x).numel()
        lines.append(f"| {name} | {numel} | {fp16} | {ours} | {fp16 / ours:.1f}x |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=["digits-cnn"])
    p.add_argument("--codecs", nargs="+", default=list(CODECS))
    p.add_argument("--optimizers", nargs="+", default=["clan"])
    p.add_argument("--variants", nargs="+", default=["base"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, help="steps per run (default: the task's)")
    p.add_argument("--epochs", type=int, help="epochs per run (default: the task's)")
    p.add_argument("--lr", type=float, help="one lr for every run (default: the LRS table)")
    p.add_argument("--out", default="runs/convergence", help="root of the run directories")
    p.add_argument("--md", help="also write the table and commands to this markdown file")
    p.add_argument("--baseline", metavar="LABEL",
                   help="run label without length and seed (e.g. lans_none_base_lr0.02): add "
                        "each row's gap to it, paired by seed")
    p.add_argument("--quick", action="store_true",
                   help="tiny grid: digits-cnn, none/onebit, clan, seed 0, 30 steps")
    p.add_argument("--collect-only", action="store_true", help="only tabulate existing runs")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    p.add_argument("--wire", action="store_true",
                   help="only print the top-k 0.1%% fp16 wire sizes of single tensors "
                        "(bit-packed indices, then int32 indices)")
    args = p.parse_args(argv)
    if args.quick:
        args.tasks, args.codecs, args.optimizers = ["digits-cnn"], ["none", "onebit"], ["clan"]
        args.seeds, args.steps, args.variants = [0], args.steps or 30, ["base"]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.wire:
        print(wire_table())
        print("\nThe same with the int32 index layout (as in the paper):\n")
        print(wire_table("topk:k=0.001,values=fp16,indices=int32"))
        return 0
    try:
        runs = expand(args)
    except ValueError as e:
        print(f"convergence.py: error: {e}", file=sys.stderr)
        return 2
    if not args.collect_only:
        execute(runs, dry=args.dry_run)
    reports = {r.out: rep for r in runs if (rep := completed(r)) is not None}
    rows = aggregate(runs, reports)
    if args.baseline:
        add_gaps(rows, args)
    text = table(rows) + "\n\nCommands (first seed):\n\n" + commands(rows)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

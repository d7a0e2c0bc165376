"""Issue 38's study of the workers' residual decay under ``gp.OneBitLANS``: the default
(``vanilla:decay=0.8,server_decay=1.0``) against 0.9 and 1.0 (vanilla) on stdlib-words (post-LN,
constant lr, the lr sweep) and stdlib-mlm (pre-LN, warm-up and cosine decay, 800 steps), and the
rules of ``clan_script.py``'s study switches (``--ef-auto``, ``--reset-every``,
``--decay-on-drift``; ``benchmarks/study_ef.py``).

Usage::

    python benchmarks/ef_decay.py            # the table of the kept runs
    python benchmarks/ef_decay.py --commands # the command of each kept run

The runs are kept in ``benchmarks/results/ef-decay/<task>/<run>/`` (report and config); the
baselines (uncompressed LANS) and the default's runs are the accuracy targets' own, in
``benchmarks/results/targets/`` (``benchmarks/targets.py``). Steps:

1. Read each kept run's config and report: the task, seed, lr and the error-feedback spec that
   ran (the report's plan; the mlm runs changed the default in a scratch checkout, which is
   the same as ``clan_script.py --ef 'vanilla:decay=0.9,server_decay=1.0'``).
2. Pair it with the targets' LANS run and the default's run of the same task, seed and lr.
3. Print the final validation losses and the gaps, ``100 * (val_loss / LANS's - 1)``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
RUNS, TARGETS = RESULTS / "ef-decay", RESULTS / "targets"
#: clan_script's task -> (the targets' run-directory stem for a number of steps, the lr of 1x)
TASKS = {"stdlib-words": ("st{steps}_constant", 0.01), "stdlib-mlm": ("st{steps}", 0.01),
         "stdlib-lm": ("st{steps}", 0.01), "digits-cnn": ("st{steps}", 0.004)}


def _load(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def _study_switches(script: list[str]) -> list[str]:
    """clan_script.py's issue-38 study switches in a run's script (``--ef-auto``,
    ``--reset-every N``, ``--decay-on-drift EF``)."""
    out: list[str] = []
    for i, a in enumerate(script):
        if a == "--ef-auto":
            out.append(a)
        elif a in ("--reset-every", "--decay-on-drift"):
            out += [a, script[i + 1]]
    return out


def describe(run: Path) -> dict[str, Any]:
    """Step 1: task, seed, lr scale and ef spec of a kept run."""
    cfg = _load(run / "config.json")["runs"][0]
    script, seed = cfg["script"], cfg["seed"]
    task = script[script.index("--task") + 1]
    ef = _load(run / "report.json")["plan"]["ef"]
    study = _study_switches(script)
    stem, lr1 = TASKS[task]
    stem = stem.format(steps=cfg["steps"])
    scale = cfg["lr"] / lr1
    return {"task": task, "seed": seed, "scale": scale, "ef": ef, "study": study,
            "steps": cfg["steps"],
            "suffix": stem + ("" if scale == 1 else f"_lr{scale:g}x") + f"_s{seed}"}


def final(path: Path) -> float | None:
    """The final validation loss of a run directory's report (None: no report, or a task
    measured by test accuracy, digits-cnn, whose runs the README reads instead)."""
    rep = path / "report.json"
    loss = _load(rep)["final_eval"].get("val_loss") if rep.exists() else None
    return None if loss is None else float(loss)


def table() -> list[str]:
    """Steps 2-3: one markdown row per kept run."""
    rows = ["| task | steps | lr | seed | error feedback | val loss | LANS | gap | default's gap |",
            "|---|---|---|---|---|---|---|---|---|"]
    for run in sorted(RUNS.glob("*/*/config.json")):
        d = describe(run.parent)
        root = TARGETS / d["task"]
        base = final(root / f"lans_none_{d['suffix']}")
        default = final(root / f"onebit-lans_onebit_{d['suffix']}")
        mine = final(run.parent)
        if base is None or mine is None:
            continue
        gap = f"{100 * (mine / base - 1):+.2f}%"
        dgap = "-" if default is None else f"{100 * (default / base - 1):+.2f}%"
        ef = f"`{d['ef']}`" + "".join(f" `{a}`" for a in d["study"])
        rows.append(f"| {d['task']} | {d['steps']} | {d['scale']:g}x | {d['seed']} | {ef} | "
                    f"{mine:.3f} | {base:.3f} | {gap} | {dgap} |")
    return rows


def commands() -> list[str]:
    """The ``gradpress train`` line that reproduces each kept run."""
    out = []
    for run in sorted(RUNS.glob("*/*/config.json")):
        cfg, d = _load(run)["runs"][0], describe(run.parent)
        argv = ["gradpress", "train", "--optimizer", "onebit-lans", "--compression", "onebit",
                "--lr", f"{cfg['lr']:g}", "--steps", str(cfg["steps"]), "--warmup-steps",
                str(cfg["warmup_steps"]), "--weight-decay", f"{cfg['weight_decay']:g}",
                *(["--schedule", cfg["schedule"]] if cfg["schedule"] != "cosine" else []),
                "--seed", str(d["seed"]), "--out", f"runs/ef-decay/{run.parent.name}", "--",
                "python", "benchmarks/clan_script.py", "--task", d["task"], "--compression",
                "onebit", "--ef", d["ef"], *d["study"]]
        out.append(shlex.join(argv))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--commands", action="store_true", help="print the kept runs' commands")
    args = p.parse_args(argv)
    print("\n".join(commands() if args.commands else table()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

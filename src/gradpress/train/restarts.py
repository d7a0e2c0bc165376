"""``gradpress train --resume`` and ``--max-restarts``: the supervisor's side of recovery.

The CLI process that launches the cluster is the supervisor. When the job fails (a process
died: the launcher ends every other process and returns non-zero, see ``docs/reliability.md``;
a hung process makes the others' waits time out, which ends the job the same way), it:

1. finds the newest complete checkpoint whose checksums match under ``OUT/checkpoints``
   (:func:`gradpress.checkpoint.latest`; none: where the run started, its ``--resume`` or
   step 0);
2. cuts the run directory back to that step (:func:`start_from`: the steps after it are
   redone);
3. launches the whole job again with ``resume`` set to that checkpoint,

at most ``max_restarts`` times; an interrupted job (Ctrl-C: exit 130 or 143) is not restarted.
The loop is :func:`gradpress.launch.restart_loop`, the one ``gradpress launch --max-restarts``
runs too.
``report.json`` records ``restarts: {"count", "steps_redone"}``.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..launch import INTERRUPTED, restart_loop
from .config import TrainConfig
from .periodic import SUBDIR, checkpoint_step, checkpoints
from .report import read_metrics

__all__ = ["INTERRUPTED", "trim_metrics", "last_step", "start_from", "run_with_restarts"]

def last_step(metrics: str | Path) -> int:
    """The highest step recorded in ``metrics.jsonl`` (0 when none)."""
    return max((int(r["step"]) for r in read_metrics(metrics) if r.get("kind") == "step"),
               default=0)


def trim_metrics(metrics: str | Path, step: int) -> None:
    """Keep only the records of ``metrics.jsonl`` up to ``step`` (a resumed run appends the
    rest): ``start`` records, and ``step``, ``eval``, ``plan`` and ``resize`` records with a
    step at most ``step``; ``end`` and ``summary`` records go. Written atomically."""
    path = Path(metrics)
    if not path.is_file():
        return
    keep = [r for r in read_metrics(path) if r.get("kind") == "start"
            or (r.get("kind") in ("step", "eval", "plan", "resize")
                and int(r.get("step", 0)) <= step)]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")
    os.replace(tmp, path)


def start_from(out: str | Path, resume: str | None) -> int:
    """Cut run directory ``out`` back to checkpoint ``resume`` (None: the start of the run);
    returns its step.

    Steps:

    1. ``metrics.jsonl`` keeps the records up to the step (:func:`trim_metrics`);
    2. the checkpoints of later steps under ``OUT/checkpoints`` are removed (they belong to the
       run being redone, or to an earlier run in the same directory), each named on stdout.
    """
    step = checkpoint_step(resume) if resume is not None else 0
    trim_metrics(Path(out) / "metrics.jsonl", step)  # step 1
    for later, d in checkpoints(Path(out) / SUBDIR):  # step 2
        if later > step and (resume is None or d.resolve() != Path(resume).resolve()):
            print(f"gradpress train: removing checkpoint {d} (after step {step})", flush=True)
            shutil.rmtree(d, ignore_errors=True)
    return step


def run_with_restarts(cfg: TrainConfig, launch: Callable[[TrainConfig], int]
                      ) -> tuple[int, dict[str, Any]]:
    """Run ``launch(cfg)`` under :func:`gradpress.launch.restart_loop` (steps 1-3 of the module
    docstring), at most ``cfg.max_restarts`` times. Returns the last exit status and
    ``{"count", "steps_redone"}``."""
    metrics = Path(cfg.out) / "metrics.jsonl"
    redone = 0

    def announce(code: int, count: int, resume: str | None) -> None:
        nonlocal redone
        reached = last_step(metrics)
        start = start_from(cfg.out, resume)  # step 2
        redone += max(0, reached - start)
        print(f"gradpress train: the job failed (exit status {code}) at step {reached}; restart "
              f"{count} of {cfg.max_restarts} from {resume or 'the start'} (step {start})",
              flush=True)

    code, count = restart_loop(lambda resume: launch(cfg.replace(resume=resume)),  # 1 and 3
                               checkpoints=Path(cfg.out) / SUBDIR, resume=cfg.resume,
                               max_restarts=cfg.max_restarts, announce=announce)
    return code, {"count": count, "steps_redone": redone}

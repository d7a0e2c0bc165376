"""How far the embedding rows that get no gradient move, run against run (issue 38).

Reads the final model of each ``gradpress train`` run directory (``model.pt`` written by
``clan_script.py --save-model``, or the newest checkpoint of ``--checkpoint-every``) of a bundled
task with an embedding ``tok.weight`` and rows that never occur in training (``stdlib-words``:
``task.unseen_in_training``), and prints per run: the mean row norm of the rows never in
training, of the rows in training, both as a ratio to the first run's (the baseline,
uncompressed LANS), and the run's final validation loss and its ratio::

    python benchmarks/row_drift.py --task stdlib-words RUN_LANS RUN_ONEBIT [RUN ...] [--json F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from gradpress.tasks import get_task


def final_model(run: Path) -> tuple[Path, int]:
    """``run/model.pt`` (``clan_script.py --save-model``), else the newest
    ``run/checkpoints/step-<N>/worker0.pt``; with the step it holds."""
    report = run / "report.json"
    if (run / "model.pt").exists():
        return run / "model.pt", int(json.loads(report.read_text())["steps"])
    steps = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))
    if not steps:
        raise FileNotFoundError(f"{run} has neither model.pt nor checkpoints/step-* (train "
                                f"with --checkpoint-every, or clan_script.py --save-model)")
    return steps[-1] / "worker0.pt", int(steps[-1].name[5:])


def measured(run: Path, unseen: torch.Tensor) -> dict[str, Any]:
    """:func:`measure`, kept in ``run/row_drift.json`` the first time, so that the record
    outlives the model files (too big to keep)."""
    kept = run / "row_drift.json"
    if kept.is_file():
        return json.loads(kept.read_text())
    row = measure(run, unseen)
    kept.write_text(json.dumps(row, indent=1) + "\n")
    return row


def measure(run: Path, unseen: torch.Tensor) -> dict[str, Any]:
    """Row norms of ``tok.weight`` of the run's final model and its final val_loss."""
    path, step = final_model(run)
    state = torch.load(path, map_location="cpu", weights_only=False)
    norms = state["model"]["tok.weight"].norm(dim=1)
    seen = torch.ones(len(norms), dtype=torch.bool)
    seen[unseen] = False
    report = json.loads((run / "report.json").read_text()) if (run / "report.json").exists() \
        else {}
    return {"run": str(run), "step": step,
            "unseen_row_norm": float(norms[unseen].mean()),
            "seen_row_norm": float(norms[seen].mean()),
            "val_loss": report.get("final_eval", {}).get("val_loss"),
            "model_ratio_vs_fp32": report.get("model_ratio_vs_fp32")}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories; the first is the base")
    p.add_argument("--task", default="stdlib-words")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    task = get_task(args.task)
    rows = [measured(r, task.unseen_in_training) for r in args.runs]
    base = rows[0]
    print(f"{'run':40s} {'step':>5s} {'unseen norm':>12s} {'vs base':>8s} {'seen norm':>10s} "
          f"{'vs base':>8s} {'val_loss':>9s} {'vs base':>8s} {'vs fp32':>8s}")
    for r in rows:
        vl = r["val_loss"]
        rel = f"{vl / base['val_loss']:.3f}x" if vl and base["val_loss"] else "-"
        print(f"{r['run'][-40:]:40s} {r['step']:5d} {r['unseen_row_norm']:12.3f} "
              f"{r['unseen_row_norm'] / base['unseen_row_norm']:7.2f}x "
              f"{r['seen_row_norm']:10.3f} {r['seen_row_norm'] / base['seen_row_norm']:7.2f}x "
              f"{vl if vl is not None else float('nan'):9.4f} {rel:>8s} "
              f"{r['model_ratio_vs_fp32'] or 0:7.1f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

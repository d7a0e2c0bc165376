"""Time to accuracy: when each run of a comparison first reaches the baseline's final result.

The target is the baseline run's last evaluation of its headline metric (``primary`` of its
``eval`` records in ``metrics.jsonl``; for the demo the uncompressed run's test accuracy). Each
run's time to accuracy is the ``time_s`` (wall-clock seconds of training, set-up excluded) of its
first evaluation at least as good as the target, and its speed-up is the baseline's time to the
same target divided by its own. Everything here is a pure function of the records, except
:func:`plot_eval_vs_time`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["time_to_target", "time_to_accuracy", "tta_columns", "tta_summary",
           "plot_eval_vs_time"]

Records = Sequence[Mapping[str, Any]]


def _evals(records: Records) -> list[Mapping[str, Any]]:
    return [r for r in records if r.get("kind") == "eval"]


def _value(ev: Mapping[str, Any]) -> float:
    return float(ev["metrics"][ev["primary"]])


def time_to_target(records: Records, target: float, higher_is_better: bool = True
                   ) -> dict[str, float | int] | None:
    """``{"time_s", "step", "value"}`` of the first evaluation in ``records`` whose primary
    metric reaches ``target`` (``>=``, or ``<=`` when lower is better); None if none does.

    Raises:
        TypeError: ``target`` is not a number or ``higher_is_better`` not a bool.
        ValueError: ``target`` is not finite.
    """
    if isinstance(target, bool) or not isinstance(target, (int, float)):
        raise TypeError(f"time_to_target: target must be a number, got "
                        f"{type(target).__name__} {target!r}")
    if not math.isfinite(target):
        raise ValueError(f"time_to_target: target must be finite, got {target!r}")
    if not isinstance(higher_is_better, bool):
        raise TypeError(f"time_to_target: higher_is_better must be a bool, got "
                        f"{higher_is_better!r}")
    for ev in _evals(records):
        v = _value(ev)
        if v >= target if higher_is_better else v <= target:
            return {"time_s": float(ev["time_s"]), "step": int(ev["step"]), "value": v}
    return None


def time_to_accuracy(runs: Mapping[str, Records], baseline: str) -> dict[str, Any] | None:
    """Each run's time to the final result of run ``baseline``, and its speed-up.

    Returns ``{"baseline", "metric", "target", "higher_is_better", "runs": {name: {"time_s",
    "step", "value", "speedup"} or None (not reached)}}``, or None when the baseline has no
    evaluation (e.g. it was interrupted before its first).

    Raises:
        ValueError: ``baseline`` is not one of ``runs``.
    """
    if baseline not in runs:
        raise ValueError(f"time_to_accuracy: baseline {baseline!r} is not one of the runs "
                         f"{sorted(runs)}")
    evals = _evals(runs[baseline])
    if not evals:
        return None
    last = evals[-1]
    target, hib = _value(last), bool(last.get("higher_is_better", True))
    reached = {name: time_to_target(recs, target, hib) for name, recs in runs.items()}
    base = reached[baseline]
    out: dict[str, Any] = {}
    for name, r in reached.items():
        speedup = None if r is None or base is None or r["time_s"] <= 0 \
            else base["time_s"] / r["time_s"]
        out[name] = None if r is None else {**r, "speedup": speedup}
    return {"baseline": baseline, "metric": last["primary"], "target": target,
            "higher_is_better": hib, "runs": out}


def tta_columns(tta: Mapping[str, Any] | None, names: Sequence[str]
                ) -> list[tuple[str, list[str]]]:
    """Two table columns for the runs ``names``: time to the target and speed-up."""
    if tta is None:
        return []
    runs = tta["runs"]
    times = ["not reached" if runs.get(n) is None else f"{runs[n]['time_s']:.1f} s"
             for n in names]
    speed = ["-" if runs.get(n) is None or runs[n]["speedup"] is None
             else f"{runs[n]['speedup']:.2f}x" for n in names]
    return [(f"to {tta['target']:.4f}", times), ("speed-up", speed)]


def tta_summary(tta: Mapping[str, Any] | None) -> str:
    """One sentence: how much faster each other run reached the baseline's final result."""
    if tta is None:
        return "time to accuracy: the baseline run has no evaluation"
    runs, base = tta["runs"], tta["baseline"]
    b = runs.get(base)
    head = (f"time to {tta['metric']} {tta['target']:.4f} (the final result of {base}"
            + (f", first reached after {b['time_s']:.1f} s)" if b else ")"))
    parts = []
    for name, r in runs.items():
        if name == base:
            continue
        if r is None:
            parts.append(f"{name} did not reach it")
        elif r["speedup"] is not None:
            s = r["speedup"]
            parts.append(f"{name} reached it "
                         + (f"{s:.2f}x faster" if s >= 1 else f"{1 / s:.2f}x slower")
                         + f" ({r['time_s']:.1f} s)")
    return head + (": " + "; ".join(parts) if parts else "")


def plot_eval_vs_time(out_dir: str | Path, runs: Mapping[str, Records],
                      tta: Mapping[str, Any] | None) -> Path | None:
    """``eval_vs_time.png``: each run's headline metric against wall time, the target as a
    dashed line and each run's first evaluation reaching it marked; None without evaluations."""
    if not any(_evals(recs) for recs in runs.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .report import _save

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, recs) in enumerate(runs.items()):
        evals = _evals(recs)
        ax.plot([e["time_s"] for e in evals], [_value(e) for e in evals], "o-", color=f"C{i}",
                markersize=3, label=name)
        hit = None if tta is None else tta["runs"].get(name)
        if hit is not None:
            ax.plot([hit["time_s"]], [hit["value"]], "*", color=f"C{i}", markersize=14)
    if tta is not None:
        ax.axhline(tta["target"], color="gray", linestyle="--", linewidth=0.8,
                   label=f"final {tta['metric']} of {tta['baseline']}")
        ax.set_ylabel(tta["metric"])
    ax.set(xlabel="wall time (s)")
    return _save(fig, ax, Path(out_dir) / "eval_vs_time.png")

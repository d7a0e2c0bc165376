"""Run records and reports of ``gradpress train``: ``metrics.jsonl``, ``report.json``, plots.

``metrics.jsonl`` holds one JSON object per line, written and flushed by rank 0 as training
goes (so an interrupted run keeps every finished step):

* ``{"kind": "start", "config", "hparams", "workers", "setup_s"}`` when the clock starts;
* ``{"kind": "step", "step", "epoch", "loss", "lr", "time_s", "step_s", "bytes_pushed",
  "bytes_pulled", "dense_fp32_bytes", "stages": {...}}``: byte counts are this worker's
  per-step deltas of ``gp.stats()`` (each worker sends and receives the same amount), and
  ``"drift_recoveries"`` on a step where the health watch saw compressed momenta drift (the
  report's ``"drift_recoveries"`` adds them up);
* ``{"kind": "eval", "step", "time_s", "metrics": {...}, "primary", "higher_is_better"}``;
* ``{"kind": "plan", "step", ...}`` at the first compressed step (or at the end of a run that
  never left its dense phase): the optimizer's :class:`~gradpress.torch.plan.Plan`
  (``Plan.to_dict()``), which becomes the report's ``"plan"``;
* ``{"kind": "summary", ...}`` at the end of a completed run (config, hyperparameters, wall
  time, stage totals, codec byte counts, replica check), or ``{"kind": "end", "status":
  "interrupted"}``.

:func:`run_report` turns the records into the report (a dict); :func:`plot_runs` draws loss
against step and against wall time and bytes per step with matplotlib's Agg backend.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "read_metrics", "run_report", "write_json", "plot_runs",
           "format_run", "format_table", "human_bytes", "print_plan", "codec_ratios"]

_RUNTIME_STAGES = ("compress_s", "send_s", "wait_s", "decompress_s")


class MetricsWriter:
    """Appends JSON records to a file, one per line, flushed after each (survives a kill);
    the file starts empty unless ``append`` (a resumed run goes on after the earlier records)."""

    def __init__(self, path: str | Path, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w",
                       encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        """Write one record and flush it to the operating system."""
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` ([] if missing); a cut-off last line is skipped."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # the process was killed mid-line
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _bytes_section(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and last per-step bytes per direction; whole-model ratios from the counters."""
    n = max(1, len(steps))
    push = sum(s["bytes_pushed"] for s in steps)
    pull = sum(s["bytes_pulled"] for s in steps)
    dense = sum(s["dense_fp32_bytes"] for s in steps)
    last = steps[-1] if steps else {"bytes_pushed": 0, "bytes_pulled": 0, "dense_fp32_bytes": 0}
    return {
        "bytes_per_step": {"push": push / n, "pull": pull / n, "dense_fp32": dense / n,
                           "push_last": last["bytes_pushed"], "pull_last": last["bytes_pulled"]},
        "bytes_total": {"push": push, "pull": pull, "dense_fp32": dense},
        # both directions together, measured on the wire (headers and small tensors included)
        "model_ratio_vs_fp32": _ratio(2 * dense, push + pull),
        "model_ratio_vs_fp16": _ratio(dense, push + pull),
    }


def _stages(steps: list[dict[str, Any]], summary: dict[str, Any] | None) -> dict[str, float]:
    """Seconds per stage over the run: loop stages and the runtime's (thread) stages."""
    out: dict[str, float] = {}
    for s in steps:
        for k, v in s.get("stages", {}).items():
            out[k] = out.get(k, 0.0) + v
    if summary is not None:  # includes evaluation time spent outside of step records
        out.update(summary.get("stages_s", {}))
    return out


def run_report(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The report of one run from its ``metrics.jsonl`` records (partial runs included)."""
    steps = [dict(r) for r in records if r.get("kind") == "step"]
    evals = [dict(r) for r in records if r.get("kind") == "eval"]
    summary = next((dict(r) for r in reversed(records) if r.get("kind") == "summary"), None)
    end = next((dict(r) for r in reversed(records) if r.get("kind") == "end"), None)
    status = summary["status"] if summary else end["status"] if end else "incomplete"
    rep: dict[str, Any] = {"run": (summary or end or (steps or evals or [{}])[0]).get("run"),
                           "status": status, "steps": len(steps)}
    start = next((dict(r) for r in records if r.get("kind") == "start"), None)
    for src in (start, summary):
        for k in ("config", "hparams", "workers", "params", "setup_s", "replicas_identical",
                  "params_sha256"):
            if src is not None and k in src:
                rep[k] = src[k]
    rep["wall_s"] = summary["wall_s"] if summary else max(
        [r.get("time_s", 0.0) for r in [*steps, *evals]], default=0.0)
    rep["s_per_step"] = _ratio(rep["wall_s"], len(steps))
    if evals:
        ev = evals[-1]
        rep["metric"] = {"name": ev["primary"], "value": ev["metrics"][ev["primary"]],
                         "higher_is_better": ev["higher_is_better"], "step": ev["step"]}
        rep["final_eval"] = ev["metrics"]
        rep["evals"] = [{"step": e["step"], **e["metrics"]} for e in evals]
    if steps:
        tail = [s["loss"] for s in steps[-10:]]
        rep["final_train_loss"] = sum(tail) / len(tail)
    rep.update(_bytes_section(steps))
    # compressed momenta that drifted from their exact average and recovered (the health watch)
    rep["drift_recoveries"] = sum(s.get("drift_recoveries", 0) for s in steps)
    codec = (summary or {}).get("codec")
    if codec:
        rep["codec"] = codec
        rep["compressed_ratio_vs_fp32"] = codec["compressed_vs_fp32"]
        rep["compressed_ratio_vs_fp16"] = codec["compressed_vs_fp16"]
    loco = (summary or {}).get("diloco")
    if loco:  # bytes per step against a per-step fp32 exchange of the whole model, both ways
        sent = rep["bytes_total"]["push"] + rep["bytes_total"]["pull"]
        rep["diloco"] = {**loco, "ratio_vs_per_step_fp32": _ratio(
            2 * 4 * loco["params"] * len(steps), sent)}
    resized = [{k: v for k, v in r.items() if k not in ("kind", "run")} for r in records
               if r.get("kind") == "resize"]
    if resized:  # resumed by another number of workers (gradpress.elastic)
        rep["resized"] = resized
    plan = next((r for r in reversed(records) if r.get("kind") == "plan"), None)
    if plan is not None:
        rep["plan"] = {k: v for k, v in plan.items() if k not in ("kind", "run")}
    rep["stages_s"] = _stages(steps, summary)
    if end is not None:
        rep["reason"] = end.get("reason")
    return rep


def write_json(path: str | Path, obj: Any) -> Path:
    """Write ``obj`` as indented JSON (NaN/inf become null)."""
    p = Path(path)
    p.write_text(json.dumps(_finite(obj), indent=2) + "\n", encoding="utf-8")
    return p


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def codec_ratios(named: Sequence[tuple[str, Any]], spec: str, min_compress_bytes: int,
                 partition_bytes: int, exact: Collection[str] = (),
                 fusion_bytes: int = 0) -> dict[str, Any]:
    """Bytes on the wire per step from the codecs' ``payload_bytes`` (one direction).

    Tensors of at least ``min_compress_bytes`` are cut into chunks of ``partition_bytes`` and
    each chunk costs the codec's payload; smaller ones, those named in ``exact`` (and all with
    codec ``none``) cost a ``none`` payload (fp32 + header) and do not count as compressed
    tensors. With ``fusion_bytes`` (the cap of :mod:`gradpress.torch.fusion`; ``named`` in the
    optimizer's order) the tensors share buckets as at run time
    (:func:`~gradpress.torch.fusion.bucket_keys`), one payload per bucket chunk.
    """
    from ..compress import build
    from ..compress.spec import parse_spec
    from ..ps.partition import chunk_layout
    from ..torch.fusion import bucket_keys, fused_codec
    from ..torch.plan import member_bytes

    cs = parse_spec(spec)
    packed = fused_codec(cs) is not None  # buckets travel compressed (int4...)
    keys = bucket_keys([(n, p.numel(), str(p.device)) for n, p in named],
                       limit=min_compress_bytes, spec=cs, cap=fusion_bytes,
                       exact=frozenset(exact))
    share = {m: member_bytes(k, j, n, partition_bytes, None if k.exact else fused_codec(cs))[0]
             for k in keys for j, (m, n) in enumerate(zip(k.members, k.numels, strict=True))}
    comp_dense = ncomp = 0
    comp_wire = model_dense = model_wire = 0.0
    dense_only = cs.name == "none"
    for name, p in named:
        numel = p.numel()
        small = dense_only or name in exact or (4 * numel < min_compress_bytes and not packed)
        chunks = [] if name in share else chunk_layout(numel, partition_bytes)
        wire = share.get(name, 0) + sum(build("none" if small else spec, c.numel).payload_bytes
                                        for c in chunks)
        model_dense, model_wire = model_dense + 4 * numel, model_wire + wire
        if not small:
            comp_dense, comp_wire, ncomp = comp_dense + 4 * numel, comp_wire + wire, ncomp + 1

    def ratio(a: float, b: float) -> float | None:
        return a / b if b else None

    return {"compressed_tensors": ncomp, "tensors": len(named),
            "compressed_fp32_bytes": comp_dense, "compressed_wire_bytes": round(comp_wire),
            "model_fp32_bytes": int(model_dense), "model_wire_bytes": round(model_wire),
            "compressed_vs_fp32": ratio(comp_dense, comp_wire),
            "compressed_vs_fp16": ratio(comp_dense // 2, comp_wire),
            "model_vs_fp32": ratio(model_dense, model_wire),
            "model_vs_fp16": ratio(model_dense // 2, model_wire)}


def print_plan(plan: Any, compressed: bool = True, run: str | None = None) -> None:
    """Print a :class:`~gradpress.torch.plan.Plan`'s table to stdout (one line when nothing is
    compressed; headed "plan of run RUN" when ``run`` is given), above a tqdm progress bar if
    one is running."""
    label = "gradpress plan" if run is None else f"plan of run {run}"
    text = plan.format(label) if compressed else \
        f"{label}: nothing is compressed (compression none), {len(plan.tensors)} tensors"
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        print(text, flush=True)
        return
    tqdm.write(text)
    sys.stdout.flush()


def _smooth(values: list[float], alpha: float = 0.1) -> list[float]:
    """Exponential moving average with bias correction (as TensorBoard's smoothing)."""
    out, acc = [], 0.0
    for i, v in enumerate(values, 1):
        acc = (1 - alpha) * acc + alpha * v
        out.append(acc / (1 - (1 - alpha) ** i))
    return out


def plot_runs(out_dir: str | Path, runs: Mapping[str, Sequence[Mapping[str, Any]]]
              ) -> list[Path]:
    """Draw every run's curves into PNGs in ``out_dir``; returns the files written.

    ``loss_vs_step.png``, ``loss_vs_time.png`` (training loss of rank 0, raw and smoothed),
    ``bytes_per_step.png`` (pushed and pulled bytes per step per worker, log scale) and, when
    there are evaluations, ``eval_vs_step.png`` (the primary metric).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    data = {name: ([r for r in recs if r.get("kind") == "step"],
                   [r for r in recs if r.get("kind") == "eval"]) for name, recs in runs.items()}
    files = []
    for fname, xkey, xlabel in (("loss_vs_step.png", "step", "step"),
                                ("loss_vs_time.png", "time_s", "wall time (s)")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, (name, (steps, _)) in enumerate(data.items()):
            xs, ys = [s[xkey] for s in steps], [s["loss"] for s in steps]
            ax.plot(xs, ys, color=f"C{i}", alpha=0.25, linewidth=0.8)
            ax.plot(xs, _smooth(ys), color=f"C{i}", label=name)
        ax.set(xlabel=xlabel, ylabel="training loss (rank 0)", yscale="log")
        files.append(_save(fig, ax, out / fname))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, (steps, _)) in enumerate(data.items()):
        xs = [s["step"] for s in steps]
        ax.plot(xs, [max(1, s["bytes_pulled"]) for s in steps], color=f"C{i}", linewidth=4,
                alpha=0.3, label=f"{name} pull")
        ax.plot(xs, [max(1, s["bytes_pushed"]) for s in steps], color=f"C{i}",
                label=f"{name} push")
    ax.set(xlabel="step", ylabel="bytes per step per worker", yscale="log")
    files.append(_save(fig, ax, out / "bytes_per_step.png"))
    if any(evals for _, evals in data.values()):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for i, (name, (_, evals)) in enumerate(data.items()):
            if evals:
                ys = [e["metrics"][e["primary"]] for e in evals]
                ax.plot([e["step"] for e in evals], ys, "o-", color=f"C{i}", label=name)
                ax.set_ylabel(evals[-1]["primary"])
        ax.set(xlabel="step")
        files.append(_save(fig, ax, out / "eval_vs_step.png"))
    return files


def _save(fig: Any, ax: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}x"


def format_run(rep: Mapping[str, Any]) -> str:
    """A human-readable block for one run's report."""
    cfg = rep.get("config") or {}
    lines = [f"run {rep['run']} ({rep['status']}): task {cfg.get('task') or 'script'}, "
             f"optimizer {cfg.get('optimizer', '?')}, compression {cfg.get('compression', '?')}"
             f", ef {(rep.get('hparams') or {}).get('ef', cfg.get('ef', '?'))}, "
             f"lr {(rep.get('hparams') or {}).get('lr', '?')}"]
    if "metric" in rep:
        others = ", ".join(f"{k} {v:.4f}" for k, v in rep["final_eval"].items()
                           if k != rep["metric"]["name"])
        lines.append(f"  {rep['metric']['name']} {rep['metric']['value']:.4f}"
                     + (f" ({others})" if others else ""))
    if "final_train_loss" in rep:
        lines.append(f"  final training loss (rank 0, last 10 steps) "
                     f"{rep['final_train_loss']:.4f}")
    lines.append(f"  wall time {rep['wall_s']:.1f} s, {rep['steps']} steps"
                 + (f", {rep['s_per_step'] * 1e3:.1f} ms/step" if rep["s_per_step"] else ""))
    b = rep["bytes_per_step"]
    lines.append(f"  bytes on the wire per step per worker: push {human_bytes(b['push'])}, "
                 f"pull {human_bytes(b['pull'])} (dense fp32 {human_bytes(b['dense_fp32'])})"
                 + (f"; last step: push {human_bytes(b['push_last'])}, pull "
                    f"{human_bytes(b['pull_last'])}"
                    if abs(b["push_last"] - b["push"]) > 0.01 * b["push"] else ""))
    lines.append(f"  compression ratio, whole model (measured): "
                 f"{_x(rep['model_ratio_vs_fp32'])} vs fp32, {_x(rep['model_ratio_vs_fp16'])}"
                 " vs fp16")
    if "codec" in rep:
        c = rep["codec"]
        lines.append(f"  compression ratio, compressed tensors ({c['compressed_tensors']} of "
                     f"{c['tensors']}, codec payloads): {_x(c['compressed_vs_fp32'])} vs fp32, "
                     f"{_x(c['compressed_vs_fp16'])} vs fp16")
    if "diloco" in rep:
        d = rep["diloco"]
        lines.append(f"  diloco: {d['outer_steps']} outer steps, one every {d['sync_every']} "
                     f"steps (overlap {'on' if d['overlap'] else 'off'}); bytes per step "
                     f"{_x(d['ratio_vs_per_step_fp32'])} fewer than a per-step fp32 exchange")
    st = rep.get("stages_s", {})
    loop = ", ".join(f"{k[:-2]} {v:.2f}" for k, v in st.items() if k not in _RUNTIME_STAGES)
    rt = ", ".join(f"{k[:-2]} {st[k]:.2f}" for k in _RUNTIME_STAGES if k in st)
    lines.append(f"  time per stage (s): {loop}" + (f"; runtime threads: {rt}" if rt else ""))
    if rep.get("reason"):
        lines.append(f"  stopped early: {rep['reason']}")
    if rep.get("replicas_identical") is False:
        lines.append("  WARNING: the workers' model replicas differ at the end")
    return "\n".join(lines)


def format_table(reports: Sequence[Mapping[str, Any]],
                 extra: Sequence[tuple[str, Sequence[str]]] = ()) -> str:
    """Side-by-side table of runs: metric, time, ``extra`` columns (header, one cell per
    report; e.g. time to accuracy), bytes per step, compression ratios."""
    for header, cells in extra:
        if len(cells) != len(reports):
            raise ValueError(f"format_table: column {header!r} has {len(cells)} cells for "
                             f"{len(reports)} reports")
    head = ("run", "compression", "lr", "metric", "time", *(h for h, _ in extra), "push/step",
            "pull/step", "model vs fp32", "model vs fp16", "compressed vs fp16")
    rows = [head]
    for i, r in enumerate(reports):
        cfg, m = r.get("config") or {}, r.get("metric")
        lr = (r.get("hparams") or {}).get("lr")
        rows.append((str(r["run"]), str(cfg.get("compression", "?")),
                     "-" if lr is None else f"{lr:g}",
                     "-" if m is None else f"{m['name']}={m['value']:.4f}",
                     f"{r['wall_s']:.1f} s", *(str(cells[i]) for _, cells in extra),
                     human_bytes(r["bytes_per_step"]["push"]),
                     human_bytes(r["bytes_per_step"]["pull"]), _x(r["model_ratio_vs_fp32"]),
                     _x(r["model_ratio_vs_fp16"]), _x(r.get("compressed_ratio_vs_fp16"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in rows)

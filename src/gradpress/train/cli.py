"""``gradpress train`` and ``gradpress demo``: argument definitions and runners.

``add_train_arguments``/``run_train`` and ``add_demo_arguments``/``run_demo`` plug into
:mod:`gradpress.cli`. Both validate everything (configuration, output directory) before any
process starts, launch one local cluster through :func:`gradpress.launch.launch` whose workers
run :mod:`gradpress.train.worker` (or the user's script), then read the run's ``metrics.jsonl``,
write ``report.json`` and the plots, and print the report. Interrupted runs (Ctrl-C) keep their
metrics and get a partial report with status ``interrupted``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .config import TrainConfig
from .options import add_arguments, from_namespace
from .periodic import resolve_resume
from .report import (
    format_run,
    format_table,
    human_bytes,
    plot_runs,
    read_metrics,
    run_report,
    write_json,
)
from .restarts import INTERRUPTED, run_with_restarts, start_from
from .session import CONFIG_ENV
from .slowlink import check_bandwidth, launch_limited, link_budget
from .tensorboard import SUBDIR as TB_SUBDIR
from .tensorboard import resolve as resolve_tensorboard
from .tta import plot_eval_vs_time, time_to_accuracy, tta_columns, tta_summary

__all__ = ["add_train_arguments", "run_train", "add_demo_arguments", "run_demo",
           "prepare_out_dir", "demo_configs", "DEMO_RUNS", "DEMO_BANDWIDTH"]

_PLAN = "config.json"
_OUTPUTS = ("metrics.jsonl", "report.json", "loss_vs_step.png", "loss_vs_time.png",
            "bytes_per_step.png", "eval_vs_step.png", "eval_vs_time.png")
_INTERRUPTED = INTERRUPTED

#: The demo's runs on digits-cnn (name, optimizer, compression, learning rate): CLAN at the
#: rate tuned for it (see ``docs/results.md``) and DiLoCo, AdamW at the task's rate with one
#: int4 outer step every 50 steps.
DEMO_RUNS = (
    ("uncompressed", "clan", "none", 4e-3),
    ("int4", "clan", "int4", 4e-3),
    ("clan-onebit", "clan", "onebit", 4e-3),
    ("diloco", "diloco", "int4", None),
)
DEMO_EPOCHS = 16
#: ``--bandwidth`` without a rate: the uncompressed run's traffic then takes far longer than its
#: compute (docs/train.md).
DEMO_BANDWIDTH = "100mbit"


def prepare_out_dir(path: str | Path, resuming: bool = False) -> Path:
    """Create ``path`` and prove it writable; remove outputs of an earlier run there (when
    ``resuming``, its metrics and TensorBoard events stay: the resumed run appends to them).

    Raises:
        ValueError: the directory cannot be created or written (before training starts).
    """
    p = Path(path).expanduser()
    probe = p / f".gradpress-write-test-{uuid.uuid4().hex}"
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
        for name in (*_OUTPUTS, _PLAN):
            if not (resuming and name == "metrics.jsonl"):
                (p / name).unlink(missing_ok=True)
        for f in (p / TB_SUBDIR).glob("events.out.tfevents.*"):
            if not resuming:
                f.unlink()  # TensorBoard would show the earlier run's steps with this one's
    except OSError as e:
        raise ValueError(f"output directory {str(path)!r} cannot be written: "
                         f"{e.strerror or e}") from None
    return p.resolve()


def add_train_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Define the options of ``gradpress train`` on ``parser``: one per
    :class:`TrainConfig` field, generated from the fields (:mod:`gradpress.train.options`)."""
    return add_arguments(parser, TrainConfig)


def _train_config(args: argparse.Namespace) -> TrainConfig:
    return from_namespace(TrainConfig, args)


def _check_param_names(cfg: TrainConfig) -> None:
    """A bundled task's ``--uncompressed-params`` must name its parameters: checked on a model
    built here, before any process starts (script mode checks in the workers)."""
    if not cfg.task or cfg.uncompressed_params in ((), ("auto",)):
        return
    from ..tasks import get_task
    from ..torch.optimizer import match_names

    model = get_task(cfg.task).build_model(cfg.seed)
    match_names([n for n, p in model.named_parameters() if p.requires_grad],
                cfg.uncompressed_params, "--uncompressed-params")


def _launch(runs: Sequence[TrainConfig], plan: Path, script: tuple[str, ...] = (),
            bandwidth: str | None = None) -> int:
    """Start one local cluster whose workers run ``runs`` (or ``script``); its exit status.
    With ``bandwidth`` (a tc rate) the cluster runs in a namespace whose loopback has that
    rate (:mod:`gradpress.train.slowlink`)."""
    from ..launch import LaunchConfig, launch
    from .report import write_json as _write

    _write(plan, {"runs": [c.to_dict() for c in runs]})
    first = runs[0]
    env = {CONFIG_ENV: str(plan)}
    if script:  # plain push_pull calls of the script pick these up as defaults
        env.update({"GRADPRESS_COMPRESSION": first.compression,
                    "GRADPRESS_EF": first.effective_ef or ""})
        if first.min_compress_bytes != "auto":  # "auto" is the optimizers' (model sizes)
            env["GRADPRESS_MIN_COMPRESS_BYTES"] = str(first.min_compress_bytes)
    command = script or (sys.executable, "-m", "gradpress.train.worker", "--plan", str(plan))
    if bandwidth is not None:
        return launch_limited(bandwidth, command, first.workers, first.servers, env)
    cfg = LaunchConfig(command=tuple(command), workers_per_node=first.workers,
                       servers_per_node=first.servers, env=env)
    return launch(cfg)


def _status(rep: dict[str, Any], code: int) -> str:
    if rep["status"] == "completed" or code == 0:
        return rep["status"]
    return "interrupted" if code in _INTERRUPTED else "failed"


def _write_reports(runs: Sequence[TrainConfig], code: int, plots: bool = True,
                   restarts: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per run: ``report.json`` (and plots) in its directory; prints its report block."""
    reports = []
    for cfg in runs:
        recs = read_metrics(Path(cfg.out) / "metrics.jsonl")
        if not recs:
            continue  # never started (interrupted before it) or a script that logged nothing
        rep = run_report(recs)
        rep["status"] = _status(rep, code)
        rep.setdefault("config", cfg.to_dict())
        if cfg.tensorboard:
            rep["tensorboard"] = str(Path(cfg.out) / TB_SUBDIR)
        if restarts is not None:
            rep["restarts"] = restarts
        if plots:
            rep["plots"] = [str(p) for p in plot_runs(cfg.out, {cfg.name: recs})]
        write_json(Path(cfg.out) / "report.json", rep)
        print(format_run(rep), flush=True)
        reports.append(rep)
    return reports


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Ignore SIGINT/SIGTERM while the reports are written: a second Ctrl-C after the
    launcher stopped the job must not lose ``report.json``."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in sigs}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_train(args: argparse.Namespace) -> int:
    """``gradpress train``: validate, launch, report; returns the exit status."""
    cfg = _train_config(args)
    tensorboard = resolve_tensorboard(cfg.tensorboard)  # --tensorboard without it: an error
    _check_param_names(cfg)
    resume = resolve_resume(cfg.resume, Path(cfg.out).expanduser(), (cfg.workers, cfg.servers))
    out = prepare_out_dir(cfg.out, resuming=resume is not None)
    cfg = cfg.replace(out=str(out), tensorboard=tensorboard, resume=resume)
    if cfg.resume is not None or cfg.checkpoint_every or cfg.max_restarts:
        start_from(out, resume)  # a fresh run: no checkpoints of an earlier one to resume from
    if cfg.resume is not None:
        print(f"gradpress train: resuming from {resume}", flush=True)
    if tensorboard:
        print(f"gradpress train: TensorBoard scalars in {out / TB_SUBDIR} (tensorboard --logdir "
              f"{out})", flush=True)
    t0 = time.perf_counter()
    code, restarts = run_with_restarts(cfg, lambda c: _launch([c], out / _PLAN, c.script))
    with _uninterrupted():
        reports = _write_reports([cfg], code, restarts=restarts)
    if not reports:
        print(f"gradpress train: no metrics in {out} (a script logs them with "
              "gradpress.train.Session)", file=sys.stderr)
    print(f"total {time.perf_counter() - t0:.1f} s; run directory {out}", flush=True)
    return code


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Define the options of ``gradpress demo``."""
    a = parser.add_argument
    a("--out", default="runs/demo", help="output directory (default runs/demo)")
    a("--workers", type=int, default=2, help="worker processes (default 2)")
    a("--servers", type=int, default=1, help="server processes (default 1)")
    a("--epochs", type=int, default=DEMO_EPOCHS,
      help=f"epochs of each run (default {DEMO_EPOCHS})")
    a("--steps", type=int, help="stop each run after this many steps (for a quick look)")
    a("--seed", type=int, default=0, help="seed of model and data order (default 0)")
    a("--no-progress", action="store_true", help="no progress bars")
    a("--tensorboard", action=argparse.BooleanOptionalAction, default=None,
      help="TensorBoard scalars of every run in OUT/<run>/tensorboard/ (default: when the "
           "tensorboard package is installed)")
    a("--bandwidth", metavar="RATE", nargs="?", const=DEMO_BANDWIDTH,
      help="run the whole demo in a network namespace whose loopback is limited to RATE, a tc "
           f"rate such as 100mbit or 1gbit (default {DEMO_BANDWIDTH}; needs root, ip and tc): "
           "time to accuracy on a slow link")
    return parser


def demo_configs(args: argparse.Namespace, out: Path,
                 tensorboard: bool = False) -> list[TrainConfig]:
    """The demo's runs: digits-cnn with CLAN's optimizer uncompressed, on two-way ``int4``
    gradients (the default) and one-bit (CLAN, the paper's method), and DiLoCo (AdamW with
    local steps, for slow links)."""
    # no dense steps: a small CNN shows no gap without them (docs/guide.md)
    return [TrainConfig(name=name, task="digits-cnn", compression=spec, ef="vanilla",
                        optimizer=opt, lr=lr, epochs=args.epochs, steps=args.steps,
                        dense_steps=0 if opt != "diloco" else None,
                        seed=args.seed, workers=args.workers, servers=args.servers,
                        out=str(out / name), progress=not args.no_progress,
                        tensorboard=tensorboard)
            for name, opt, spec, lr in DEMO_RUNS]


def run_demo(args: argparse.Namespace,
             configs: Callable[[Path, bool], list[TrainConfig]] | None = None) -> int:
    """``gradpress demo``: four digits-cnn runs in one cluster (behind a link of
    ``--bandwidth`` when given), a side-by-side table with time to accuracy (to the first
    run's final result), plots. ``configs(out, tensorboard)`` replaces the runs (a benchmark's
    comparison; default :func:`demo_configs`)."""
    rate = None if args.bandwidth is None else check_bandwidth(args.bandwidth)
    tensorboard = resolve_tensorboard(args.tensorboard)  # --tensorboard without it: an error
    out = prepare_out_dir(args.out)
    runs = (configs(out, tensorboard) if configs is not None
            else demo_configs(args, out, tensorboard))
    for cfg in runs:
        prepare_out_dir(cfg.out)
    t0 = time.perf_counter()
    code = _launch(runs, out / _PLAN, bandwidth=rate)
    with _uninterrupted():
        reports = _write_reports(runs, code, plots=False)  # one set of plots with every run
        summary = _demo_summary(runs, reports, out, rate)
        wall = time.perf_counter() - t0
        write_json(out / "report.json", {"status": "completed" if code == 0 else "stopped",
                                         "exit_code": code, "wall_s": wall, **summary,
                                         "runs": reports})
    print(f"\n{summary['table']}\n\n{summary['summary']}\n\ntotal {wall:.1f} s (one cluster, "
          f"start-up included); plots and reports in {out}", flush=True)
    if tensorboard:
        print(f"TensorBoard, the runs side by side: tensorboard --logdir {out}", flush=True)
    return code


def _demo_summary(runs: Sequence[TrainConfig], reports: Sequence[dict[str, Any]], out: Path,
                  rate: str | None) -> dict[str, Any]:
    """The demo report's comparison: time to the uncompressed run's final accuracy (table and
    sentences), the link's share of a step with ``--bandwidth``, the plots."""
    recs = {cfg.name: read_metrics(Path(cfg.out) / "metrics.jsonl") for cfg in runs}
    recs = {k: v for k, v in recs.items() if v}
    baseline = runs[0].name
    tta = time_to_accuracy(recs, baseline) if baseline in recs else None
    plots = plot_runs(out, recs) if reports else []
    if reports and (p := plot_eval_vs_time(out, recs, tta)) is not None:
        plots.append(p)
    table = format_table(reports, tta_columns(tta, [str(r["run"]) for r in reports]))
    lines = [tta_summary(tta)]
    link = None
    if rate is not None:
        link = {str(r["run"]): link_budget(r, rate, runs[0].workers) for r in reports}
        lines += [_link_line(name, b, rate) for name, b in link.items() if b is not None]
    return {"bandwidth": rate, "table": table, "time_to_accuracy": tta, "link": link,
            "summary": "\n".join(lines), "plots": [str(p) for p in plots]}


def _link_line(name: str, b: dict[str, Any], rate: str) -> str:
    compute = "?" if b["compute_s_per_step"] is None else f"{b['compute_s_per_step']:.3f}"
    return (f"{name}: {human_bytes(b['link_bytes_per_step'])} a step over the {rate} link "
            f"(every worker's push and pull) need {b['link_s_per_step']:.3f} s; compute "
            f"(forward and backward) {compute} s a step, the whole step {b['s_per_step']:.3f} s")

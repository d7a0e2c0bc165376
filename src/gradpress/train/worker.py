"""The per-worker training loop of ``gradpress train`` and ``gradpress demo``.

Run by every worker process of a local cluster started by the CLI::

    python -m gradpress.train.worker --plan RUN_DIR/config.json

The plan lists one or more :class:`~gradpress.train.config.TrainConfig` runs (the demo runs
three in one cluster; each run's tensor names start with its name, so their keys never mix).
For each run:

1. Build the task's model from the run's seed (identical on every worker), the configured
   optimizer behind ``gp.DistributedOptimizer``, and broadcast the parameters from rank 0 (or,
   with ``resume``, load the checkpoint: :mod:`gradpress.train.periodic`).
2. For each step: take this worker's shard of the global batch, forward and backward (the
   gradient hooks start the compressed push_pulls during backward), apply the lr schedule,
   synchronize and step; rank 0 logs loss, bytes and stage times to ``metrics.jsonl``.
3. Rank 0 evaluates after every epoch (or every ``eval_every`` steps) and at the end; the other
   workers go on and wait for it at the next push_pull. Every ``checkpoint_every`` steps all
   workers save a checkpoint.
4. At the end the workers compare fingerprints of their parameters (replicas must be
   bit-identical) and rank 0 writes the summary record (with ``params_sha256``).

SIGINT or SIGTERM (the launcher stopping everything after Ctrl-C) ends the worker at once; rank 0
first records ``{"kind": "end", "status": "interrupted"}`` after the steps already written.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import TrainConfig
from .guard import TrainingDiverged
from .periodic import TrainCheckpoints, params_sha256
from .session import Session

__all__ = ["run_task", "train_steps", "total_steps", "main"]


def total_steps(cfg: TrainConfig, steps_per_epoch: int, defaults: Any) -> int:
    """Optimizer steps of the run: ``steps`` and/or ``epochs``, else the task's defaults."""
    if cfg.epochs is None and cfg.steps is None:
        return defaults.total_steps(steps_per_epoch)
    by_epochs = cfg.epochs * steps_per_epoch if cfg.epochs is not None else None
    return min(x for x in (by_epochs, cfg.steps) if x is not None)


def _progress(cfg: TrainConfig, total: int, rank: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=cfg.name, unit="step", dynamic_ncols=True,
                disable=rank != 0 or not cfg.progress, file=sys.stderr)


def run_task(cfg: TrainConfig, sessions: list[Session] | None = None,
             optimizer_options: Mapping[str, Any] | None = None) -> Session:
    """Train ``cfg.task`` on this worker (steps 1-4 of the module docstring).

    ``sessions`` (if given) receives the session as soon as it exists, so an interrupt handler
    can record the partial run. ``optimizer_options`` go to the optimizer's class
    (:meth:`Session.optimizer`; experiments only, e.g. ``benchmarks/clan_script.py``).
    """
    import gradpress as gp
    from gradpress.tasks import get_task

    if cfg.task is None:
        raise ValueError("run_task needs a bundled task (TrainConfig.task), got None")
    task = get_task(cfg.task)
    bs = cfg.batch_size or task.defaults.batch_size
    spe = task.steps_per_epoch(gp.size(), bs)
    total = total_steps(cfg, spe, task.defaults)
    # 1. model, optimizer, identical start
    model = task.build_model(cfg.seed)
    model.train()
    s = Session(cfg, defaults=task.defaults, total_steps=total)
    if sessions is not None:
        sessions.append(s)
    opt = s.optimizer(model, **(optimizer_options or {}))
    ckpt = s.checkpoints(model, opt)
    s.start()
    epochs = train_steps(task, model, opt, s, bs, cfg.eval_every or spe, ckpt)
    # 4. replicas check and summary
    s.finish(model, task=cfg.task, epochs=epochs, steps_per_epoch=spe, batch_size=bs,
             total_steps=total, params_sha256=params_sha256(model), resumed_from=cfg.resume)
    return s


def train_steps(task: Any, model: Any, opt: Any, s: Session, bs: int, eval_every: int,
                ckpt: TrainCheckpoints | None = None) -> int:
    """Steps 2-3 until ``s.total_steps``; returns the number of epochs begun.

    The bundled task's loop with any optimizer: a script started by ``gradpress train ... --
    python SCRIPT`` that builds its own (``benchmarks/clan_script.py``) calls it between
    ``s.start()`` and ``s.finish()``; ``bs`` is the per-worker batch size and rank 0 evaluates
    every ``eval_every`` steps and at the end. With ``ckpt``, training goes on from its
    ``position`` (a resumed run skips the batches already drawn) and saves after each step
    when due.
    """
    rank, world, total = s.rank, s.size, s.total_steps
    if total is None:
        raise ValueError("train_steps needs the session's total_steps, got None")
    bar = _progress(s.cfg, total, rank)
    bar.update(s.steps)
    epoch, skip = ckpt.position if ckpt is not None else (0, 0)
    try:
        while s.steps < total:
            batches = task.train_batches(rank, world, bs, s.cfg.seed, epoch)
            index, skip = skip, 0
            for _ in range(index):  # drawn before the checkpoint
                next(batches, None)
            while s.steps < total:
                # 2. one step: data, forward/backward (pushes start), sync, update, log
                with s.stage("data"):
                    batch = next(batches, None)
                if batch is None:
                    break
                index += 1
                opt.zero_grad()
                with s.stage("compute"):
                    loss = task.loss(model, batch)
                    loss.backward()
                s.step(opt)
                loss_value = float(loss.detach())
                s.log_step(loss_value, epoch)
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.4f}", refresh=False)
                # 3. evaluation on rank 0
                if rank == 0 and (s.steps % eval_every == 0 or s.steps == total):
                    with s.stage("eval"):
                        result = task.evaluate(model)
                    s.log_eval(result)
                    bar.set_postfix(loss=f"{loss_value:.4f}",
                                    **{result.primary: f"{result.value:.4f}"})
                if ckpt is not None:
                    ckpt.after_step(epoch, index)
            epoch += 1
    finally:
        bar.close()
    return epoch


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def load_plan(path: str | Path) -> list[TrainConfig]:
    """The runs of a plan file written by the CLI (``{"runs": [config dicts]}``)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    runs = [TrainConfig.from_dict(d) for d in data.get("runs", [])]
    if not runs:
        raise ValueError(f"plan {path} lists no runs")
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m gradpress.train.worker --plan PATH``."""
    ap = argparse.ArgumentParser(prog="python -m gradpress.train.worker",
                                 description="one worker of a gradpress train/demo cluster")
    ap.add_argument("--plan", required=True, help="config.json written by gradpress train")
    args = ap.parse_args(argv)
    runs = load_plan(args.plan)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _raise_interrupt)
    import gradpress as gp

    sessions: list[Session] = []
    try:
        gp.init()
        for cfg in runs:
            run_task(cfg, sessions)
        gp.shutdown()
        return 0
    except KeyboardInterrupt as e:
        # the launcher is stopping every process: keep the metrics, skip the shutdown handshake;
        # a second signal must not interrupt the writing of what was measured
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        if sessions:
            sessions[-1].ended("interrupted", str(e) or "SIGINT")
        sys.stderr.flush()
        os._exit(130)
    except TrainingDiverged as e:  # recorded by the session; the message says it all
        print(f"gradpress worker: {e}", file=sys.stderr, flush=True)
        return 1
    except BaseException as e:
        if sessions:
            sessions[-1].ended("failed", f"{type(e).__name__}: {e}")
        raise


if __name__ == "__main__":
    sys.exit(main())

"""``Session``: the per-worker half of ``gradpress train`` (bundled tasks and user scripts).

A session builds the configured optimizer, drives the learning-rate schedule, times the stages
of each step, and (on rank 0) appends one JSON record per step to ``metrics.jsonl`` with the
bytes that crossed the wire (per-step deltas of ``gp.stats()``), also as TensorBoard scalars
with ``cfg.tensorboard`` (:mod:`gradpress.train.tensorboard`); at the first compressed step
rank 0 prints the optimizer's plan (``opt.plan()``, see ``docs/train.md``) and records it. A
user script started by ``gradpress train ... -- python my_train.py`` gets the same machinery::

    import gradpress as gp
    from gradpress.train import Session
    gp.init()
    s = Session.from_env()                  # the config `gradpress train` exported
    opt = s.optimizer(model)                # e.g. CLAN + DistributedOptimizer(onebit, ef)
    for x, y in batches:
        opt.zero_grad()
        with s.stage("compute"):
            loss = loss_fn(model(x), y); loss.backward()
        s.step(opt)                         # synchronize, optimizer step, next lr
        s.log_step(loss.item())
    s.log_eval({"accuracy": acc}, primary="accuracy")
    s.finish(model)

A script checkpoints like a bundled task (``--checkpoint-every``, ``--resume``,
``--max-restarts``) through :meth:`Session.checkpoints`: it resumes when the run does (else
broadcasts the parameters), and ``ck.after_step(epoch, index)`` after each step saves when due;
``ck.position`` is the (epoch, batches drawn in it) to go on from.

The optimizer (``--optimizer``) is built by :func:`gradpress.torch.builder.build_optimizer`,
the builder of ``gp.CLAN`` and ``gp.OneBitLANS``: the same settings give the same optimizer.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..compress.registry import ef_needs_lr
from .config import TrainConfig
from .guard import DivergenceGuard, TrainingDiverged
from .hparams import lr_factor, resolve_hparams
from .report import MetricsWriter, codec_ratios, print_plan, read_metrics

__all__ = ["Session", "CONFIG_ENV", "STAGES", "resolve_hparams", "codec_ratios"]

#: Environment variable naming the ``config.json`` that ``gradpress train`` writes for scripts.
CONFIG_ENV = "GRADPRESS_TRAIN_CONFIG"
#: Stages timed by the training loop (``gp.stats()`` adds compress/send/wait/decompress).
STAGES = ("data", "compute", "sync", "update", "eval")
_RUNTIME_STAGES = ("compress_s", "send_s", "wait_s", "decompress_s")
_BYTES = ("bytes_pushed", "bytes_pulled", "dense_fp32_bytes")


class Session:
    """Optimizer, schedule, stage timers and metrics of one run on one worker.

    Args:
        cfg: the run's configuration.
        defaults: the task's :class:`~gradpress.tasks.TaskDefaults` (None in script mode).
        total_steps: planned optimizer steps (for the schedule and the 1-bit optimizers'
            default ``dense_steps``).
        run_dir: where rank 0 writes ``metrics.jsonl`` (default ``cfg.out``).
    """

    def __init__(self, cfg: TrainConfig, *, defaults: Any | None = None,
                 total_steps: int | None = None, run_dir: str | Path | None = None) -> None:
        from .. import api

        self.cfg = cfg
        self.rank, self.size = api.rank(), api.size()
        self.hparams = resolve_hparams(cfg, defaults, total_steps)
        self.total_steps = total_steps
        self.steps = 0
        self.run_dir = Path(run_dir or cfg.out)
        metrics = self.run_dir / "metrics.jsonl"
        # a resumed run's clock goes on from the records it appends to (cut back to its
        # checkpoint), so time_s and wall_s cover every segment of the run
        self._clock0 = _recorded_time(metrics) if self.rank == 0 and cfg.resume else 0.0
        self.writer = MetricsWriter(metrics, append=bool(cfg.resume)) if self.rank == 0 else None
        self.tensorboard: Any = None  # rank 0 with cfg.tensorboard: the same records as scalars
        if self.writer is not None and cfg.tensorboard:
            from .tensorboard import SUBDIR, TensorBoardWriter

            self.tensorboard = TensorBoardWriter(self.run_dir / SUBDIR)
        self.stage_s = dict.fromkeys(STAGES, 0.0)
        self._step_stage = dict.fromkeys(STAGES, 0.0)
        self._named: list[tuple[str, nn.Parameter]] = []
        self._wrapper: Any = None
        self._created = self._t0 = self._last_t = time.perf_counter()
        self._last_stats = self._stats()
        self._started = False
        self.setup_s = 0.0
        self._last_eval: dict[str, Any] | None = None
        self._plan: Any = None       # rank 0: the optimizer's Plan, from the first step on
        self._plan_written = False
        self._lr = float(self.hparams["lr"])
        frac = cfg.stop_on_divergence
        self.guard = DivergenceGuard(frac) if frac is not None and self.rank == 0 else None

    @classmethod
    def from_env(cls, total_steps: int | None = None) -> Session:
        """The session of a script started by ``gradpress train ... -- CMD`` (reads
        ``$GRADPRESS_TRAIN_CONFIG``); ``total_steps`` defaults to the config's ``steps``."""
        path = os.environ.get(CONFIG_ENV)
        if not path:
            raise ValueError(f"${CONFIG_ENV} is not set: start the script with "
                             "`gradpress train [options] -- python SCRIPT ...`")
        cfg = TrainConfig.from_dict(json.loads(Path(path).read_text())["runs"][0])
        return cls(cfg, total_steps=total_steps or cfg.steps)

    def checkpoints(self, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
        """The run's :class:`~gradpress.train.periodic.TrainCheckpoints` of ``model`` and
        ``opt`` (collective over the workers): with ``cfg.resume`` (``--resume``, or the
        checkpoint a restart resumes from) it is loaded at once, else worker 0's parameters are
        broadcast. Call it after :meth:`optimizer`, before :meth:`start`."""
        from ..torch.broadcast import broadcast_parameters
        from .periodic import TrainCheckpoints

        ck = TrainCheckpoints(self, model, opt)
        if self.cfg.resume:
            ck.resume(self.cfg.resume)
        else:
            broadcast_parameters({f"{self.cfg.name}.{k}": v
                                  for k, v in model.state_dict().items()}, root_rank=0)
        return ck

    def note_resize(self, event: Mapping[str, Any]) -> None:
        """Rank 0: record that the run resumed a checkpoint of another number of workers
        (:func:`gradpress.elastic.last_resize`); ``report.json`` lists it under ``resized``."""
        if self.writer is not None:
            self._record({"kind": "resize", "run": self.cfg.name, "step": self.steps,
                          **event})

    @property
    def is_logger(self) -> bool:
        """Whether this worker writes the metrics (rank 0)."""
        return self.writer is not None

    # -- optimizer ------------------------------------------------------------------------------
    def optimizer(self, model: nn.Module, *, core: type | None = None,
                  **options: Any) -> torch.optim.Optimizer:
        """The configured optimizer of ``model``, built by
        :func:`gradpress.torch.builder.build_optimizer` as ``gp.CLAN`` and ``gp.OneBitLANS``
        build theirs (tensor names prefixed by the run's name, so runs can share a cluster).

        ``core`` and ``options`` replace the optimizer's class and go to it as they are (the
        convergence study's variants in ``benchmarks/``); none by default.
        """
        from ..torch.builder import build_optimizer

        self._named = [
            (f"{self.cfg.name}.{n}", p) for n, p in model.named_parameters() if p.requires_grad]
        if self.cfg.optimizer == "diloco":
            return self._local_steps(model)
        self._wrapper = build_optimizer(self._named, self._optimizer_config(), core=core,
                                        core_options=options)
        self.set_lr(self._wrapper)  # each group's peak lr; the first step's lr, before backward
        return self._wrapper

    def _local_steps(self, model: nn.Module) -> Any:
        """``--optimizer diloco``: AdamW inside ``gp.DiLoCo`` (:mod:`.local_steps`)."""
        from .local_steps import build_local_steps

        cfg, hp = self.cfg, self.hparams
        opt = build_local_steps(
            model, self._named, lr=hp["lr"], betas=hp["betas"],
            weight_decay=hp["weight_decay"], sync_every=hp["sync_every"],
            compression=cfg.compression, overlap=cfg.overlap, outer_lr=cfg.outer_lr,
            outer_momentum=cfg.outer_momentum, prefix=cfg.name)
        self._named = []  # nothing is pushed per step: the report counts rounds instead
        self._wrapper = opt
        self.set_lr(opt)
        return opt

    def _optimizer_config(self) -> Any:
        """The :class:`~gradpress.torch.builder.OptimizerConfig` of this run over
        ``self._named``: the config's settings, the task's defaults where it gives none,
        :mod:`gradpress.defaults` for the rest."""
        from ..torch.builder import OptimizerConfig
        from ..torch.optimizer import match_names

        cfg, hp = self.cfg, self.hparams
        listed: Any = "auto"
        if cfg.uncompressed_params != ("auto",):  # the names as the user wrote them, prefixed
            named = [n[len(cfg.name) + 1:] for n, _ in self._named]
            listed = [f"{cfg.name}.{n}" for n in sorted(
                match_names(named, cfg.uncompressed_params, "--uncompressed-params"))]
        kw: dict[str, Any] = {"betas": hp["betas"]} if "betas" in hp else {}
        if cfg.optimizer == "sgd-ef":
            kw["momentum"] = hp["momentum"]
        return OptimizerConfig(
            method=cfg.optimizer, lr=hp["lr"], compression=cfg.compression, ef=cfg.ef,
            dense_steps=hp.get("dense_steps"), weight_decay=hp["weight_decay"],
            min_compress_bytes=cfg.min_compress_bytes,
            uncompressed_params=listed, **kw)

    def _exact_names(self) -> frozenset[str]:
        """The tensors that travel exact: those named, and those the dense phase measured."""
        w = self._wrapper
        return frozenset(n for p, n in w._gp_names.items() if p in w._gp_dense)

    # -- stepping -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Time the enclosed block as stage ``name`` (one of :data:`STAGES`)."""
        if name not in self.stage_s:
            raise ValueError(f"unknown stage {name!r}; valid stages: {', '.join(STAGES)}")
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            self.stage_s[name] += dt
            self._step_stage[name] += dt

    def start(self, warmup: bool = True) -> None:
        """Start the run's clock and byte counters (called by :meth:`step` if not yet).

        With ``warmup`` (every worker must call it then), first run the optimizers' fused
        kernel on a tiny tensor and push_pull one throw-away tensor with the run's codec:
        kernels compile or load and links open on workers and servers, so the first measured
        step is not charged for them.
        """
        if self._started:
            return
        if warmup:
            import gradpress as gp

            from ..optim import kernels

            kernels.warm()  # the layer-wise optimizers' fused kernel (numba)
            x = torch.linspace(-1.0, 1.0, 1024)
            ef = self.cfg.effective_ef
            gp.push_pull(x, name=f"{self.cfg.name}.warmup", compression=self.cfg.compression,
                         ef=ef, lr=self.hparams["lr"] if ef_needs_lr(ef) else None,
                         min_compress_bytes=0)
        self._started = True
        self._t0 = self._last_t = time.perf_counter()
        self.setup_s = self._t0 - self._created
        self._last_stats = self._stats()
        self.stage_s = dict.fromkeys(STAGES, 0.0)
        self._step_stage = dict.fromkeys(STAGES, 0.0)
        if self.writer is not None:
            self._record({"kind": "start", "run": self.cfg.name,
                          "config": self.cfg.to_dict(), "hparams": self.hparams,
                          "workers": self.size, "setup_s": self.setup_s})

    def set_lr(self, opt: Any) -> float:
        """Apply the schedule for step ``self.steps`` to ``opt.param_groups`` (a torch optimizer
        or diloco's :class:`~.local_steps.LocalSteps`); returns the lr of the first group."""
        hp = self.hparams
        f = lr_factor(self.steps, hp["warmup_steps"], self.total_steps, hp["schedule"])
        for g in opt.param_groups:
            g["lr"] = g.setdefault("peak_lr", g["lr"]) * f
        return opt.param_groups[0]["lr"]

    def step(self, opt: torch.optim.Optimizer) -> float:
        """``synchronize`` (stage ``sync``), optimizer step (stage ``update``), then the next
        step's lr; returns this step's lr.

        A step's lr is in the optimizer before its backward pass (set when the previous step
        ends, or by :meth:`optimizer` for the first): gradients are pushed from backward hooks,
        and corrected error feedback scales by the lr they carry. An optimizer the session did
        not build gets its first lr here, after the first backward pass; call :meth:`set_lr`
        once before the loop to have it there too.
        """
        self.start(warmup=False)
        if any("peak_lr" not in g for g in opt.param_groups):  # not scheduled by the session yet
            self.set_lr(opt)
        lr = self._lr = opt.param_groups[0]["lr"]  # 1-bit momenta pushed in the update carry it
        self._note_plan(opt)
        with self.stage("sync"):
            opt.synchronize()  # type: ignore[attr-defined]
        with self.stage("update"), opt.skip_synchronize():  # type: ignore[attr-defined]
            opt.step()
        self.steps += 1
        if self.steps == self.total_steps and hasattr(opt, "sync"):
            with self.stage("sync"):
                opt.sync()  # diloco: every worker ends on the global parameters
        self.set_lr(opt)
        return lr

    def _note_plan(self, opt: torch.optim.Optimizer) -> None:
        """Rank 0, once: at the first compressed step print the optimizer's plan (what travels
        compressed, what exact, and why) and record it (``report.json``'s ``"plan"``)."""
        if self.writer is None or self._plan_written or not hasattr(opt, "plan"):
            return
        if self._plan is None:
            self._plan = opt.plan()
        if self.steps >= self._plan.dense_steps:
            self._plan = opt.plan()  # again: decisions measured in the dense phase are made
            print_plan(self._plan, self.cfg.compressed, self.cfg.name)
            self._write_plan()

    def _write_plan(self) -> None:
        if self.writer is not None and self._plan is not None and not self._plan_written:
            self._record({"kind": "plan", "run": self.cfg.name, "step": self.steps,
                          **self._plan.to_dict()})
            self._plan_written = True

    # -- metrics --------------------------------------------------------------------------------
    def _record(self, rec: Mapping[str, Any]) -> None:
        """Rank 0: append ``rec`` to ``metrics.jsonl`` and give its scalars to TensorBoard."""
        if self.writer is not None:
            self.writer.write(rec)
        if self.tensorboard is not None:
            self.tensorboard.write(rec)

    @staticmethod
    def _stats() -> dict[str, float]:
        import gradpress as gp

        return dict(gp.stats())

    def log_step(self, loss: float, epoch: int = 0) -> dict[str, Any] | None:
        """Rank 0: append the step's record (loss, lr, time, byte deltas, stage seconds);
        with ``cfg.stop_on_divergence``, then raises
        :class:`~gradpress.train.guard.TrainingDiverged` if the loss climbed back that far."""
        now, stats = time.perf_counter(), self._stats()
        rec = None
        if self.writer is not None:
            stages = {f"{k}_s": v for k, v in self._step_stage.items()}
            stages.update({k: stats[k] - self._last_stats[k] for k in _RUNTIME_STAGES})
            rec = {"kind": "step", "run": self.cfg.name, "step": self.steps, "epoch": epoch,
                   "loss": float(loss), "lr": self._lr,
                   "time_s": self._elapsed(now), "step_s": now - self._last_t,
                   **{k: int(stats[k] - self._last_stats[k]) for k in _BYTES},
                   "stages": stages}
            drifts = stats.get("drift_recoveries", 0) - self._last_stats.get("drift_recoveries", 0)
            if drifts:  # the health watch saw compressed momenta drift (gradpress.optim.health)
                rec["drift_recoveries"] = int(drifts)
            self._record(rec)
        self._last_stats, self._last_t = stats, now
        self._step_stage = dict.fromkeys(STAGES, 0.0)
        if self.guard is not None:
            try:
                self.guard.observe(loss, self.steps)
            except TrainingDiverged as e:
                self.ended("failed", f"{type(e).__name__}: {e}")
                raise
        return rec

    def log_eval(self, metrics: Any, primary: str | None = None,
                 higher_is_better: bool | None = None) -> None:
        """Rank 0: record an evaluation (an ``EvalResult`` or a mapping of metric values)."""
        if hasattr(metrics, "metrics"):  # EvalResult
            primary, higher_is_better = metrics.primary, metrics.higher_is_better
            metrics = metrics.metrics
        if not isinstance(metrics, Mapping) or not metrics:
            raise ValueError(f"log_eval needs a non-empty mapping of metrics, got {metrics!r}")
        primary = primary or next(iter(metrics))
        if primary not in metrics:
            raise ValueError(f"primary metric {primary!r} is not one of {sorted(metrics)}")
        if higher_is_better is None:
            higher_is_better = "acc" in primary
        self._last_eval = {"kind": "eval", "run": self.cfg.name, "step": self.steps,
                           "time_s": self._elapsed(),
                           "metrics": {k: float(v) for k, v in metrics.items()},
                           "primary": primary, "higher_is_better": bool(higher_is_better)}
        if self.writer is not None:
            self._record(self._last_eval)

    def finish(self, model: nn.Module | None = None, **extra: Any) -> None:
        """End the run: check that replicas agree, write the summary record (rank 0)."""
        same = self._replicas_identical(model) if model is not None else None
        if self.writer is None:
            return
        from .. import api
        from ..torch.fusion import has_worker_momentum

        self._write_plan()  # a run that ended in its dense phase: the plan it would have used
        rec = {"kind": "summary", "run": self.cfg.name, "status": "completed",
               "config": self.cfg.to_dict(), "hparams": self.hparams, "steps": self.steps,
               "workers": self.size, "wall_s": self._elapsed(),
               "setup_s": self.setup_s,
               "stages_s": {f"{k}_s": v for k, v in self.stage_s.items()},
               "replicas_identical": same, **extra}
        if self._named:  # in the optimizer's order, small tensors fused as they were pushed
            pushed = [(n, p) for p, n in self._wrapper._gp_names.items() if p.requires_grad]
            cap = 0 if has_worker_momentum(self._wrapper._gp_spec) else api.config().fusion_cap
            rec["codec"] = codec_ratios(pushed, self.cfg.compression, self._wrapper._gp_min_bytes,
                                        api.config().partition_bytes,
                                        exact=self._exact_names(), fusion_bytes=cap)
            rec["params"] = sum(p.numel() for _, p in self._named)
        if self.cfg.optimizer == "diloco" and self._wrapper is not None:
            loco = self._wrapper.loco
            rec["diloco"] = {"sync_every": loco.sync_every, "outer_steps": loco.outer_steps,
                             "overlap": loco.overlap,
                             "params": sum(g.numel() for g in loco.parameters())}
        self._record(rec)
        self.close_tensorboard()

    def close_tensorboard(self) -> None:
        """Flush and close the TensorBoard event file (after the last record; idempotent)."""
        if self.tensorboard is not None:
            self.tensorboard.close()

    def _elapsed(self, now: float | None = None) -> float:
        """Training seconds so far: this process's since :meth:`start`, plus those recorded by
        the segments a resumed run continues."""
        return self._clock0 + (time.perf_counter() if now is None else now) - self._t0

    def ended(self, status: str, reason: str) -> None:
        """Rank 0: record that the run stopped early with ``status`` (``interrupted`` or
        ``failed``) and why; the metrics so far stay on disk."""
        if self.writer is not None:
            self._record({"kind": "end", "run": self.cfg.name, "status": status,
                          "reason": reason, "step": self.steps, "time_s": self._elapsed()})
        self.close_tensorboard()

    def _replicas_identical(self, model: nn.Module) -> bool:
        """Compare the sha256 of every worker's parameters
        (:func:`~gradpress.train.periodic.tensors_sha256`): each worker writes its digest, as 16
        16-bit numbers (exact in float32), into its own row of a zero matrix; the servers sum
        the rows exactly and every worker compares them."""
        import gradpress as gp

        from .periodic import tensors_sha256

        digest = torch.frombuffer(bytearray(tensors_sha256(model.named_parameters())),
                                  dtype=torch.int16).to(torch.float32)
        slots = torch.zeros(self.size, digest.numel())
        slots[self.rank] = digest
        every = gp.push_pull(slots, name=f"{self.cfg.name}.replica-check", average=False,
                             compression="none", ef="none")
        return bool((every == every[0]).all())


def _recorded_time(metrics: Path) -> float:
    """The latest ``time_s`` of the step and eval records in ``metrics`` (0.0 if none)."""
    return max((float(r["time_s"]) for r in read_metrics(metrics)
                if r.get("kind") in ("step", "eval") and "time_s" in r), default=0.0)

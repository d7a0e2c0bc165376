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

Optimizer mapping (``--optimizer``):

1. ``clan``: :func:`gradpress.optim.clan` (LANS without gradient normalisation) wrapped in
   ``DistributedOptimizer(compression, ef, dense_steps)``, as ``gp.CLAN``; ``lans``, ``lamb``
   and ``adam`` (AdamW) likewise.
2. ``sgd-ef``: dist-EF-SGDM (Zheng, Huang, Kwok 2019): SGD without its own momentum behind
   ``DistributedOptimizer(momentum="nesterov")``; the worker-side momentum applies to every
   tensor, also to those below ``min_compress_bytes`` that travel uncompressed.
3. ``onebit-adam``: :class:`gradpress.optim.OneBitAdam`; gradients travel uncompressed for
   ``dense_steps`` steps (``DistributedOptimizer(compression="bf16")``; fp32 when
   ``--compression none``), then the optimizer
   communicates its momentum with ``push_pull(m, compression=spec, ef)`` (the wrapper stops
   pushing gradients once ``compression_active`` is true).
4. ``onebit-lans``: :class:`gradpress.optim.OneBitLANS`, driven like ``onebit-adam``: the
   algorithm of ``gp.OneBitLANS``.
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
from .config import MOMENTUM_OPTIMIZERS, TrainConfig
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
        self._named: list[tuple[str, torch.Tensor]] = []
        self._exact: frozenset[str] = frozenset()   # names that always travel uncompressed
        self._exact_keys: set[str] = set()          # their 1-bit Adam/LANS momentum keys
        self._auto = False                          # --uncompressed-params auto
        self._auto_taken = False
        self._wrapper: Any = None
        self._fusion: Any = None  # the Fuser of the small momenta (1-bit optimizers)
        self._flat_names: list[str] = []
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

    @property
    def is_logger(self) -> bool:
        """Whether this worker writes the metrics (rank 0)."""
        return self.writer is not None

    # -- optimizer ------------------------------------------------------------------------------
    def optimizer(self, model: nn.Module, **options: Any) -> torch.optim.Optimizer:
        """The configured optimizer of ``model``, wrapped in ``gp.DistributedOptimizer``.

        ``options`` go to the optimizer's class as they are (for experiments, e.g.
        ``variance="frozen"`` for :class:`gradpress.optim.OneBitLANS`); none by default.
        """
        import gradpress as gp
        from gradpress.optim import weight_decay_groups
        from gradpress.torch.optimizer import match_names

        cfg, hp = self.cfg, self.hparams
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._named = [(f"{cfg.name}.{n}", p) for n, p in named]
        self._auto = cfg.uncompressed_params == ("auto",)  # measured in the dense phase
        exact = () if self._auto else match_names([n for n, _ in named],
                                                  cfg.uncompressed_params, "--uncompressed-params")
        self._exact = frozenset(f"{cfg.name}.{n}" for n in exact)
        groups = weight_decay_groups(model.parameters(), hp["weight_decay"])
        wrap: dict[str, Any] = {"compression": cfg.compression, "ef": cfg.effective_ef,
                                "min_compress_bytes": cfg.min_compress_bytes,
                                "dense_steps": hp.get("dense_steps", 0),
                                "uncompressed_params": "auto" if self._auto
                                else sorted(self._exact)}
        opt = self._build(groups, wrap, options)
        if cfg.optimizer in MOMENTUM_OPTIMIZERS:
            opt.communicate = self._communicate_momentum
            warm = self._dense_codec()  # bf16 unless nothing is compressed (as gp.OneBitLANS)
            wrap = {"compression": warm or "none", "ef": "none",
                    "min_compress_bytes": cfg.min_compress_bytes,
                    "uncompressed_params": "auto" if self._auto else sorted(self._exact)}
            # the momentum keys are positions in the optimizer's flat parameter order
            names = {p: n for n, p in self._named}
            flat = [p for g in opt.param_groups for p in g["params"]]
            self._exact_keys = {str(i) for i, p in enumerate(flat) if names[p] in self._exact}
            self._describe_momentum(opt)
        self.set_lr(opt)  # records each group's peak lr; the first step's lr, before backward
        self._wrapper = gp.DistributedOptimizer(opt, named_parameters=self._named, **wrap)
        names_of = {p: n for n, p in self._named}
        self._flat_names = [names_of.get(p, "") for g in opt.param_groups for p in g["params"]]
        return self._wrapper

    def _measured_exact(self) -> None:
        """``--uncompressed-params auto``: take the tensors the dense phase measured as exact
        (decided at its end, the same on every worker) into the names and momentum keys."""
        meter = getattr(self._wrapper, "_gp_meter", None) if self._auto else None
        if meter is None or meter.result is None or self._auto_taken:
            return
        self._auto_taken = True
        self._exact = frozenset(meter.result.exact)
        self._exact_keys = {str(i) for i, n in enumerate(self._flat_names) if n in self._exact}

    def _build(self, groups: list[dict[str, Any]], wrap: dict[str, Any],
               options: Mapping[str, Any]) -> torch.optim.Optimizer:
        """The optimizer of :meth:`optimizer` (steps 1-4 of the module docstring); ``sgd-ef``
        puts its momentum into ``wrap``."""
        from gradpress.optim import LAMB, LANS, OneBitAdam, OneBitLANS

        cfg, hp = self.cfg, self.hparams
        kw = {"lr": hp["lr"], "weight_decay": hp["weight_decay"], **options}
        if cfg.optimizer == "sgd-ef":
            mu = hp["momentum"]
            if cfg.compressed:  # momentum before compression, on the workers (dist-EF-SGDM)
                wrap.update(momentum="nesterov", mu=mu)
                return torch.optim.SGD(groups, momentum=0.0, **kw)
            # uncompressed: torch's Nesterov momentum is the same update
            return torch.optim.SGD(groups, momentum=mu, nesterov=mu > 0, **kw)
        kw["betas"] = hp["betas"]
        if cfg.optimizer == "clan":  # what gradpress.optim.clan builds
            return LANS(groups, normalize_grad=False, **kw)
        if cfg.optimizer == "onebit-lans" and options.get("variance", "local") == "local":
            kw.setdefault("blend", self._momentum_exact)  # as gp.OneBitLANS (step 3 there)
        if cfg.optimizer in MOMENTUM_OPTIMIZERS:
            cls = OneBitLANS if cfg.optimizer == "onebit-lans" else OneBitAdam
            return cls(groups, dense_steps=hp["dense_steps"], **kw)
        cls = {"lans": LANS, "lamb": LAMB, "adam": torch.optim.AdamW}[cfg.optimizer]
        return cls(groups, **kw)

    def _describe_momentum(self, opt: torch.optim.Optimizer) -> None:
        """Tell the optimizer's plan how :meth:`_communicate_momentum` pushes the momenta, and
        build the fuser of the small ones (:mod:`gradpress.torch.fusion`)."""
        from ..compress.spec import CodecSpec, parse_spec
        from ..torch.fusion import momentum_fuser
        from ..torch.plan import MomentumTraffic, set_momentum_traffic

        cs, ef = parse_spec(self.cfg.compression), self.cfg.effective_ef
        spec = CodecSpec(cs.name, dict(cs.params), {**cs.wrappers, **({"ef": ef} if ef else {})})
        self._fusion = momentum_fuser(opt.param_groups, prefix=f"{self.cfg.name}.m.", spec=spec,
                                      min_compress_bytes=self.cfg.min_compress_bytes)
        set_momentum_traffic(opt, MomentumTraffic(
            prefix=f"{self.cfg.name}.m.", compression=spec,
            min_compress_bytes=self.cfg.min_compress_bytes,
            exact_keys=frozenset(self._exact_keys), dense_compression=self._dense_codec()))

    def _dense_codec(self) -> Any:
        """The 1-bit optimizers' dense-phase codec (:func:`gradpress.torch.plan.dense_codec`)."""
        from ..compress.spec import parse_spec
        from ..torch.plan import dense_codec

        return dense_codec(parse_spec(self.cfg.compression))

    def _momentum_exact(self, i: int) -> bool:
        """Whether every momentum arrives exact (fp32): then
        :class:`~gradpress.optim.OneBitLANS` blends in the recovered gradient (step 4)."""
        from ..compress.spec import parse_spec
        from ..torch.plan import travels_exact

        self._measured_exact()
        spec = parse_spec(self.cfg.compression)
        flat = [p for g in self._wrapper.param_groups for p in g["params"]]
        return all(travels_exact(p.numel(), spec=spec, exact=str(j) in self._exact_keys,
                                 min_compress_bytes=self.cfg.min_compress_bytes)
                   for j, p in enumerate(flat))

    def _communicate_momentum(self, key: str, m: torch.Tensor) -> Any:
        """1-bit Adam's compression stage: compressed, error-fed push_pull of the momentum."""
        import gradpress as gp
        from gradpress.torch.optimizer import ALWAYS_EXACT

        ef = self.cfg.effective_ef
        self._measured_exact()
        if self._fusion.fuses(f"{self.cfg.name}.m.{key}"):  # small: shares a fused key
            return self._fusion.add(f"{self.cfg.name}.m.{key}", m)
        exact = key in self._exact_keys  # named tensors travel as small tensors do
        return gp.push_pull_async(m, name=f"{self.cfg.name}.m.{key}", average=True,
                                  compression=self.cfg.compression, ef=ef,
                                  lr=self._lr if ef_needs_lr(ef) else None,
                                  min_compress_bytes=ALWAYS_EXACT if exact
                                  else self.cfg.min_compress_bytes)

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
            n = max(1024, self.cfg.min_compress_bytes // 4)
            x = torch.linspace(-1.0, 1.0, n)
            ef = self.cfg.effective_ef
            gp.push_pull(x, name=f"{self.cfg.name}.warmup", compression=self.cfg.compression,
                         ef=ef, lr=self.hparams["lr"] if ef_needs_lr(ef) else None,
                         min_compress_bytes=self.cfg.min_compress_bytes)
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

    def set_lr(self, opt: torch.optim.Optimizer) -> float:
        """Apply the schedule for step ``self.steps``; returns the lr of the first group."""
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
        self._measured_exact()
        if self._named:  # in the optimizer's order, small tensors fused as they were pushed
            pushed = [(n, p) for p, n in self._wrapper._gp_names.items() if p.requires_grad]
            cap = 0 if has_worker_momentum(self._wrapper._gp_spec) else api.config().fusion_cap
            rec["codec"] = codec_ratios(pushed, self.cfg.compression,
                                        self.cfg.min_compress_bytes, api.config().partition_bytes,
                                        exact=self._exact, fusion_bytes=cap)
            rec["params"] = sum(p.numel() for _, p in self._named)
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
        """Gather a fingerprint of every worker's parameters (each worker fills its own slot
        of a zero vector, the servers sum exactly) and compare them bit for bit."""
        import gradpress as gp

        flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        slots = torch.zeros(self.size, 3)
        slots[self.rank] = torch.stack([flat.sum(), flat.abs().sum(), (flat * flat).sum()])
        every = gp.push_pull(slots, name=f"{self.cfg.name}.replica-check", average=False,
                             compression="none", ef="none")
        return bool((every == every[0]).all())


def _recorded_time(metrics: Path) -> float:
    """The latest ``time_s`` of the step and eval records in ``metrics`` (0.0 if none)."""
    return max((float(r["time_s"]) for r in read_metrics(metrics)
                if r.get("kind") in ("step", "eval") and "time_s" in r), default=0.0)

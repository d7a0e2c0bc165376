"""``TrainConfig``: everything one ``gradpress train`` run needs, validated on construction.

A config is frozen and keyword-only. Each field is also a ``gradpress train`` option: its help
text is the field's documentation and the argument parser is generated from the fields
(:mod:`gradpress.train.options`). Fields left as ``None`` take the task's or the optimizer's
defaults when the worker resolves them. Bad input is a ``ValueError`` naming the field, the
value and what was expected; an unknown task, codec or optimizer lists the valid choices.
Validation imports no task data, so it is cheap and runs before any process starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import defaults
from ..torch.builder import METHODS, MOMENTUM_METHODS
from .options import option

__all__ = ["TrainConfig", "OPTIMIZERS", "EF_CHOICES", "SCHEDULES", "MOMENTUM_OPTIMIZERS"]

#: ``--optimizer`` choices; :mod:`gradpress.torch.builder` says what each one builds, and
#: ``diloco`` is AdamW inside ``gp.DiLoCo`` (:mod:`gradpress.train.local_steps`).
OPTIMIZERS = (*METHODS, "diloco")
#: Optimizers that communicate their momentum after ``dense_steps`` (>= 1) dense steps.
MOMENTUM_OPTIMIZERS = MOMENTUM_METHODS
#: The error-feedback kinds ``--ef`` takes (``vanilla`` also as ``vanilla:decay=B,...``).
EF_CHOICES = ("vanilla", "corrected", "sparse", "none")
#: Learning-rate schedules after the linear warm-up.
SCHEDULES = ("constant", "cosine", "linear")


def _positive_int(obj: Any, name: str, optional: bool = True, lo: int = 1) -> None:
    v = getattr(obj, name)
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"TrainConfig.{name} must be an int >= {lo}, got {v!r}")


def _number(obj: Any, name: str, lo: float, *, strict: bool, hi: float | None = None,
            closed: bool = False) -> None:
    v = getattr(obj, name)
    if v is None:
        return
    bad = isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
    if not bad:
        bad = v <= lo if strict else v < lo
        bad = bad or (hi is not None and (v > hi if closed else v >= hi))
    if bad:
        rng = f"> {lo}" if strict else f">= {lo}"
        rng += f" and {'<=' if closed else '<'} {hi}" if hi is not None else ""
        raise ValueError(f"TrainConfig.{name} must be a finite number {rng}, got {v!r}")


def _choice(obj: Any, name: str, valid: tuple[str, ...], what: str) -> None:
    v = getattr(obj, name)
    if v not in valid:
        raise ValueError(f"unknown {what} {v!r}; valid {what}s: {', '.join(valid)}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run on a local cluster (``gradpress train``; the demo runs three).

    Either ``task`` (a bundled task, trained by ``python -m gradpress.train.worker``) or
    ``script`` (the user's own worker command, see ``docs/reference/cli.md``) must be given.
    Every field is documented by its help text (``gradpress train --help``).
    """

    #: Label of the run: prefixes its tensor names (runs can share a cluster, as the demo's
    #: three do) and names it in reports.
    name: str = "run"
    task: str | None = option(None, "bundled task, or give a worker script after --",
                              metavar="NAME", choices=lambda: _task_names())
    script: tuple[str, ...] = option((), "script mode: -- CMD ... run by each worker instead "
                                         "of a bundled task", metavar="CMD",
                                     positional=True)
    workers: int = option(2, "worker processes", metavar="N")
    servers: int = option(1, "parameter-server processes", metavar="N")
    compression: str = option(None, "codec spec of the gradients (of the momenta for "
                                    "onebit-adam/onebit-lans), e.g. none, int8, "
                                    f"topk:k=0.001,values=fp16 (default: "
                                    f"{defaults.ONEBIT_COMPRESSION} for "
                                    f"{', '.join(defaults.ONEBIT_METHODS)}, "
                                    f"{defaults.COMPRESSION} otherwise)", metavar="SPEC")
    ef: str | None = option(None, "error feedback on workers and servers (default: "
                                  f"{defaults.MOMENTUM_EF} for onebit-lans, {defaults.EF} "
                                  "otherwise); vanilla also as vanilla:decay=B[,server_decay=S]"
                                  "[,anneal=1] (residuals decay by B a step, the servers' by S; "
                                  "anneal=1 moves B towards 1 as the lr falls); ignored without "
                                  "compression", metavar="KIND", choices=EF_CHOICES)
    optimizer: str = option("clan", "optimizer", metavar="NAME", choices=OPTIMIZERS)
    lr: float | None = option(None, "peak learning rate (default: the task's for the "
                                    "optimizer; required with a script)", metavar="LR")
    epochs: int | None = option(None, "passes over the training data (default: the task's "
                                      "unless --steps is given)", metavar="N")
    steps: int | None = option(None, "stop after this many steps (with --epochs: whichever "
                                     "comes first)", metavar="N")
    batch_size: int | None = option(None, "per-worker batch size (default: the task's)",
                                    metavar="N")
    weight_decay: float | None = option(None, "decoupled weight decay, not on biases and "
                                              "normalisation weights (default: the task's; "
                                              f"{defaults.WEIGHT_DECAY} with a script)",
                                        metavar="WD")
    warmup_steps: int | None = option(None, "linear learning-rate warm-up steps (default: the "
                                            "task's)", metavar="N")
    schedule: str = option("cosine", "lr schedule after the warm-up", metavar="KIND",
                           choices=SCHEDULES)
    dense_steps: int | None = option(None, "uncompressed opening steps before compression "
                                           f"starts (default: {defaults.DENSE_STEPS} for clan, "
                                           "onebit-lans and onebit-adam, 0 for the others; "
                                           "not for sgd-ef)", metavar="N")
    uncompressed_params: tuple[str, ...] = option(
        (defaults.UNCOMPRESSED_PARAMS,), "parameters (names or fnmatch patterns, e.g. "
        "pos.weight) whose gradients or momenta always travel uncompressed; auto: those whose "
        "gradients agree little across workers, measured in the dense phase", metavar="NAME")
    #: diloco: inner steps per outer step (None: ``gradpress.defaults.DILOCO_SYNC_EVERY``).
    sync_every: int | None = None
    #: diloco: send each round while the next H inner steps run, applying its outer update
    #: one round late (``gp.DiLoCo(overlap=True)``).
    overlap: bool = False
    #: diloco: the outer SGD step's lr (1.0 with no momentum: plain averaging).
    outer_lr: float = 1.0
    #: diloco: the outer step's Nesterov momentum (DiLoCo's paper: lr 0.7, momentum 0.9).
    outer_momentum: float = 0.0
    #: ``sgd-ef``'s momentum, applied before compression (None: the task's).
    momentum: float | None = None
    #: The Adam-family optimizers' moment decays (None: :data:`gradpress.defaults.BETAS`).
    betas: tuple[float, float] | None = None
    #: Smaller gradients (momenta) travel exact; ``"auto"``: measured from the model's sizes.
    min_compress_bytes: int | str = defaults.MIN_COMPRESS_BYTES
    stop_on_divergence: float | None = option(None, "stop (status failed) when the 50-step "
                                                    "mean training loss climbs back this "
                                                    "fraction of the way from its lowest to "
                                                    "its first (0.5: half-way; default: never)",
                                              metavar="F")
    eval_every: int | None = option(None, "evaluate every N steps (default: every epoch; the "
                                          "end is always evaluated)", metavar="N")
    checkpoint_every: int = option(0, "save a checkpoint every N steps into "
                                      "OUT/checkpoints/step-<N>/, keeping the newest 2 (0: "
                                      "never; a script saves through Session.checkpoints)",
                                   metavar="N")
    resume: str | None = option(None, "continue from a checkpoint: its directory, or auto (the "
                                      "newest valid one under OUT/checkpoints; none: start "
                                      "afresh)", metavar="DIR")
    max_restarts: int = option(0, "when a process dies, restart the whole job from the newest "
                                  "valid checkpoint, at most N times", metavar="N")
    seed: int = option(0, "seed of the model initialisation and of the data order",
                       metavar="N")
    out: str = option("runs/train", "run directory: metrics.jsonl, report.json, plots",
                      metavar="DIR")
    progress: bool = option(True, "the progress bar on rank 0")
    tensorboard: bool | None = option(None, "TensorBoard scalars (loss, lr, eval, bytes, "
                                            "compression ratio, stage times) in "
                                            "OUT/tensorboard/ (default: when the tensorboard "
                                            "package is installed)")

    def __post_init__(self) -> None:
        if self.compression is None:
            object.__setattr__(self, "compression", defaults.compression_for(self.optimizer))
        self._check_what()
        for name in ("workers", "servers"):
            _positive_int(self, name, optional=False)
        for name in ("epochs", "steps", "batch_size", "eval_every"):
            _positive_int(self, name)
        _positive_int(self, "warmup_steps", lo=0)
        _choice(self, "optimizer", OPTIMIZERS, "optimizer")
        self._check_dense_steps()
        self._check_local_steps()
        if self.min_compress_bytes != "auto":
            _positive_int(self, "min_compress_bytes", optional=False, lo=0)
        _positive_int(self, "seed", optional=False, lo=0)
        self._check_recovery()
        _number(self, "lr", 0.0, strict=True)
        _number(self, "weight_decay", 0.0, strict=False)
        _number(self, "stop_on_divergence", 0.0, strict=True)
        _number(self, "momentum", 0.0, strict=False, hi=1.0)
        self._check_betas()
        self._check_ef()
        _choice(self, "schedule", SCHEDULES, "schedule")
        if not isinstance(self.out, str) or not self.out:
            raise ValueError(f"TrainConfig.out must be a non-empty path, got {self.out!r}")
        if not isinstance(self.uncompressed_params, tuple) or not all(
                isinstance(n, str) and n for n in self.uncompressed_params):
            raise ValueError(f"TrainConfig.uncompressed_params must be a tuple of non-empty "
                             f"names or patterns, got {self.uncompressed_params!r}")
        if not isinstance(self.progress, bool):
            raise ValueError(f"TrainConfig.progress must be a bool, got {self.progress!r}")
        if self.tensorboard is not None and not isinstance(self.tensorboard, bool):
            raise ValueError(f"TrainConfig.tensorboard must be True, False or None (on when "
                             f"the package is installed), got {self.tensorboard!r}")
        self._check_codec()

    def _check_dense_steps(self) -> None:
        """``dense_steps``: >= 0; >= 1 for the 1-bit optimizers; none for ``sgd-ef``."""
        lo = 1 if self.optimizer in MOMENTUM_OPTIMIZERS else 0
        _positive_int(self, "dense_steps", lo=lo)
        if self.dense_steps and self.optimizer == "sgd-ef":
            raise ValueError(f"TrainConfig.dense_steps is not for sgd-ef (its momentum runs "
                             f"on the compressed gradients from the first step), got "
                             f"{self.dense_steps}")

    def _check_local_steps(self) -> None:
        """``sync_every`` >= 1, ``outer_lr`` > 0, ``outer_momentum`` in [0, 1), ``overlap``
        a bool: all for ``diloco`` only (ValueError naming the field otherwise)."""
        _positive_int(self, "sync_every")
        _number(self, "outer_lr", 0.0, strict=True)
        _number(self, "outer_momentum", 0.0, strict=False, hi=1.0)
        if not isinstance(self.overlap, bool):
            raise ValueError(f"TrainConfig.overlap must be a bool, got {self.overlap!r}")
        if self.optimizer == "diloco":
            if self.dense_steps:
                raise ValueError(f"TrainConfig.dense_steps is not for diloco, got "
                                 f"{self.dense_steps}")
            return
        given = {"sync_every": self.sync_every is not None, "overlap": self.overlap,
                 "outer_lr": self.outer_lr != 1.0, "outer_momentum": self.outer_momentum != 0}
        for name, on in given.items():
            if on:
                raise ValueError(f"TrainConfig.{name} is for --optimizer diloco, got "
                                 f"{getattr(self, name)!r} with optimizer {self.optimizer!r}")

    def _check_recovery(self) -> None:
        """``checkpoint_every`` and ``max_restarts``: ints >= 0; ``resume``: a non-empty path
        or ``auto`` (a script saves and resumes through ``Session.checkpoints``)."""
        _positive_int(self, "checkpoint_every", optional=False, lo=0)
        _positive_int(self, "max_restarts", optional=False, lo=0)
        if self.resume is not None and (not isinstance(self.resume, str) or not self.resume):
            raise ValueError(f"TrainConfig.resume must be a checkpoint directory or 'auto', got "
                             f"{self.resume!r}")

    def _check_betas(self) -> None:
        """``betas``: None or two numbers in [0, 1); not for ``sgd-ef``."""
        b = self.betas
        if b is None:
            return
        if not isinstance(b, tuple) or len(b) != 2 or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                and 0.0 <= x < 1.0 for x in b):
            raise ValueError(f"TrainConfig.betas must be two numbers in [0, 1), got {b!r}")
        if self.optimizer == "sgd-ef":
            raise ValueError(f"TrainConfig.betas is for the Adam-family optimizers, got {b!r} "
                             f"with optimizer 'sgd-ef'")

    def _check_ef(self) -> None:
        """``ef``: None (the optimizer's default) or an error-feedback spec, text or
        :class:`~gradpress.compress.EFSpec` (checked whether or not compression is on; an EFSpec
        is kept as its text, so configs stay JSON)."""
        from ..compress.spec import EFSpec, parse_ef

        if isinstance(self.ef, EFSpec):
            object.__setattr__(self, "ef", str(self.ef))
        if self.ef is None:
            return
        if not isinstance(self.ef, str) or not self.ef.strip():
            raise ValueError(f"TrainConfig.ef must be an error-feedback spec such as 'vanilla' "
                             f"or an EFSpec, got {self.ef!r}")
        try:
            parse_ef(self.ef)
        except ValueError as e:
            raise ValueError(f"TrainConfig.ef: unknown error feedback {self.ef!r}; valid: "
                             f"{', '.join(EF_CHOICES)} ({e})") from None

    def _check_what(self) -> None:
        """Exactly one of task and script; the task must be bundled; names are plain."""
        if not isinstance(self.name, str) or not self.name or any(
                c in self.name for c in "/\\\0 "):
            raise ValueError(f"TrainConfig.name must be a non-empty word without '/', '\\' or "
                             f"spaces (it names a directory and tensors), got {self.name!r}")
        if not isinstance(self.script, tuple) or not all(isinstance(a, str) for a in self.script):
            raise ValueError(f"TrainConfig.script must be a tuple of strings, got {self.script!r}")
        if bool(self.task) == bool(self.script):
            raise ValueError("give either a task (--task NAME) or a worker script "
                             f"(-- python train.py ...), got task={self.task!r} and "
                             f"script={list(self.script)!r}")
        if self.script and self.lr is None:
            raise ValueError("a worker script has no task defaults: give the learning rate "
                             "(--lr)")
        if self.task is not None:
            from ..tasks import task_names

            if self.task not in task_names():
                raise ValueError(f"unknown task {self.task!r}; valid tasks: "
                                 f"{', '.join(task_names())}")

    def _check_codec(self) -> None:
        """Build the codec once (cheap): unknown codecs, parameters or ef list valid choices."""
        from ..compress import build

        if not isinstance(self.compression, str) or not self.compression.strip():
            raise ValueError(f"TrainConfig.compression must be a codec spec such as 'none' or "
                             f"'onebit', got {self.compression!r}")
        try:
            build(self.compression, 1024, ef=self.effective_ef)
        except ValueError as e:
            raise ValueError(f"compression {self.compression!r}: {e}") from None

    @property
    def compressed(self) -> bool:
        """Whether gradients (or 1-bit Adam's momenta) go through a codec other than ``none``."""
        from ..compress.spec import parse_spec

        return parse_spec(self.compression).name != "none"

    @property
    def effective_ef(self) -> str | None:
        """The codec's error feedback: None without compression or with ``ef='none'``."""
        ef = defaults.ef_for(self.optimizer) if self.ef is None else self.ef
        if ef.strip().lower() == "none" or not self.compressed:
            return None
        return ef

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (``script`` as a list)."""
        d = dataclasses.asdict(self)
        d["script"] = list(self.script)
        d["uncompressed_params"] = list(self.uncompressed_params)
        if self.betas is not None:
            d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict`; unknown keys are a ValueError listing the valid ones."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"TrainConfig: unknown field(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(sorted(names))}")
        kw = dict(d)
        for key in ("script", "uncompressed_params", "betas"):
            if kw.get(key) is not None:
                kw[key] = tuple(kw[key])
        return cls(**kw)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _task_names() -> list[str]:
    from ..tasks import task_names

    return task_names()

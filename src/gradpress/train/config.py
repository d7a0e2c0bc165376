"""``TrainConfig``: everything one ``gradpress train`` run needs, validated on construction.

A config is frozen and keyword-only. Fields left as ``None`` take the task's defaults
(:class:`gradpress.tasks.TaskDefaults`) when the worker resolves them. Bad input is a
``ValueError`` naming the field, the value and what was expected; an unknown task, codec or
optimizer lists the valid choices. Validation imports no task data, so it is cheap and runs
before any process starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["TrainConfig", "OPTIMIZERS", "EF_CHOICES", "SCHEDULES",
           "DEFAULT_UNCOMPRESSED_STEPS"]

#: ``--optimizer`` choices; see :mod:`gradpress.train.session` for what each one builds.
OPTIMIZERS = ("clan", "lans", "lamb", "adam", "sgd-ef", "onebit-adam", "onebit-lans")
#: Optimizers without ``uncompressed_steps``: ``sgd-ef`` compresses from the first step, the
#: 1-bit ones warm up densely for ``freeze_step`` steps and then communicate their momentum.
NO_UNCOMPRESSED_STEPS = ("sgd-ef", "onebit-adam", "onebit-lans")
#: Optimizers that take ``freeze_step``.
FREEZING = ("clan", "lans", "onebit-adam", "onebit-lans")
#: ``--ef`` choices (``none``: no error feedback; ``ef21``: onebit-lans only, differences to a
#: shared estimate instead of residuals, ``OneBitLANS(ef21=True)``).
EF_CHOICES = ("vanilla", "corrected", "sparse", "none", "ef21")
#: Default uncompressed warm-up steps per optimizer. CLAN: 50 (stdlib-mlm, onebit, 200 steps:
#: validation loss 9.0% above uncompressed LANS without warm-up, 1.4% with 50 steps; see
#: ``docs/convergence.md``).
DEFAULT_UNCOMPRESSED_STEPS: dict[str, int] = {"clan": 100}  # as gp.CLAN (convergence.md)
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


def _onebit_lans_choice(cfg: Any, name: str, valid: tuple[str, str]) -> None:
    """A ``onebit-lans`` option: one of ``valid``, and its first (default) with the others."""
    v = getattr(cfg, name)
    if v not in valid:
        raise ValueError(f"TrainConfig.{name} must be {' or '.join(valid)}, got {v!r}")
    if v != valid[0] and cfg.optimizer != "onebit-lans":
        raise ValueError(f"TrainConfig.{name}={v!r} is for onebit-lans, got optimizer "
                         f"{cfg.optimizer!r}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run on a local cluster (``gradpress train``; the demo runs three).

    Either ``task`` (a bundled task, trained by ``python -m gradpress.train.worker``) or
    ``script`` (the user's own worker command, see the README) must be given.
    """

    #: Label of the run: prefixes its tensor names (so several runs can share one cluster)
    #: and names it in reports and plots.
    name: str = "run"
    #: Bundled task (``gradpress.tasks.task_names()``), or None with ``script``.
    task: str | None = None
    #: The user's worker command (script mode), e.g. ``("python", "train.py")``; empty for a
    #: bundled task.
    script: tuple[str, ...] = ()
    #: Worker processes.
    workers: int = 2
    #: Parameter-server processes.
    servers: int = 1
    #: Codec spec of the gradients (``onebit``, ``topk:k=0.001,values=fp16``, ...); for
    #: ``onebit-adam``/``onebit-lans`` the codec of the momentum after warm-up.
    compression: str = "none"
    #: Error feedback on workers and servers: ``vanilla``, ``corrected``, ``sparse``
    #: (randomk only), ``none``, or ``ef21`` (``onebit-lans`` only: the optimizer sends
    #: differences to a shared estimate and the codec runs without residuals). Ignored when
    #: ``compression`` is ``none``.
    ef: str = "vanilla"
    #: With ``ef='vanilla'``: residuals decay by this factor each step, ``p = x + ef_decay*e``
    #: on workers and servers (``vanilla:decay=B``); None: they do not (1.0). 0.9, the
    #: momentum's ``b1``, suits ``onebit-adam``/``onebit-lans`` (``docs/convergence.md`` 2.7).
    ef_decay: float | None = None
    #: With ``ef='vanilla'``: the servers' residuals decay by this factor instead of
    #: ``ef_decay`` (``vanilla:decay=B,server_decay=S``); None: the same as the workers'.
    #: ``ef_decay=0.9`` with 1.0 here suits ``onebit-lans`` (``docs/convergence.md`` 2.10).
    server_ef_decay: float | None = None
    #: With ``ef_decay`` < 1: the workers' loss per step, ``1 - ef_decay``, shrinks with the
    #: lr, ``B_t = 1 - (1 - ef_decay) * lr / lr_max`` (``vanilla:decay=B,anneal=1``; pushes
    #: carry the lr; the servers' decay stays fixed). ``docs/convergence.md`` 2.15.
    ef_anneal: bool = False
    #: Optimizer (see :data:`OPTIMIZERS`).
    optimizer: str = "clan"
    #: Peak learning rate; None: the task's default for the optimizer family.
    lr: float | None = None
    #: Passes over the training set; None: the task's default (unless ``steps`` is given).
    epochs: int | None = None
    #: Optimizer steps; the run stops at ``steps`` or after ``epochs``, whichever comes first.
    steps: int | None = None
    #: Per-worker batch size; None: the task's default.
    batch_size: int | None = None
    #: Decoupled weight decay (not applied to biases and normalisation weights); None: the
    #: task's default.
    weight_decay: float | None = None
    #: Linear learning-rate warm-up steps; None: the task's default.
    warmup_steps: int | None = None
    #: Schedule after warm-up: ``constant``, ``cosine`` (to 0) or ``linear`` (to 0).
    schedule: str = "cosine"
    #: 1-bit Adam's and 1-bit LANS's uncompressed warm-up steps; None: 20% of the run
    #: (DeepSpeed uses 15-25%).
    #: With ``clan``/``lans``: freeze the second moment after this many steps (None: never;
    #: usually equal to ``uncompressed_steps``).
    freeze_step: int | None = None
    #: ``onebit-lans``: keep LANS's instant-gradient direction after the warm-up, from the
    #: averaged momenta (``OneBitLANS(blend=)``); False: the momentum direction alone.
    blend: bool = True
    #: ``onebit-lans``: communicate the momentum divided by the frozen ``sqrt(v)+eps``
    #: (``OneBitLANS(precondition=)``); False: the momentum itself, as 1-bit Adam.
    precondition: bool = True
    #: ``onebit-lans``: what travels after the warm-up, ``momentum`` or ``gradient``
    #: (``OneBitLANS(sends=)``).
    sends: str = "momentum"
    #: ``onebit-lans``: every this many steps after the warm-up, one dense step refreshes the
    #: frozen second moment (``OneBitLANS(refresh_every=)``); None: never.
    refresh_every: int | None = None
    #: ``onebit-lans``: the second moment after the warm-up, ``frozen`` or ``local`` (each
    #: worker keeps its own from its local gradient, ``OneBitLANS(variance=)``).
    variance: str = "frozen"
    #: First steps whose gradients travel uncompressed (``DistributedOptimizer(warmup_steps=)``);
    #: None: :data:`DEFAULT_UNCOMPRESSED_STEPS` of the optimizer (0 if absent). Not for
    #: ``sgd-ef``, ``onebit-adam`` and ``onebit-lans`` (the last two have ``freeze_step``).
    uncompressed_steps: int | None = None
    #: Momentum coefficient of ``sgd-ef`` (applied before compression); None: the task's.
    momentum: float | None = None
    #: Decay of the first moment (``b1``) of the Adam-family optimizers (all but ``sgd-ef``);
    #: None: the optimizer's default, 0.9. Higher (0.95) averages a compressed momentum's
    #: error over more steps.
    beta1: float | None = None
    #: Decay of the second moment (``b2``) of the Adam-family optimizers (all but ``sgd-ef``);
    #: None: the optimizer's default, 0.999. Lower (0.99) makes ``v`` follow the gradient's
    #: current scale within about 1/(1-b2) steps.
    beta2: float | None = None
    #: Gradients smaller than this many bytes travel uncompressed (16 KiB: the bundled tasks'
    #: large weight tensors are compressed, norms and biases are not).
    min_compress_bytes: int = 16 << 10
    #: Names or ``fnmatch`` patterns of the model's parameters (``model.named_parameters()``
    #: names, e.g. ``pos.weight``) that always travel uncompressed, whatever their size; each
    #: must match a parameter (checked when the model is built).
    uncompressed_params: tuple[str, ...] = ()
    #: Stop the run (status ``failed``, with the reason) when the training loss, averaged
    #: over 50 steps, climbs back this fraction of the way from its lowest 50-step mean to
    #: its first (0.5: half-way); None: never (``gradpress.train.guard``).
    stop_on_divergence: float | None = None
    #: Evaluate every this many steps; None: after every epoch. The end is always evaluated.
    eval_every: int | None = None
    #: Seed of the model initialisation and of the data order.
    seed: int = 0
    #: Run directory (created): ``metrics.jsonl``, ``report.json``, PNG plots.
    out: str = "runs/train"
    #: Show a progress bar on rank 0.
    progress: bool = True

    def __post_init__(self) -> None:
        self._check_what()
        for name in ("workers", "servers"):
            _positive_int(self, name, optional=False)
        for name in ("epochs", "steps", "batch_size", "freeze_step", "eval_every",
                     "refresh_every"):
            _positive_int(self, name)
        _positive_int(self, "warmup_steps", lo=0)
        _positive_int(self, "uncompressed_steps", lo=0)
        if self.uncompressed_steps and self.optimizer in NO_UNCOMPRESSED_STEPS:
            raise ValueError(f"TrainConfig.uncompressed_steps is for gradient-compressing "
                             f"optimizers (clan, lans, lamb, adam), got "
                             f"{self.uncompressed_steps} with optimizer {self.optimizer!r}")
        if self.freeze_step is not None and self.optimizer not in FREEZING:
            raise ValueError(f"TrainConfig.freeze_step is for {', '.join(FREEZING)}, got "
                             f"{self.freeze_step} with optimizer {self.optimizer!r}")
        for name in ("blend", "precondition"):
            flag = getattr(self, name)
            if not isinstance(flag, bool):
                raise ValueError(f"TrainConfig.{name} must be a bool, got {flag!r}")
            if not flag and self.optimizer != "onebit-lans":
                raise ValueError(f"TrainConfig.{name}=False is for onebit-lans, got optimizer "
                                 f"{self.optimizer!r}")
        if self.refresh_every is not None and self.optimizer != "onebit-lans":
            raise ValueError(f"TrainConfig.refresh_every is for onebit-lans, got "
                             f"{self.refresh_every} with optimizer {self.optimizer!r}")
        _onebit_lans_choice(self, "variance", ("frozen", "local"))
        if self.variance == "local" and (self.refresh_every is not None or not self.precondition
                                         or self.sends != "momentum" or self.ef == "ef21"):
            raise ValueError(f"TrainConfig.variance='local' needs precondition, sends='momentum', "
                             f"no ef21 and no refresh_every, got refresh_every="
                             f"{self.refresh_every}, precondition={self.precondition}, sends="
                             f"{self.sends!r}, ef={self.ef!r}")
        _onebit_lans_choice(self, "sends", ("momentum", "gradient"))
        _positive_int(self, "min_compress_bytes", optional=False, lo=0)
        _positive_int(self, "seed", optional=False, lo=0)
        _number(self, "lr", 0.0, strict=True)
        _number(self, "weight_decay", 0.0, strict=False)
        _number(self, "stop_on_divergence", 0.0, strict=True)
        _number(self, "momentum", 0.0, strict=False, hi=1.0)
        for name in ("beta1", "beta2"):
            _number(self, name, 0.0, strict=False, hi=1.0)
            if getattr(self, name) is not None and self.optimizer == "sgd-ef":
                raise ValueError(f"TrainConfig.{name} is for the Adam-family optimizers, got "
                                 f"{getattr(self, name)} with optimizer 'sgd-ef'")
        _choice(self, "optimizer", OPTIMIZERS, "optimizer")
        _choice(self, "ef", EF_CHOICES, "error feedback")
        for name in ("ef_decay", "server_ef_decay"):
            _number(self, name, 0.0, strict=False, hi=1.0, closed=True)
            if getattr(self, name) is not None and self.ef != "vanilla":
                raise ValueError(f"TrainConfig.{name} is for ef='vanilla', got "
                                 f"{getattr(self, name)} with ef={self.ef!r}")
        if not isinstance(self.ef_anneal, bool):
            raise ValueError(f"TrainConfig.ef_anneal must be a bool, got {self.ef_anneal!r}")
        if self.ef_anneal and (self.ef_decay is None or self.ef_decay == 1.0):
            raise ValueError(f"TrainConfig.ef_anneal moves the workers' ef_decay B < 1 towards "
                             f"1 as the lr falls; give ef_decay < 1, got {self.ef_decay!r}")
        if self.ef == "ef21" and self.optimizer != "onebit-lans":
            raise ValueError(f"TrainConfig.ef='ef21' is for onebit-lans (it needs an optimizer "
                             f"that keeps the shared estimate), got optimizer "
                             f"{self.optimizer!r}")
        _choice(self, "schedule", SCHEDULES, "schedule")
        if not isinstance(self.out, str) or not self.out:
            raise ValueError(f"TrainConfig.out must be a non-empty path, got {self.out!r}")
        if not isinstance(self.uncompressed_params, tuple) or not all(
                isinstance(n, str) and n for n in self.uncompressed_params):
            raise ValueError(f"TrainConfig.uncompressed_params must be a tuple of non-empty "
                             f"names or patterns, got {self.uncompressed_params!r}")
        if not isinstance(self.progress, bool):
            raise ValueError(f"TrainConfig.progress must be a bool, got {self.progress!r}")
        self._check_codec()

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
        """The codec's error feedback: None without compression, with ``ef='none'`` or with
        ``ef='ef21'`` (the optimizer's estimate is the feedback then)."""
        if self.ef in ("none", "ef21") or not self.compressed:
            return None
        if self.ef_decay is None and self.server_ef_decay is None:
            return self.ef
        kind = f"vanilla:decay={1.0 if self.ef_decay is None else self.ef_decay!r}"
        if self.server_ef_decay is not None:
            kind += f",server_decay={self.server_ef_decay!r}"
        return kind + (",anneal=1" if self.ef_anneal else "")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict (``script`` as a list)."""
        d = dataclasses.asdict(self)
        d["script"] = list(self.script)
        d["uncompressed_params"] = list(self.uncompressed_params)
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
        for key in ("script", "uncompressed_params"):
            if key in kw:
                kw[key] = tuple(kw[key])
        return cls(**kw)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

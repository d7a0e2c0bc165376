"""Effective hyperparameters and the learning-rate schedule of a ``gradpress train`` run."""

from __future__ import annotations

import math
from typing import Any

from .config import DEFAULT_DENSE_STEPS, MOMENTUM_OPTIMIZERS, TrainConfig

__all__ = ["resolve_hparams", "lr_factor"]


def resolve_hparams(cfg: TrainConfig, defaults: Any | None, total_steps: int | None
                    ) -> dict[str, Any]:
    """The effective hyperparameters: ``cfg``'s, else the task's defaults (script mode: fixed
    fallbacks; ``lr`` is required there)."""
    family = {"onebit-adam": "adam", "onebit-lans": "lans", "sgd-ef": "sgd"}.get(
        cfg.optimizer, cfg.optimizer)
    if cfg.lr is None and defaults is None:
        raise ValueError("TrainConfig.lr is required without a bundled task (give --lr)")
    hp = {
        "lr": cfg.lr if cfg.lr is not None else defaults.lr_for(family),  # type: ignore[union-attr]
        "weight_decay": _first(cfg.weight_decay, getattr(defaults, "weight_decay", None), 0.0),
        "warmup_steps": _first(cfg.warmup_steps, getattr(defaults, "warmup_steps", None), 0),
        "momentum": _first(cfg.momentum, getattr(defaults, "momentum", None), 0.9),
        "schedule": cfg.schedule, "total_steps": total_steps,
    }
    if cfg.optimizer != "sgd-ef":
        hp["dense_steps"] = _dense_steps(cfg, total_steps)
        hp["betas"] = cfg.betas or (0.9, 0.999)
    return hp


def _dense_steps(cfg: TrainConfig, total_steps: int | None) -> int:
    """``cfg.dense_steps``, else :data:`DEFAULT_DENSE_STEPS` of the optimizer (0 if absent);
    the 1-bit optimizers: 20% of the run (500 steps if unknown), at least 1."""
    if cfg.dense_steps is not None:
        return cfg.dense_steps
    if cfg.optimizer in MOMENTUM_OPTIMIZERS:
        return max(1, (total_steps or 500) // 5)
    return DEFAULT_DENSE_STEPS.get(cfg.optimizer, 0)


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def lr_factor(step: int, warmup: int, total: int | None, schedule: str) -> float:
    """Multiplier of the peak lr for 0-based ``step``: linear warm-up, then the schedule."""
    if step < warmup:
        return (step + 1) / warmup
    if total is None or schedule == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress

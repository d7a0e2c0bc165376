"""Effective hyperparameters and the learning-rate schedule of a ``gradpress train`` run."""

from __future__ import annotations

import math
from typing import Any

from .. import defaults as default_values
from .config import TrainConfig

__all__ = ["resolve_hparams", "lr_factor"]


def resolve_hparams(cfg: TrainConfig, defaults: Any | None, total_steps: int | None
                    ) -> dict[str, Any]:
    """The effective hyperparameters: ``cfg``'s, else the task's defaults (script mode: fixed
    fallbacks; ``lr`` is required there)."""
    family = {"onebit-adam": "adam", "onebit-lans": "lans", "sgd-ef": "sgd",
              "diloco": "adam"}.get(
        cfg.optimizer, cfg.optimizer)
    if cfg.lr is None and defaults is None:
        raise ValueError("TrainConfig.lr is required without a bundled task (give --lr)")
    hp = {
        "lr": cfg.lr if cfg.lr is not None else defaults.lr_for(family),  # type: ignore[union-attr]
        "weight_decay": _first(cfg.weight_decay, getattr(defaults, "weight_decay", None),
                               default_values.WEIGHT_DECAY),
        "warmup_steps": _first(cfg.warmup_steps, getattr(defaults, "warmup_steps", None), 0),
        "momentum": _first(cfg.momentum, getattr(defaults, "momentum", None),
                           default_values.SGD_MOMENTUM),
        "schedule": cfg.schedule, "total_steps": total_steps,
        "ef": cfg.effective_ef or "none",  # the method's own when the config gives none
    }
    if cfg.optimizer != "sgd-ef":
        hp["dense_steps"] = default_values.dense_steps_for(cfg.optimizer, cfg.compression) \
            if cfg.dense_steps is None else cfg.dense_steps
        hp["betas"] = cfg.betas or default_values.BETAS
    if cfg.optimizer == "diloco":
        hp["sync_every"] = cfg.sync_every or default_values.DILOCO_SYNC_EVERY
    return hp


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

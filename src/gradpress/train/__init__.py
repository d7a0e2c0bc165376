"""``gradpress train`` and ``gradpress demo``: training runs on a local cluster.

    from gradpress.train import TrainConfig, Session
    cfg = TrainConfig(task="digits-cnn", compression="onebit", optimizer="clan")

* :class:`TrainConfig` (``config.py``): the validated configuration of one run; each field is
  a ``gradpress train`` option, the parser is generated from the fields (``options.py``).
* :class:`Session` (``session.py``): optimizer, schedule, stage timers and metrics on a worker;
  ``Session.from_env()`` in a user script started by ``gradpress train ... -- python SCRIPT``.
* ``worker.py``: the training loop of the bundled tasks (``python -m gradpress.train.worker``).
* ``report.py``: ``metrics.jsonl``, ``report.json`` and the plots.
* ``cli.py``: the ``train`` and ``demo`` subcommands.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import EF_CHOICES, OPTIMIZERS, SCHEDULES, TrainConfig

__all__ = ["TrainConfig", "Session", "OPTIMIZERS", "EF_CHOICES", "SCHEDULES"]


def __getattr__(name: str) -> Any:  # Session imports torch: load it on first use
    if name == "Session":
        return importlib.import_module(".session", __name__).Session
    raise AttributeError(f"module 'gradpress.train' has no attribute {name!r}")

"""Bundled training tasks for ``gradpress train`` and ``gradpress demo``.

Every task's data ships with an installed package (no network)::

    from gradpress.tasks import get_task, task_names
    task = get_task("digits-cnn")
    model = task.build_model(seed=0)
    for batch in task.train_batches(rank, world_size, task.defaults.batch_size, seed=0, epoch=0):
        loss = task.loss(model, batch); ...
    print(task.evaluate(model).summary())

Tasks:
    ``digits-cnn``  scikit-learn's 8x8 digits, residual CNN (needs scikit-learn).
    ``stdlib-lm``   byte-level causal (next-byte) language model on the Python documentation.
    ``stdlib-mlm``  byte-level masked language model on the Python stdlib's source.
    ``stdlib-words`` word-level post-LN causal language model, long-tailed vocabulary.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import Batch, EvalResult, Task, TaskDefaults, shard_batches

__all__ = ["Batch", "EvalResult", "Task", "TaskDefaults", "get_task", "task_names",
           "shard_batches"]

# task name -> "module:class"; imported on first use so importing gradpress.tasks stays light.
_TASKS = {
    "digits-cnn": "gradpress.tasks.digits:DigitsTask",
    "stdlib-lm": "gradpress.tasks.stdlib_lm:StdlibLMTask",
    "stdlib-mlm": "gradpress.tasks.stdlib_mlm:StdlibMLMTask",
    "stdlib-words": "gradpress.tasks.stdlib_words:StdlibWordsTask",
}


def task_names() -> list[str]:
    """Names of the bundled tasks, sorted."""
    return sorted(_TASKS)


def get_task(name: str, **options: Any) -> Task:
    """A new instance of the task called ``name``; ``options`` go to its constructor.

    Raises:
        ValueError: ``name`` is not a bundled task (the message lists the valid names).
    """
    if not isinstance(name, str) or name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}")
    module_name, class_name = _TASKS[name].split(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**options)

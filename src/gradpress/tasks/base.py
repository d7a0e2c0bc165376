"""The training-task interface used by ``gradpress train`` and ``gradpress demo``.

A :class:`Task` bundles a dataset that ships with an installed package (no network), a model
factory, a loss and an evaluation. Everything is deterministic under a seed: model
initialisation runs under ``torch.manual_seed``-style explicit generators, and the order of the
training data is a permutation drawn from a generator seeded by ``(seed, epoch)``.

Data-parallel sharding (:func:`shard_batches`) follows Horovod/BytePS practice: every rank draws
the same permutation of the training set, cuts it into global batches of
``world_size * batch_size`` examples (the incomplete tail is dropped), and rank ``r`` takes the
``r``-th slice of ``batch_size`` examples of every global batch. Shards are therefore disjoint and
every rank yields exactly ``steps_per_epoch`` batches, so collective operations never hang on a
rank that ran out of data. ``batch_size`` is always the per-worker batch size.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch
from torch import nn

__all__ = [
    "Batch",
    "EvalResult",
    "TaskDefaults",
    "Task",
    "derive_seed",
    "shard_batches",
    "model_device",
    "check_shard_args",
]

#: A batch is a tuple of CPU tensors; its meaning is task-specific (inputs first, targets last).
Batch = tuple[torch.Tensor, ...]

#: Optimizer family aliases accepted by :meth:`TaskDefaults.lr_for`.
_LR_ALIASES = {
    "adamw": "adam",
    "onebit_adam": "adam",
    "onebitadam": "adam",
    "1bit_adam": "adam",
    "nag": "sgd",
    "sgdm": "sgd",
    "ef_sgdm": "sgd",
    "clan": "lans",
    "onebit_lans": "lans",
}


@dataclass(frozen=True)
class EvalResult:
    """Metrics of one evaluation.

    Attributes:
        metrics: metric name -> value, e.g. ``{"test_accuracy": 0.98, "test_loss": 0.07}``.
        primary: name of the headline metric (a key of ``metrics``).
        higher_is_better: whether a larger ``primary`` value is better.
        num_examples: number of examples (or masked tokens) the metrics were computed on.
    """

    metrics: Mapping[str, float]
    primary: str
    higher_is_better: bool
    num_examples: int

    def __post_init__(self) -> None:
        if self.primary not in self.metrics:
            raise ValueError(f"EvalResult primary metric {self.primary!r} is not one of "
                             f"its metrics {sorted(self.metrics)}")
        object.__setattr__(self, "metrics", MappingProxyType(dict(self.metrics)))

    @property
    def value(self) -> float:
        """The value of the primary metric."""
        return self.metrics[self.primary]

    def __getitem__(self, name: str) -> float:
        return self.metrics[name]

    def summary(self) -> str:
        """One line ``name=value`` per metric, primary first, for logs."""
        names = [self.primary] + sorted(k for k in self.metrics if k != self.primary)
        return " ".join(f"{k}={self.metrics[k]:.4f}" for k in names)


@dataclass(frozen=True)
class TaskDefaults:
    """Default hyperparameters of a task.

    Attributes:
        batch_size: per-worker batch size.
        epochs: number of passes over the training set.
        max_steps: if not None, stop after this many optimizer steps (whichever comes first).
        lr: optimizer family -> learning rate; families are ``adam`` (Adam, AdamW, 1-bit Adam),
            ``sgd`` (SGD with momentum, NAG, dist-EF-SGDM), ``lans`` (LANS, CLAN) and ``lamb``.
        momentum: momentum of the ``sgd`` family.
        weight_decay: weight decay for all families.
        warmup_steps: linear learning-rate warm-up steps (0: none).
    """

    batch_size: int
    epochs: int
    lr: Mapping[str, float]
    max_steps: int | None = None
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "lr", MappingProxyType(dict(self.lr)))

    def __hash__(self) -> int:
        return hash((self.batch_size, self.epochs, tuple(sorted(self.lr.items())),
                     self.max_steps, self.momentum, self.weight_decay, self.warmup_steps))

    def lr_for(self, optimizer: str) -> float:
        """Default learning rate for ``optimizer`` (a family name or an alias like ``adamw``)."""
        key = optimizer.lower().replace("-", "_")
        key = _LR_ALIASES.get(key, key)
        if key not in self.lr:
            raise ValueError(f"no default learning rate for optimizer {optimizer!r}; expected "
                             f"one of {', '.join(sorted(self.lr))} or an alias "
                             f"({', '.join(sorted(_LR_ALIASES))})")
        return self.lr[key]

    def total_steps(self, steps_per_epoch: int) -> int:
        """Optimizer steps of a default run given the task's ``steps_per_epoch``."""
        steps = self.epochs * steps_per_epoch
        return steps if self.max_steps is None else min(steps, self.max_steps)


class Task(abc.ABC):
    """A bundled training task: data, model, loss, evaluation and default hyperparameters.

    Subclasses set :attr:`name`, :attr:`description` and :attr:`defaults` and implement the
    abstract methods. Batches are CPU tensors; :meth:`loss` and :meth:`evaluate` move them to
    the model's device.
    """

    name: str
    description: str
    defaults: TaskDefaults

    @property
    @abc.abstractmethod
    def num_train_examples(self) -> int:
        """Number of training examples (sequences for language models)."""

    @abc.abstractmethod
    def build_model(self, seed: int) -> nn.Module:
        """A freshly initialised model; identical parameters for identical ``seed``."""

    @abc.abstractmethod
    def train_batches(self, rank: int, world_size: int, batch_size: int, seed: int,
                      epoch: int) -> Iterator[Batch]:
        """This rank's shard of one training epoch (see :func:`shard_batches`)."""

    @abc.abstractmethod
    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Scalar training loss of ``model`` on ``batch`` (mean over the batch)."""

    @abc.abstractmethod
    def evaluate(self, model: nn.Module) -> EvalResult:
        """Metrics on the fixed held-out set; restores the model's train/eval mode."""

    def steps_per_epoch(self, world_size: int, batch_size: int) -> int:
        """Batches per epoch on every rank: ``num_train_examples // (world_size*batch_size)``."""
        check_shard_args(0, world_size, batch_size)
        steps = self.num_train_examples // (world_size * batch_size)
        if steps == 0:
            raise ValueError(f"task {self.name!r}: global batch {world_size}x{batch_size} exceeds "
                             f"its {self.num_train_examples} training examples")
        return steps


def check_shard_args(rank: int, world_size: int, batch_size: int) -> None:
    """Validate ``rank``/``world_size``/``batch_size``; ValueError naming the bad one."""
    for name, value in (("rank", rank), ("world_size", world_size), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed mixed from ``parts`` (ints or strings) with numpy's SeedSequence."""
    words: list[int] = []
    for part in parts:
        if isinstance(part, str):
            words.extend(part.encode())
        else:
            words.append(int(part) & 0xFFFFFFFFFFFFFFFF)
    state = np.random.SeedSequence(words).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def shard_batches(num_examples: int, rank: int, world_size: int, batch_size: int, seed: int,
                  epoch: int) -> Iterator[torch.Tensor]:
    """Index tensors of this rank's batches for one epoch.

    Steps:
      1. Draw a permutation of ``num_examples`` from a generator seeded by ``(seed, epoch)``;
         identical on every rank.
      2. Cut it into ``num_examples // (world_size*batch_size)`` global batches (drop the tail).
      3. Yield slice ``[rank*batch_size, (rank+1)*batch_size)`` of every global batch.
    """
    check_shard_args(rank, world_size, batch_size)
    global_batch = world_size * batch_size
    steps = num_examples // global_batch
    if steps == 0:
        raise ValueError(f"global batch {world_size}x{batch_size}={global_batch} exceeds the "
                         f"{num_examples} training examples")
    # 1. the same permutation on every rank
    gen = torch.Generator().manual_seed(derive_seed(seed, epoch, "shuffle"))
    perm = torch.randperm(num_examples, generator=gen)
    # 2.-3. this rank's slice of each global batch
    for step in range(steps):
        start = step * global_batch + rank * batch_size
        yield perm[start:start + batch_size]


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a parameterless model)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")

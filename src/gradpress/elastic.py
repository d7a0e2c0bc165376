"""Resuming a checkpoint with another number of workers (an elastic job that lost or gained
nodes): the rule for the error-feedback state, and the record of what was done.

Parameters, optimizer state, step counters and the servers' residuals do not depend on the
number of workers and load as usual; the servers' residuals are re-sharded (every server reads
all saved ``server*.pt`` and takes the keys it serves now, :mod:`gradpress.ps.codec_state`).
What is per worker is each worker's codec state: its error-feedback residual (the part of its
own gradients that its compressed pushes did not carry yet) and, with compressed momentum, its
momentum buffer. ``gradpress.checkpoint.load(..., resize=RULE)`` applies one of:

* ``"fold"`` (the default): every worker of the resumed job starts from the **mean** of the
  saved workers' tensors (residuals, momentum buffers); counters and scalars (steps,
  ``lr_prev``) come from worker 0, where every worker holds the same. The servers average the
  pushes, so the correction still owed to the averaged gradient, ``mean_i e_i``, is exactly
  what the resumed workers owe together: nothing of the lost workers' residuals is dropped,
  and nothing is counted twice when the job grows.
* ``"reset"``: the worker tensors start at zero (the server residuals are still re-sharded):
  what the saved workers owed is dropped, as DeepSpeed does on every load.
* ``"refuse"``: a checkpoint of another number of workers or servers is a
  :class:`~gradpress.CheckpointError` naming both layouts (the behaviour with the same sizes
  is the same under every rule).

Steps of a resized load (mirrored in :func:`resized_engine_state`):

1. check that the rule applies (not ``"refuse"``; the optimizer keeps no per-worker state);
2. read every saved worker's codec state (``"fold"``) or worker 0's (``"reset"``);
3. fold (mean) or zero every tensor leaf; keep the other leaves of worker 0;
4. record a :class:`ResizeEvent` (logged as a warning; :func:`last_resize` returns it, and
   ``gradpress train`` writes it into ``report.json`` under ``"resized"``).

Measured (docs/checkpoints.md, "Fewer or more workers"): see the record cited there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .ps.errors import CheckpointError

__all__ = ["RESIZE_RULES", "ResizeEvent", "fold_states", "reset_state", "last_resize"]

log = logging.getLogger(__name__)

#: The rules of a resized load (see the module docstring).
RESIZE_RULES = ("fold", "reset", "refuse")

_LAST: list[ResizeEvent] = []


@dataclass(frozen=True, kw_only=True)
class ResizeEvent:
    """One load of a checkpoint into a job of another size."""

    #: The checkpoint directory.
    checkpoint: str
    #: Its saved step.
    step: int
    #: Workers and servers of the saved job.
    saved_workers: int
    saved_servers: int
    #: Workers and servers of this job.
    workers: int
    servers: int
    #: The rule applied to the workers' codec state (``"fold"`` or ``"reset"``).
    rule: str

    def __post_init__(self) -> None:
        if self.rule not in RESIZE_RULES[:2]:
            raise ValueError(f"ResizeEvent.rule must be 'fold' or 'reset', got {self.rule!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        what = ("each worker starts from the mean of the saved workers' residuals and momenta"
                if self.rule == "fold" else "the workers' residuals and momenta start at zero")
        return (f"checkpoint {self.checkpoint} (step {self.step}) was saved by "
                f"{self.saved_workers} workers and {self.saved_servers} servers, this job has "
                f"{self.workers} workers and {self.servers} servers: resize rule "
                f"{self.rule!r}: {what}; the servers' residuals are re-sharded")


def check_rule(rule: str) -> str:
    """``rule`` if it is one of :data:`RESIZE_RULES`, else ValueError."""
    if rule not in RESIZE_RULES:
        raise ValueError(f"resize must be one of {', '.join(map(repr, RESIZE_RULES))}, "
                         f"got {rule!r}")
    return rule


def last_resize() -> dict[str, Any] | None:
    """What the last resized :func:`gradpress.checkpoint.load` in this process did (the
    fields of :class:`ResizeEvent`), or None when no load changed the job's size."""
    return _LAST[-1].to_dict() if _LAST else None


def _map(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, Mapping):
        return {k: _map(v, fn) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_map(v, fn) for v in tree]
    return tree


def reset_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A worker engine state (``gradpress.worker_state_dict()``) with every tensor zeroed."""
    return dict(_map(state, torch.zeros_like))


def _add(acc: Any, other: Any, where: str) -> Any:
    """``acc + other`` on tensor leaves (float64 sums); ``acc`` elsewhere."""
    if isinstance(acc, torch.Tensor):
        if not isinstance(other, torch.Tensor) or other.shape != acc.shape:
            raise CheckpointError(f"cannot fold the saved workers' codec state: {where} differs "
                                  f"in shape between workers")
        return acc + other.to(torch.float64)
    if isinstance(acc, Mapping) and isinstance(other, Mapping):
        return {k: _add(v, other[k], f"{where}/{k}") if k in other else v
                for k, v in acc.items()}
    if isinstance(acc, list) and isinstance(other, list) and len(acc) == len(other):
        return [_add(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(acc, other))]
    return acc


def fold_states(states: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The mean of several workers' engine states, tensor by tensor (float64 sums, cast back
    to each tensor's dtype); other leaves and tensors some worker lacks come from the first."""
    if not states:
        raise ValueError("fold_states: no worker states to fold")
    first = states[0]
    acc = _map(first, lambda t: t.to(torch.float64))
    for i, s in enumerate(states[1:], 1):
        acc = _add(acc, s, f"worker {i}")
    n = len(states)

    def cast(pair: tuple[Any, Any]) -> Any:
        a, f = pair
        if isinstance(a, torch.Tensor):
            return (a / n).to(f.dtype)
        if isinstance(a, Mapping):
            return {k: cast((a[k], f[k])) for k in a}
        if isinstance(a, list):
            return [cast(p) for p in zip(a, f)]
        return f
    return dict(cast((acc, first)))


def resized_engine_state(event: ResizeEvent, per_worker_optimizer: bool,
                         read_engine: Callable[[int], Mapping[str, Any]]) -> dict[str, Any]:
    """This worker's codec state in a resized job (module docstring, steps 1-4).

    ``read_engine(r)`` returns saved worker ``r``'s engine state."""
    if per_worker_optimizer:  # step 1 ("refuse" never gets here)
        raise CheckpointError(f"checkpoint {event.checkpoint}: its optimizer keeps a state per "
                              f"worker (per_worker_state), which has no rule for another number "
                              f"of workers; resume with {event.saved_workers} workers and "
                              f"{event.saved_servers} servers (this job has {event.workers} and "
                              f"{event.servers})")
    if event.rule == "fold":  # steps 2-3
        state = fold_states([read_engine(r) for r in range(event.saved_workers)])
    else:
        state = reset_state(read_engine(0))
    _LAST.append(event)  # step 4
    log.warning("gradpress: %s", event.describe())
    return state

"""``gp.DiLoCo``: local steps, then one outer step on the two-way compressed pseudo-gradient.

DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language
Models") communicates once every ``sync_every`` = H inner steps instead of every step. Steps of
one round, on every worker:

1. The user's loop runs unchanged: ``inner_optimizer.step()`` (any torch optimizer over the
   model's parameters) updates the worker's local parameters ``p``; a step post-hook counts
   the steps and starts a round at every H-th.
2. Pseudo-gradient: ``delta = base - p``, the local progress since the round began (``base``
   is where this worker's local run started).
3. ``delta`` is averaged over the workers through the parameter servers, two-way compressed
   with error feedback on workers and servers (the codec of ``gp.DistributedOptimizer``,
   default ``int4``; ``compression="none"`` is exact).
4. The outer optimizer steps the global parameters ``g`` on the averaged pseudo-gradient.
   Every worker received the same bytes, so ``g`` is bit-identical on all workers.
5. The local parameters restart from ``g``: ``p = g`` (with ``overlap=True``,
   ``p = g + (p - base)``, see below) and ``base = p``.

With ``overlap=True`` (after Streaming DiLoCo, Douillard et al. 2025, and "Eager updates for
overlapped communication in DiLoCo", Kale et al. 2025) step 3 starts at round r and is waited
for at round r + 1, so the exchange travels while the next H inner steps compute; the outer
update is applied one round late, on top of the local progress made meanwhile (step 5's
``g + (p - base)``). ``sync()`` (or leaving the ``with`` block) finishes every round, and all
workers then hold the same parameters ``g``.

Tuning:
    * ``sync_every``: bytes per step fall as 1/H; accuracy falls slowly with H. Start at 50.
    * ``outer_optimizer``: default plain averaging (SGD, lr 1.0, no momentum), which cannot
      overshoot; DiLoCo's published Nesterov outer step (lr 0.7, momentum 0.9) pays only over
      thousands of outer steps (``docs/guide.md#low-communication-training-diloco``).
    * ``compression``: ``"int4"`` (default), a quarter of fp16's bytes; ``"onebit"`` sends
      one bit an element; ``"none"`` is exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .. import defaults
from ..compress.spec import CodecSpec

__all__ = ["DiLoCo"]

log = logging.getLogger(__name__)
OuterFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def _plain_averaging(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The default outer optimizer: ``g -= mean(delta)``, i.e. the average of the replicas."""
    return torch.optim.SGD(params, lr=1.0)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_inner(inner: torch.optim.Optimizer, params: set[torch.Tensor]) -> None:
    """The inner optimizer must step only the model's trainable parameters (ValueError)."""
    other = sum(1 for g in inner.param_groups for p in g["params"] if p not in params)
    if other:
        raise ValueError(f"inner_optimizer holds {other} parameter(s) that are not trainable "
                         "parameters of model; build it over model.parameters()")


class DiLoCo:
    """Train with local steps and a two-way compressed outer step every ``sync_every`` steps.

    Args:
        model: the replica this worker trains (its parameters are the inner optimizer's).
        inner_optimizer: any ``torch.optim.Optimizer`` over parameters of ``model`` (its state
            stays local to the worker, as in DiLoCo).
        sync_every: H, the inner steps per round (>= 1). Default 50.
        outer_optimizer: ``callable(params) -> torch.optim.Optimizer`` building the outer
            optimizer over the global parameters, e.g. ``functools.partial(torch.optim.SGD,
            lr=0.7, momentum=0.9, nesterov=True)``. Default: plain averaging (SGD, lr 1.0).
        compression: codec of the pseudo-gradient, both ways (default ``"int4"``; ``"none"``
            exact; any spec ``gp.DistributedOptimizer`` takes).
        overlap: exchange while the next H inner steps run and apply the outer update one
            round late (module docstring). Default False.
        prefix: name prefix of the pushed tensors (two DiLoCo instances need two prefixes).

    ``gradpress.init()`` must have run; the constructor broadcasts worker 0's parameters so
    every worker starts from the same point. Buffers (BatchNorm statistics) stay local.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 sync_every: int = defaults.DILOCO_SYNC_EVERY,
                 outer_optimizer: OuterFactory | None = None,
                 compression: str | Mapping[str, Any] | CodecSpec | None = defaults.COMPRESSION,
                 overlap: bool = False, prefix: str = "diloco") -> None:
        from .broadcast import broadcast_parameters
        from .optimizer import _wrap

        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError("inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be a bool, got {overlap!r}")
        self.sync_every = _check_int("sync_every", sync_every, 1)
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty str, got {prefix!r}")
        self.overlap = overlap
        named = [(f"{prefix}.{n}", p) for n, p in model.named_parameters() if p.requires_grad]
        _check_inner(inner_optimizer, {p for _, p in named})
        self._local = [p for _, p in named]
        self._base = [p.detach().clone() for p in self._local]
        self._global = [torch.nn.Parameter(p.detach().clone().float()) for p in self._local]
        outer = (outer_optimizer or _plain_averaging)(self._global)
        if not isinstance(outer, torch.optim.Optimizer):
            raise TypeError("outer_optimizer must return a torch.optim.Optimizer, got "
                            f"{type(outer).__name__}")
        self._outer = _wrap(outer, [(n, g) for (n, _), g in zip(named, self._global)],
                            compression=compression, on_backward=False)  # checks the codec
        broadcast_parameters(named)  # every worker starts from worker 0's parameters
        with torch.no_grad():
            for p, b, g in zip(self._local, self._base, self._global):
                b.copy_(p)
                g.copy_(p)
        self.inner_steps = 0      # inner steps taken
        self.outer_steps = 0      # outer steps taken
        self._local_steps = 0     # inner steps since the last round
        self._in_flight = False   # overlap: a round's exchange is on the wire
        self._averaged = False    # ... and was already waited for (state_dict)
        self._hook = inner_optimizer.register_step_post_hook(self._after_inner_step)
        log.info("DiLoCo: %d tensors, sync_every=%d, outer=%s, compression=%s, overlap=%s",
                 len(named), self.sync_every, type(outer).__name__,
                 self._outer._gp_spec, overlap)

    # -- the round --------------------------------------------------------------------------
    def _after_inner_step(self, *_: Any) -> None:  # step 1
        self.inner_steps += 1
        self._local_steps += 1
        if self._local_steps == self.sync_every:
            self._round(wait=not self.overlap)

    @torch.no_grad()
    def _round(self, wait: bool) -> None:
        delta = [(b - p).float() for b, p in zip(self._base, self._local)]  # step 2
        self._local_steps = 0
        self._finish()  # overlap: the previous round's exchange, one round late
        if not wait:  # step 5, overlapped: the global parameters plus the local progress
            for p, g, d in zip(self._local, self._global, delta):
                p.copy_(g - d)
        for g, d in zip(self._global, delta):
            g.grad = d
        for g in self._global:  # step 3: every push starts now
            self._outer._gp_push(g)
        self._in_flight, self._averaged = True, False
        if wait:
            self._finish()  # steps 3-4
            for p, g in zip(self._local, self._global):  # step 5
                p.copy_(g)
        for b, p in zip(self._base, self._local):
            b.copy_(p)

    def _finish(self) -> None:
        """Steps 3-4 of the round in flight (if any): wait for its average (unless
        :meth:`state_dict` did) and step the outer optimizer on it."""
        if not self._in_flight:
            return
        if self._averaged:
            with self._outer.skip_synchronize():
                self._outer.step()
        else:
            self._outer.step()
        self.outer_steps += 1
        self._in_flight = self._averaged = False
        for g in self._global:
            g.grad = None

    # -- public -------------------------------------------------------------------------------
    def sync(self) -> None:
        """Finish training's communication: the round in flight and the local steps since the
        last round take one last, synchronous, outer step; every worker then holds the same
        global parameters in ``model``. Call it on every worker at the same point."""
        if self._local_steps:
            self._round(wait=True)
        elif self._in_flight:  # overlap, ended on a round: only that round's outer step is due
            self._finish()
            with torch.no_grad():
                for p, b, g in zip(self._local, self._base, self._global):
                    p.copy_(g)
                    b.copy_(g)

    def state_dict(self) -> dict[str, Any]:
        """The global parameters, each worker's base, the outer optimizer's state (momentum)
        with this worker's residuals, the step counters and, with ``overlap``, the averaged
        pseudo-gradient of the round in flight (waited for here). Save the model's and the
        inner optimizer's state beside it; the servers' residuals: ``gp.save_server_state``."""
        self.settle()
        return {"global": [g.detach().clone() for g in self._global],
                "base": [b.clone() for b in self._base],
                "outer": self._outer.state_dict(),
                "inner_steps": self.inner_steps, "outer_steps": self.outer_steps,
                "local_steps": self._local_steps,
                "in_flight": [g.grad.clone() for g in self._global if g.grad is not None]
                if self._in_flight else None}

    def settle(self) -> None:
        """Wait for the round on the wire (``overlap``), if any, without stepping: its average
        lands in the global parameters' ``.grad`` and is stepped at the next round. After it no
        push is in flight (what a checkpoint needs)."""
        if self._in_flight and not self._averaged:
            self._outer.synchronize()
            self._averaged = True

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (this worker's own; the same model)."""
        glob, base = list(state["global"]), list(state["base"])
        for what, saved in (("global", glob), ("base", base)):
            if len(saved) != len(self._global) or any(
                    s.shape != g.shape for s, g in zip(saved, self._global)):
                raise ValueError(f"DiLoCo state {what!r} holds {len(saved)} tensors of other "
                                 f"shapes than this model's {len(self._global)}; a checkpoint "
                                 "of another model")
        with torch.no_grad():
            for g, b, sg, sb in zip(self._global, self._base, glob, base):
                g.copy_(sg)
                b.copy_(sb)
        self._outer.load_state_dict(state["outer"])
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
        self._local_steps = int(state["local_steps"])
        pending = state.get("in_flight")
        self._in_flight = self._averaged = pending is not None
        for g, avg in zip(self._global, pending or [None] * len(self._global)):
            g.grad = None if avg is None else avg.clone()

    def close(self) -> None:
        """:meth:`sync`, then stop counting the inner optimizer's steps."""
        self.sync()
        self._hook.remove()

    def __enter__(self) -> DiLoCo:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self._hook.remove()

    def plan(self) -> Any:
        """What each outer step pushes, tensor by tensor (a :class:`~gradpress.torch.plan.Plan`
        of the pseudo-gradients; ``print(loco.plan().format())``)."""
        return self._outer.plan()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The global parameters (the outer optimizer's), in the model's order."""
        return iter(self._global)

"""``gradpress train --optimizer diloco``: the bundled loop with :class:`gradpress.DiLoCo`.

:class:`LocalSteps` gives ``gp.DiLoCo`` and its inner AdamW the face the training session
drives (``synchronize``, ``skip_synchronize``, ``step``, ``param_groups``, ``plan``, state
dicts), so the loop, the lr schedule, reports and checkpoints stay as they are:

1. ``step()`` steps the inner AdamW; every ``sync_every``-th step ``gp.DiLoCo`` runs a round
   (the bytes on the wire are counted by the engine like every push).
2. ``state_dict()`` holds each worker's own state (``per_worker_state``): the inner AdamW's
   moments, DiLoCo's global parameters, base and outer momentum, and the worker's local
   parameters, which differ between rounds and are put back at the next ``zero_grad()`` (a
   checkpoint loads the model from worker 0 and broadcasts it).
3. :meth:`settle` waits for a round on the wire before a checkpoint (no push in flight).
4. :meth:`sync` ends training: every worker holds the global parameters.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["LocalSteps", "build_local_steps"]


class LocalSteps:
    """The inner optimizer and its ``gp.DiLoCo``, driven as one optimizer (module steps)."""

    per_worker_state = True  # every worker's inner moments and local parameters are its own

    def __init__(self, inner: torch.optim.Optimizer, loco: Any) -> None:
        self.inner, self.loco = inner, loco
        self._params = [p for g in inner.param_groups for p in g["params"]]
        self._restore: list[torch.Tensor] | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def synchronize(self) -> None:
        """Nothing to wait for per step: the rounds communicate."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield

    def step(self, closure: Any = None) -> Any:  # step 1
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._restore is not None:  # step 2: the local parameters of a loaded checkpoint
            with torch.no_grad():
                for p, saved in zip(self._params, self._restore):
                    p.copy_(saved)
            self._restore = None
        self.inner.zero_grad(set_to_none=set_to_none)

    def plan(self) -> Any:
        return self.loco.plan()

    def settle(self) -> None:  # step 3
        self.loco.settle()

    def sync(self) -> None:  # step 4
        self.loco.sync()

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``"diloco"`` and ``"local"`` (step 2)."""
        return {**self.inner.state_dict(), "diloco": self.loco.state_dict(),
                "local": [p.detach().clone() for p in self._params]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = dict(state)
        loco, local = state.pop("diloco"), state.pop("local")
        if len(local) != len(self._params) or any(
                t.shape != p.shape for t, p in zip(local, self._params)):
            raise ValueError("DiLoCo checkpoint: its local parameters do not match this "
                             "model's (another model or another optimizer grouping)")
        self.inner.load_state_dict(state)
        self.loco.load_state_dict(loco)
        self._restore = [t.clone() for t in local]


def build_local_steps(model: torch.nn.Module, named: list[tuple[str, Any]], *, lr: float,
                      betas: tuple[float, float], weight_decay: float, sync_every: int,
                      compression: str, overlap: bool, outer_lr: float,
                      outer_momentum: float, prefix: str) -> LocalSteps:
    """AdamW (weight decay not on biases and norms) inside ``gp.DiLoCo`` with an SGD outer
    step (Nesterov when ``outer_momentum`` > 0)."""
    from ..optim import weight_decay_groups
    from ..torch.diloco import DiLoCo

    groups = weight_decay_groups([p for _, p in named], weight_decay)
    inner = torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=weight_decay)
    outer = functools.partial(torch.optim.SGD, lr=outer_lr, momentum=outer_momentum,
                              nesterov=outer_momentum > 0)
    loco = DiLoCo(model, inner, sync_every=sync_every, outer_optimizer=outer,
                  compression=compression, overlap=overlap, prefix=prefix)
    return LocalSteps(inner, loco)

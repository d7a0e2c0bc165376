"""Broadcasts among the workers (torch.distributed on the workers' process group)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object"]


def _group_and_root(root_rank: int) -> tuple[dist.ProcessGroup, int]:
    from .. import api

    grp = api.worker_group()
    n = api.size()
    if not 0 <= root_rank < n:
        raise ValueError(f"root_rank must be in [0, {n}) (a worker rank), got {root_rank}")
    return grp, dist.get_global_rank(grp, root_rank)


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                         root_rank: int = 0) -> None:
    """Overwrite every worker's tensors with root's, in place (e.g. ``model.state_dict()``).

    Tensors are visited in name order, so every worker must pass the same names.
    """
    items = sorted(params.items() if isinstance(params, Mapping) else params,
                   key=lambda kv: kv[0])
    grp, src = _group_and_root(root_rank)
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"broadcast_parameters: {name!r} is {type(t).__name__}, not a tensor")
        buf = t.detach()
        host = buf if buf.device.type == "cpu" and buf.is_contiguous() else buf.cpu().contiguous()
        dist.broadcast(host, src=src, group=grp)
        if host is not buf:
            buf.copy_(host)


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """Return root's ``obj`` on every worker (pickled through torch.distributed)."""
    grp, src = _group_and_root(root_rank)
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=grp)
    return box[0]


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every worker's optimizer state (and hyperparameters) equal to root's.

    The per-worker codec state of a ``DistributedOptimizer`` (its ``"gradpress"`` entry:
    error-feedback residuals, momentum buffers) is not broadcast: each worker keeps its own.
    """
    from .. import api

    state = None
    if api.rank() == root_rank:
        state = optimizer.state_dict()
        state.pop("gradpress", None)
    state = broadcast_object(state, root_rank=root_rank)
    optimizer.load_state_dict(state)

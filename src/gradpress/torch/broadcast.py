"""Broadcasts among the workers (torch.distributed on the workers' process group).

Objects travel pickled, with every tensor copied to the CPU first (:func:`host_pickle`): a CUDA
tensor pickles its storage with its device (``torch.storage`` ``__reduce__`` saves it with
``torch.save``, whose location tag is ``cuda:<index>``), so every worker would unpickle it onto
the root's device index (cuda:0 for root 0) and create a CUDA context and an allocation there.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object",
           "host_pickle", "shared_state_dict", "load_optimizer_state"]


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

    Tensors are visited in name order, so every worker must pass the same names. Each tensor
    travels through a CPU copy of its own (one tensor at a time, never the whole set).
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


class _HostPickler(pickle.Pickler):
    """A pickler that writes every tensor not on ``host`` as a copy on ``host``."""

    def __init__(self, file: Any, host: torch.device) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.host = host

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or obj.device == self.host:
            return NotImplemented
        copy = obj.detach().to(self.host)
        if isinstance(obj, torch.nn.Parameter):
            copy = torch.nn.Parameter(copy, requires_grad=obj.requires_grad)
        elif obj.requires_grad:
            copy.requires_grad_()
        return copy.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def host_pickle(obj: Any, host: str | torch.device = "cpu") -> bytes:
    """``obj`` pickled with every tensor in it (at any depth, in any container or object)
    replaced by a copy on ``host`` (one tensor at a time); unpickled, it holds no tensor of
    another device. ``host`` is a parameter for tests (``"meta"`` shows the move on a CPU)."""
    buf = io.BytesIO()
    _HostPickler(buf, torch.device(host)).dump(obj)
    return buf.getvalue()


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """Return root's ``obj`` on every worker (pickled through torch.distributed).

    Tensors in it arrive on the CPU on the other workers (root keeps its own ``obj``): move
    them where they belong (``optimizer.load_state_dict`` does so for optimizer state)."""
    from .. import api

    grp, src = _group_and_root(root_rank)
    root = api.rank() == root_rank
    box: list[Any] = [host_pickle(obj) if root else None]
    dist.broadcast_object_list(box, src=src, group=grp)
    return obj if root else pickle.loads(box[0])  # bytes from our own root


def shared_state_dict(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's ``state_dict()`` without the per-worker codec state of a
    ``DistributedOptimizer`` (its ``"gradpress"`` entry), which is not even gathered (no CPU
    copies of the residuals are made only to be dropped)."""
    own = getattr(optimizer, "_gp_state_dict", None)
    if own is not None:
        return own(codec=False)
    state = optimizer.state_dict()
    state.pop("gradpress", None)
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, releasing the optimizer's current state first.

    ``torch.optim.Optimizer.load_state_dict`` casts each saved tensor to its parameter's device
    and dtype (``_process_value_according_to_param_policy``; ``step`` stays as it is unless the
    group is fused or capturable) while the old state is still referenced, so a device would
    hold the old and the new state whole. The layout is checked first (ValueError, as torch's
    own check, before anything is released), then the old state is dropped and the new one
    arrives tensor by tensor from ``state`` (CPU tensors: a checkpoint or a broadcast).
    """
    groups, saved = optimizer.param_groups, state.get("param_groups")
    if not isinstance(saved, list) or len(saved) != len(groups):
        raise ValueError(f"loaded optimizer state has {len(saved or [])} parameter groups, "
                         f"the optimizer {len(groups)}")
    for i, (g, s) in enumerate(zip(groups, saved)):
        if len(g["params"]) != len(s.get("params", ())):
            raise ValueError(f"loaded optimizer state's parameter group {i} has "
                             f"{len(s.get('params', ()))} parameters, the optimizer's "
                             f"{len(g['params'])}")
    optimizer.state.clear()
    optimizer.load_state_dict(state)  # type: ignore[arg-type]  # any mapping; the stubs say dict


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every worker's optimizer state (and hyperparameters) equal to root's.

    The per-worker codec state of a ``DistributedOptimizer`` (its ``"gradpress"`` entry:
    error-feedback residuals, momentum buffers) is not broadcast: each worker keeps its own.
    Root's state travels as CPU copies (:func:`host_pickle`, one tensor at a time); each other
    worker loads every tensor onto the device of the parameter it belongs to
    (:func:`load_optimizer_state`). Root keeps its state as it is.
    """
    from .. import api

    if api.size() == 1:
        return
    root = api.rank() == root_rank
    state = broadcast_object(shared_state_dict(optimizer) if root else None, root_rank)
    if not root:
        load_optimizer_state(optimizer, state)

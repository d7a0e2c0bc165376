"""Hierarchical aggregation for several workers per node (``GRADPRESS_HIERARCHICAL=1``).

As BytePS does within a machine (Jiang et al., OSDI 2020, section 4.2), per tensor:

1. local reduce: the node's workers sum their tensors into the node leader (its first worker)
   with a ``torch.distributed.reduce`` in the node's reduce subgroup;
2. the leader alone runs the compressed push/pull of the sum through the servers (which divide
   by the total number of workers when averaging), so each node sends one stream, not one per
   worker;
3. local broadcast: the leader broadcasts the result in the node's broadcast subgroup.

A reduce thread issues the reduces (and the leader's pushes) in submission order and a
broadcast thread issues the broadcasts in the same order, each on its own subgroup, so the
collectives of one tensor overlap with those of the next and every worker of the node issues
them in the same order. All workers of a node must call ``push_pull`` in the same order.
Results are identical on all workers (the leader's bytes are broadcast); with ``none`` they
equal the plain sum up to the summation order of the local reduce.

The collectives run on float32 host buffers: a CUDA tensor is copied down at ``submit`` into
pinned memory without blocking (on the caller's current stream; the reduce thread waits for
the copy's event before its reduce) and its result copied back at ``wait`` from that pinned
buffer, also without blocking, on the waiter's current stream, into ``out=`` when one is given
(on the tensor's device, as in the flat pipeline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .calls import Handle, blocking_event, check_out, flat_fp32
from .cluster import Cluster
from .config import PSConfig
from .errors import GradpressError
from .handoff import TaskPool
from .worker import WorkerEngine

__all__ = ["HierarchicalEngine"]


def _stage(tensor: torch.Tensor, out: torch.Tensor | None,
           name: str) -> tuple[torch.Tensor, torch.Tensor | None, Any]:
    """The float32 CPU buffer the node's collectives work on in place, where the result goes
    at ``wait`` when that is not the buffer itself (a device ``out=``; else None), and for a
    CUDA tensor the event after its copy into the (pinned) buffer (else None).

    ``out`` follows :func:`~gradpress.ps.calls.check_out` as in the flat pipeline: on the
    tensor's device, possibly the tensor itself. A CPU ``out`` is the buffer; otherwise the
    buffer is a CPU copy (the input is never modified unless it is ``out``).
    """
    src = flat_fp32(tensor, name, keep_device=True)
    dest = None if out is None else check_out(out, src, name)
    if dest is not None and dest.device.type == "cpu":
        if dest.data_ptr() != src.data_ptr():
            dest.copy_(src)
        return dest, None, None
    if src.is_cuda:  # no host synchronisation: the reduce thread waits for the event
        flat = torch.empty(src.numel(), dtype=torch.float32, device="cpu", pin_memory=True)
        flat.copy_(src, non_blocking=True)
        return flat, dest, torch.cuda.current_stream(src.device).record_event(blocking_event())
    flat = src.cpu()
    if flat.numel() and flat.data_ptr() == tensor.data_ptr():
        flat = flat.clone()
    return flat, dest, None


class HierarchicalEngine:
    """Front of a worker's ``push_pull`` when aggregation is hierarchical.

    Args:
        cluster: the joined job (with ``local_groups``).
        cfg: runtime options.
        engine: the worker pipeline; only the leader's talks to servers.
    """

    def __init__(self, cluster: Cluster, cfg: PSConfig, engine: WorkerEngine) -> None:
        if cluster.local_groups is None:
            raise GradpressError("hierarchical aggregation needs the node subgroups; connect "
                                 "the cluster with hierarchical=True")
        self.cluster = cluster
        self.cfg = cfg
        self.engine = engine
        lay = cluster.layout
        self.leader = lay.node_workers(lay.node_of_worker(cluster.rank))[0]
        self.is_leader = cluster.rank == self.leader
        self._reduce_group, self._bcast_group = cluster.local_groups
        self._error: BaseException | None = None
        self._reducer = TaskPool(1, "gp-local-reduce", on_error=engine.fail)
        self._broadcaster = TaskPool(1, "gp-local-broadcast", on_error=engine.fail)

    def submit(self, tensor: torch.Tensor, name: str, **kwargs: Any) -> Handle:
        """Start a hierarchical push_pull; ``kwargs`` as :meth:`WorkerEngine.submit`."""
        if self._error is not None:
            raise GradpressError(f"hierarchical aggregation failed earlier: {self._error}") \
                from self._error
        self.engine.check_call(name, kwargs.get("compression"), kwargs.get("ef"),
                               kwargs.get("lr"))
        out = kwargs.pop("out", None)
        flat, dest, copied = _stage(tensor, out, name)
        like = tensor if out is None else out
        # the leader's engine counts its own calls; the others count theirs here
        on_done = None if self.is_leader else self._count
        handle = Handle(name, flat, like.shape, like.dtype, like.device, 1, on_done=on_done,
                        dest=dest)
        self._reducer.submit(self._run, self._reduce, flat, copied, name, kwargs, handle)
        return handle

    def close(self) -> None:
        """Stop the threads after the queued tensors went through."""
        self._reducer.shutdown(timeout=self.cfg.timeout)
        self._broadcaster.shutdown(timeout=self.cfg.timeout)

    def _run(self, fn: Callable[..., None], *item: Any) -> None:
        handle = item[-1]
        if self._error is not None:
            handle._set_error(self._error)
            return
        try:
            fn(*item)
        except BaseException as e:  # noqa: BLE001 - the node's collectives are now unusable
            self._error = e
            handle._set_error(e)

    def _count(self, handle: Handle) -> None:
        if handle.error is None:
            self.engine.account(steps=1, dense_fp32_bytes=4 * handle._out.numel())

    def _collective(self, stage: str, name: str, fn: Callable[[], object]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
            self.engine.account(**{f"{stage.replace(' ', '_')}_s": time.perf_counter() - t0})
        except RuntimeError as e:
            raise GradpressError(f"{stage} of {name!r} among the workers of node "
                                 f"{self.cluster.layout.node_of_worker(self.cluster.rank)} "
                                 f"(leader: {self.cluster.describe(self.leader)}) failed: "
                                 f"{e}") from e

    def _reduce(self, flat: torch.Tensor, copied: Any, name: str, kwargs: dict[str, Any],
                handle: Handle) -> None:  # steps 1-2
        if copied is not None:
            copied.synchronize()  # the tensor's copy into flat (sleeps; no spinning)
        self._collective("local reduce", name, lambda: dist.reduce(
            flat, self.leader, op=dist.ReduceOp.SUM, group=self._reduce_group))
        inner = self.engine.submit(flat, name, out=flat, **kwargs) if self.is_leader else None
        self._broadcaster.submit(self._run, self._broadcast, flat, name, inner, handle)

    def _broadcast(self, flat: torch.Tensor, name: str, inner: Handle | None,
                   handle: Handle) -> None:  # step 3
        if inner is not None:
            inner.wait()  # the leader's result is in flat (in place)
        self._collective("local broadcast", name, lambda: dist.broadcast(
            flat, self.leader, group=self._bcast_group))
        handle._chunk_done()

"""The public functions of gradpress (re-exported lazily by ``gradpress``)::

    import gradpress as gp
    gp.init()                              # in a process started by `gradpress launch`/torchrun
    y = gp.push_pull(t, name="w", average=True, compression="onebit", ef="vanilla")
    h = gp.push_pull_async(t, name="w"); y = h.wait()
    gp.stats(); gp.shutdown()

``push_pull`` returns a new tensor (same shape, dtype and device as ``t``): the sum over workers,
divided by the number of workers when ``average``. Every worker receives identical bytes.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .compress.spec import CodecSpec, EFSpec
from .ps.calls import Handle
from .ps.cluster import Cluster
from .ps.config import ClusterConfig, PSConfig, available_cores
from .ps.errors import GradpressError, NotInitializedError
from .ps.hierarchy import HierarchicalEngine
from .ps.server import ServerEngine, serve
from .ps.trace import Tracer, trace_path
from .ps.transport import Transport
from .ps.watchdog import Watchdog
from .ps.worker import WorkerEngine

__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "is_initialized",
           "push_pull", "push_pull_async", "Handle", "stats", "barrier", "worker_group",
           "config", "worker_state_dict", "load_worker_state_dict", "save_server_state",
           "load_server_state"]

log = logging.getLogger(__name__)
Compression = str | Mapping[str, Any] | CodecSpec | None


class _Runtime:
    """Everything ``init`` creates in a worker process."""

    def __init__(self, ccfg: ClusterConfig, cfg: PSConfig) -> None:
        self.ccfg = ccfg
        self.cfg = cfg
        self.cluster = Cluster.connect(ccfg, cfg.timeout, cfg.hierarchical)
        rank = ccfg.rank
        self.tracer = Tracer(trace_path(cfg.trace, "worker", rank, rank) if cfg.trace else None,
                             rank, self.cluster.describe(rank))
        self.transport = Transport(rank, self.cluster.describe, self.cluster.reported_errors)
        self.worker = WorkerEngine(self.cluster, cfg, self.transport, self.tracer)
        self.front = HierarchicalEngine(self.cluster, cfg, self.worker) \
            if cfg.hierarchical else None
        self.server: ServerEngine | None = None
        hosted = self.cluster.my_servers
        if hosted:  # colocated: this worker also runs a server engine on threads
            self.server = ServerEngine(self.cluster, cfg, self.transport, hosted[0],
                                       tracer=self.tracer, on_error=self.worker.fail).start()
        # a failure anywhere fails this engine; exit forced after `timeout` (docs/design.md)
        self.watchdog = Watchdog(self.cluster, interval=cfg.watchdog_interval,
                                 exit_within=cfg.timeout, on_failure=self.worker.fail,
                                 local_error=lambda: self.worker.error).start()

    def submit(self, tensor: torch.Tensor, name: str, **kwargs: Any) -> Handle:
        if self.front is not None:
            return self.front.submit(tensor, name, **kwargs)
        return self.worker.submit(tensor, name, **kwargs)

    def close(self) -> None:
        lay = self.cluster.layout
        if self.front is not None:
            self.front.close()
        pushes = self.ccfg.rank in lay.pushers
        self.worker.close([lay.server_rank(s) for s in range(lay.num_servers)] if pushes else [])
        if self.server is not None and self.worker.error is None:
            idle = self.cfg.idle_timeout or None
            self.server.join(idle)  # serves the other workers until they all stopped
        self.tracer.write()
        self.watchdog.stop()
        if self.worker.error is None:
            self.cluster.close()


_RT: _Runtime | None = None
_WAS_SHUT_DOWN = False
_LOCK = threading.Lock()


def _rt() -> _Runtime:
    if _RT is None:
        raise NotInitializedError("gradpress is not initialized: call gradpress.init() first "
                                  "(in a process started by `gradpress launch` or torchrun)")
    return _RT


def init(config: PSConfig | None = None, **overrides: Any) -> None:
    """Join the job described by the environment (see docs/reference/environment.md).

    Args:
        config: runtime options; by default ``PSConfig.from_env(**overrides)``.
        overrides: :class:`~gradpress.ps.config.PSConfig` fields (e.g. ``timeout=60``).

    A process whose role is ``server`` (under torchrun with ``GRADPRESS_NUM_SERVERS``) serves
    until every worker shut down, then exits with status 0. Calling ``init`` again while
    initialized does nothing; after ``shutdown`` it raises (the servers have stopped).
    """
    global _RT
    if config is not None and overrides:
        raise TypeError("init: pass either a PSConfig or keyword overrides, not both")
    cfg = config if config is not None else PSConfig.from_env(**overrides)
    with _LOCK:
        if _RT is not None:
            return
        if _WAS_SHUT_DOWN:
            raise GradpressError("gradpress was shut down in this process and its servers have "
                                 "stopped; start a new job to initialize again")
        ccfg = ClusterConfig.from_env()
        if cfg.torch_threads is not None:
            torch.set_num_threads(cfg.torch_threads)
        _warn_oversubscription(cfg, ccfg)
        if ccfg.role == "server":
            serve(ccfg, cfg)
            sys.exit(0)
        _RT = _Runtime(ccfg, cfg)
    atexit.register(_shutdown_at_exit)


def _warn_oversubscription(cfg: PSConfig, ccfg: ClusterConfig) -> None:
    cores = max(1, available_cores() // max(1, ccfg.local_size))
    if cfg.compress_threads * torch.get_num_threads() > cores:
        log.info("compress_threads (%d) x torch threads (%d) exceeds the %d cores of this "
                    "process; set GRADPRESS_TORCH_THREADS or GRADPRESS_COMPRESS_THREADS",
                    cfg.compress_threads, torch.get_num_threads(), cores)


def shutdown() -> None:
    """Finish in-flight work, stop the servers, join threads, destroy the process group.

    Safe to call more than once; registered with ``atexit`` by ``init``.
    """
    global _RT, _WAS_SHUT_DOWN
    with _LOCK:
        rt, _RT = _RT, None
        _WAS_SHUT_DOWN |= rt is not None
    if rt is not None:
        rt.close()


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception as e:  # noqa: BLE001 - at exit, report rather than raise
        print(f"gradpress: shutdown at exit failed: {e}", file=sys.stderr)


def is_initialized() -> bool:
    """Whether ``init`` ran (and ``shutdown`` did not yet)."""
    return _RT is not None


def rank() -> int:
    """This worker's rank, ``0 .. size()-1``."""
    return _rt().ccfg.rank


def size() -> int:
    """Number of workers."""
    return _rt().ccfg.num_workers


def local_rank() -> int:
    """This worker's index among the workers of its node."""
    return _rt().ccfg.local_rank


def local_size() -> int:
    """Number of workers on this node."""
    return _rt().ccfg.local_size


def config() -> PSConfig:
    """The runtime options in effect."""
    return _rt().cfg


def worker_group() -> dist.ProcessGroup:
    """The torch.distributed process group of the workers (for broadcasts among workers)."""
    grp = _rt().cluster.worker_group
    assert grp is not None
    return grp


def push_pull_async(tensor: torch.Tensor, name: str, average: bool = True,
                    compression: Compression = None, ef: str | EFSpec | None = None, *,
                    lr: float | None = None, min_compress_bytes: int | None = None,
                    out: torch.Tensor | None = None) -> Handle:
    """Start summing ``tensor`` over all workers through the servers; see :func:`push_pull`.

    Do not modify ``tensor`` (or ``out``) before the handle completes."""
    return _rt().submit(tensor, name, average=average, compression=compression, ef=ef, lr=lr,
                        min_compress_bytes=min_compress_bytes, out=out)


def push_pull(tensor: torch.Tensor, name: str, average: bool = True,
              compression: Compression = None, ef: str | EFSpec | None = None, *,
              lr: float | None = None, min_compress_bytes: int | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Sum (or average) ``tensor`` over all workers; every worker gets identical values.

    Args:
        tensor: a floating-point tensor (any shape, device); the result has its shape, dtype
            and device. On CUDA the result is ready for work queued on the caller's current
            stream after this returns (other streams must wait on that stream).
        name: identifies the tensor on all workers (keys are derived from it).
        average: divide the sum by the number of workers (on the server).
        compression: codec spec (``"onebit"``, ``"topk:k=0.001"``, a BytePS-style dict);
            None uses ``GRADPRESS_COMPRESSION`` (default ``"none"``).
        ef: error feedback, an :class:`~gradpress.compress.EFSpec` or its text (``"vanilla"``,
            ``"vanilla:decay=B"``, ``"vanilla:decay=B,server_decay=S"``, ``"corrected"``,
            ``"sparse"``, ``"none"``); None uses the spec's ``ef`` or ``GRADPRESS_EF``. Workers
            and servers each keep a residual (``server_decay``: the servers' decays by ``S``,
            the workers' by ``B``; ``",anneal=1"`` after them: the workers' decay rises from
            ``B`` towards 1 as ``lr`` falls).
        lr: learning rate of this step, carried to the servers; required with
            ``"corrected"`` and ``anneal=1``.
        min_compress_bytes: tensors smaller than this travel uncompressed (default from the
            config, 1 MiB).
        out: write the result here and return it (viewed with its own shape) instead of a new
            tensor: a contiguous float32 tensor on ``tensor``'s device with the input's number
            of elements. It may be ``tensor`` itself (in place, no extra result buffer); it
            must not overlap it otherwise. The same rule holds with hierarchical aggregation,
            where a device ``out`` is filled when the handle is waited for.
    """
    return push_pull_async(tensor, name, average, compression, ef, lr=lr,
                           min_compress_bytes=min_compress_bytes, out=out).wait()


def stats() -> dict[str, float]:
    """Counters of this worker: ``bytes_pushed``, ``bytes_pulled``, ``dense_fp32_bytes``,
    ``steps`` (completed push_pulls), ``chunks``, ``drift_recoveries`` (compressed momenta
    that drifted and recovered, :mod:`gradpress.optim.health`), and per-stage seconds
    ``compress_s``, ``send_s``, ``wait_s`` (waiting for replies) and ``decompress_s``."""
    return _rt().worker.stats()


def barrier() -> None:
    """Block until every worker reached the barrier (bounded by ``GRADPRESS_TIMEOUT``)."""
    dist.barrier(group=worker_group())


# -- checkpoints (docs/design.md) ---------------------------------------------------------------
def worker_state_dict(names: set[str] | None = None) -> dict[str, Any]:
    """This worker's codec state per tensor name and chunk: error-feedback residuals, momentum
    buffers and step counters (CPU copies; ``names`` restricts the tensors). No push_pull may
    be in flight (call the optimizer's ``step()`` first)."""
    return _rt().worker.checkpoint.state_dict(names)


def load_worker_state_dict(state: Mapping[str, Any]) -> None:
    """Restore :func:`worker_state_dict` output (of the same rank). Tensors not pushed yet get
    their state at their first push_pull, which raises ValueError naming the tensor if its size,
    codec or chunking differ from the saved ones."""
    _rt().worker.checkpoint.load_state_dict(dict(state))


def save_server_state(directory: str) -> None:
    """Every server writes its residuals and step counters to ``directory/server<i>.pt``.

    Collective over the workers (same ``directory`` everywhere), with no push_pull in flight;
    returns when every server acknowledged (bounded by ``GRADPRESS_TIMEOUT``; an error names
    the server). The directory must be reachable under this path by the servers.
    """
    _rt().worker.checkpoint.server_state("save", _abs_dir(directory))


def load_server_state(directory: str) -> None:
    """Every server reads the ``server*.pt`` files of ``directory`` (written by
    :func:`save_server_state`) and restores its keys; keys not pushed yet get their state at
    their first push. Collective over the workers, like :func:`save_server_state`."""
    _rt().worker.checkpoint.server_state("load", _abs_dir(directory))


def _abs_dir(directory: str) -> str:
    if not isinstance(directory, str | os.PathLike) or not str(directory):
        raise TypeError(f"directory must be a non-empty path, got {directory!r}")
    return os.path.abspath(os.fspath(directory))

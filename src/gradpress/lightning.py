"""PyTorch Lightning strategies that train with gradpress's two-way compressed communication.

Two routes, both a drop-in ``Trainer(strategy=...)`` for an unchanged ``LightningModule``
(recipes: ``docs/integrations.md#pytorch-lightning``)::

    from gradpress.lightning import TwoWayCompressionStrategy, ParameterServerStrategy
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TwoWayCompressionStrategy())
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=ParameterServerStrategy("onebit"))

* :class:`TwoWayCompressionStrategy`: DDP with :func:`~gradpress.ddp.two_way_compression_hook`
  registered on any device (Lightning's ``DDPStrategy`` registers communication hooks only on
  CUDA, so ``DDPStrategy(ddp_comm_hook=...)`` on CPU silently trains uncompressed).
* :class:`ParameterServerStrategy`: no DDP; gradpress's parameter servers (colocated, one engine
  per worker) average the gradients through :func:`gradpress.DistributedOptimizer`.

Both put every rank's compression state (worker and server residuals, step counters) into the
checkpoints Lightning writes, under :data:`CHECKPOINT_KEY`, and restore it on ``ckpt_path=``.
Importing this module needs the ``lightning`` package (``pip install "gradpress[lightning]"``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    from lightning.pytorch import Trainer
    from lightning.pytorch.core.optimizer import LightningOptimizer
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as _e:  # pragma: no cover - exercised without lightning installed
    raise ImportError('gradpress.lightning needs PyTorch Lightning (the `lightning` package): '
                      'pip install "gradpress[lightning]"') from _e

from . import api, defaults
from .compress.spec import Compression, EFSpec
from .ddp import TwoWayCompressionState, two_way_compression_hook
from .torch.broadcast import broadcast_parameters
from .torch.optimizer import DistributedOptimizer

__all__ = ["TwoWayCompressionStrategy", "ParameterServerStrategy", "CHECKPOINT_KEY"]

log = logging.getLogger(__name__)

#: The key of a Lightning checkpoint that holds gradpress's per-rank compression state.
CHECKPOINT_KEY = "gradpress"
_FORMAT = 1


def _gather_to_zero(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (in rank order), None elsewhere; ``[obj]`` without a
    process group. Collective over the default group."""
    if not dist.is_available() or not dist.is_initialized():
        return [obj]
    out: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _saved_entry(checkpoint: Mapping[str, Any], kind: str, world: int) -> Mapping[str, Any] | None:
    """The checkpoint's gradpress entry, checked against this job (None: there is none)."""
    entry = checkpoint.get(CHECKPOINT_KEY)
    if entry is None:
        log.warning("gradpress.lightning: the checkpoint has no %r entry; compression state "
                    "starts from zero", CHECKPOINT_KEY)
        return None
    if entry.get("strategy") != kind or entry.get("world_size") != world:
        raise ValueError(f"gradpress.lightning: the checkpoint's compression state was saved by "
                         f"{entry.get('strategy')!r} with {entry.get('world_size')} processes; "
                         f"this job is {kind!r} with {world}: resume with the same strategy and "
                         f"number of processes")
    return entry


class _StatsLogging:
    """Shared by both strategies: ``compression_stats`` and its logging after each step."""

    _log_stats: bool

    @property
    def compression_stats(self) -> dict[str, float]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _log_compression(self, module: Any) -> None:
        """Log this rank's cumulative ``gradpress/bytes_sent``, ``gradpress/fp32_bytes`` and
        ``gradpress/compression_ratio`` through the LightningModule (rank 0's reach loggers)."""
        if not self._log_stats or module is None or getattr(module, "_current_fx_name", None) \
                is None:
            return
        s = self.compression_stats
        sent, fp32 = float(s["bytes_sent"]), float(s["fp32_bytes"])
        module.log_dict({"gradpress/bytes_sent": sent, "gradpress/fp32_bytes": fp32,
                         "gradpress/compression_ratio": fp32 / sent if sent else 1.0},
                        on_step=True, on_epoch=False, rank_zero_only=True)


class TwoWayCompressionStrategy(_StatsLogging, DDPStrategy):
    """A ``DDPStrategy`` that registers its communication hook on every device, CPU included.

    Takes ``DDPStrategy``'s arguments. ``ddp_comm_hook`` defaults to
    :func:`~gradpress.ddp.two_way_compression_hook` and ``ddp_comm_state`` to
    ``TwoWayCompressionState(compression)``: ``compression`` (default ``"int4"``) is a spec
    string, a BytePS-style dict or a ``CodecSpec``, with vanilla error feedback and buckets from
    1 MiB; build your own state for other settings (then leave ``compression`` out). Replicas
    stay bit-identical (every rank decodes the same bytes). ``log_stats`` (default True) logs
    the bytes sent after each optimizer step (:attr:`compression_stats`). Recipes:
    ``docs/integrations.md#pytorch-lightning``.

    Checkpoints (``Trainer.save_checkpoint``, ``ModelCheckpoint``; collective on every rank):

    1. every rank takes its hook state's ``state_dict()`` (its own residuals and counters);
    2. rank 0 gathers them and writes them, in rank order, under ``checkpoint["gradpress"]``;
    3. on ``trainer.fit(..., ckpt_path=...)`` every rank loads its own entry back into the state
       (applied to each bucket when DDP first hands it over).
    """

    _KIND = "two_way_hook"

    def __init__(self, *, compression: Compression | None = None,
                 ddp_comm_state: object | None = None,
                 ddp_comm_hook: Callable[..., Any] | None = two_way_compression_hook,
                 log_stats: bool = True, **kwargs: Any) -> None:
        if compression is not None and (ddp_comm_state is not None
                                        or ddp_comm_hook is not two_way_compression_hook):
            raise TypeError("TwoWayCompressionStrategy: compression sets the default hook's "
                            "state; give either compression or ddp_comm_state/ddp_comm_hook, "
                            f"got compression={compression!r} with {ddp_comm_state!r}, "
                            f"{getattr(ddp_comm_hook, '__name__', ddp_comm_hook)}")
        if ddp_comm_state is None and ddp_comm_hook is two_way_compression_hook:
            ddp_comm_state = TwoWayCompressionState(
                defaults.COMPRESSION if compression is None else compression)
        super().__init__(ddp_comm_state=ddp_comm_state, ddp_comm_hook=ddp_comm_hook, **kwargs)
        self._log_stats = log_stats
        self._hook_registered = False

    @property
    def comm_state(self) -> object | None:
        """The hook's state (a :class:`~gradpress.ddp.TwoWayCompressionState` by default)."""
        return self._ddp_comm_state

    @property
    def compression_stats(self) -> dict[str, float]:
        """This rank's counters since the start: ``bytes_sent`` (compressed payloads plus
        uncompressed allreduce input), ``fp32_bytes`` (what an fp32 allreduce would take) and the
        hook state's own ``compression_stats()``; zeros for a state without them."""
        fn = getattr(self._ddp_comm_state, "compression_stats", None)
        raw: dict[str, float] = dict(fn()) if callable(fn) else {}
        dense, plain = raw.get("dense_bytes", 0), raw.get("allreduce_bytes", 0)
        return {**raw, "bytes_sent": raw.get("payload_bytes", 0) + plain,
                "fp32_bytes": dense + plain}

    def _register_ddp_hooks(self) -> None:
        """Register the hook on the DDP model whatever the device (Lightning: CUDA only)."""
        model = self.model
        if self._ddp_comm_hook is None or not isinstance(
                model, torch.nn.parallel.DistributedDataParallel):
            return
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        model.register_comm_hook(state=self._ddp_comm_state, hook=hook)
        self._hook_registered = True

    def setup(self, trainer: Trainer) -> None:
        """DDP's setup; registers the hook here if Lightning did not call
        ``_register_ddp_hooks`` (a private method that may change between versions)."""
        self._hook_registered = False
        super().setup(trainer)
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel) \
                and not self._hook_registered:
            self._register_ddp_hooks()

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._log_compression(self.lightning_module)
        return out

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Add every rank's hook state (gathered on rank 0) and write the checkpoint."""
        sd = getattr(self._ddp_comm_state, "state_dict", None)
        if callable(sd) and "optimizer_states" in checkpoint:
            states = _gather_to_zero(sd())
            if states is not None:
                checkpoint = {**checkpoint, CHECKPOINT_KEY: {
                    "format": _FORMAT, "strategy": self._KIND, "world_size": len(states),
                    "ranks": states}}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Restore the optimizers, then this rank's own hook state."""
        super().load_optimizer_state_dict(checkpoint)
        load = getattr(self._ddp_comm_state, "load_state_dict", None)
        entry = _saved_entry(checkpoint, self._KIND, self.world_size) if callable(load) else None
        if entry is not None and load is not None:
            load(entry["ranks"][self.global_rank])


def _track_step_calls(opt: torch.optim.Optimizer) -> None:
    """Mark ``opt.step`` as LR schedulers expect (they patch the instance's ``step`` to record
    that it ran; the wrapped optimizer needs its own such marker)."""
    ref = weakref.ref(opt)
    cls_step = type(opt).step

    def step(*args: Any, **kwargs: Any) -> Any:
        o = ref()
        assert o is not None
        o._opt_called = True  # type: ignore[attr-defined]
        return cls_step(o, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = step  # type: ignore[method-assign]


class ParameterServerStrategy(_StatsLogging, DDPStrategy):
    """Lightning on gradpress's parameter servers: gradients averaged by ``push_pull``, no DDP.

    The LightningModule is unchanged. The arguments mirror
    :func:`gradpress.DistributedOptimizer` with the defaults of :mod:`gradpress.defaults`
    (``compression="int4"``, ``ef="vanilla"``, ``min_compress_bytes="auto"``, no dense steps);
    ``init`` holds :func:`gradpress.init` overrides (``PSConfig`` fields, e.g. ``{"timeout":
    60}``); the other keywords are ``DDPStrategy``'s (``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``start_method``). Servers
    are colocated: one engine per worker, as under torchrun. Steps:

    1. ``setup_environment``: sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
       ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` from Lightning's cluster
       environment and calls :func:`gradpress.init`, whose gloo process group of the workers is
       the default group that Lightning's barrier, broadcast and ``sync_dist`` use;
    2. ``setup``: broadcasts rank 0's parameters and buffers, and wraps every optimizer in a
       ``gradpress.DistributedOptimizer`` (``backward_passes_per_step`` =
       ``accumulate_grad_batches``; LR schedulers are pointed at the wrapper);
    3. each optimizer step: the closure runs (forward, backward: every gradient's push_pull
       starts as backward produces it), ``synchronize()`` writes the averaged gradients, then
       Lightning's ``on_before_optimizer_step`` and gradient clipping see them, then the step;
    4. checkpoints: every rank's worker codec state and its server engine's state are gathered
       on rank 0 under ``checkpoint["gradpress"]``; ``ckpt_path=`` restores each rank's own.

    gradpress stays initialized after ``fit`` (``validate``/``test`` may follow) and shuts down
    at interpreter exit; call ``gradpress.shutdown()`` to end it earlier.
    """

    optimizers: list[torch.optim.Optimizer]  # DDPStrategy's property, set in setup_optimizers

    _KIND = "parameter_server"

    def __init__(self, compression: Compression | None = defaults.COMPRESSION,
                 ef: str | EFSpec | None = defaults.EF, *,
                 momentum: str | None = None, mu: float = defaults.SGD_MOMENTUM,
                 min_compress_bytes: int | str | None = defaults.MIN_COMPRESS_BYTES,
                 dense_steps: int = defaults.WRAPPER_DENSE_STEPS, nan_policy: str = "raise",
                 uncompressed_params: Iterable[str] | str = defaults.UNCOMPRESSED_PARAMS,
                 init: Mapping[str, Any] | None = None, log_stats: bool = True,
                 **kwargs: Any) -> None:
        for bad in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper",
                    "model_averaging_period", "process_group_backend"):
            if bad in kwargs:
                raise TypeError(f"ParameterServerStrategy does not use DDP: {bad!r} is not "
                                f"supported")
        super().__init__(process_group_backend="gloo", **kwargs)
        self._opt_kwargs: dict[str, Any] = dict(
            compression=compression, ef=ef, momentum=momentum, mu=mu,
            min_compress_bytes=min_compress_bytes, dense_steps=dense_steps,
            nan_policy=nan_policy, uncompressed_params=uncompressed_params)
        self._init = dict(init or {})
        self._log_stats = log_stats

    @property
    def compression_stats(self) -> dict[str, float]:
        """:func:`gradpress.stats` of this worker plus ``bytes_sent`` (``bytes_pushed``) and
        ``fp32_bytes`` (``dense_fp32_bytes``); zeros before ``setup``."""
        if not api.is_initialized():
            return {"bytes_sent": 0, "fp32_bytes": 0}
        s = dict(api.stats())
        return {**s, "bytes_sent": s.get("bytes_pushed", 0),
                "fp32_bytes": s.get("dense_fp32_bytes", 0)}

    def setup_distributed(self) -> None:
        """Step 1: gradpress's process group instead of Lightning's."""
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        env = self.cluster_environment
        assert env is not None
        os.environ.update({"RANK": str(self.global_rank), "WORLD_SIZE": str(self.world_size),
                           "LOCAL_RANK": str(self.local_rank),
                           "LOCAL_WORLD_SIZE": str(self.num_processes),
                           "MASTER_ADDR": env.main_address, "MASTER_PORT": str(env.main_port),
                           "GRADPRESS_NNODES": str(self.num_nodes)})
        os.environ.setdefault("GRADPRESS_COLOCATE", "1")
        if not api.is_initialized():
            api.init(**self._init)

    def configure_ddp(self) -> None:
        """Step 2a (no DDP wrapper): every replica starts from rank 0's parameters."""
        assert self.model is not None
        broadcast_parameters(self.model.state_dict(), root_rank=0)

    def setup_optimizers(self, trainer: Trainer) -> None:
        """Step 2b: wrap every optimizer in a ``gradpress.DistributedOptimizer``."""
        super().setup_optimizers(trainer)
        assert self.lightning_module is not None
        named = list(self.lightning_module.named_parameters())
        wrapped: list[torch.optim.Optimizer] = []
        for opt in self.optimizers:
            patched = opt.__dict__.pop("step", None)  # an LR scheduler's wrapper of opt.step
            new = DistributedOptimizer(opt, named_parameters=named,
                                       backward_passes_per_step=trainer.accumulate_grad_batches,
                                       **self._opt_kwargs)
            if patched is not None:
                opt.step = patched  # type: ignore[method-assign]
                _track_step_calls(new)
            for cfg in self.lr_scheduler_configs:
                if cfg.scheduler.optimizer is opt:
                    cfg.scheduler.optimizer = new
            wrapped.append(new)
        self.optimizers = wrapped

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any],
                       model: Any = None, **kwargs: Any) -> Any:
        """Step 3: run the closure, average the gradients, then Lightning's step."""
        opt = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if not hasattr(opt, "skip_synchronize"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        result = closure()
        opt.synchronize()
        with opt.skip_synchronize():
            out = super().optimizer_step(optimizer, lambda: result, model, **kwargs)
        self._log_compression(self.lightning_module)
        return out

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's state without its per-rank codec part (saved under ``"gradpress"``)."""
        state = dict(super().optimizer_state(optimizer))
        state.pop("gradpress", None)
        return state

    def _shared_dir(self) -> Path:
        """A fresh directory named by rank 0, created on every node (for server files)."""
        name = tempfile.mkdtemp(prefix="gradpress-lightning-") if self.global_rank == 0 else None
        path = Path(self.broadcast(name, src=0))
        path.mkdir(parents=True, exist_ok=True)
        self.barrier("gradpress.lightning")
        return path

    def _drop_dir(self, path: Path) -> None:
        self.barrier("gradpress.lightning")
        if self.local_rank == 0:
            shutil.rmtree(path, ignore_errors=True)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        """Step 4: add every rank's worker state and server state, then write (rank 0)."""
        if api.is_initialized() and "optimizer_states" in checkpoint:
            tmp = self._shared_dir()
            api.save_server_state(str(tmp))
            hosted = api._rt().cluster.my_servers
            mine = {"worker": api.worker_state_dict(),
                    "servers": {i: torch.load(tmp / f"server{i}.pt", weights_only=True)
                                for i in hosted}}
            states = _gather_to_zero(mine)
            self._drop_dir(tmp)
            if states is not None:
                servers = {i: s for st in states for i, s in st["servers"].items()}
                checkpoint = {**checkpoint, CHECKPOINT_KEY: {
                    "format": _FORMAT, "strategy": self._KIND, "world_size": len(states),
                    "workers": [st["worker"] for st in states], "servers": servers}}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Step 4 on resume: optimizers, then this rank's worker state and every server's."""
        super().load_optimizer_state_dict(checkpoint)
        entry = _saved_entry(checkpoint, self._KIND, self.world_size)
        if entry is None:
            return
        api.load_worker_state_dict(entry["workers"][self.global_rank])
        tmp = self._shared_dir()
        if self.local_rank == 0:
            for i, s in entry["servers"].items():
                torch.save(s, tmp / f"server{i}.pt")
        self.barrier("gradpress.lightning")
        api.load_server_state(str(tmp))
        self._drop_dir(tmp)

    def teardown(self) -> None:
        """Lightning's teardown; gradpress keeps running (see the class docstring)."""
        super().teardown()

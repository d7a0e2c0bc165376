"""``DistributedOptimizer``: wrap a torch optimizer so each gradient is push_pulled (compressed,
two-way, with error feedback) as soon as backward produces it.

Steps of one training iteration (Horovod/BytePS pattern; BytePS-Compress, Zhong et al. 2021):

1. ``loss.backward()``: a post-accumulate-grad hook on every parameter counts backward passes;
   on the ``backward_passes_per_step``-th pass it starts ``push_pull_async`` of that gradient,
   so communication of late layers overlaps backward of early layers. Gradients below
   ``min_compress_bytes`` are copied into their fused key instead, pushed when its last
   member arrived (:mod:`gradpress.torch.fusion`).
2. ``step()`` calls :meth:`synchronize`: parameters whose hook did not fire (no gradient this
   step) push zeros, so no server waits forever; every handle is waited for and the averaged,
   decompressed gradient replaces ``p.grad``.
3. With ``nan_policy="skip"`` a worker whose gradient is not finite pushes zeros instead and the
   workers agree (a one-element uncompressed push_pull) to skip the step everywhere; gradients are
   then set to inf so a ``torch.amp.GradScaler`` also sees the overflow and lowers its scale.
4. The wrapped optimizer's ``step`` runs on the averaged gradient. Every worker received the same
   bytes, so replicas stay identical without broadcasting parameters after step 0.

With ``dense_steps=N`` the first N optimizer steps push_pull every gradient uncompressed (under
the tensor's name plus ``"@dense"``, so the compressed keys and their residuals start fresh at
step N), as 1-bit Adam's full-precision phase does (Tang et al. 2021); see ``docs/guide.md``
for when it pays.

With ``torch.amp.GradScaler``, follow the Horovod recipe::

    scaler.scale(loss).backward()
    opt.synchronize()
    scaler.unscale_(opt)            # optional (gradient clipping)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import defaults
from ..compress.registry import build
from ..compress.spec import CodecSpec, EFSpec, parse_spec
from ._names import _param_names, match_names
from .agreement import Agreement, AgreementMeter, auto_min_compress_bytes
from .fusion import DENSE_SUFFIX, check_layout, fused_codec, gradient_fuser
from .plan import NONFINITE_KEY, Plan, optimizer_plan

__all__ = ["DistributedOptimizer", "match_names", "ALWAYS_EXACT"]

log = logging.getLogger(__name__)
NAN_POLICIES = defaults.NAN_POLICIES  # shared with the DDP hook
_FLAG_NAME = NONFINITE_KEY
#: A ``min_compress_bytes`` no tensor reaches: the tensor travels uncompressed (fp32, exact) and
#: keeps the worker-side momentum of dist-EF-SGDM, as tensors below the threshold do. How the
#: ``uncompressed_params`` travel, here and in the 1-bit optimizers' momentum push_pulls.
ALWAYS_EXACT = 1 << 62


def DistributedOptimizer(  # noqa: N802  (factory named like the class it returns, as Horovod's)
        optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, Any]] | None = None,
        compression: str | Mapping[str, Any] | CodecSpec | None = defaults.WRAPPER_COMPRESSION,
        ef: str | EFSpec | None = None,
        momentum: str | None = None, mu: float = 0.9,
        min_compress_bytes: int | str | None = defaults.MIN_COMPRESS_BYTES,
        backward_passes_per_step: int = 1, nan_policy: str = defaults.NAN_POLICY,
        dense_steps: int = defaults.WRAPPER_DENSE_STEPS,
        uncompressed_params: Iterable[str] | str = defaults.UNCOMPRESSED_PARAMS
        ) -> torch.optim.Optimizer:
    """Return ``optimizer`` turned into a distributed one (same class name, a subclass of it).

    Args:
        optimizer: any ``torch.optim.Optimizer`` (its param groups and hyperparameters are taken).
        named_parameters: ``model.named_parameters()``; names key the tensors on all workers.
            Without it, names are ``group{g}.param{i}`` (same model on all workers required).
        compression: codec spec. Default ``"int4"``: 4-bit codes with a scale per 128
            elements (4.125 bits an element), the optimizer's accuracy kept
            (``docs/guide.md#the-frontier``); ``"none"`` is exact, bit for bit the optimizer on
            the averaged gradients; ``"onebit"``, ``"topk:k=0.001,values=fp16"``, a BytePS dict.
        ef: error feedback (default ``"vanilla"`` for every lossy codec, ``"none"`` to turn
            it off): ``"vanilla"``, ``"vanilla:decay=B"`` (residuals decay by ``B``
            per step; ``"vanilla:decay=B,server_decay=S"``: the servers' by ``S``),
            ``"corrected"`` (the group's lr travels with each push), ``"sparse"``
            (randomk) or None.
        momentum: ``"nesterov"`` applies momentum before compression (dist-EF-SGDM); turn the
            optimizer's own momentum off then.
        mu: that momentum's coefficient.
        min_compress_bytes: gradients smaller than this travel uncompressed (exact), packed
            into fused keys (``GRADPRESS_FUSION_BYTES``, :mod:`gradpress.torch.fusion`).
            Default ``"auto"``: the largest tensors holding
            :data:`~gradpress.torch.agreement.COMPRESSED_SHARE` of the bytes are compressed,
            and every tensor of 1 MiB or more
            (:func:`~gradpress.torch.agreement.auto_min_compress_bytes`).
        backward_passes_per_step: gradients accumulate locally over this many backward passes
            before one push_pull (not divided: scale the loss if you want a mean).
        nan_policy: ``"raise"`` (non-finite gradients are an error) or ``"skip"`` (the step is
            skipped on all workers; use this with AMP).
        dense_steps: the first this many ``step()`` calls communicate uncompressed gradients;
            compression (and error feedback) starts after them. Default 0: compress from the
            first step.
        uncompressed_params: names or ``fnmatch`` patterns (``"pos.weight"``, ``"*.bias"``) of
            parameters whose gradients always travel uncompressed (fp32, exact), whatever their
            size; each pattern must match a name. A model's learned position embedding is the
            usual candidate: small in a large model, but one-bit compression of it can delay a
            transformer's use of context (``docs/guide.md``). ``"auto"``: measured instead,
            during the ``dense_steps``: tensors whose gradients agree little across workers
            travel exact (:mod:`gradpress.torch.agreement`). Default ``"auto"`` (without dense
            steps there is nothing to measure: every tensor above ``min_compress_bytes`` is
            compressed).
    """
    return _wrap(optimizer, named_parameters, compression=compression, ef=ef, momentum=momentum,
                 mu=mu, min_compress_bytes=min_compress_bytes,
                 backward_passes_per_step=backward_passes_per_step, nan_policy=nan_policy,
                 dense_steps=dense_steps, uncompressed_params=uncompressed_params)


def _wrap(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, Any]] | None,
          *, compression: Any = defaults.WRAPPER_COMPRESSION, ef: str | EFSpec | None = None,
          momentum: str | None = None, mu: float = 0.9,
          min_compress_bytes: int | str | None = defaults.MIN_COMPRESS_BYTES,
          backward_passes_per_step: int = 1, nan_policy: str = defaults.NAN_POLICY,
          dense_steps: int = defaults.WRAPPER_DENSE_STEPS,
          uncompressed_params: Iterable[str] | str = defaults.UNCOMPRESSED_PARAMS,
          on_backward: bool = True) -> Any:
    """:func:`DistributedOptimizer`; with ``on_backward=False`` no gradient hook starts a push
    during backward: ``step()`` pushes every gradient (what ``gp.DiLoCo``'s outer step does)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    methods = {k: v for k, v in vars(_Distributed).items() if k not in ("__dict__", "__weakref__")}
    cls: Any = type(optimizer.__class__.__name__, (optimizer.__class__,), methods)
    obj = cls.__new__(cls)
    # keep hyperparameters, state and param groups; not an instance attribute that shadows a
    # method (an LR scheduler built first patches ``optimizer.step`` on the instance: copied, it
    # would step the unwrapped optimizer and never average)
    obj.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                         if not (callable(v) and hasattr(cls, k))})
    if isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < 0:
        raise ValueError(f"dense_steps must be an int >= 0, got {dense_steps!r}")
    obj._gp_init(named_parameters, compression, ef, momentum, mu, min_compress_bytes,
                 backward_passes_per_step, nan_policy, uncompressed_params, on_backward)
    obj._gp_dense_steps = dense_steps
    obj._gp_steps = 0
    if dense_steps == 0 and not hasattr(obj, "compression_active"):
        obj._gp_meter = None  # "auto" without a dense phase: nothing to measure, all compressed
    return obj


def _same(value: Any) -> Any:
    return value


def _pending_state() -> set[str]:
    """Tensor names whose loaded codec state waits for their first push (this worker's)."""
    from .. import api

    return api._rt().worker.checkpoint.pending() if api.is_initialized() else set()


def _in_place(grad: torch.Tensor) -> torch.Tensor | None:
    """``grad`` itself when push_pull can average it in place (float32 and contiguous, on any
    device: ``out=`` is on the tensor's device), saving a result buffer per gradient; else None
    (another dtype: a float32 result, copied into ``p.grad``)."""
    ok = grad.dtype == torch.float32 and grad.is_contiguous()
    return grad if ok else None


def _zero_if_nonfinite(grad: torch.Tensor) -> torch.Tensor:
    """Zero ``grad`` in place when any element is not finite, without reading the answer on
    the host (no device synchronisation); returns the 0-d bool tensor "not finite", on
    ``grad``'s device, for :func:`_any_set` to read once per step."""
    bad = torch.isfinite(grad).all().logical_not()
    grad.masked_fill_(bad, 0)  # a 0-d mask broadcasts: all or nothing
    return bad


def _any_set(flags: list[torch.Tensor]) -> bool:
    """Whether any of the 0-d bool ``flags`` is set: one reduction and one read per device
    (one host synchronisation per step on a single GPU)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for f in flags:
        by_device.setdefault(f.device, []).append(f)
    return any(bool(torch.stack(fs).any()) for fs in by_device.values())


class _Distributed:
    """Methods mixed into the dynamic subclass built by :func:`DistributedOptimizer`."""

    # what the mixed-in methods use of the torch optimizer they join, and what the factory sets
    param_groups: list[dict[str, Any]]
    state: Any
    _gp_dense_steps: int

    def _gp_init(self, named_parameters: Iterable[tuple[str, Any]] | None, compression: Any,
                 ef: str | EFSpec | None, momentum: str | None, mu: float,
                 min_compress_bytes: int | str | None,
                 passes: int, nan_policy: str, uncompressed: Iterable[str],
                 on_backward: bool = True) -> None:
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
            raise ValueError(f"backward_passes_per_step must be an int >= 1, got {passes!r}")
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {', '.join(NAN_POLICIES)}, "
                             f"got {nan_policy!r}")
        if min_compress_bytes == "auto":
            min_compress_bytes = auto_min_compress_bytes(
                4 * p.numel() for g in self.param_groups for p in g["params"] if p.requires_grad)
        if min_compress_bytes is not None and (
                isinstance(min_compress_bytes, bool) or not isinstance(min_compress_bytes, int)
                or min_compress_bytes < 0):
            raise ValueError(f"min_compress_bytes must be an int >= 0, 'auto' or None, got "
                             f"{min_compress_bytes!r}")
        cs = parse_spec(compression)
        wrappers = dict(cs.wrappers)
        for k, v in (("ef", ef), ("momentum", momentum)):
            if v is not None:
                wrappers[k] = v
        if cs.name != "none":  # lossy: error feedback on workers and servers unless told
            wrappers.setdefault("ef", defaults.EF)
        if wrappers.get("momentum") not in (None, "none", ""):
            wrappers.setdefault("mu", mu)
        self._gp_spec = CodecSpec(cs.name, dict(cs.params), wrappers)
        build(self._gp_spec, 1024)  # a bad spec is a ValueError here, not at the first step()
        self._gp_min_bytes = min_compress_bytes
        # a block-scaled codec compresses small tensors as well as large ones: they are fused
        # below min_compress_bytes (one key for many) and compressed all the same
        self._gp_push_bytes = 0 if fused_codec(self._gp_spec) is not None else min_compress_bytes
        self._gp_passes = passes
        self._gp_nan = nan_policy
        self._gp_names = _param_names(self.param_groups, named_parameters)
        auto = isinstance(uncompressed, str) and uncompressed == "auto"
        exact = frozenset() if auto else match_names(self._gp_names.values(), uncompressed,
                                                     "uncompressed_params")
        self._gp_meter = AgreementMeter(self._gp_names.values()) if auto else None
        self._gp_dense = {p for p, n in self._gp_names.items() if n in exact}
        self._gp_lr = {p: g for g in self.param_groups for p in g["params"]}
        self._gp_counts: dict[torch.Tensor, int] = {}
        self._gp_handles: dict[torch.Tensor, Any] = {}
        self._gp_fusion: Any = None  # the Fuser of the small exact gradients, at first push
        self._gp_nonfinite: list[torch.Tensor] = []  # nan_policy="skip": one flag per push
        self._gp_skipped = False
        self._gp_skip_sync = False
        self._gp_hooks = [p.register_post_accumulate_grad_hook(self._gp_hook)
                          for p in self._gp_names if p.requires_grad and on_backward]
        log.info("DistributedOptimizer(%s): %d tensors, compression=%s, min_compress_bytes=%s, "
                 "backward_passes_per_step=%d, nan_policy=%s, uncompressed_params=%s",
                 type(self).__name__, len(self._gp_names), self._gp_spec, min_compress_bytes,
                 passes, nan_policy, sorted(exact))

    # -- hooks ----------------------------------------------------------------------------------
    def _gp_hook(self, p: torch.Tensor) -> None:  # step 1
        n = self._gp_counts.get(p, 0) + 1
        self._gp_counts[p] = n
        if n > self._gp_passes:
            raise RuntimeError(
                f"gradient of {self._gp_names[p]!r} computed {n} times before step(); call "
                f"step() or synchronize() every {self._gp_passes} backward pass(es) "
                f"(backward_passes_per_step), or use skip_synchronize() for local steps")
        if n == self._gp_passes and self._gp_communicates():
            self._gp_push(p)

    def _gp_communicates(self) -> bool:
        """False once an optimizer that communicates by itself (1-bit Adam) took over."""
        return not getattr(self, "compression_active", False)

    def _gp_push(self, p: torch.Tensor) -> None:
        from .. import api

        grad = p.grad.detach() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
        if self._gp_nan == "skip":  # p.grad is overwritten by the average (or inf) anyway
            self._gp_nonfinite.append(_zero_if_nonfinite(grad))
        exact = p in self._gp_dense  # chosen by name: travels as a small tensor does, exact
        if self._gp_meter is not None:  # dense phase of "auto": this worker's own gradient
            self._gp_meter.add_local(self._gp_names[p], grad)
        dense, fuser = self._gp_steps < self._gp_dense_steps, self._gp_fuser()
        if fuser.fuses(self._gp_names[p]):  # small and exact: pushed with its fused key
            self._gp_handles[p] = fuser.add(self._gp_names[p], grad,
                                            DENSE_SUFFIX if dense else "")
            return
        if dense and not exact:  # dense phase: own keys
            self._gp_handles[p] = api.push_pull_async(
                grad, self._gp_names[p] + DENSE_SUFFIX, average=True, compression="none",
                ef="none", out=_in_place(grad))
            return
        self._gp_handles[p] = api.push_pull_async(
            grad, self._gp_names[p], average=True, compression=self._gp_spec,
            lr=self._gp_lr[p]["lr"],
            min_compress_bytes=ALWAYS_EXACT if exact else self._gp_push_bytes,
            out=_in_place(grad))

    def _gp_fuser(self) -> Any:
        """The fuser of the small gradients (built at the first push, after ``init``)."""
        if self._gp_fusion is None:
            exact = frozenset(self._gp_names[p] for p in self._gp_dense)
            self._gp_fusion = gradient_fuser(self._gp_names, self._gp_min_bytes, self._gp_spec,
                                             exact)
        return self._gp_fusion

    # -- public ---------------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish the push_pull of every gradient and write the averages into ``p.grad``."""
        from .. import api

        if self._gp_communicates():
            for p in self._gp_names:  # step 2: parameters without a gradient push zeros
                if p.requires_grad and p not in self._gp_handles:
                    self._gp_push(p)
        for p, h in self._gp_handles.items():
            avg = h.wait()  # CUDA: the current stream waits for the result (the host does not)
            if p.grad is None:  # a copy: avg may be a slice of a bucket reused next step
                p.grad = avg.to(dtype=p.dtype, copy=True)
            elif avg.data_ptr() != p.grad.data_ptr():  # else averaged in place already
                p.grad.copy_(avg)
            if self._gp_meter is not None:
                self._gp_meter.add_average(self._gp_names[p], avg)
        self._gp_handles.clear()
        self._gp_counts.clear()
        pending = _pending_state()  # loaded state left unclaimed by every push: another layout?
        if pending:
            check_layout(self._gp_fuser(), self._gp_names.values(), pending)
        self._gp_skipped = False
        if self._gp_nan == "skip":  # step 3: the step's one read of the finiteness flags
            flag = torch.tensor([1.0 if _any_set(self._gp_nonfinite) else 0.0], device="cpu")
            self._gp_nonfinite.clear()
            total = api.push_pull(flag, _FLAG_NAME, average=False, compression="none", ef="none")
            if float(total[0]) > 0:
                self._gp_skipped = True
                for p in self._gp_names:
                    if p.grad is not None:
                        p.grad.fill_(float("inf"))
                log.warning("non-finite gradient on %d worker(s): step skipped on all workers",
                            int(total[0]))

    def plan(self) -> Plan:
        """What this optimizer pushes per step once compression starts, tensor by tensor:
        codec or exact, bytes, and why (:class:`~gradpress.torch.plan.Plan`; ``print(
        opt.plan().format())`` shows the table). Computed locally from the parameters and the
        configuration, so it works before ``gradpress.init()`` and is the same on every
        worker; see ``docs/guide.md``."""
        return optimizer_plan(self)

    @property
    def step_skipped(self) -> bool:
        """Whether the last synchronize found a non-finite gradient (nan_policy='skip')."""
        return self._gp_skipped

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this block ``step()`` does not synchronize (call :meth:`synchronize` first)."""
        self._gp_skip_sync = True
        try:
            yield
        finally:
            self._gp_skip_sync = False

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless inside :meth:`skip_synchronize`) and step the wrapped optimizer.

        A ``closure`` (forward and backward, as Lightning and LBFGS-style loops pass) runs once,
        before the gradients are averaged; the wrapped optimizer gets its loss back from a
        closure that does not recompute (an optimizer that re-evaluates the closure several
        times per step sees the first evaluation each time). Returns the closure's loss."""
        if closure is not None and not self._gp_skip_sync:
            with torch.enable_grad():
                loss = closure()
            closure = functools.partial(_same, loss)
        if not self._gp_skip_sync:
            self.synchronize()
        self._gp_steps += 1
        if self._gp_meter is not None:
            self._gp_meter.end_step()
            if self._gp_steps == self._gp_dense_steps:
                self.decide_exact()
        if self._gp_skipped:  # step 3: agreed skip
            return None
        out = super(self.__class__, self).step(closure)  # type: ignore[misc]  # step 4
        if self._gp_meter is not None and self._gp_meter.result is None \
                and not self._gp_communicates():
            self.decide_exact()  # a 1-bit optimizer's dense phase just ended
        return out

    def decide_exact(self) -> Agreement | None:
        """With ``uncompressed_params="auto"``: decide, once and the same on every worker,
        which tensors travel exact from the agreement measured so far (None otherwise)."""
        from .. import api

        if self._gp_meter is None:
            return None
        first = self._gp_meter.result is None
        name = f"{next(iter(self._gp_names.values()), 'gradpress')}@agreement"
        result = self._gp_meter.decide(
            lambda v: api.push_pull(v.float(), name, average=False, compression="none",
                                    ef="none"), api.size())
        self._gp_dense |= {p for p, n in self._gp_names.items() if n in result.exact}
        if first:
            log.info("measured over %d dense steps: exact %s", result.steps,
                     sorted(result.exact) or "none")
        return result

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus, under ``"gradpress"``, this worker's codec state
        of its tensors (error-feedback residuals, momentum, step counters; per worker).

        :func:`~gradpress.torch.broadcast.broadcast_optimizer_state` leaves that part out, so
        per-worker residuals are never overwritten by another worker's. After
        ``gradpress.shutdown()`` (no codec state left) only the wrapped optimizer's state remains.
        ``"gradpress_steps"`` is the number of steps taken (where the ``dense_steps`` phase is).
        """
        return self._gp_state_dict(codec=True)

    def _gp_state_dict(self, codec: bool) -> dict[str, Any]:
        """:meth:`state_dict`; with ``codec=False`` without the ``"gradpress"`` entry, whose
        residuals are then not copied to the CPU at all (what the broadcast and the checkpoint's
        shared optimizer state take: :func:`~gradpress.torch.broadcast.shared_state_dict`)."""
        from .. import api

        state = super(self.__class__, self).state_dict()  # type: ignore[misc]
        if codec and api.is_initialized():
            names = set(self._gp_names.values()) | {_FLAG_NAME}
            # the buckets' names, also before the first push (a save right after a load keeps
            # the loaded residuals, which wait for their first push under these names)
            names |= self._gp_fuser().names(("", DENSE_SUFFIX))
            state["gradpress"] = api.worker_state_dict(names)
        if self._gp_meter is not None:
            state["gradpress_agreement"] = self._gp_meter.state_dict()
        state["gradpress_steps"] = self._gp_steps  # the dense phase's position
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load :meth:`state_dict` output; the ``"gradpress"`` part (if present) restores this
        worker's codec state (save and load each worker's own state dict)."""
        from .. import api

        state = dict(state_dict)
        codec_state = state.pop("gradpress", None)
        agreement = state.pop("gradpress_agreement", None)
        steps = state.pop("gradpress_steps", None)
        if steps is not None:
            self._gp_steps = int(steps)
        super(self.__class__, self).load_state_dict(state)  # type: ignore[misc]
        if agreement is not None and self._gp_meter is not None:
            self._gp_meter.load_state_dict(agreement)
            if self._gp_meter.result is not None:
                self._gp_dense |= {p for p, n in self._gp_names.items()
                                   if n in self._gp_meter.result.exact}
        if codec_state is not None:
            api.load_worker_state_dict(codec_state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gp_handles:
            raise RuntimeError("zero_grad() called while push_pulls are in flight; call step() "
                               "or synchronize() first")
        super(self.__class__, self).zero_grad(set_to_none=set_to_none)  # type: ignore[misc]

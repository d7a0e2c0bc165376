"""1-bit LANS: LANS for ``dense_steps``, then each worker's momentum communicated compressed.

The 1-bit Adam recipe (Tang et al., ICML 2021, arXiv:2102.02888; :class:`OneBitAdam`) applied to
LANS (Zheng et al. 2020, arXiv:2006.13484), in the way DeepSpeed's 1-bit LAMB (Li et al. 2021,
arXiv:2104.06069) applies it to LAMB: what travels compressed after the dense phase is each
worker's momentum, not its gradient. ``gp.OneBitLANS`` builds it for a cluster; see
``docs/guide.md`` for when to prefer it to CLAN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._common import (
    Bucket,
    adam_denominators,
    add_scaled_,
    direction,
    moments_,
    norms,
    scaled_by,
    trust_ratios,
)
from .health import HealthWatch, Watched
from .idle_rows import IdleRows
from .lans import LANS
from .onebit_adam import Communicate, OneBitAdam, _split, _split_where, received

__all__ = ["OneBitLANSCore"]


class OneBitLANSCore(IdleRows, Watched, LANS):
    r"""1-bit LANS, single-process core (the distributed layer supplies ``communicate``).

    Per parameter tensor ``x`` at its step ``t`` with ``g = p.grad``:

    1. Dense phase, ``t <= dense_steps``: a :class:`LANS` step (steps 1-7 there,
       ``normalize_grad`` as configured) on ``g``, which the caller averaged over workers
       *uncompressed*.
    2. Compression stage, ``t > dense_steps``: ``g`` is the worker's *local* gradient, divided
       by its norm if ``normalize_grad``. Each worker keeps updating its own
       ``m = b1*m + (1-b1)*g`` and ``v = b2*v + (1-b2)*g*g``, bias-corrected at ``t`` as in
       LANS, and sends ``m/d`` with its own ``d = sqrt(vh)+eps`` through
       ``communicate(key, m/d)`` (compressed by the distributed layer with worker and server
       error feedback; None: identity). What comes back, ``a``, the average of the workers'
       ``m/d``, is the same on every worker, so the replicas stay identical; each worker's
       momentum becomes ``m = a*d`` in its own units.
    2b. Idle rows (``hold_idle_rows``): a tensor of two or more dimensions
       whose averaged dense-phase gradient had a row of zeros (an embedding: rows of tokens
       absent from a batch) is marked on every worker alike. In the compression stage each
       worker also sends, exact, which of its rows have a gradient (``communicate(key +
       ".rows", flags)``, one value a row). In ``a``, a row without gradient on any worker
       takes its last shared value times ``b1/sqrt(b2)``, as LANS's moments decay without a
       gradient, instead of what the codec sent: a one-bit code gives every element the same
       magnitude, so rows without gradient would walk (DeepSpeed's 1-bit Adam masks such rows
       by hand; here they are measured). Rows never used stay at ``a = 0`` and move by weight
       decay only, as under LANS. The step scales the rows in use up to the workers' mean norm
       of what they sent (sent with the flags): a one-bit scale averaged over idle rows shrinks
       them, which would inflate weight decay's share of step 3 (:mod:`.idle_rows`).
    2c. Health watch (``watch``): every few steps the sent ``m/d`` are also averaged exactly;
       a tensor whose step points away from that average recovers (:mod:`.health`).
    3. Compression-stage update, LAMB's step as in 1-bit LAMB: ``r = a*sb + wd*x``
       (``sb = 1/(1-b1^t)``, the momentum's bias correction), ``q_r = ||x||/||r||`` (1 where a
       norm is 0, clamped to the trust bounds), ``x = x - lr*q_r*r``.
    4. Blend (``blend``), LANS's step proper: the averaged gradient is recovered from two
       consecutive averages, ``gh = (a - b1*a_prev)/(1-b1)``, and
       ``x = x - lr*(b1*q_r*r + (1-b1)*q_c*c)`` with ``c = gh + wd*x`` and its own trust ratio
       ``q_c``. With exact communication this is LANS on the average of the workers' ``m/d``;
       through a compressed link the recovered gradient carries the compression error
       divided by ``1-b1``. ``gp.OneBitLANS`` blends only when every momentum travels
       exact (why: ``docs/optimizers.md``).

    With per-layer gradient normalisation a local gradient has the same norm as the averaged
    one, so the local ``v`` stays on the dense phase's scale; unlike a frozen ``v`` it follows
    the gradients as they change, which keeps ``m/d`` (what the codec sees) even, at no cost on
    the wire.

    Tuning advice (see ``docs/guide.md``):

    * ``dense_steps``: 100. Long enough for ``v`` to settle and for the model to leave its fast
      early phase; for a transformer, a fixed number of steps that ends before it starts to
      use its context. Must be >= 1.
    * ``lr``: LANS's rate (a relative step per layer); keep the uncompressed run's schedule.
    * ``normalize_grad``: True (LANS proper) normalises each worker's local gradient per layer
      before it enters the moments, so ``m`` and ``v`` stay on the dense phase's scale.
    * ``betas``: ``(0.9, 0.999)``; a high ``b1`` averages the momentum's compression error out.
    * ``eps``, ``weight_decay``, ``min_trust``, ``max_trust``: as :class:`LANS`.

    Recipe (the same as :class:`OneBitAdam`): while :attr:`compression_active` is False the caller
    averages gradients uncompressed into ``p.grad``; once True it leaves the local gradient there
    and ``communicate`` must do a compressed push_pull of the momentum. ``key`` is the
    parameter's position in the flat order of ``param_groups`` (the ids of ``state_dict()``).

    Args:
        params: iterable of parameters or of param-group dicts (torch semantics).
        lr, betas, eps, weight_decay, normalize_grad, min_trust, max_trust, fused: as
            :class:`LANS` (``fused`` applies to the dense steps; the compression stage runs
            torch's foreach ops).
        dense_steps: number of uncompressed opening steps, an int >= 1.
        communicate: ``communicate(key: str, m: Tensor)`` returning the averaged momentum (a
            tensor or a handle with ``wait()``); None means identity.
        blend: step 4 for every tensor (True), none (False, the default), or those whose
            flat index ``i`` has ``blend(i)`` true (a callable).
            ``gp.OneBitLANS`` and ``gradpress train`` blend every tensor when every momentum
            travels exact, none otherwise.
        hold_idle_rows: step 2b for every tensor with idle rows (True), none (False, the
            default), or those whose flat index ``i`` has ``hold_idle_rows(i)`` true (a
            callable). ``gp.OneBitLANS`` holds those whose momentum travels compressed; the same
            tensors are the ones ``watch`` watches.
        watch: a :class:`~gradpress.optim.health.HealthWatch` that probes the compressed
            momenta against their exact average and has a drifted tensor recover (the caller
            routes it by :meth:`recovering` and :meth:`generation`); None (the default): none.

    Raises:
        ValueError: a hyperparameter is out of range (the message names it).
        TypeError: ``communicate`` is not callable, a flag is not a bool, or a gradient is
            sparse.
    """

    #: Each worker's state differs (its own second moment, from its local gradients):
    #: :func:`gradpress.checkpoint.save` stores every worker's, not worker 0's alone.
    per_worker_state = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, normalize_grad: bool = True,
                 min_trust: float | None = None, max_trust: float | None = None,
                 fused: bool | None = None, dense_steps: int = 100,
                 communicate: Communicate | None = None,
                 blend: bool | Callable[[int], bool] = False,
                 hold_idle_rows: bool | Callable[[int], bool] = False,
                 watch: HealthWatch | None = None) -> None:
        if isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < 1:
            raise ValueError(f"dense_steps must be an int >= 1, got {dense_steps!r}")
        for name, flag in (("blend", blend), ("hold_idle_rows", hold_idle_rows)):
            if not callable(flag) and not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool or a callable, got {flag!r}")
        if watch is not None and not isinstance(watch, HealthWatch):
            raise TypeError(f"watch must be a gradpress.optim.health.HealthWatch or None, got "
                            f"{watch!r}")
        self.blend, self.hold_idle_rows, self.watch = blend, hold_idle_rows, watch
        #: flat index -> parameter name, for the watch's warnings (``gp.OneBitLANS`` sets it)
        self.param_names: dict[int, str] = {}
        self._setup(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 normalize_grad=normalize_grad, min_trust=min_trust,
                                 max_trust=max_trust, dense_steps=dense_steps), fused)
        self.communicate = communicate  # type: ignore[misc]  # OneBitAdam's property

    # 1-bit Adam's compression-stage plumbing, shared (OneBitAdam is not a base: LANS is)
    communicate = OneBitAdam.communicate
    compression_active = OneBitAdam.compression_active
    _launch = OneBitAdam._launch
    _compresses = OneBitAdam._compresses

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group["dense_steps"] is None:
            raise ValueError("dense_steps must be an int >= 1 for OneBitLANSCore, got None")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model, returns the loss."""
        loss = self._closure_loss(closure)
        stages = []
        for b, group in self._bucketed():
            fs = group["dense_steps"]
            warm, comp = _split(b, lambda t: t <= fs)  # noqa: B023  (used at once)
            if warm.params:
                # Step 1: a LANS step on the (uncompressed-averaged) gradient.
                self._note_idle_rows(warm)
                self._update(warm, group)
            for part, blend in self._by_blend(comp):
                # Step 2: launch every communication of the step before waiting for any.
                stages.append((part, group) + self._send(part, group, blend))
        for b, group, pending, prev, (d, s), rows, probes in stages:
            got = received(b, pending)
            got, step = self._hold_idle_rows(b, group, got, rows)     # step 2b
            self._check_health(b, step, probes)                         # step 2c
            self._local_update(b, group, got, prev, d, s, step)         # steps 3-4
        return loss

    def _by_blend(self, b: Bucket) -> list[tuple[Bucket, bool]]:
        """The compression-stage tensors of ``b`` split into (those that blend, True) and
        (the others, False), empty parts left out; ``blend`` decides per flat index."""
        if not b.params:
            return []
        if not callable(self.blend):
            return [(b, self.blend)]
        yes, no = _split_where(b, [bool(self.blend(i)) for i in b.indices])
        return [(part, flag) for part, flag in ((yes, True), (no, False)) if part.params]

    def _send(self, b: Bucket, group: dict[str, Any], blend: bool
              ) -> tuple[list[Any], Any, Any, dict[int, Any], dict[int, Any]]:
        """Step 2 up to the communication: returns (pending, b1*a_prev or None, the
        ``(d, s)`` of :func:`adam_denominators`, and by position in ``b`` the pending row
        flags of step 2b and probes of step 2c)."""
        flags = self._row_flags(b, group)  # before normalising: which rows have a gradient
        g = self._normalized(b.grads) if group["normalize_grad"] else b.grads
        sent, prev, ds = self._local_moments(b, group, g, blend)
        return (self._launch(b, sent), prev,  # type: ignore[misc]  # OneBitAdam's
                ds, self._send_rows(b, flags, sent),
                self._send_probes(b, group, sent))

    def _holds(self, index: int) -> bool:
        """Whether ``hold_idle_rows`` (and the watch) apply to flat parameter ``index``."""
        hold = self.hold_idle_rows
        return bool(hold(index)) if callable(hold) else hold

    def _local_moments(self, b: Bucket, group: dict[str, Any], g: list[torch.Tensor],
                       blend: bool) -> tuple[list[torch.Tensor], Any, Any]:
        """Step 2 (local ``v``) up to the communication: ``v`` and ``m`` from the local
        gradient; returns (``m/d``, to send; b1*a_prev or None; ``(d, s)``)."""
        beta1, beta2 = group["betas"]
        prev = None
        if blend:  # a_prev; at the first compressed step the dense phase's (shared) m/d
            if any("shared_momentum" not in self.state[p] for p in b.params):
                d_last = self._dense_denominators(b, group)[0]
                for p, m, dl in zip(b.params, b.exp_avgs, d_last):
                    self.state[p].setdefault("shared_momentum", m / dl)
            prev = list(torch._foreach_mul(
                [self.state[p]["shared_momentum"] for p in b.params], beta1))
        moments_(b, g, beta1, beta2)                       # this worker's own m and v
        d, s = adam_denominators(b, beta2, group["eps"])   # bias-corrected at t, as LANS
        return list(torch._foreach_div(b.exp_avgs, d)), prev, (d, s)

    def _local_update(self, b: Bucket, group: dict[str, Any], got: list[torch.Tensor],
                      prev: list[torch.Tensor] | None, d: list[torch.Tensor],
                      s: list[float], step: list[torch.Tensor]) -> None:
        """Step 3 (local ``v``): the update along ``step`` (the shared average ``a = got``,
        idle rows' step 2c applied)."""
        for p, m, a, di in zip(b.params, b.exp_avgs, got, d):
            torch.mul(a, di, out=m)                 # this worker's momentum, in its units
            if prev is not None:
                self.state[p]["shared_momentum"] = a.clone()
        self._momentum_update(b, group, prev, step, None, s)

    @staticmethod
    def _dense_denominators(b: Bucket, group: dict[str, Any]
                            ) -> tuple[list[torch.Tensor], list[float]]:
        """:func:`adam_denominators` of ``v`` as the dense phase left it (bias-corrected at
        ``dense_steps``)."""
        steps = [group["dense_steps"]] * len(b.params)
        return adam_denominators(dataclasses.replace(b, steps=steps), group["betas"][1],
                                 group["eps"])

    @staticmethod
    def _momentum_update(b: Bucket, group: dict[str, Any], prev: list[torch.Tensor] | None,
                         mom: list[torch.Tensor], d: list[torch.Tensor] | None,
                         s: list[float]) -> None:
        """Step 3 along the averaged momentum ``mom``; ``prev`` is
        ``b1*m_prev`` (blend) or None (momentum only); ``d``, ``s`` the frozen denominators
        (``d`` None: ``mom`` and ``prev`` are divided by it already, the local ``v``)."""
        beta1 = group["betas"][0]
        lr, wd = group["lr"], group["weight_decay"]
        r = direction(mom, d, [si / (1.0 - beta1 ** t) for si, t in zip(s, b.steps)],
                      b.params, wd)
        c = None
        if prev is not None:
            # gh = (m - b1*m_prev)/(1-b1): the averaged gradient, recovered from the momenta.
            gh = list(torch._foreach_sub(mom, prev))
            c = direction(gh, d, [si / (1.0 - beta1) for si in s], b.params, wd)
        xn = norms(b.params)
        dtype = b.params[0].dtype
        q_r = trust_ratios(xn, r, group["min_trust"], group["max_trust"])
        if c is None:
            add_scaled_(b.params, r, scaled_by(q_r, -lr, dtype))
            return
        q_c = trust_ratios(xn, c, group["min_trust"], group["max_trust"])
        add_scaled_(b.params, r, scaled_by(q_r, -lr * beta1, dtype))
        add_scaled_(b.params, c, scaled_by(q_c, -lr * (1.0 - beta1), dtype))

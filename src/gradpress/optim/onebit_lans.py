"""1-bit LANS: LANS for ``dense_steps``, then each worker's momentum communicated compressed.

The 1-bit Adam recipe (Tang et al., ICML 2021, arXiv:2102.02888; :class:`OneBitAdam`) applied to
LANS (Zheng et al. 2020, arXiv:2006.13484), in the way DeepSpeed's 1-bit LAMB (Li et al. 2021,
arXiv:2104.06069) applies it to LAMB: what travels compressed after the dense phase is each
worker's momentum, not its gradient. ``gp.OneBitLANS`` wraps it for a cluster; see
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

__all__ = ["OneBitLANS", "SENDS", "VARIANCES"]

#: What :class:`OneBitLANS` communicates in its compression stage.
SENDS = ("momentum", "gradient")
#: How :class:`OneBitLANS` keeps the second moment in its compression stage.
VARIANCES = ("frozen", "local")


class OneBitLANS(IdleRows, Watched, LANS):
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
    2b. Idle rows (``hold_idle_rows``, ``variance="local"``): a tensor of two or more dimensions
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
       divided by ``1-b1`` (10x). ``gp.OneBitLANS`` blends only when every momentum travels
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

    Experiment switches (off by default; the convergence study in ``benchmarks/`` measures
    them): ``variance="frozen"`` (1-bit Adam's frozen ``v``, bias-corrected at
    ``dense_steps``; then also ``precondition=False`` to send ``m`` rather than ``m/d``,
    ``sends="gradient"`` to send the gradient and keep the momentum local, ``ef21=True`` to
    send differences to a shared estimate (EF21, Richtarik et al. 2021, arXiv:2106.05203; the
    distributed layer must run without residuals) and ``refresh_every=K`` for one dense step
    every ``K`` compression-stage steps that refreshes ``v``, after 0/1 Adam, arXiv:2202.06009).

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
            flat index ``i`` has ``blend(i)`` true (a callable; ``variance="local"`` only).
            ``gp.OneBitLANS`` and ``gradpress train`` blend every tensor when every momentum
            travels exact, none otherwise.
        hold_idle_rows: step 2b for every tensor with idle rows (True), none (False, the
            default), or those whose flat index ``i`` has ``hold_idle_rows(i)`` true (a
            callable). ``gp.OneBitLANS`` holds those whose momentum travels compressed. Needs
            ``variance="local"``; the same tensors are the ones ``watch`` watches.
        watch: a :class:`~gradpress.optim.health.HealthWatch` that probes the compressed
            momenta against their exact average and has a drifted tensor recover (the caller
            routes it by :meth:`recovering` and :meth:`generation`); None (the default): none.
        variance, precondition, sends, ef21, refresh_every: the experiment switches above
            (``"local"``, True, ``"momentum"``, False, None by default).

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
                 communicate: Communicate | None = None, variance: str = "local",
                 blend: bool | Callable[[int], bool] = False, precondition: bool = True,
                 sends: str = "momentum", ef21: bool = False,
                 refresh_every: int | None = None,
                 hold_idle_rows: bool | Callable[[int], bool] = False,
                 watch: HealthWatch | None = None) -> None:
        if isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < 1:
            raise ValueError(f"dense_steps must be an int >= 1, got {dense_steps!r}")
        if callable(blend) and variance != "local":
            raise ValueError(f"a per-tensor blend (a callable) needs variance='local', "
                             f"got variance={variance!r}")
        for name, flag in (("blend", blend if not callable(blend) else True),
                           ("precondition", precondition), ("ef21", ef21)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if refresh_every is not None and (isinstance(refresh_every, bool) or not isinstance(
                refresh_every, int) or refresh_every < 1):
            raise ValueError(f"refresh_every must be None or an int >= 1, got {refresh_every!r}")
        self.refresh_every = refresh_every
        if sends not in SENDS:
            raise ValueError(f"sends must be one of {', '.join(SENDS)}, got {sends!r}")
        if not callable(hold_idle_rows) and not isinstance(hold_idle_rows, bool):
            raise TypeError(f"hold_idle_rows must be a bool or a callable, got "
                            f"{hold_idle_rows!r}")
        self.hold_idle_rows = hold_idle_rows
        if watch is not None and not isinstance(watch, HealthWatch):
            raise TypeError(f"watch must be a gradpress.optim.health.HealthWatch or None, got "
                            f"{watch!r}")
        self.watch = watch
        #: flat index -> parameter name, for the watch's warnings (``gp.OneBitLANS`` sets it)
        self.param_names: dict[int, str] = {}
        self.blend, self.precondition, self.sends, self.ef21 = blend, precondition, sends, ef21
        self.variance = _check_variance(variance, self)
        self._setup(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 normalize_grad=normalize_grad, min_trust=min_trust,
                                 max_trust=max_trust, freeze_variance_after=None,
                                 dense_steps=dense_steps), fused)
        self.communicate = communicate

    communicate = OneBitAdam.communicate
    compression_active = OneBitAdam.compression_active
    _launch = OneBitAdam._launch

    def _compresses(self, t: int, group: dict[str, Any]) -> bool:
        """Whether a tensor's step ``t`` runs the compression stage: past the dense phase and
        not a refresh step, which is dense."""
        return t > group["dense_steps"] and not self._refreshes(t, group)

    def _refreshes(self, t: int, group: dict[str, Any]) -> bool:
        """Whether step ``t`` of a tensor is a variance-refresh step (``refresh_every``)."""
        k, fs = self.refresh_every, group["dense_steps"]
        return k is not None and t > fs and (t - fs) % k == 0

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group["dense_steps"] is None:
            raise ValueError("dense_steps must be an int >= 1 for OneBitLANS, got None")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model, returns the loss."""
        loss = self._closure_loss(closure)
        stages = []
        for b, group in self._bucketed():
            fs = group["dense_steps"]
            warm, comp = _split(b, lambda t, fs=fs: t <= fs)
            refresh, comp = _split(comp, lambda t, g=group: self._refreshes(t, g))
            if warm.params:
                # Step 1: a LANS step on the (uncompressed-averaged) gradient.
                self._note_idle_rows(warm)
                self._update(warm, group)
            if refresh.params:
                self._refresh(refresh, group)
            for part, blend in self._by_blend(comp):
                # Step 2: launch every communication of the step before waiting for any.
                stages.append((part, group) + self._send(part, group, blend))
        for b, group, pending, prev, (d, s), est, rows, probes in stages:
            got = received(b, pending)
            if est is not None:
                torch._foreach_add_(est, got)          # EF21: h = h + averaged difference
                got = est
            if self.variance == "local":
                got, step = self._hold_idle_rows(b, group, got, rows)
                self._check_health(b, step, probes)
                self._local_update(b, group, got, prev, d, s, step)
                continue
            if self.precondition:
                got = torch._foreach_mul(got, d)        # back from x/d to x
            mom = b.exp_avgs
            if self.sends == "gradient":
                moments_(b, got, *group["betas"], update_variance=False)
            elif est is not None:
                mom = got      # EF21: the momenta stay local; step along the shared estimate
            else:
                for m, avg in zip(b.exp_avgs, got):
                    if avg is not m:
                        m.copy_(avg)
            self._momentum_update(b, group, prev, mom, d, s)
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
              ) -> tuple[list[Any], Any, Any, Any, dict[int, Any], dict[int, Any]]:
        """Step 2 up to the communication: returns (pending, b1*m_prev or None, the
        ``(d, s)`` of :func:`adam_denominators`, the EF21 estimates or None, and by position in
        ``b`` the pending row flags of step 2b and probes of step 2c)."""
        beta1, beta2 = group["betas"]
        if self.variance == "local":
            flags = self._row_flags(b, group)  # before normalising: which rows have a gradient
            g = self._normalized(b.grads) if group["normalize_grad"] else b.grads
            sent, prev, ds = self._local_moments(b, group, g, blend)
            return (self._launch(b, sent), prev, ds, None, self._send_rows(b, flags, sent),
                    self._send_probes(b, group, sent))
        g = self._normalized(b.grads) if group["normalize_grad"] else b.grads
        ds = self._denominators(b, group)
        d = ds[0] if self.precondition else None     # what the sent tensors are divided by
        est = self._estimates(b, d) if self.ef21 else None
        prev = None
        if blend:  # b1 * the momentum the last update stepped along
            last = b.exp_avgs
            if est is not None and self.sends == "momentum":
                last = torch._foreach_mul(est, d) if d is not None else est
            prev = torch._foreach_mul(last, beta1)
        if self.sends == "momentum":
            moments_(b, g, beta1, beta2, update_variance=False)   # local momentum, v frozen
            src = b.exp_avgs
        else:
            src = g
        sent = torch._foreach_div(src, d) if d is not None else list(src)
        if est is not None:
            sent = torch._foreach_sub(sent, est)        # EF21: only the difference travels
        return self._launch(b, sent), prev, ds, est, {}, {}

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
                d_last = self._denominators(b, group)[0]
                for p, m, d in zip(b.params, b.exp_avgs, d_last):
                    self.state[p].setdefault("shared_momentum", m / d)
            prev = torch._foreach_mul([self.state[p]["shared_momentum"] for p in b.params],
                                      beta1)
        moments_(b, g, beta1, beta2)                       # this worker's own m and v
        d, s = adam_denominators(b, beta2, group["eps"])   # bias-corrected at t, as LANS
        return torch._foreach_div(b.exp_avgs, d), prev, (d, s)

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

    def _denominators(self, b: Bucket, group: dict[str, Any]
                      ) -> tuple[list[torch.Tensor], list[float]]:
        """:func:`adam_denominators` of the frozen ``v``, bias-corrected at the step of its
        last update (``dense_steps``, or the last refresh)."""
        vsteps = [self.state[p].get("variance_step", group["dense_steps"]) for p in b.params]
        return adam_denominators(dataclasses.replace(b, steps=vsteps), group["betas"][1],
                                 group["eps"])

    def _refresh(self, b: Bucket, group: dict[str, Any]) -> None:
        """``refresh_every``: a dense step on the uncompressed-averaged gradient that refreshes
        ``v``."""
        beta1, beta2 = group["betas"]
        g = self._normalized(b.grads) if group["normalize_grad"] else b.grads
        prev = torch._foreach_mul(b.exp_avgs, beta1) if self.blend is True else None
        for p, v, gi, t in zip(b.params, b.exp_avg_sqs, g, b.steps):
            st = self.state[p]
            # the averaged gradient stands in for the k steps since v's last update
            w = beta2 ** (t - st.get("variance_step", group["dense_steps"]))
            v.mul_(w).addcmul_(gi, gi, value=1.0 - w)
            st["variance_step"] = t
        torch._foreach_lerp_(b.exp_avgs, g, 1.0 - beta1)
        d, s = self._denominators(b, group)
        if self.ef21:  # every worker holds the same m and d: the estimates restart exact
            for p, m, di in zip(b.params, b.exp_avgs, d):
                self.state[p]["ef21_estimate"] = m / di if self.precondition else m.clone()
        self._momentum_update(b, group, prev, b.exp_avgs, d, s)

    def _estimates(self, b: Bucket, d: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """The EF21 estimates of the bucket's tensors, created from the shared momentum (the
        same on every worker when compression starts) on first use."""
        out = []
        for i, (p, m) in enumerate(zip(b.params, b.exp_avgs)):
            st = self.state[p]
            if "ef21_estimate" not in st:
                st["ef21_estimate"] = m / d[i] if d is not None else m.clone()
            out.append(st["ef21_estimate"])
        return out

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
            gh = torch._foreach_sub(mom, prev)
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


def _check_variance(variance: Any, opt: OneBitLANS) -> str:
    """``variance`` if valid and compatible with the other options, else ValueError."""
    if variance not in VARIANCES:
        raise ValueError(f"variance must be one of {', '.join(VARIANCES)}, got {variance!r}")
    if variance != "local" and opt.hold_idle_rows is not False:
        raise ValueError(f"hold_idle_rows needs variance='local', got variance={variance!r}")
    if variance == "local":
        clash = [name for name, bad in (("precondition=False", not opt.precondition),
                                        (f"sends={opt.sends!r}", opt.sends != "momentum"),
                                        ("ef21=True", opt.ef21),
                                        (f"refresh_every={opt.refresh_every!r}",
                                         opt.refresh_every is not None)) if bad]
        if clash:
            raise ValueError(f"variance='local' needs precondition=True, sends='momentum', "
                             f"no ef21 and no refresh_every (the local v is never stale), "
                             f"got {', '.join(clash)}")
    return variance

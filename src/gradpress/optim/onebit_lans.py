"""1-bit LANS: LANS with a dense warm-up, then frozen variance and communicated momentum.

The 1-bit Adam recipe (Tang et al., ICML 2021, arXiv:2102.02888; :class:`OneBitAdam`) applied to
LANS (Zheng et al. 2020, arXiv:2006.13484), in the way DeepSpeed's 1-bit LAMB (Li et al. 2021,
arXiv:2104.06069) applies it to LAMB: what travels compressed after the warm-up is each worker's
momentum, not its gradient. It is the "compress the momentum instead of the gradient" remedy of
CLAN's transformer gap (``docs/convergence.md``, section 2.6) and what ``gp.CLAN`` builds by
default (``communicate="momentum"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from ._common import (
    Bucket,
    adam_denominators,
    direction,
    moments_,
    norms,
    scaled_by,
    trust_ratios,
)
from .lans import LANS
from .onebit_adam import Communicate, OneBitAdam, _split, received

__all__ = ["OneBitLANS", "SENDS", "VARIANCES"]

#: What :class:`OneBitLANS` communicates in its compression stage.
SENDS = ("momentum", "gradient")
#: How :class:`OneBitLANS` keeps the second moment in its compression stage.
VARIANCES = ("frozen", "local")


class OneBitLANS(LANS):
    r"""1-bit LANS, single-process core (the distributed layer supplies ``communicate``).

    Per parameter tensor ``x`` at its step ``t`` with ``g = p.grad``:

    1. Warm-up, ``t <= freeze_step``: a :class:`LANS` step (steps 1-7 there, ``normalize_grad``
       as configured) on ``g``, which the caller averaged over workers *uncompressed*.
    2. Compression stage, ``t > freeze_step``: ``g`` is the worker's *local* gradient, divided by
       its norm if ``normalize_grad``; ``v`` is frozen with its bias correction
       ``1-b2^freeze_step``; the local momentum ``m = b1*m + (1-b1)*g`` is replaced by
       ``communicate(key, m)``, the average of all workers' momenta (compressed by the
       distributed layer with worker and server error feedback; None: identity).
       With ``ef21`` (EF21, Richtarik, Sokolov, Fatkhullin, NeurIPS 2021, arXiv:2106.05203;
       with momentum: Fatkhullin et al., NeurIPS 2023, arXiv:2305.15155) every worker keeps
       the same estimate ``h`` of the averaged sent tensor (initialised to the shared momentum
       when compression starts) and sends only ``sent - h``; the averaged difference ``a``
       comes back and ``h = h + a`` replaces the average. Whatever a codec drops, on either
       side, stays in the next difference, so the distributed layer must run *without*
       residuals (``ef=None``): the estimate is the error feedback.
    3. Compression-stage update: ``r = mh/(sqrt(vh)+eps) + wd*x`` with ``mh = m/(1-b1^t)``
       and ``q_r = ||x||/||r||`` (1 where a norm is 0, clamped to the trust bounds).
       With ``blend`` (LANS's Nesterov-style part), the averaged gradient that no longer
       travels is recovered from two consecutive averaged momenta,
       ``gh = (m - b1*m_prev)/(1-b1)`` (exact for a lossless codec), and the update is LANS's
       step 7 with it: ``c = gh/(sqrt(vh)+eps) + wd*x``, ``q_c = ||x||/||c||``,
       ``x = x - lr*b1*q_r*r - lr*(1-b1)*q_c*c``. Without ``blend``:
       ``x = x - lr*q_r*r`` (LAMB's update, as in 1-bit LAMB); the total step is ``lr*||x||``
       either way.
    4. Variance refresh (``refresh_every=K``; after 0/1 Adam, Lu et al., ICML 2022,
       arXiv:2202.06009, which updates the variance only at some steps): every ``K``-th step of
       the compression stage (``t - freeze_step`` a multiple of ``K``) is dense again: the
       caller averages gradients uncompressed, as in the warm-up, and
       ``m = b1*m + (1-b1)*g``; the averaged gradient stands in for every step since ``v``
       was last updated, ``k`` of them: ``v = b2^k*v + (1-b2^k)*g*g``, whose bias correction
       is then ``1-b2^t`` as in LANS; the update is step 3's with this ``m`` and ``v``. The
       EF21 estimates are reset to the (shared) new ``m/d``.
    5. Local variance (``variance="local"``, instead of step 2's frozen ``v``): each worker
       keeps updating its own ``v = b2*v + (1-b2)*g*g`` from its local (normalised) gradient,
       bias-corrected at ``t`` as in LANS, and sends its momentum divided by its own
       ``d = sqrt(vh)+eps``. What comes back, ``a``, the average of the workers' ``m/d``, is
       the same on every worker: the update is step 3's with ``r = a*sb + wd*x`` and, with
       ``blend``, ``c = (a - b1*a_prev)*s/(1-b1) + wd*x`` (``a_prev`` the last step's ``a``,
       kept in the state as ``shared_momentum``; ``sb``, ``s`` the bias corrections), so the
       replicas stay identical; each worker's momentum becomes ``m = a*d`` in its own units.
       With per-layer gradient normalisation a local gradient has the same norm as the
       averaged one, so the local ``v`` stays on the warm-up's scale; unlike a frozen ``v``
       it follows the gradients as they change, which keeps ``m/d`` (what the codec sees)
       even, at no cost on the wire.

    Tuning advice:

    * ``freeze_step``: the dense warm-up, long enough for ``v`` to settle and for the model to
      leave the fast early phase: 1-bit Adam uses 15-25% of the run. Must be >= 1.
    * ``lr``: LANS's rate (a relative step per layer); keep the uncompressed run's schedule.
    * ``normalize_grad``: True (LANS proper, the default here) normalises each worker's local
      gradient per layer before it enters the momentum, so ``v`` (frozen from normalised
      gradients) and ``m`` stay on the same scale; False gives CLAN's unnormalised gradient.
    * ``betas``: ``(0.9, 0.999)``; a high ``b1`` averages the momentum's compression error out.
    * ``precondition``: True compresses ``m/d`` instead of ``m``. A one-bit or top-k codec
      treats all elements of a chunk alike; on ``m`` that error is then divided by ``d``, so
      elements with a tiny second moment get huge, wrong steps, inflate ``||r||`` and shrink
      every other element's step through the trust ratio. On ``m/d`` the error is spread
      evenly over the update itself. The two are the same with a lossless codec.
    * ``sends``: ``"momentum"`` (1-bit Adam's choice: the momentum is smoother than the
      gradient) or ``"gradient"`` (CLAN's: the codec's error enters the momentum with weight
      ``1-b1`` instead of 1; with ``v`` frozen it no longer reaches the second moment).
    * ``ef21``: False (residual error feedback in the codec, as 1-bit Adam); True sends
      differences to a shared estimate instead. The estimate is dense even when the codec is
      top-k, so the update is too, and a one-bit codec's error is relative to the change of
      the momentum in one step (about ``1-b1`` of it), not to the momentum itself.
    * ``blend``: True keeps LANS's update after the warm-up; ``gh`` carries the codec's error of
      one step amplified by ``1/(1-b1)`` (error feedback cancels it over the next steps), and
      its trust ratio ``q_c`` gives it ``1-b1`` of every layer's step. False uses the momentum
      direction alone: on stdlib-mlm with one-bit it was better on every seed (1600 steps:
      +6.33% against +7.97%, ``docs/convergence.md`` 2.9), and ``gp.CLAN`` uses it by
      default. Without compression the two differ little.
    * ``variance``: ``"frozen"`` (1-bit Adam's and 1-bit LAMB's choice) or ``"local"``
      (step 5, needs ``precondition``, ``sends="momentum"``, no ``ef21``, no refresh).
      On stdlib-mlm at 1600 steps the local variance removed the frozen one's cost without
      compression and cut one-bit's gap from +20.8% to +14.7% (3 seeds) with no extra bytes
      (``docs/convergence.md`` 2.8); ``gp.CLAN`` uses it by default.
    * ``refresh_every``: None (``v`` stays frozen, as 1-bit Adam). A frozen ``v`` remembers
      the warm-up's gradients; when the gradients of some weights grow or shrink later (a
      transformer that starts to use its context), their steps are mis-scaled. Each refresh
      costs one dense step: ``K`` = 50 with a one-bit codec (32x) sends about 1.6x the bytes
      of no refresh. The codec's residuals, in units of the old ``m/d``, are not rescaled
      when ``d`` changes. On stdlib-mlm it halved the frozen ``v``'s cost without compression
      but did not help one-bit at 800 steps; at 1600 it did (``docs/convergence.md`` 2.7).
    * ``eps``, ``weight_decay``, ``min_trust``, ``max_trust``: as :class:`LANS`.

    Recipe (the same as :class:`OneBitAdam`): while :attr:`compression_active` is False the caller
    averages gradients uncompressed into ``p.grad``; once True it leaves the local gradient there
    and ``communicate`` must do a compressed push_pull of the momentum. ``key`` is the
    parameter's position in the flat order of ``param_groups`` (the ids of ``state_dict()``).

    Args:
        params: iterable of parameters or of param-group dicts (torch semantics).
        lr, betas, eps, weight_decay, normalize_grad, min_trust, max_trust, fused: as
            :class:`LANS` (``fused`` applies to the warm-up steps; the compression stage runs
            torch's foreach ops).
        freeze_step: number of warm-up steps, an int >= 1.
        blend: keep LANS's instant-gradient direction after the warm-up (step 3).
        precondition: communicate the momentum (or gradient) divided by ``d`` (step 2).
        sends: ``"momentum"`` or ``"gradient"`` (step 2).
        ef21: communicate differences to a shared estimate (step 2); the distributed layer's
            codec must then run without error feedback.
        refresh_every: None, or an int >= 1: every this many compression-stage steps, one
            dense step refreshes ``v`` (step 4).
        variance: ``"frozen"`` or ``"local"`` (step 5).
        communicate: ``communicate(key: str, m: Tensor)`` returning the averaged momentum (a
            tensor or a handle with ``wait()``); None means identity.

    Raises:
        ValueError: a hyperparameter is out of range (the message names it).
        TypeError: ``communicate`` is not callable, a flag is not a bool, or a gradient is
            sparse.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, normalize_grad: bool = True,
                 min_trust: float | None = None, max_trust: float | None = None,
                 fused: bool | None = None, freeze_step: int = 100,
                 communicate: Communicate | None = None, blend: bool = True,
                 precondition: bool = True, sends: str = "momentum",
                 ef21: bool = False, refresh_every: int | None = None,
                 variance: str = "frozen") -> None:
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"freeze_step must be an int >= 1, got {freeze_step!r}")
        for name, flag in (("blend", blend), ("precondition", precondition), ("ef21", ef21)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if refresh_every is not None and (isinstance(refresh_every, bool) or not isinstance(
                refresh_every, int) or refresh_every < 1):
            raise ValueError(f"refresh_every must be None or an int >= 1, got {refresh_every!r}")
        self.refresh_every = refresh_every
        if sends not in SENDS:
            raise ValueError(f"sends must be one of {', '.join(SENDS)}, got {sends!r}")
        self.blend, self.precondition, self.sends, self.ef21 = blend, precondition, sends, ef21
        self.variance = _check_variance(variance, self)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         normalize_grad=normalize_grad, min_trust=min_trust,
                         max_trust=max_trust, fused=fused, freeze_step=freeze_step)
        self.communicate = communicate

    communicate = OneBitAdam.communicate
    compression_active = OneBitAdam.compression_active
    _launch = OneBitAdam._launch

    def _compresses(self, t: int, group: dict[str, Any]) -> bool:
        """Whether a tensor's step ``t`` runs the compression stage: past the warm-up and not
        a refresh step (step 4), which is dense."""
        return t > group["freeze_step"] and not self._refreshes(t, group)

    def _refreshes(self, t: int, group: dict[str, Any]) -> bool:
        """Whether step ``t`` of a tensor is a variance-refresh step (step 4)."""
        k, fs = self.refresh_every, group["freeze_step"]
        return k is not None and t > fs and (t - fs) % k == 0

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if group["freeze_step"] is None:
            raise ValueError("freeze_step must be an int >= 1 for OneBitLANS, got None")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model, returns the loss."""
        loss = self._closure_loss(closure)
        stages = []
        for b, group in self._bucketed():
            fs = group["freeze_step"]
            warm, comp = _split(b, lambda t, fs=fs: t <= fs)
            refresh, comp = _split(comp, lambda t, g=group: self._refreshes(t, g))
            if warm.params:
                # Step 1: a LANS step on the (uncompressed-averaged) gradient.
                self._update(warm, group)
            if refresh.params:
                self._refresh(refresh, group)
            if comp.params:
                # Step 2: launch every communication of the step before waiting for any.
                stages.append((comp, group) + self._send(comp, group))
        for b, group, pending, prev, (d, s), est in stages:
            got = received(b, pending)
            if est is not None:
                torch._foreach_add_(est, got)          # EF21: h = h + averaged difference
                got = est
            if self.variance == "local":
                self._local_update(b, group, got, prev, d, s)
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

    def _send(self, b: Bucket, group: dict[str, Any]) -> tuple[list[Any], Any, Any, Any]:
        """Step 2 up to the communication: returns (pending, b1*m_prev or None, the frozen
        ``(d, s)`` of :func:`adam_denominators`, the EF21 estimates or None)."""
        beta1, beta2 = group["betas"]
        g = self._normalized(b.grads) if group["normalize_grad"] else b.grads
        if self.variance == "local":
            return self._send_local(b, group, g)
        ds = self._denominators(b, group)
        d = ds[0] if self.precondition else None     # what the sent tensors are divided by
        est = self._estimates(b, d) if self.ef21 else None
        prev = None
        if self.blend:  # b1 * the momentum the last update stepped along
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
        return self._launch(b, sent), prev, ds, est

    def _send_local(self, b: Bucket, group: dict[str, Any], g: list[torch.Tensor]
                    ) -> tuple[list[Any], Any, Any, None]:
        """Step 5 up to the communication: ``v`` and ``m`` from the local gradient, ``m/d``
        sent; returns (pending, b1*a_prev or None, ``(d, s)``, None)."""
        beta1, beta2 = group["betas"]
        prev = None
        if self.blend:  # a_prev; at the first compressed step the warm-up's (shared) m/d
            if any("shared_momentum" not in self.state[p] for p in b.params):
                d_last = self._denominators(b, group)[0]
                for p, m, d in zip(b.params, b.exp_avgs, d_last):
                    self.state[p].setdefault("shared_momentum", m / d)
            prev = torch._foreach_mul([self.state[p]["shared_momentum"] for p in b.params],
                                      beta1)
        moments_(b, g, beta1, beta2)                       # this worker's own m and v
        d, s = adam_denominators(b, beta2, group["eps"])   # bias-corrected at t, as LANS
        return self._launch(b, torch._foreach_div(b.exp_avgs, d)), prev, (d, s), None

    def _local_update(self, b: Bucket, group: dict[str, Any], got: list[torch.Tensor],
                      prev: list[torch.Tensor] | None, d: list[torch.Tensor],
                      s: list[float]) -> None:
        """Step 5 after the communication: the update from the shared average ``a = got``."""
        for p, m, a, di in zip(b.params, b.exp_avgs, got, d):
            torch.mul(a, di, out=m)                 # this worker's momentum, in its units
            if self.blend:
                self.state[p]["shared_momentum"] = a.clone()
        self._momentum_update(b, group, prev, got, None, s)

    def _denominators(self, b: Bucket, group: dict[str, Any]
                      ) -> tuple[list[torch.Tensor], list[float]]:
        """:func:`adam_denominators` of the frozen ``v``, bias-corrected at the step of its
        last update (``freeze_step``, or the last refresh)."""
        vsteps = [self.state[p].get("variance_step", group["freeze_step"]) for p in b.params]
        return adam_denominators(dataclasses.replace(b, steps=vsteps), group["betas"][1],
                                 group["eps"])

    def _refresh(self, b: Bucket, group: dict[str, Any]) -> None:
        """Step 4: a dense step on the uncompressed-averaged gradient that refreshes ``v``."""
        beta1, beta2 = group["betas"]
        g = self._normalized(b.grads) if group["normalize_grad"] else b.grads
        prev = torch._foreach_mul(b.exp_avgs, beta1) if self.blend else None
        for p, v, gi, t in zip(b.params, b.exp_avg_sqs, g, b.steps):
            st = self.state[p]
            # the averaged gradient stands in for the k steps since v's last update
            w = beta2 ** (t - st.get("variance_step", group["freeze_step"]))
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
        """Step 3 with v frozen along the averaged momentum ``mom``; ``prev`` is
        ``b1*m_prev`` (blend) or None (momentum only); ``d``, ``s`` the frozen denominators
        (``d`` None: ``mom`` and ``prev`` are divided by it already, step 5)."""
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
            torch._foreach_addcmul_(b.params, r, scaled_by(q_r, -lr, dtype))
            return
        q_c = trust_ratios(xn, c, group["min_trust"], group["max_trust"])
        torch._foreach_addcmul_(b.params, r, scaled_by(q_r, -lr * beta1, dtype))
        torch._foreach_addcmul_(b.params, c, scaled_by(q_c, -lr * (1.0 - beta1), dtype))


def _check_variance(variance: Any, opt: OneBitLANS) -> str:
    """``variance`` if valid and compatible with the other options, else ValueError."""
    if variance not in VARIANCES:
        raise ValueError(f"variance must be one of {', '.join(VARIANCES)}, got {variance!r}")
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

"""The convergence study's optimizer variants, kept out of the shipped optimizers.

``benchmarks/convergence.py`` and ``benchmarks/clan_script.py --method train`` measured these
switches against the shipped algorithm and concluded against each (the log:
``benchmarks/results/convergence-log-2026.md``); they live here so that the log stays
reproducible while ``gradpress.optim`` carries one algorithm:

1. :class:`StudyOneBitLANS`: :class:`gradpress.optim.OneBitLANSCore` with ``variance="frozen"``
   (1-bit Adam's frozen ``v``, bias-corrected at ``dense_steps``), and then
   ``precondition=False`` (send ``m``, not ``m/d``), ``sends="gradient"`` (send the gradient,
   keep the momentum local), ``ef21=True`` (send differences to a shared estimate: EF21,
   Richtarik et al. 2021, arXiv:2106.05203; the distributed layer must run without residuals)
   and ``refresh_every=K`` (one dense step every ``K`` that refreshes ``v``, after 0/1 Adam,
   arXiv:2202.06009). ``variance="local"`` is the shipped algorithm itself.
2. :class:`StudyLANS`: :class:`gradpress.optim.LANS` with ``freeze_variance_after=N``: ``v``
   stops changing after a tensor's ``N``-th step, its bias correction stays ``1-b2^N``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from gradpress.optim import LANS, OneBitLANSCore
from gradpress.optim._common import Bucket, adam_denominators, moments_
from gradpress.optim.onebit_adam import _split, received

__all__ = ["StudyOneBitLANS", "StudyLANS", "SENDS", "VARIANCES", "make_core"]

#: What :class:`StudyOneBitLANS` communicates in its compression stage.
SENDS = ("momentum", "gradient")
#: How :class:`StudyOneBitLANS` keeps the second moment in its compression stage.
VARIANCES = ("frozen", "local")
#: The keywords of the study switches, by class.
LANS_SWITCHES = ("freeze_variance_after",)
ONEBIT_SWITCHES = ("variance", "precondition", "sends", "ef21", "refresh_every")


def make_core(method: str, options: dict[str, Any]) -> type | None:
    """The class ``gradpress.torch.builder.build_optimizer`` takes as ``core`` for the study
    ``options`` of ``method`` (None: none given, the shipped class)."""
    if method == "onebit-lans" and set(options) & {*ONEBIT_SWITCHES, "blend"}:
        return StudyOneBitLANS
    if method in ("clan", "lans") and set(options) & set(LANS_SWITCHES):
        return StudyLANS
    if set(options) - {"blend"}:
        raise ValueError(f"the study switches {sorted(options)} do not apply to {method}")
    return None


class StudyLANS(LANS):
    """:class:`gradpress.optim.LANS` with ``freeze_variance_after`` (module docstring, 2)."""

    def __init__(self, params: Iterable[Any], *, freeze_variance_after: int | None = None,
                 **kw: Any) -> None:
        fs = freeze_variance_after
        if fs is not None and (not isinstance(fs, int) or isinstance(fs, bool) or fs < 1):
            raise ValueError(f"freeze_variance_after must be None or an int >= 1, got {fs!r}")
        self.freeze_variance_after = fs
        super().__init__(params, **kw)

    def _variance_frozen_after(self, group: dict[str, Any]) -> int | None:
        return self.freeze_variance_after


class StudyOneBitLANS(OneBitLANSCore):
    """:class:`gradpress.optim.OneBitLANSCore` with the switches of the module docstring (1).

    With ``variance="frozen"`` the idle-row hold and the health watch are off (they need the
    local ``v``), whatever the builder passes.
    """

    def __init__(self, params: Iterable[Any], *, variance: str = "local",
                 blend: bool | Callable[[int], bool] = False, precondition: bool = True,
                 sends: str = "momentum", ef21: bool = False, refresh_every: int | None = None,
                 **kw: Any) -> None:
        if callable(blend) and variance != "local":
            raise ValueError(f"a per-tensor blend (a callable) needs variance='local', "
                             f"got variance={variance!r}")
        for name, flag in (("precondition", precondition), ("ef21", ef21)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if refresh_every is not None and (isinstance(refresh_every, bool) or not isinstance(
                refresh_every, int) or refresh_every < 1):
            raise ValueError(f"refresh_every must be None or an int >= 1, got {refresh_every!r}")
        if sends not in SENDS:
            raise ValueError(f"sends must be one of {', '.join(SENDS)}, got {sends!r}")
        self.refresh_every, self.precondition, self.sends, self.ef21 = (
            refresh_every, precondition, sends, ef21)
        if variance == "frozen":  # the hold and the watch need the local v
            kw.update(hold_idle_rows=False, watch=None)
        super().__init__(params, blend=blend, **kw)
        self.variance = _check_variance(variance, self)

    def _compresses(self, t: int, group: dict[str, Any]) -> bool:
        """Whether a tensor's step ``t`` runs the compression stage: past the dense phase and
        not a refresh step, which is dense."""
        return t > group["dense_steps"] and not self._refreshes(t, group)

    def _refreshes(self, t: int, group: dict[str, Any]) -> bool:
        """Whether step ``t`` of a tensor is a variance-refresh step (``refresh_every``)."""
        k, fs = self.refresh_every, group["dense_steps"]
        return k is not None and t > fs and (t - fs) % k == 0

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


def _check_variance(variance: Any, opt: StudyOneBitLANS) -> str:
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

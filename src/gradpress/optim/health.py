"""How far a 1-bit optimizer's compressed momenta drift from the exact ones, and recovery.

:class:`~gradpress.optim.OneBitLANSCore` steps along ``a``, the average of the workers' momenta
``u = m/(sqrt(v)+eps)`` delivered through a two-way compressed link with error feedback. Error
feedback keeps ``a`` close to the exact average ``u_bar`` *over time*; when it stops doing so
(residuals that grow, a codec whose scale misfits the tensor), training drifts away from what
uncompressed training would do, and nothing the user sees says so until the validation loss
does. The watch measures it, identically on every worker:

1. Every ``every`` compression-stage steps (a probe step), each watched tensor's ``u`` is also
   averaged exactly (``communicate(key + ".probe", u)``; bf16 through ``gp.OneBitLANS``, one
   dense step's traffic every ``every`` steps).
2. The agreement of the step with it, ``cos(a, u_bar)``, is kept per tensor (``probe_cos`` in
   the optimizer state, every probe's ``(step, cos)`` in ``probe_log``).
3. A tensor whose agreement falls below ``threshold`` has drifted: for ``recover_steps`` steps
   its momentum travels exact (the caller routes ``recovering(i)`` tensors' keys exact), and its
   error-feedback residuals start afresh afterwards (``generation`` counts the events, and the
   caller names the keys of each generation apart). A warning names the tensor; the events are
   counted per tensor (``recoveries``).

Tuning advice: ``every`` trades the probe's bytes (one bf16 copy of the momenta) against how
soon a drift is seen; ``threshold`` is the cosine below which the compressed step is judged to
point elsewhere than the exact one (``docs/optimizers.md``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from ._common import Bucket

__all__ = ["HealthWatch", "Watched", "DEFAULT_PROBE_EVERY", "DEFAULT_THRESHOLD",
           "DEFAULT_RECOVER_STEPS"]

log = logging.getLogger(__name__)

#: A probe every this many compression-stage steps: a bf16 copy, a small share of the bytes.
DEFAULT_PROBE_EVERY = 100
#: A step whose cosine with the exact average falls below this has drifted.
DEFAULT_THRESHOLD = 0.0
#: Steps a drifted tensor's momentum travels exact before it is compressed afresh.
DEFAULT_RECOVER_STEPS = 10


@dataclass(frozen=True, kw_only=True)
class HealthWatch:
    """The watch's settings (its per-tensor state lives in the optimizer's state).

    Attributes:
        every: probe every this many compression-stage steps, >= 1.
        threshold: ``cos(a, u_bar)`` below this is a drift, in [-1, 1]; None measures only.
        recover_steps: steps a drifted tensor travels exact, >= 1.
    """

    every: int = DEFAULT_PROBE_EVERY
    threshold: float | None = DEFAULT_THRESHOLD
    recover_steps: int = DEFAULT_RECOVER_STEPS

    def __post_init__(self) -> None:
        for name in ("every", "recover_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"HealthWatch.{name} must be an int >= 1, got {v!r}")
        th = self.threshold
        if th is not None and (isinstance(th, bool) or not isinstance(th, (int, float))
                               or not -1.0 <= th <= 1.0):
            raise ValueError(f"HealthWatch.threshold must be None or a number in [-1, 1], "
                             f"got {th!r}")

    def probes(self, t: int, dense_steps: int) -> bool:
        """Step 1: whether compression-stage step ``t`` (a tensor's count) is a probe step."""
        return t > dense_steps and (t - dense_steps) % self.every == 0

    def check(self, st: dict[str, Any], label: str, t: int, step: torch.Tensor,
              exact: torch.Tensor) -> bool:
        """Steps 2-3 for one tensor (``st`` its optimizer state, ``label`` its name in the
        warning): keep the cosine and return whether it drifted (then it recovers until
        ``t + recover_steps``)."""
        cos = _cosine(step, exact)
        st["probe_cos"] = cos
        st.setdefault("probe_log", []).append((t, cos))
        if self.threshold is None or not cos < self.threshold:
            return False
        st["recover_until"] = t + self.recover_steps
        st["generation"] = int(st.get("generation", 0)) + 1
        st["recoveries"] = int(st.get("recoveries", 0)) + 1
        log.warning("the compressed momentum of %s drifted at step %d: cos %.3f with the exact "
                    "average (threshold %g); it travels exact for %d steps, then compressed "
                    "with fresh residuals", label, t, cos, self.threshold, self.recover_steps)
        return True

    @staticmethod
    def recovering(st: dict[str, Any], t: int) -> bool:
        """Whether a tensor at step ``t`` is in a recovery (its momentum travels exact)."""
        return t <= int(st.get("recover_until", 0))


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """cos(a, b) in float64; 1.0 where both are zero, 0.0 where one is."""
    a, b = a.detach().double().reshape(-1), b.detach().double().reshape(-1)
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 and nb == 0.0:
        return 1.0
    if na == 0.0 or nb == 0.0 or not math.isfinite(na * nb):
        return 0.0 if math.isfinite(na * nb) else -1.0
    return float(a @ b) / (na * nb)


class Watched:
    """Mixin of :class:`~gradpress.optim.OneBitLANSCore`: the watch's steps inside its ``step()``.
    Needs ``state``, ``param_groups``, ``_communicate``, ``watch`` (a :class:`HealthWatch` or
    None), ``param_names`` and ``_holds(index)`` (the tensors watched)."""

    state: Any
    param_groups: list[dict[str, Any]]
    _communicate: Any
    watch: HealthWatch | None
    param_names: dict[int, str]

    def _holds(self, index: int) -> bool:
        raise NotImplementedError

    def _send_probes(self, b: Bucket, group: dict[str, Any], sent: list[torch.Tensor]
                     ) -> dict[int, Any]:
        """Watch step 1: on a probe step, communicate each watched tensor's ``m/d`` again,
        key ``"<i>.probe"``, to be averaged exactly (:mod:`gradpress.optim.health`)."""
        w = self.watch
        if w is None:
            return {}
        out = {}
        for j, (i, t) in enumerate(zip(b.indices, b.steps)):
            st = self.state[b.params[j]]
            if w.probes(t, group["dense_steps"]) and self._holds(i) \
                    and not HealthWatch.recovering(st, t):
                c = self._communicate
                out[j] = sent[j] if c is None else c(f"{i}.probe", sent[j])
        return out

    def _check_health(self, b: Bucket, step: list[torch.Tensor], probes: dict[int, Any]
                      ) -> None:
        """Watch steps 2-3: the step's cosine with the exact average of the probes."""
        watch = self.watch
        for j, pending in probes.items():
            assert watch is not None  # _send_probes takes probes only with a watch
            exact = pending.wait() if hasattr(pending, "wait") else pending
            i = b.indices[j]
            label = self.param_names.get(i, f"parameter {i}")
            watch.check(self.state[b.params[j]], label, b.steps[j], step[j], exact)

    def _param(self, index: int) -> torch.Tensor:
        """The parameter at flat position ``index`` of ``param_groups``."""
        flat = getattr(self, "_flat", None)
        if flat is None or flat[0] != len(self.param_groups):
            flat = (len(self.param_groups), [p for g in self.param_groups for p in g["params"]])
            self._flat = flat
        return flat[1][index]

    def recovering(self, index: int) -> bool:
        """Whether flat parameter ``index``'s momentum travels exact this step, recovering from
        a drift the watch saw (:mod:`gradpress.optim.health`); False without a watch."""
        st = self.state.get(self._param(index), {})
        return self.watch is not None and HealthWatch.recovering(st, int(st.get("step", 0)))

    def generation(self, index: int) -> int:
        """How many drifts flat parameter ``index`` recovered from: its compressed keys'
        residuals start afresh with each (the caller names each generation's keys apart)."""
        return int(self.state.get(self._param(index), {}).get("generation", 0))

    def new_drifts(self, index: int) -> int:
        """The drifts of flat parameter ``index`` not counted yet (in ``gp.stats()``), now
        counted. The count lives in the parameter's state (``"drifts_counted"``) beside its
        generation, so a resumed run does not count the drifts before its checkpoint again."""
        st = self.state.get(self._param(index))
        if st is None:
            return 0
        gen, counted = int(st.get("generation", 0)), int(st.get("drifts_counted", 0))
        st["drifts_counted"] = gen
        return max(0, gen - counted)

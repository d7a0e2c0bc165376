"""Issue 38 study: the workers' residual decay chosen from a measurement, two rules
(``clan_script.py --ef-auto``: per tensor from the codec's contraction, below;
``--decay-on-drift EF``: whole until the health watch sees a drift, :func:`install_decay_on_drift`).

Hypothesis (from the probes of ``vanilla`` runs on stdlib-mlm, where only ``out.weight``'s
compressed momentum turned against the exact one): a codec contracts a heavy-tailed tensor
much less than a Gaussian-like one (one-bit's ``delta = ||D(C(p))||^2 / ||p||^2`` is about 2/pi
on a Gaussian vector and falls towards k/n when k elements hold the energy), so its residual
grows many times the momentum and what it delivers is stale; a decay of 0.8 on every tensor
tames that tensor but throws away signal on all the others (stdlib-words underfits with it).

The rule (``--ef-auto`` of ``clan_script.py``, worker side only; the servers keep
``server_decay``): each worker-side error-feedback codec measures, at every compress,
``q_t = ||x - D(C(x))|| / ||x||`` of the step's input ``x`` alone (how much of it the codec
cannot deliver in one step: its shape, not the residual's) and decays its residual by
``B = min(1, q_ref / q_t)``, where ``q_ref`` is the same codec's ``q`` on a seeded Gaussian
vector of the tensor's size (measured once). So ``B * q_t <= q_ref``: the residual is kept as
contractive as vanilla error feedback keeps it on a Gaussian-like tensor, and such a tensor
keeps its whole residual (``B = 1``, vanilla). It costs one extra compress and decompress of
``x`` per step (a study, not a kernel).

This patches :class:`gradpress.compress.ef.ErrorFeedback` in the worker process (the decay is
set before each step); it is a study switch, not the product.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("study_ef")


def _q(inner: Any, x: torch.Tensor) -> float:
    """How much of ``x`` one plain compress/decompress of ``inner`` does not deliver."""
    d = inner.decompress(inner.compress(x.clone()))
    return float((x - d).norm() / x.norm().clamp_min(1e-30))


def install_auto_decay() -> None:
    """Patch ``ErrorFeedback._step``: the decay of each vanilla residual from its measured
    contraction, as the module docstring says."""
    from gradpress.compress.ef import ErrorFeedback

    if getattr(ErrorFeedback, "_study_auto", False):
        return
    orig = ErrorFeedback._step

    def _step(self: Any, flat: torch.Tensor, body: torch.Tensor, h: Any) -> Any:
        if self.kind != "vanilla" or self.anneal or not self.numel:
            return orig(self, flat, body, h)
        if not hasattr(self, "_q_ref"):
            g = torch.Generator().manual_seed(self.numel)
            self._q_ref = _q(self.inner, torch.randn(self.numel, generator=g))
            self._n_steps = 0
        # the codec's loss on this step's input alone (without the residual)
        q = _q(self.inner, flat.reshape(-1).float())
        self.decay = 1.0 if q <= self._q_ref else self._q_ref / q  # _lr_ratio returns it
        self._n_steps += 1
        if self._n_steps % 100 == 1:
            log.warning("study_ef key %s numel %d: q %.3f (Gaussian %.3f), decay %.3f",
                        h.key, self.numel, q, self._q_ref, self.decay)
        return orig(self, flat, body, h)

    ErrorFeedback._step = _step  # type: ignore[method-assign]
    ErrorFeedback._study_auto = True  # type: ignore[attr-defined]


def install_decay_on_drift(ef: str) -> None:
    """``--decay-on-drift EF``: the workers' residuals are kept whole (the factory's ``ef``)
    until the health watch sees a drift in any tensor; from the next step on, every compressed
    momentum travels under ``ef`` (e.g. ``vanilla:decay=0.8,server_decay=1.0``), under new
    keys, so workers and servers build fresh codecs with it. Patches the builder's momentum
    route in this worker process; every worker sees the same drift at the same step (the
    probe is an exact average), so the keys switch together."""
    import dataclasses

    from gradpress.torch import builder

    route = builder._MomentumRoute
    if getattr(route, "_study_drift", False):
        return
    orig = route.communicate

    def communicate(self: Any, key: str, m: torch.Tensor) -> Any:
        switched = getattr(self, "_switched", False)
        if not switched and any(self.opt.generation(i) for i in range(len(self.named))):
            self._switched = switched = True
            self._spec0 = self.spec
            log.warning("study_ef: a drift was seen; every compressed momentum now travels "
                        "with ef %s", ef)
        fused = self.fusion is not None and self.fusion.fuses(f"{self.prefix}{key}")
        if not switched or fused or key.endswith((".rows", ".probe")):
            return orig(self, key, m)
        spec0, prefix0 = self.spec, self.prefix
        self.spec = dataclasses.replace(self._spec0, wrappers={**self._spec0.wrappers, "ef": ef})
        self.prefix = prefix0 + "d."
        try:
            return orig(self, key, m)
        finally:
            self.spec, self.prefix = spec0, prefix0

    route.communicate = communicate  # type: ignore[method-assign]
    route._study_drift = True  # type: ignore[attr-defined]

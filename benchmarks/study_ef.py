"""Issue 38 study: the workers' residual decay chosen per tensor from what the codec measures.

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

"""LANS: layer-wise adaptive moments with Nesterov-style blending, and its CLAN configuration.

Reference: Shuai Zheng, Haibin Lin, Sheng Zha, Mu Li, "Accelerated Large Batch Optimization
of BERT Pretraining in 54 Minutes", arXiv:2006.13484 (2020), Algorithm 2. CLAN is the adaptive
method of Zhong, Xie, Zheng, Lin, "Compressed Communication for Distributed Training: Adaptive
Methods and System" (2021): LANS with the per-layer gradient normalisation turned off, driven by
the two-way, error-feedback compressed gradient (see ``docs/reference/api.md``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ._common import (
    Bucket,
    BucketedOptimizer,
    adam_denominators,
    add_scaled_,
    check_fused,
    check_trust,
    direction,
    divided,
    fused_layerwise_,
    moments_,
    norms,
    scaled_by,
    trust_ratios,
    use_fused,
)

__all__ = ["LANS"]


class LANS(BucketedOptimizer):
    r"""The LANS optimizer (Zheng et al. 2020), one "layer" per parameter tensor.

    For every parameter tensor ``x`` with gradient ``g`` (taken from ``p.grad``, which a
    distributed wrapper fills with the averaged, decompressed gradient), at its step ``t``:

    1. If ``normalize_grad``: ``g = g / ||g||`` (skipped where ``||g|| = 0``). ``p.grad`` is
       left untouched.
    2. Moments: ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``.
    3. Bias correction: ``mh = m/(1-b1^t)``; ``vh = v/(1-b2^t)``; ``d = sqrt(vh) + eps``.
    4. Momentum direction: ``r = mh/d + wd*x``.
    5. Instant-gradient direction: ``c = g/d + wd*x`` (the Nesterov-style part).
    6. Trust ratios: ``q_r = ||x||/||r||``, ``q_c = ||x||/||c||``; 1 where a norm is 0;
       clamped to ``[min_trust, max_trust]`` when given.
    7. Update: ``x = x - lr*b1*q_r*r - lr*(1-b1)*q_c*c``.

    The trust ratios make the step of every layer proportional to that layer's weight norm, so
    one learning rate serves embeddings, attention and LayerNorm weights alike; this is what
    lets LANS/LAMB train BERT at batch 32k-96k. Weight decay is decoupled (added to the
    direction, steps 4-5, before the trust ratio), as in the paper. Exclude biases and
    normalisation weights from decay with a param group ``{"params": ..., "weight_decay": 0.0}``.

    Tuning advice:

    * ``lr``: the main knob. Because of the trust ratio it is a *relative* step (a layer moves
      by about ``lr * ||x||`` per step), so it does not transfer from Adam. The paper uses
      0.00125 for BERT-base at batch 2k (``lr`` grows about with the square root of the batch
      size; 0.0060 at 64k). Always use a linear warm-up over the first steps and a decay
      schedule.
      CLAN (``normalize_grad=False`` on a compressed gradient) wants its own rate; see
      :func:`gradpress.optim.clan_core`.
    * ``betas``: keep ``(0.9, 0.999)``. ``b1`` also sets the blend between the momentum
      (weight ``b1``) and instant-gradient (``1-b1``) directions. Lower ``b2`` (0.98-0.99) if
      the loss spikes after warm-up; it makes the second moment follow the gradient faster.
    * ``eps``: 1e-6 (the paper's value). Larger values (1e-4) damp the update of parameters
      with tiny gradients; raise it if half-precision gradients underflow.
    * ``weight_decay``: 0.01 as for BERT; set it to 0 for biases and LayerNorm in a separate
      param group. It enters the trust-ratio denominator, so large values shrink every step.
    * ``normalize_grad``: True is LANS proper and makes the step invariant to the gradient's
      scale (useful with loss scaling or very large batches). Turn it off (CLAN) when the
      gradient comes through compression with error feedback: normalising a compressed
      gradient per layer would rescale the residual that the error feedback carries over.
    * ``min_trust``/``max_trust``: None (unbounded) unless some layer's weight norm is near 0
      at initialisation and its step gets too small (``min_trust``), or a layer with a tiny
      update direction explodes (``max_trust``, e.g. 10).

    Speed: a bucket whose parameters, gradients and moments are all contiguous float32 CPU
    tensors (the usual case) runs a fused numba kernel (:mod:`gradpress.optim.kernels`), two
    passes over each tensor instead of about twelve ``torch._foreach_*`` passes, with the same
    float32 arithmetic element by element; the norms are summed in another order (float64
    partial sums) and torch's CPU ``sqrt`` is not correctly rounded, so the two paths agree to
    float32 rounding, not bit for bit. Other tensors
    (CUDA, float64/half, non-contiguous) keep the foreach path. The fused kernel runs on one
    thread; the first step on a machine compiles it once (seconds; cached on disk).

    Args:
        params: iterable of parameters or of param-group dicts (torch semantics).
        lr: learning rate, >= 0.
        betas: ``(b1, b2)``, each in [0, 1).
        eps: term added to ``sqrt(vh)``, > 0.
        weight_decay: decoupled weight decay coefficient, >= 0.
        normalize_grad: divide each tensor's gradient by its L2 norm first (step 1).
        min_trust: optional lower bound of the trust ratios (step 6).
        max_trust: optional upper bound of the trust ratios (step 6).
        fused: None (default) picks the fused CPU kernel for every bucket of contiguous float32
            CPU tensors and the foreach path for the rest; True requires the fused kernel
            (ValueError for a parameter, gradient or moment it cannot take); False always uses
            the foreach path. It is not part of the param groups or of ``state_dict()``; the
            state is the same either way, so checkpoints move freely between the two paths.

    Raises:
        ValueError: a hyperparameter is out of range (the message names it); with
            ``fused=True``, a tensor the fused kernel cannot take (also from :meth:`step`).
        TypeError: a gradient is sparse (raised by :meth:`step`).

    State per parameter: ``step`` (int), ``exp_avg`` (m), ``exp_avg_sq`` (v);
    ``state_dict()``/``load_state_dict()`` are torch's.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, normalize_grad: bool = True,
                 min_trust: float | None = None, max_trust: float | None = None,
                 fused: bool | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        normalize_grad=normalize_grad, min_trust=min_trust, max_trust=max_trust)
        self._setup(params, defaults, fused)

    def _setup(self, params: Iterable[Any], defaults: dict[str, Any], fused: bool | None) -> None:
        """Check ``fused`` and ``defaults``, then build the param groups (subclasses add their
        own defaults before calling it)."""
        check_fused(fused)
        self.fused = fused
        self._check_group(defaults)
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if not isinstance(group["normalize_grad"], bool):
            raise ValueError(f"normalize_grad must be a bool, got {group['normalize_grad']!r}")
        check_trust(group["min_trust"], group["max_trust"])
        self._check_fused_params(group)

    @staticmethod
    def _normalized(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """New list ``g / ||g||`` per tensor, ``g`` itself where the norm is 0 (one
        multi-tensor division, no host copy of the norms:
        :func:`gradpress.optim._scalars.divided`)."""
        n = norms(grads)
        n = torch.where(n > 0, n, torch.ones_like(n)).to(grads[0].dtype)
        return divided(grads, n)

    def _variance_frozen_after(self, group: dict[str, Any]) -> int | None:
        """The step after which ``v`` stops changing: None, LANS proper (the convergence
        study's variant in ``benchmarks/`` freezes it)."""
        return None

    def _update(self, b: Bucket, group: dict[str, Any]) -> None:
        frozen = self._variance_frozen_after(group)
        if use_fused(b, self.fused, type(self).__name__):
            # Steps 1-7 per tensor in two passes (gradpress.optim.kernels).
            fused_layerwise_(b, group, blend=True, normalize=group["normalize_grad"],
                             frozen_after=frozen)
            return
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        # Step 1: per-layer gradient normalisation (a copy; p.grad stays as it was).
        g = self._normalized(b.grads) if group["normalize_grad"] else b.grads
        # Step 2: first and second moments.
        moments_(b, g, beta1, beta2, frozen_after=frozen)
        # Step 3: d = s*(sqrt(vh) + eps) with s = sqrt(1 - b2^t), per tensor's own t.
        d, s = adam_denominators(b, beta2, group["eps"], frozen_after=frozen)
        # Step 4: r = mh/(sqrt(vh)+eps) + wd*x = m * s/(1 - b1^t) / d + wd*x.
        r = direction(b.exp_avgs, d, [si / (1.0 - beta1 ** t) for si, t in zip(s, b.steps)],
                      b.params, wd)
        # Step 5: c = g/(sqrt(vh)+eps) + wd*x = g * s / d + wd*x.
        c = direction(g, d, s, b.params, wd)
        del d
        # Step 6: trust ratios ||x||/||r|| and ||x||/||c|| (1 where a norm is 0), before x moves.
        xn = norms(b.params)
        q_r = trust_ratios(xn, r, group["min_trust"], group["max_trust"])
        q_c = trust_ratios(xn, c, group["min_trust"], group["max_trust"])
        # Step 7: x -= lr*b1*q_r*r + lr*(1-b1)*q_c*c (the ratios stay on the device).
        dtype = b.params[0].dtype
        add_scaled_(b.params, r, scaled_by(q_r, -lr * beta1, dtype))
        add_scaled_(b.params, c, scaled_by(q_c, -lr * (1.0 - beta1), dtype))

"""LAMB: layer-wise adaptive moments for large-batch training.

Reference: Yang You, Jing Li, Sashank Reddi, Jonathan Hseu, Sanjiv Kumar, Srinadh Bhojanapalli,
Xiaodan Song, James Demmel, Kurt Keutzer, Cho-Jui Hsieh, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes", ICLR 2020 (arXiv:1904.00962 v3+, Algorithm 2, with
Adam's bias correction).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._common import (
    Bucket,
    BucketedOptimizer,
    adam_denominators,
    add_scaled_,
    check_fused,
    check_trust,
    direction,
    fused_layerwise_,
    moments_,
    norms,
    scaled_by,
    trust_ratios,
    use_fused,
)

__all__ = ["LAMB"]


class LAMB(BucketedOptimizer):
    r"""The LAMB optimizer (You et al. 2019/2020), one "layer" per parameter tensor.

    For every parameter tensor ``x`` with gradient ``g = p.grad`` at its step ``t``:

    1. Moments: ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``.
    2. Bias correction (when ``bias_correction``): ``mh = m/(1-b1^t)``; ``vh = v/(1-b2^t)``;
       otherwise ``mh = m``, ``vh = v``.
    3. Direction: ``u = mh/(sqrt(vh)+eps) + wd*x`` (decoupled weight decay).
    4. Trust ratio: ``q = ||x||/||u||``; 1 where a norm is 0; clamped to
       ``[min_trust, max_trust]`` when given.
    5. Update: ``x = x - lr*q*u``.

    LAMB is LANS (:class:`gradpress.optim.LANS`) without gradient normalisation and without
    the instant-gradient (Nesterov-style) term; it is the baseline large-batch optimizer that
    NVIDIA and DeepSpeed ship. Exclude biases and normalisation weights from decay with a param
    group ``{"params": ..., "weight_decay": 0.0}``.

    Tuning advice:

    * ``lr``: a relative step (each layer moves by about ``lr * ||x||``), so it does not carry
      over from Adam. BERT recipes use 0.00176 at batch 4k up to 0.006 at 32k (roughly the
      square root of the batch size); use a linear warm-up and a decay schedule.
    * ``betas``: ``(0.9, 0.999)``; lower ``b2`` to 0.98 if the loss spikes.
    * ``eps``: 1e-6 as in the paper's BERT runs; raise it (1e-4) for half-precision gradients.
    * ``weight_decay``: 0.01 for BERT-style models, 0 for biases and LayerNorm.
    * ``bias_correction``: keep True (paper v3); False reproduces the v1 paper and some older
      implementations, which take larger steps early in training.
    * ``min_trust``/``max_trust``: None unless a layer starts at norm 0 (raise ``min_trust``) or
      an update with a tiny direction norm explodes (cap with ``max_trust``, e.g. 10).

    Speed: as :class:`gradpress.optim.LANS`, buckets of contiguous float32 CPU tensors run a
    fused two-pass numba kernel (same float32 arithmetic per element, norms summed in another
    order); other tensors keep the foreach path.

    Args:
        params: iterable of parameters or of param-group dicts (torch semantics).
        lr: learning rate, >= 0.
        betas: ``(b1, b2)``, each in [0, 1).
        eps: term added to ``sqrt(vh)``, > 0.
        weight_decay: decoupled weight decay coefficient, >= 0.
        bias_correction: apply Adam's bias correction (step 2).
        min_trust: optional lower bound of the trust ratio.
        max_trust: optional upper bound of the trust ratio.
        fused: None (default) picks the fused CPU kernel where every tensor of a bucket is a
            contiguous float32 CPU tensor; True requires it (ValueError otherwise); False
            always uses the foreach path. Not part of ``state_dict()``.

    Raises:
        ValueError: a hyperparameter is out of range (the message names it); with
            ``fused=True``, a tensor the fused kernel cannot take (also from :meth:`step`).
        TypeError: a gradient is sparse (raised by :meth:`step`).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, bias_correction: bool = True,
                 min_trust: float | None = None, max_trust: float | None = None,
                 fused: bool | None = None) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, min_trust=min_trust,
                        max_trust=max_trust)
        check_fused(fused)
        self.fused = fused
        self._check_group(defaults)
        super().__init__(params, defaults)

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        if not isinstance(group["bias_correction"], bool):
            raise ValueError(f"bias_correction must be a bool, got {group['bias_correction']!r}")
        check_trust(group["min_trust"], group["max_trust"])
        self._check_fused_params(group)

    def _update(self, b: Bucket, group: dict[str, Any]) -> None:
        bc = group["bias_correction"]
        if use_fused(b, self.fused, type(self).__name__):
            # Steps 1-5 per tensor in two passes (gradpress.optim.kernels).
            fused_layerwise_(b, group, blend=False, bias_correction=bc)
            return
        beta1, beta2 = group["betas"]
        # Step 1: first and second moments, in place in the state.
        moments_(b, b.grads, beta1, beta2)
        # Step 2: d = s*(sqrt(vh) + eps) with s = sqrt(1 - b2^t) (1 without bias correction).
        d, s = adam_denominators(b, beta2, group["eps"], bc)
        # Step 3: u = mh/(sqrt(vh)+eps) + wd*x = m * s/(1 - b1^t) / d + wd*x.
        scale = [si / (1.0 - beta1 ** t) if bc else 1.0 for si, t in zip(s, b.steps)]
        u = direction(b.exp_avgs, d, scale, b.params, group["weight_decay"])
        del d
        # Step 4: trust ratio ||x||/||u|| (1 where a norm is 0).
        q = trust_ratios(norms(b.params), u, group["min_trust"], group["max_trust"])
        # Step 5: x -= lr*q*u.
        add_scaled_(b.params, u, scaled_by(q, -group["lr"], b.params[0].dtype))

"""1-bit Adam: full-precision Adam for ``dense_steps``, then frozen variance and communicated
momentum.

Reference: Hanlin Tang, Shaoduo Gan, Ammar Ahmad Awan, Samyam Rajbhandari, Conglong Li,
Xiangru Lian, Ji Liu, Ce Zhang, Yuxiong He, "1-bit Adam: Communication Efficient Large-Scale
Training with Adam's Convergence Speed", ICML 2021 (arXiv:2102.02888), Algorithm 1; the
DeepSpeed implementation ``deepspeed/runtime/fp16/onebit/adam.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ._common import Bucket, BucketedOptimizer, moments_

__all__ = ["OneBitAdam", "Communicate"]

#: ``communicate(key, momentum) -> averaged momentum`` (a tensor, or a handle whose
#: ``wait()`` returns one, so all pushes of a step can be in flight together).
Communicate = Callable[[str, torch.Tensor], Any]


def _split(b: Bucket, first: Callable[[int], bool]) -> tuple[Bucket, Bucket]:
    """Split a bucket into (tensors whose step ``t`` has ``first(t)``, the others), e.g.
    (dense-phase tensors, compression-stage tensors)."""
    return _split_where(b, [first(t) for t in b.steps])


def _split_where(b: Bucket, flags: list[bool]) -> tuple[Bucket, Bucket]:
    """Split a bucket into (the tensors whose flag is true, the others), in order."""
    warm, comp = Bucket(), Bucket()
    for i, t in enumerate(b.steps):
        dst = warm if flags[i] else comp
        dst.params.append(b.params[i])
        dst.grads.append(b.grads[i])
        dst.exp_avgs.append(b.exp_avgs[i])
        dst.exp_avg_sqs.append(b.exp_avg_sqs[i])
        dst.steps.append(t)
        dst.indices.append(b.indices[i])
    return warm, comp


def received(b: Bucket, pending: list[Any]) -> list[torch.Tensor]:
    """Wait for what ``communicate`` returned for each tensor of ``b`` (tensors or handles with
    ``wait()``); TypeError unless each is a tensor shaped like the parameter's momentum."""
    out = []
    for i, (m, res) in enumerate(zip(b.exp_avgs, pending)):
        avg = res.wait() if hasattr(res, "wait") else res
        if not isinstance(avg, torch.Tensor) or avg.shape != m.shape:
            got = tuple(avg.shape) if isinstance(avg, torch.Tensor) else type(avg).__name__
            raise TypeError(f"communicate for parameter {b.indices[i]} must return a tensor "
                            f"of shape {tuple(m.shape)}, got {got}")
        out.append(avg)
    return out


class OneBitAdam(BucketedOptimizer):
    r"""1-bit Adam (Tang et al. 2021, as in DeepSpeed), single-process core.

    Per parameter tensor ``x`` at its step ``t`` with ``g = p.grad``:

    1. Dense phase, ``t <= dense_steps``: plain Adam on ``g``, which the caller has averaged over
       workers *uncompressed*: ``m = b1*m + (1-b1)*g``; ``v = b2*v + (1-b2)*g*g``.
    2. Compression stage, ``t > dense_steps``: ``v`` is frozen (with its bias correction
       ``1-b2^dense_steps``); ``g`` is the worker's *local* gradient; the local momentum
       ``m = b1*m + (1-b1)*g`` is replaced by ``communicate(key, m)``, the average of all
       workers' momenta (the distributed layer compresses it with worker and server error
       feedback; ``None`` means identity, i.e. one process).
    3. Update (both stages, decoupled weight decay):
       ``x = x - lr*(mh/(sqrt(vh)+eps) + wd*x)`` with ``mh = m/(1-b1^t)`` and
       ``vh = v/(1-b2^min(t, dense_steps))``; without ``bias_correction``, ``mh = m``,
       ``vh = v`` (exactly DeepSpeed's ``OnebitAdam``).

    Weight decay is *decoupled* (AdamW style): with ``weight_decay=0`` the dense phase equals
    ``torch.optim.Adam``, otherwise ``torch.optim.AdamW`` with the same hyperparameters. Bias
    correction is on by default so that the dense phase is exactly torch's Adam; it is then frozen
    with ``v``, so the step size does not jump when compression starts (DeepSpeed uses no bias
    correction in either stage; pass ``bias_correction=False`` to reproduce it).

    Recipe (how the distributed layer drives it): before each ``step()``, read
    :attr:`compression_active`. While False, average the gradients over workers uncompressed
    (``compression="none"``) into ``p.grad``. Once True, stop averaging gradients, leave the
    local gradient in ``p.grad`` and set :attr:`communicate` to a function doing a compressed
    push_pull (e.g. ``onebit`` with worker and server error feedback) of the momentum.
    ``key`` is the parameter's position in the flat order of ``param_groups`` as a string
    (the ids of ``state_dict()``), identical on every worker.

    Tuning advice:

    * ``dense_steps`` (the full-precision phase DeepSpeed calls ``freeze_step``): long enough
      for ``v`` to settle: DeepSpeed uses
      23k of 152k total steps for BERT pretraining and a few hundred to a few thousand
      steps for fine-tuning. Too short and the frozen variance is stale: the loss rises after
      the switch. Must be >= 1.
    * ``lr``: Adam's; keep the schedule of the uncompressed run. The compression stage usually
      needs no change of rate.
    * ``betas``: ``(0.9, 0.999)``; a high ``b1`` averages out the compression error of the
      momentum, so do not lower it much below 0.9.
    * ``eps``: 1e-8 (Adam's). The frozen ``v`` can be tiny for rarely updated parameters;
      raise ``eps`` (1e-6) if steps blow up after ``dense_steps``.
    * ``weight_decay``: decoupled, 0.01 for transformers, 0 for biases and LayerNorm (param
      groups).

    Args:
        params: iterable of parameters or of param-group dicts (torch semantics).
        lr: learning rate, >= 0.
        betas: ``(b1, b2)``, each in [0, 1).
        eps: term added to ``sqrt(vh)``, > 0.
        weight_decay: decoupled weight decay coefficient, >= 0.
        dense_steps: number of uncompressed opening steps, an int >= 1.
        communicate: ``communicate(key: str, m: Tensor)`` returning the averaged momentum (a
            tensor or a handle with ``wait()``); None means identity.
        bias_correction: apply (and freeze) Adam's bias correction.

    Raises:
        ValueError: a hyperparameter is out of range (the message names it).
        TypeError: ``communicate`` is not callable, or a gradient is sparse.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, dense_steps: int = 100,
                 communicate: Communicate | None = None, bias_correction: bool = True) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        dense_steps=dense_steps, bias_correction=bias_correction)
        self._check_group(defaults)
        super().__init__(params, defaults)
        self.communicate = communicate

    @property
    def communicate(self) -> Communicate | None:
        """The momentum-averaging function of the compression stage (None: identity)."""
        return self._communicate

    @communicate.setter
    def communicate(self, fn: Communicate | None) -> None:
        if fn is not None and not callable(fn):
            raise TypeError(f"communicate must be callable or None, got {type(fn).__name__}")
        self._communicate = fn

    @property
    def compression_active(self) -> bool:
        """True when the next ``step()`` runs the compression stage for some parameter.

        That is, some parameter has completed ``dense_steps`` steps: from now on the caller
        must hand local (not averaged) gradients and let the optimizer communicate momentum.
        """
        for group in self.param_groups:
            for p in group["params"]:
                if self._compresses(int(self.state.get(p, {}).get("step", 0)) + 1, group):
                    return True
        return False

    def _compresses(self, t: int, group: dict[str, Any]) -> bool:
        """Whether a tensor's step ``t`` runs the compression stage: past the dense phase."""
        return t > group["dense_steps"]

    def _check_group(self, group: dict[str, Any]) -> None:
        super()._check_group(group)
        fs = group["dense_steps"]
        if isinstance(fs, bool) or not isinstance(fs, int) or fs < 1:
            raise ValueError(f"dense_steps must be an int >= 1, got {fs!r}")
        if not isinstance(group["bias_correction"], bool):
            raise ValueError(f"bias_correction must be a bool, got {group['bias_correction']!r}")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model, returns the loss."""
        loss = self._closure_loss(closure)
        stages: list[tuple[Bucket, dict[str, Any], Any]] = []
        for b, group in self._bucketed():
            fs = group["dense_steps"]
            warm, comp = _split(b, lambda t, fs=fs: t <= fs)  # type: ignore[misc]
            beta1, beta2 = group["betas"]
            if warm.params:
                # Step 1: Adam moments on the (uncompressed-averaged) gradient.
                moments_(warm, warm.grads, beta1, beta2)
                stages.append((warm, group, None))
            if comp.params:
                # Step 2: local momentum, v frozen; launch every communication before waiting.
                moments_(comp, comp.grads, beta1, beta2, update_variance=False)
                stages.append((comp, group, self._launch(comp, comp.exp_avgs)))
        for b, group, pending in stages:
            if pending is not None:
                self._collect(b, pending)
            self._apply(b, group)
        return loss

    def _launch(self, b: Bucket, tensors: list[torch.Tensor]) -> list[Any]:
        """Hand each of the bucket's ``tensors`` (keyed by parameter index) to
        ``communicate``; returns tensors (no ``communicate``: as they are) or handles."""
        if self._communicate is None:
            return list(tensors)
        return [self._communicate(str(i), t) for i, t in zip(b.indices, tensors)]

    @staticmethod
    def _collect(b: Bucket, pending: list[Any]) -> None:
        """Wait for the averaged momenta and store them as the new ``m``."""
        for m, avg in zip(b.exp_avgs, received(b, pending)):
            if avg is not m:
                m.copy_(avg)

    @staticmethod
    def _apply(b: Bucket, group: dict[str, Any]) -> None:
        """Step 3: x = x*(1 - lr*wd) - lr*mh/(sqrt(vh)+eps), as torch's Adam/AdamW compute it."""
        beta1, beta2 = group["betas"]
        lr, fs = group["lr"], group["dense_steps"]
        if group["weight_decay"] != 0:
            torch._foreach_mul_(b.params, 1.0 - lr * group["weight_decay"])
        d = torch._foreach_sqrt(b.exp_avg_sqs)
        if group["bias_correction"]:
            torch._foreach_div_(d, [(1.0 - beta2 ** min(t, fs)) ** 0.5 for t in b.steps])
        torch._foreach_add_(d, group["eps"])
        if group["bias_correction"]:
            scale = [-lr / (1.0 - beta1 ** t) for t in b.steps]
        else:
            scale = [-lr] * len(b.steps)
        torch._foreach_addcdiv_(b.params, b.exp_avgs, d, scale)

"""Shared machinery of the gradpress optimizers: validation, batching, moments, trust ratios.

All optimizers here keep, per parameter tensor, ``step`` (a Python int), ``exp_avg`` (m) and
``exp_avg_sq`` (v) in ``self.state[p]``, so checkpoints written by one are readable by tools
that know torch's Adam layout. Work is batched with ``torch._foreach_*`` ops over the
tensors of one (device, dtype) bucket. Per-tensor scalars known on the host (bias
corrections) travel as lists of floats; those computed on the device (trust ratios, gradient
norms) as one stacked 1-D tensor per list, applied by one multi-tensor op (:func:`add_scaled_`,
:func:`divided`) without leaving the device. CUDA's foreach kernels take the fast multi-tensor
route only when the tensors of all lists are dense and match in size and stride
(``can_use_fast_route`` in torch/include/ATen/native/ForeachUtils.h), so a list of 0-d tensors
runs one kernel per tensor, and take per-tensor scalars only from the host (``Scalar[]``, or a
``Tensor scalars`` that ``convert_tensor_to_scalar_list`` there requires on the CPU): copying
them there is a synchronisation per bucket on a GPU. So CPU buckets pass the scalars as host
values, and other devices spread them, with no host copy, over a buffer shaped like the
bucket's tensors for the tensor-list overloads (:mod:`gradpress.optim._scalars`). The device
path is reasoned from PyTorch's sources and run on the CPU and the meta device by the tests,
not yet measured on a GPU. Buckets of contiguous
float32 CPU tensors can instead take the fused numba kernels of :mod:`gradpress.optim.kernels`
(:func:`use_fused`, :func:`fused_layerwise_`): two passes per tensor instead of about twelve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import kernels
from ._scalars import add_scaled_, divided, scaled_by

__all__ = [
    "Bucket",
    "adam_denominators",
    "add_scaled_",
    "divided",
    "direction",
    "BucketedOptimizer",
    "check_fused",
    "fused_layerwise_",
    "unfusable",
    "use_fused",
    "buckets",
    "check_betas",
    "check_common",
    "check_trust",
    "moments_",
    "variance_step",
    "norms",
    "scaled_by",
    "trust_ratios",
]


def _is_real_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_common(lr: float, betas: Any, eps: float, weight_decay: float) -> None:
    """Raise ValueError naming the first invalid one of lr, betas, eps, weight_decay."""
    if not _is_real_number(lr) or lr < 0:
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    check_betas(betas)
    if not _is_real_number(eps) or eps <= 0:
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    if not _is_real_number(weight_decay) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")


def check_betas(betas: Any) -> None:
    """Raise ValueError unless ``betas`` is a pair of numbers each in [0, 1)."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if not _is_real_number(b) or not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}] must be a number in [0, 1), got {b!r}")


def check_trust(min_trust: float | None, max_trust: float | None) -> None:
    """Raise ValueError unless the optional trust-ratio bounds are >= 0 and ordered."""
    for name, val in (("min_trust", min_trust), ("max_trust", max_trust)):
        if val is not None and (not _is_real_number(val) or val < 0):
            raise ValueError(f"{name} must be None or a finite number >= 0, got {val!r}")
    if min_trust is not None and max_trust is not None and min_trust > max_trust:
        raise ValueError(f"min_trust ({min_trust!r}) must not exceed max_trust ({max_trust!r})")


@dataclass
class Bucket:
    """The tensors of one param group that share a (device, dtype), as parallel lists."""

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)
    numel: int = 0


#: A bucket is closed once it holds this many elements, which bounds the temporaries a step
#: allocates (LANS needs up to four bucket-sized ones) without giving up batching.
MAX_BUCKET_NUMEL = 1 << 25


def buckets(group: dict[str, Any], state: Any, owner: str,
            first_index: int = 0) -> list[Bucket]:
    """Advance the step count of every parameter of ``group`` that has a gradient and bucket them.

    Creates the zero moments on first use. ``indices`` are positions in the optimizer's flat
    parameter order (``first_index`` is where this group starts), as in ``state_dict()``.
    Buckets keep the parameter order and close at :data:`MAX_BUCKET_NUMEL` elements.
    Raises TypeError for sparse gradients (``owner`` names the optimizer in the message).
    """
    out: list[Bucket] = []
    current: dict[tuple[torch.device, torch.dtype], Bucket] = {}
    for i, p in enumerate(group["params"]):
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise TypeError(f"{owner} does not support sparse gradients "
                            f"(parameter {first_index + i})")
        st = state[p]
        if not st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["step"] = int(st["step"]) + 1
        b = current.get((p.device, p.dtype))
        if b is None or b.numel >= MAX_BUCKET_NUMEL:
            b = current[(p.device, p.dtype)] = Bucket()
            out.append(b)
        b.numel += p.numel()
        b.params.append(p)
        b.grads.append(p.grad)
        b.exp_avgs.append(st["exp_avg"])
        b.exp_avg_sqs.append(st["exp_avg_sq"])
        b.steps.append(st["step"])
        b.indices.append(first_index + i)
    return out


def moments_(b: Bucket, grads: list[torch.Tensor], beta1: float, beta2: float,
             update_variance: bool = True, frozen_after: int | None = None) -> None:
    """In place: m = b1*m + (1-b1)*g and (unless frozen) v = b2*v + (1-b2)*g*g.

    With ``frozen_after``, ``v`` of a tensor whose step is past it stays as it was.
    """
    torch._foreach_lerp_(b.exp_avgs, grads, 1.0 - beta1)
    if not update_variance:
        return
    live = [i for i, t in enumerate(b.steps) if frozen_after is None or t <= frozen_after]
    vs, gs = [b.exp_avg_sqs[i] for i in live], [grads[i] for i in live]
    if vs:
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)


def variance_step(t: int, frozen_after: int | None) -> int:
    """The step that ``v``'s bias correction uses: ``t``, or ``frozen_after`` once ``v`` froze."""
    return t if frozen_after is None else min(t, frozen_after)


def norms(ts: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each tensor as one 1-D tensor, in float32 at least (no half overflow)."""
    dtype = torch.promote_types(ts[0].dtype, torch.float32)
    return torch.stack(torch._foreach_norm(ts, dtype=dtype))


def trust_ratios(xn: torch.Tensor, us: list[torch.Tensor], min_trust: float | None = None,
                 max_trust: float | None = None) -> torch.Tensor:
    """Per-tensor ratio ``xn / ||u||`` as one 1-D tensor; 1 where either norm is 0.

    ``xn`` holds the weight norms (:func:`norms` of the parameters, taken once per step). The
    ratio is clamped to [min_trust, max_trust] where given; the "1 where a norm is 0" rule wins.
    """
    un = norms(us)
    ratio = xn / torch.where(un > 0, un, torch.ones_like(un))
    if min_trust is not None or max_trust is not None:
        ratio = ratio.clamp(min=min_trust, max=max_trust)
    return torch.where((xn > 0) & (un > 0), ratio, torch.ones_like(ratio))


class BucketedOptimizer(torch.optim.Optimizer):
    """Base class: closure handling, per-group validation, and a loop over buckets.

    Subclasses implement ``_check_group(group)`` (raise ValueError on a bad hyperparameter) and
    ``_update(bucket, group)`` (one step for the tensors of a bucket, gradients in ``p.grad``).
    Those with fused kernels keep their ``fused`` flag (None, True, False) in ``self.fused``,
    outside the param groups, so ``state_dict()`` does not change; it survives pickling.
    """

    fused: bool | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["fused"] = self.fused
        return state

    def _check_fused_params(self, group: dict[str, Any]) -> None:
        """With ``fused=True``, raise ValueError for a parameter the fused kernels cannot take."""
        if self.fused is not True or "params" not in group:
            return
        first = sum(len(g["params"]) for g in getattr(self, "param_groups", [])
                    if g is not group)
        for i, p in enumerate(group["params"]):
            why = unfusable(p)
            if why is not None:
                raise ValueError(f"{type(self).__name__}(fused=True) needs contiguous float32 "
                                 f"CPU tensors, but parameter {first + i} is {why}; "
                                 "use fused=None (automatic) or fused=False")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch semantics) and validate its hyperparameters after defaults fill in."""
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict[str, Any]) -> None:
        check_common(group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _update(self, bucket: Bucket, group: dict[str, Any]) -> None:
        raise NotImplementedError

    def _bucketed(self) -> list[tuple[Bucket, dict[str, Any]]]:
        """All (bucket, group) pairs of this step, advancing each used parameter's step count."""
        work, start = [], 0
        for group in self.param_groups:
            for b in buckets(group, self.state, type(self).__name__, start):
                work.append((b, group))
            start += len(group["params"])
        return work

    @staticmethod
    def _closure_loss(closure: Any) -> Any:
        """Run ``closure`` (if any) with gradients enabled; its loss, or None."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Perform one optimization step; ``closure`` re-evaluates the model, returns the loss."""
        loss = self._closure_loss(closure)
        for b, group in self._bucketed():
            self._update(b, group)
        return loss


def adam_denominators(b: Bucket, beta2: float, eps: float, bias_correction: bool = True,
                      frozen_after: int | None = None) -> tuple[list[torch.Tensor], list[float]]:
    """``d = sqrt(v) + eps*s`` with ``s = sqrt(1-b2^t)`` (1 without bias correction), and ``s``.

    Since ``d = s * (sqrt(v/(1-b2^t)) + eps)``, a direction ``a/(sqrt(vh)+eps)`` is
    ``a*s/d``: one pass fewer than dividing ``v`` by its bias correction first. With
    ``frozen_after``, ``t`` stops at it (see :func:`variance_step`).
    """
    s = [math.sqrt(1.0 - beta2 ** variance_step(t, frozen_after)) if bias_correction else 1.0
         for t in b.steps]
    d = torch._foreach_sqrt(b.exp_avg_sqs)
    torch._foreach_add_(d, [eps * si for si in s])
    return d, s  # type: ignore[return-value]  # foreach ops return lists


def direction(num: list[torch.Tensor], d: list[torch.Tensor] | None, scale: list[float],
              params: list[torch.Tensor], wd: float) -> list[torch.Tensor]:
    """New list ``scale * num / d + wd * x`` per tensor (two passes over the data); with ``d``
    None, ``num`` is divided already: ``scale * num + wd * x``."""
    if d is None:
        out = torch._foreach_mul(num, scale)
        if wd != 0:
            torch._foreach_add_(out, torch._foreach_mul(params, wd))
        return out  # type: ignore[return-value]  # foreach ops return lists
    if wd != 0:
        out = torch._foreach_mul(params, wd)
        torch._foreach_addcdiv_(out, num, d, scale)
    else:
        out = torch._foreach_div(num, d)
        torch._foreach_mul_(out, scale)
    return out  # type: ignore[return-value]  # foreach ops return lists


# -- fused CPU kernels ---------------------------------------------------------------------------

def check_fused(fused: Any) -> None:
    """Raise ValueError unless ``fused`` is None (auto), True or False."""
    if fused is not None and not isinstance(fused, bool):
        raise ValueError(f"fused must be None (auto), True or False, got {fused!r}")


def unfusable(t: torch.Tensor) -> str | None:
    """Why the fused kernels cannot take ``t``, or None when it is a contiguous float32 CPU
    tensor."""
    if t.device.type != "cpu":
        return f"on device {t.device}"
    if t.dtype != torch.float32:
        return f"of dtype {t.dtype}"
    if t.layout != torch.strided or not t.is_contiguous():
        return "not contiguous"
    return None


def use_fused(b: Bucket, fused: bool | None, owner: str) -> bool:
    """Whether bucket ``b`` takes the fused kernels: never for ``fused=False``; for None when
    every parameter, gradient and moment of it is a contiguous float32 CPU tensor; always for
    True, which raises ValueError naming the first tensor that is not."""
    if fused is False:
        return False
    for k, index in enumerate(b.indices):
        named = (("parameter", b.params[k]), ("gradient", b.grads[k]),
                 ("exp_avg", b.exp_avgs[k]), ("exp_avg_sq", b.exp_avg_sqs[k]))
        for what, t in named:
            why = unfusable(t)
            if why is None:
                continue
            if fused:
                raise ValueError(f"{owner}(fused=True) needs contiguous float32 CPU tensors, "
                                 f"but the {what} of parameter {index} is {why}; "
                                 "use fused=None (automatic) or fused=False")
            return False
    return True


def _flat(t: torch.Tensor) -> Any:
    return t.detach().view(-1).numpy()


def fused_layerwise_(b: Bucket, group: dict[str, Any], blend: bool, normalize: bool = False,
                     bias_correction: bool = True, frozen_after: int | None = None) -> None:
    """One LANS (``blend``) or LAMB step of every tensor of ``b`` with the fused kernel.

    Same arithmetic as the foreach path (see :mod:`gradpress.optim.kernels`); the scalars
    ``s = sqrt(1-b2^t)`` and ``s/(1-b1^t)`` are computed in double as
    :func:`adam_denominators` and the directions do. A tensor past ``frozen_after`` keeps its
    ``v``: the kernel's ``b2`` becomes 1 and ``1-b2`` 0, so ``v = fma(0*g, g, v*1) = v``.
    """
    beta1, beta2 = group["betas"]
    by_step: dict[int, Any] = {}      # the scalars depend on the tensor only through its step
    for p, g, m, v, t in zip(b.params, b.grads, b.exp_avgs, b.exp_avg_sqs, b.steps):
        h = by_step.get(t)
        if h is None:
            tv = variance_step(t, frozen_after)
            s = math.sqrt(1.0 - beta2 ** tv) if bias_correction else 1.0
            kr = s / (1.0 - beta1 ** t) if bias_correction else 1.0
            h = by_step[t] = kernels.coeffs(beta1, beta2, group["eps"], group["weight_decay"],
                                            group["lr"], s, kr, group["min_trust"],
                                            group["max_trust"], blend, frozen=t != tv)
        kernels.layerwise_step(_flat(p), _flat(g), _flat(m), _flat(v), h, normalize, blend)

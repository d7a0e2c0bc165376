"""Per-tensor scalars of a bucket computed on its device (trust ratios, gradient norms), applied
by one multi-tensor op each without a host copy: the host path for CPU tensors, the device path
(:func:`_per_element`) for the others. See :mod:`gradpress.optim._common` for why."""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["add_scaled_", "divided", "scaled_by"]


def scaled_by(ratio: torch.Tensor, factor: float, dtype: torch.dtype) -> torch.Tensor:
    """``factor * ratio`` in ``dtype``: one 1-D tensor, an entry per tensor of a bucket."""
    return (ratio * factor).to(dtype)


#: Internal switch for tests: when True, CPU tensors also take the device path of
#: :func:`add_scaled_` and :func:`divided` (per-element scalars, no host copy), so that the CPU
#: suite covers it. Not public API.
_DEVICE_PATH_ON_CPU = False

#: The per-tensor element counts of recent buckets as device tensors (the ``repeats`` of
#: :func:`_per_element`), keyed by (device, stream id, counts); at most :data:`_SIZES_MAX`.
_SIZES: dict[tuple[Any, ...], torch.Tensor] = {}
_SIZES_MAX = 64
_SIZES_LOCK = threading.Lock()


def _on_host(t: torch.Tensor) -> bool:
    """Whether per-tensor scalars on ``t``'s device take the host path (CPU tensors)."""
    return t.device.type == "cpu" and not _DEVICE_PATH_ON_CPU


def _sizes_on(device: torch.device, numels: tuple[int, ...]) -> torch.Tensor:
    """``numels`` as a 1-D integer tensor on ``device``, cached per device, stream and counts.

    Made once per bucket layout with a ``non_blocking`` copy, from pinned memory on CUDA: the
    copy kernel then issues ``cudaMemcpyAsync`` without the ``cudaStreamSynchronize`` of a
    blocking copy (``c10::cuda::memcpy_and_sync`` in torch/include/c10/cuda/CUDAFunctions.h, the
    call that sync debug mode reports) and records an event so that the caching host allocator
    does not reuse the pinned block before the copy ran (torch/include/ATen/cuda/
    CachingHostAllocator.h). Keyed by the current stream too, so a tensor is used only on the
    stream that allocated it and dropping it from the cache is safe in the caching allocator's
    stream order (other accelerators: keyed by device only). int32 where the total allows
    (``repeat_interleave``'s index then takes 4 bytes an element).
    """
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None
    key = (device, stream, numels)
    with _SIZES_LOCK:
        sizes = _SIZES.get(key)
        if sizes is None:
            if len(_SIZES) >= _SIZES_MAX:
                del _SIZES[next(iter(_SIZES))]      # the oldest entry
            dtype = torch.int32 if sum(numels) < 2 ** 31 else torch.int64
            host = torch.tensor(numels, dtype=dtype, pin_memory=device.type == "cuda")
            sizes = _SIZES[key] = host.to(device, non_blocking=True)
        return sizes


def _shaped_like(seg: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The 1-D segment ``seg`` (``t.numel()`` equal values) viewed with ``t``'s shape and, where
    ``t`` is dense in another order (e.g. transposed), its strides: CUDA's multi-tensor route
    needs matching strides in all lists. Every element holds the same value, so any in-bounds
    layout is correct."""
    if t.is_contiguous() or t.numel() == 0:
        return seg.view(t.shape)
    strides = t.stride()
    if min(strides) >= 0 and sum((n - 1) * s for n, s in zip(t.shape, strides)) < t.numel():
        return seg.as_strided(t.shape, strides)
    return seg.view(t.shape)


def _per_element(scalars: torch.Tensor, ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors shaped like ``ts``, the ``i``-th filled with ``scalars[i]``: views of one flat
    buffer made on ``scalars``' device by ``repeat_interleave`` with ``output_size`` given, which
    "will avoid stream synchronization needed to calculate output shape" (its docstring in
    torch/_torch_docs.py; ``meta_repeat_interleave_Tensor`` in torch/_meta_registrations.py
    refuses to run without it, having no values to sum). Costs one buffer of the bucket's
    element count in ``scalars``' dtype, plus, while it is filled, an int32 index of the same
    length."""
    numels = tuple(t.numel() for t in ts)
    sizes = _sizes_on(scalars.device, numels)
    flat = torch.repeat_interleave(scalars, sizes, output_size=sum(numels))
    return [_shaped_like(seg, t) for seg, t in zip(flat.split(numels), ts)]


def _ones_like_each(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """A tensor of ones like each of ``ts`` (same size and strides, so CUDA's multi-tensor
    route stays open), as views of one buffer the size of the largest; ``ones_like`` for a
    tensor that is not contiguous."""
    ones = torch.ones(max(t.numel() for t in ts), dtype=ts[0].dtype, device=ts[0].device)
    return [ones[:t.numel()].view(t.shape) if t.is_contiguous() else torch.ones_like(t)
            for t in ts]


def add_scaled_(xs: list[torch.Tensor], us: list[torch.Tensor], scalars: torch.Tensor) -> None:
    """In place ``x_i += s_i * u_i`` for every tensor, ``scalars`` the 1-D tensor of the ``s_i``
    on the tensors' device (:func:`scaled_by`), with one multi-tensor op and no host copy.

    CPU tensors (the host path): ``_foreach_addcmul_(x, ones, u, scalars)``, which computes
    ``x + (s*1)*u``, the same rounding as ``x + (1*u)*s`` with ``s`` a 0-d tensor. Other
    devices (the device path; CPU too with :data:`_DEVICE_PATH_ON_CPU`): the ``s_i`` are
    spread over a buffer shaped like ``us`` (:func:`_per_element`: one extra buffer of the
    bucket's elements in its dtype during the step) and ``_foreach_addcmul_(x, u, s)`` computes
    ``x + (1*u)*s``: the same products and sums, so the two paths agree bit for bit on the CPU.
    The ``Tensor scalars`` overload would need the scalars on the host, a synchronisation per
    call on a GPU."""
    if not xs:
        return
    if _on_host(scalars):
        torch._foreach_addcmul_(xs, _ones_like_each(us), us, scalars.contiguous())
    else:
        torch._foreach_addcmul_(xs, us, _per_element(scalars, us))


def divided(ts: list[torch.Tensor], scalars: torch.Tensor) -> list[torch.Tensor]:
    """New list ``t_i / s_i``, ``scalars`` the 1-D tensor of the ``s_i`` on the tensors' device,
    with one multi-tensor ``_foreach_div``: by a Python list of the values on the CPU (the op
    has no ``Tensor scalars`` overload), by tensors shaped like ``ts`` (:func:`_per_element`)
    elsewhere, which divide the same values (bit for bit on the CPU)."""
    if not ts:
        return []
    if _on_host(scalars):
        return list(torch._foreach_div(ts, scalars.tolist()))
    return list(torch._foreach_div(ts, _per_element(scalars, ts)))

"""What ``push_pull`` accepts and where its chunks are staged: the call's codec spec, the input
and ``out=`` tensors, and the host buffers and CUDA streams of GPU tensors (see
:mod:`gradpress.ps.worker`, "Where compression runs")."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from ..compress.spec import CodecSpec, parse_spec
from .config import PSConfig

__all__ = ["resolve_codec", "check_out", "flat_fp32", "host_buffer", "on_stream"]

_NO_EF = (None, "", "none")


def resolve_codec(compression: str | Mapping[str, Any] | CodecSpec | None, ef: str | None,
                  cfg: PSConfig) -> tuple[CodecSpec, dict[str, Any]]:
    """Split a spec into the codec spec and wrapper options; call arguments beat config defaults.

    Returns ``(codec spec without wrappers, {"ef": ..., "momentum": ..., "mu": ...})``.
    """
    cs = parse_spec(cfg.compression if compression is None else compression)
    wrappers = dict(cs.wrappers)
    spec_ef = wrappers.pop("ef", None)
    if ef is not None and spec_ef is not None and str(ef).lower() != str(spec_ef).lower():
        raise ValueError(f"ef given twice with different values: {ef!r} (argument) and "
                         f"{spec_ef!r} (compression spec {compression!r})")
    chosen = ef if ef is not None else spec_ef if spec_ef is not None else cfg.ef
    chosen = None if chosen is None else str(chosen).strip().lower()
    wrappers["ef"] = None if chosen in _NO_EF else chosen
    if str(wrappers.get("momentum", "")).lower() in _NO_EF:
        wrappers.pop("momentum", None)
    return CodecSpec(cs.name, dict(cs.params)), wrappers


def check_out(out: torch.Tensor, flat: torch.Tensor, name: str) -> torch.Tensor:
    """Validate ``out=`` of a push_pull whose input is ``flat``; returns its flat view.

    ``out`` must be a contiguous float32 tensor on ``flat``'s device with the input's number of
    elements; it may be the input itself (in place) but must not overlap it otherwise.
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"push_pull({name!r}): out must be a torch.Tensor, got "
                        f"{type(out).__name__}")
    if out.dtype != torch.float32 or out.device != flat.device or not out.is_contiguous():
        raise TypeError(f"push_pull({name!r}): out must be a contiguous float32 tensor on "
                        f"{flat.device} (the tensor's device), got {out.dtype} on {out.device}"
                        f"{'' if out.is_contiguous() else ' (not contiguous)'}")
    if out.numel() != flat.numel():
        raise ValueError(f"push_pull({name!r}): out has {out.numel()} elements, the tensor has "
                         f"{flat.numel()}")
    o = out.reshape(-1)
    if o.numel() and o.data_ptr() != flat.data_ptr():
        lo, hi = flat.data_ptr(), flat.data_ptr() + 4 * flat.numel()
        if o.data_ptr() < hi and lo < o.data_ptr() + 4 * o.numel():
            raise ValueError(f"push_pull({name!r}): out overlaps the input tensor without being "
                             f"the same memory; pass the tensor itself (in place) or a separate "
                             f"buffer")
    return o


def flat_fp32(tensor: torch.Tensor, name: str, *, keep_device: bool = False) -> torch.Tensor:
    """``tensor`` as a flat, contiguous float32 tensor on the CPU (``keep_device``: on its own
    device); no copy when it already is one."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"push_pull({name!r}): expected a torch.Tensor, got "
                        f"{type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"push_pull({name!r}): expected a floating-point tensor, got "
                        f"{tensor.dtype}")
    device = tensor.device if keep_device else torch.device("cpu")
    return tensor.detach().reshape(-1).to(device=device, dtype=torch.float32).contiguous()


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An uninitialised float32 CPU buffer of ``like``'s size; pinned when ``like`` is on CUDA
    (torch's caching host allocator reuses pinned blocks, so this is cheap per chunk)."""
    return torch.empty(like.numel(), dtype=torch.float32, pin_memory=like.is_cuda)


def on_stream(stream: Any) -> contextlib.AbstractContextManager:
    """Run a chunk's device work on the CUDA stream recorded at submit (no-op without one)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

"""What ``push_pull`` accepts and where its chunks are staged: the call's codec spec, the input
and ``out=`` tensors, and the host buffers and CUDA streams of GPU tensors (see
:mod:`gradpress.ps.worker`, "Where compression runs")."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from ..compress.registry import pick_ef
from ..compress.spec import CodecSpec, EFSpec, parse_ef, parse_spec
from .config import PSConfig

__all__ = ["resolve_codec", "check_out", "flat_fp32", "host_buffer", "on_stream"]


def resolve_codec(compression: str | Mapping[str, Any] | CodecSpec | None,
                  ef: str | EFSpec | None, cfg: PSConfig) -> tuple[CodecSpec, dict[str, Any]]:
    """Split a spec into the codec spec and wrapper options; call arguments beat config defaults.

    Returns ``(codec spec without wrappers, {"ef": ..., "momentum": ..., "mu": ...})``, with
    ``"ef"`` the canonical text of the error feedback (``str(EFSpec)``; None for none): what
    the key descriptors and checkpoints carry.
    """
    spec = parse_spec(cfg.compression if compression is None else compression)
    wrappers = dict(spec.wrappers)
    chosen = pick_ef(ef, wrappers.pop("ef", None), compression) or parse_ef(cfg.ef)
    wrappers["ef"] = str(chosen) if chosen.enabled else None
    if str(wrappers.get("momentum", "")).strip().lower() in ("", "none"):
        wrappers.pop("momentum", None)
    return CodecSpec(spec.name, dict(spec.params)), wrappers


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

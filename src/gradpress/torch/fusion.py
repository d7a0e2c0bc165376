"""Which of an optimizer's tensors share fused keys (:mod:`gradpress.ps.fusion`), the same at
run time and in ``opt.plan()``.

1. A tensor is fused when it is smaller than ``min_compress_bytes`` (so it travels exact, fp32;
   with a block-scaled codec such as ``int4`` the fused key itself travels compressed, see
   :func:`fused_codec`) and the pushes carry no worker-side momentum (dist-EF-SGDM keeps a
   momentum buffer per key, which fusion would move to the fused key); larger tensors, also
   those kept exact by name, keep their own keys.
2. The order is the optimizer's parameter order reversed: the order in which backward produces
   gradients, as DDP's buckets, so the first bucket fills first and the last one, pushed at
   the end of backward, holds the first layers' tensors. The 1-bit optimizers' momenta use the
   same order, so their dense phase (gradients) and compressed phase (momenta) fuse alike.
3. The cap is ``PSConfig.fusion_cap``: ``GRADPRESS_FUSION_BYTES``, by default
   ``partition_bytes`` (a fused key is one chunk); 0 turns fusion off.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ..compress.spec import CodecSpec
from ..ps.calls import Handle
from ..ps.fusion import FusedKey, Fuser, fused_keys

if TYPE_CHECKING:
    from ..ps.config import PSConfig

__all__ = ["has_worker_momentum", "tensor_fusion", "make_fuser", "gradient_fuser",
           "momentum_fuser", "fused_key_bytes", "DENSE_SUFFIX"]

#: The suffix of the keys of ``DistributedOptimizer``'s dense phase (fused keys too).
DENSE_SUFFIX = "@dense"


def has_worker_momentum(spec: CodecSpec | None) -> bool:
    """Whether ``spec`` applies momentum on the workers before compression (dist-EF-SGDM)."""
    if spec is None:
        return False
    return str(spec.wrappers.get("momentum", "") or "").strip().lower() not in ("", "none")


def tensor_fusion(entries: Sequence[tuple[str, torch.Tensor]], *,
                  min_compress_bytes: int | None, spec: CodecSpec | None,
                  cfg: PSConfig, exact: frozenset[str] = frozenset()) -> list[FusedKey]:
    """The fused keys of an optimizer's pushes (steps 1-3).

    Args:
        entries: ``(push name, tensor)`` in the optimizer's parameter order, frozen
            parameters left out.
        min_compress_bytes: the pushes' threshold (None: the runtime's, ``cfg``'s).
        spec: the pushes' codec spec (None: no wrappers).
        cfg: the runtime options (``fusion_cap``, ``min_compress_bytes``).
        exact: push names kept exact by name: left out of fused keys that travel compressed.
    """
    limit = cfg.min_compress_bytes if min_compress_bytes is None else min_compress_bytes
    if has_worker_momentum(spec) or cfg.fusion_cap == 0:
        return []
    keep = exact if fused_codec(spec) is not None else frozenset()
    small = [(n, t) for n, t in reversed(entries) if 4 * t.numel() < limit and n not in keep]
    return fused_keys([(n, t.numel()) for n, t in small], cfg.fusion_cap,
                      breaks=[str(t.device) for _, t in small])


def fused_codec(spec: CodecSpec | None) -> CodecSpec | None:
    """The codec fused keys travel with: ``spec`` itself for a block-scaled codec (``int4``...:
    a scale per block, so a key of small tensors compresses as well as a large tensor and
    zero stays exact), else None (exact, fp32)."""
    from ..defaults import BLOCK_SCALED

    return spec if spec is not None and spec.name in BLOCK_SCALED else None


def _push(spec: CodecSpec | None, buf: torch.Tensor, name: str) -> Handle:
    from .. import api

    if spec is None or name.endswith(DENSE_SUFFIX):
        return api.push_pull_async(buf, name, average=True, compression="none", ef="none",
                                   out=buf)
    return api.push_pull_async(buf, name, average=True, compression=spec,
                               min_compress_bytes=0, out=buf)


def make_fuser(keys: Sequence[FusedKey], cfg: PSConfig,
               spec: CodecSpec | None = None) -> Fuser:
    """A :class:`~gradpress.ps.fusion.Fuser` pushing ``keys`` through ``push_pull_async``
    (averaged, in place; exact unless :func:`fused_codec` of ``spec`` names a codec)."""
    return Fuser(keys, functools.partial(_push, fused_codec(spec)), cfg.timeout)


def fused_key_bytes(key: FusedKey, partition_bytes: int,
                    spec: CodecSpec | None = None) -> tuple[int, int]:
    """``(payload bytes, chunks)`` of one push of ``key``: its chunks with their headers, fp32
    or in :func:`fused_codec` of ``spec``."""
    from ..compress import build
    from ..ps.partition import chunk_layout

    codec = fused_codec(spec) or "none"
    chunks = chunk_layout(key.numel, partition_bytes)
    return sum(build(codec, c.numel).payload_bytes for c in chunks), len(chunks)


def gradient_fuser(names: Mapping[torch.Tensor, str], min_compress_bytes: int | None,
                   spec: CodecSpec | None, exact: frozenset[str] = frozenset()) -> Fuser:
    """The fuser of ``DistributedOptimizer``'s gradient pushes; ``names`` maps each parameter
    to its name in the optimizer's parameter order (built after ``init``); ``exact``: the
    names kept exact."""
    from .. import api

    entries = [(n, p) for p, n in names.items() if p.requires_grad]
    cfg = api.config()
    keys = tensor_fusion(entries, min_compress_bytes=min_compress_bytes, spec=spec, cfg=cfg,
                         exact=exact)
    return make_fuser(keys, cfg, spec)


def momentum_fuser(param_groups: Sequence[dict], *, prefix: str, spec: CodecSpec | None,
                   min_compress_bytes: int | None) -> Fuser:
    """The fuser of a 1-bit optimizer's momentum pushes, whose names are ``prefix`` and the
    parameter's position in the flat order of ``param_groups`` (built after ``init``)."""
    from .. import api

    flat = [p for g in param_groups for p in g["params"]]
    entries = [(f"{prefix}{i}", p) for i, p in enumerate(flat) if p.requires_grad]
    cfg = api.config()
    keys = tensor_fusion(entries, min_compress_bytes=min_compress_bytes, spec=spec, cfg=cfg)
    return make_fuser(keys, cfg)

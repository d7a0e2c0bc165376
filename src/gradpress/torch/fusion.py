"""Which of an optimizer's tensors share fused keys, buckets (:mod:`gradpress.ps.fusion`), the
same at run time, in ``opt.plan()`` and in ``gradpress train``'s reports.

A key costs a fixed amount per push whatever its size (a control message, headers, two hops,
a server reduce, a reply, runtime threads), so the fewer keys a step, the less a short step
pays beside the wire. The rule (:func:`bucket_keys`, a pure function):

1. **Buckets of everything** where that cannot change a value: with a block-scaled codec
   (``int4``..., a scale per block of B elements; :func:`fused_codec`) every tensor goes into a
   bucket, its slice aligned to B so it is cut into the blocks it would have alone, and the
   bucket travels compressed; with ``compression="none"`` every tensor goes into an exact
   bucket. Both are bit-identical to pushing each tensor under its own key: the codecs work
   block by block, error feedback and the servers' sums element by element. Tensors kept exact
   by name share exact buckets of their own.
2. **Small tensors only** otherwise: codecs with one scale per chunk (``onebit``, ``topk``,
   ``dithering``...) would change if tensors shared a chunk, so a tensor of at least
   ``min_compress_bytes`` keeps its own key and only the smaller ones (exact anyway) share
   exact buckets; so does every tensor under an error feedback that needs each tensor's lr
   (``corrected``, ``anneal=1``). Pushes with worker-side momentum (dist-EF-SGDM, a momentum
   buffer per key) are not fused.
3. The order is the optimizer's parameter order reversed: the order in which backward produces
   gradients, as DDP's buckets, so the first bucket fills first and the last one, pushed at
   the end of backward, holds the first layers' tensors. The 1-bit optimizers' momenta use the
   same order, so their dense phase (gradients) and compressed phase (momenta) fuse alike.
4. The cap is ``PSConfig.fusion_cap``: ``GRADPRESS_FUSION_BYTES``, by default
   ``partition_bytes`` (a bucket is one chunk); 0 turns fusion off, every tensor its own key.
   A tensor of the cap or more stands alone, and the tensors around it share buckets as if it
   were not there (its neighbours in backward order are not cut into more buckets).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..compress import build
from ..compress.spec import CodecSpec
from ..ps.calls import Handle
from ..ps.errors import CheckpointError
from ..ps.fusion import FUSED_PREFIX, FusedKey, Fuser, fused_keys

if TYPE_CHECKING:
    from ..ps.config import PSConfig

__all__ = ["has_worker_momentum", "tensor_fusion", "bucket_keys", "make_fuser", "gradient_fuser",
           "momentum_fuser", "fused_key_bytes", "check_layout", "DENSE_SUFFIX"]

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
    """The fused keys of an optimizer's pushes (:func:`bucket_keys` of its tensors).

    Args:
        entries: ``(push name, tensor)`` in the optimizer's parameter order, frozen
            parameters left out.
        min_compress_bytes: the pushes' threshold (None: the runtime's, ``cfg``'s).
        spec: the pushes' codec spec (None: no wrappers).
        cfg: the runtime options (``fusion_cap``, ``min_compress_bytes``).
        exact: push names kept exact by name.
    """
    limit = cfg.min_compress_bytes if min_compress_bytes is None else min_compress_bytes
    return bucket_keys([(n, t.numel(), str(t.device)) for n, t in entries], limit=limit,
                       spec=spec, cap=cfg.fusion_cap, exact=exact)


def bucket_keys(entries: Sequence[tuple[str, int, str]], *, limit: int,
                spec: CodecSpec | None, cap: int,
                exact: Collection[str] = frozenset()) -> list[FusedKey]:
    """The buckets of ``(push name, numel, device)`` entries in parameter order (steps 1-4);
    ``limit``: ``min_compress_bytes``; ``cap``: the fusion cap in bytes."""
    if has_worker_momentum(spec) or cap == 0:
        return []
    order = list(reversed(entries))
    codec = fused_codec(spec)

    def keys(part: list[tuple[str, int, str]], **kw: Any) -> list[FusedKey]:
        part = [e for e in part if 4 * e[1] < cap]  # a tensor of the cap or more stands alone
        return fused_keys([(n, k) for n, k, _ in part], cap, [d for _, _, d in part], **kw)

    if spec is not None and spec.name == "none":  # step 1: all exact
        return keys(order, exact=True)
    small = [e for e in order if 4 * e[1] < limit]  # step 2
    if codec is None:
        return keys(small)
    pool = small if _ef_needs_lr(spec) else order  # step 1: all, aligned to the blocks
    return (keys([e for e in pool if e[0] not in exact], align=_block(codec))
            + keys([e for e in pool if e[0] in exact], exact=True))


def _block(codec: CodecSpec) -> int:
    """Elements per scale of the block-scaled ``codec``."""
    from ..compress.blockint import BlockInt

    codec_obj = build(CodecSpec(codec.name, dict(codec.params), {}), 1)
    if not isinstance(codec_obj, BlockInt):
        raise TypeError(f"codec {codec.name!r} is not block-scaled")
    return codec_obj.block


def _ef_needs_lr(spec: CodecSpec | None) -> bool:
    """Whether ``spec``'s error feedback reads each push's lr (``corrected``, ``anneal=1``)."""
    ef = str((spec.wrappers.get("ef") if spec is not None else "") or "").replace(" ", "")
    return ef.startswith("corrected") or "anneal=1" in ef


def fused_codec(spec: CodecSpec | None) -> CodecSpec | None:
    """The codec compressed buckets travel with: ``spec`` itself for a block-scaled codec
    (``int4``...: a scale per block, so a bucket of small tensors compresses as well as a
    large tensor and zero stays exact), else None (buckets travel exact, fp32)."""
    from ..defaults import BLOCK_SCALED

    return spec if spec is not None and spec.name in BLOCK_SCALED else None


def _push(spec: CodecSpec | None, exact: frozenset[str], buf: torch.Tensor,
          name: str) -> Handle:
    from .. import api

    if spec is None or name.endswith(DENSE_SUFFIX) or name in exact:
        return api.push_pull_async(buf, name, average=True, compression="none", ef="none",
                                   out=buf)
    return api.push_pull_async(buf, name, average=True, compression=spec,
                               min_compress_bytes=0, out=buf)


def make_fuser(keys: Sequence[FusedKey], cfg: PSConfig,
               spec: CodecSpec | None = None, reuse: bool = False) -> Fuser:
    """A :class:`~gradpress.ps.fusion.Fuser` pushing ``keys`` through ``push_pull_async``
    (averaged, in place; exact unless :func:`fused_codec` of ``spec`` names a codec);
    ``reuse``: each bucket keeps its buffer from step to step."""
    exact = frozenset(k.name for k in keys if k.exact)
    return Fuser(keys, functools.partial(_push, fused_codec(spec), exact), cfg.timeout,
                 reuse=reuse)


def fused_key_bytes(key: FusedKey, partition_bytes: int,
                    spec: CodecSpec | None = None) -> tuple[int, int]:
    """``(payload bytes, chunks)`` of one push of ``key``: its chunks with their headers, fp32
    or in :func:`fused_codec` of ``spec``."""
    from ..compress import build
    from ..ps.partition import chunk_layout

    codec = (None if key.exact else fused_codec(spec)) or "none"
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
    return make_fuser(keys, cfg, spec, reuse=True)  # synchronize() copies every result out


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


def check_layout(fuser: Fuser, names: Collection[str], pending: Collection[str]) -> None:
    """Refuse loaded state (``pending``: tensor names whose saved state waits for their first
    push) that belongs to another bucket layout than ``fuser``'s over this optimizer's push
    ``names``: a bucket this run does not have, or a tensor saved under its own key that this
    run pushes in a bucket. Its residuals would otherwise be silently left unused."""
    own, buckets = set(names), fuser.names(("", DENSE_SUFFIX))
    for n in sorted(pending):
        base = n.removesuffix(DENSE_SUFFIX)
        if base.startswith(FUSED_PREFIX):
            stray = base[len(FUSED_PREFIX):].rsplit("+", 1)[0] in own and n not in buckets
        else:
            stray = base in own and fuser.fuses(base)
        if stray:
            raise CheckpointError(
                f"the loaded codec state of {n!r} belongs to another bucket layout than this "
                f"run's ({len(fuser.keys)} buckets): the checkpoint was saved with another "
                f"GRADPRESS_FUSION_BYTES, model, codec or gradpress version; resume with the "
                f"settings it was saved with")

"""Sparse codecs: ``topk`` (largest magnitudes, with their indices) and ``randomk`` (values at
positions every worker and server derives from ``(seed, key, step)``, so no indices travel).

Wire formats (after the 40-byte header), with ``kk`` the resolved count (see :func:`resolve_k`):

- ``topk``: ``kk`` int32 indices in ascending order, then ``kk`` values (fp32, or fp16 with
  ``values=fp16``, saturated to +-65504 rather than overflowing to inf). The numba path selects
  the exact top-k (ties broken by lowest index) with a sampled threshold; the torch path (GPU
  tensors, ``backend='torch'``) uses ``torch.topk``, which may break ties differently, so its
  payload can differ from the numba one on tied magnitudes. Counts and sortedness are identical.
- ``randomk``: ``kk`` fp32 values only. Positions are stratified: one per bucket of
  ``[0, numel)``, drawn by a counter-based hash (see :mod:`.kernels.sparse`); the numba and torch
  paths produce byte-identical payloads. The effective seed is part of the config fingerprint, so
  peers built with different seeds reject each other's payloads instead of mis-decoding them.

Error feedback with ``topk`` on CPU (``_encode_ef_fused``) stores ``p = x + e`` over the residual
(under ``nan_policy="raise"`` only after a read-only pass found every ``p`` finite, so a rejected
input leaves the residual intact without a second residual-sized buffer), selects from it and
fixes only the ``kk`` sent entries (no dense decode).

References: Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017
(top-k); Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (top-k, random-k).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

import numpy as np
import torch

from .base import Codec
from .cast import _require_cpu
from .header import Header
from .kernels import sparse as K
from .kernels.common import ef_args, fill_p, p_all_finite
from .registry import register
from .spec import Param, choice, parse_int, parse_k

__all__ = ["TopK", "RandomK", "resolve_k"]

_MAX_NUMEL = 2**31 - 1
_FP16_MAX = 65504.0


def resolve_k(k: float, numel: int) -> int:
    """Number of elements sent: ``k < 1`` is a fraction (rounded, at least 1), else a count.

    Both are capped at ``numel``; an empty chunk sends nothing.
    """
    if numel == 0:
        return 0
    if k < 1:
        return min(numel, max(1, round(k * numel)))
    return min(numel, int(k))


def _parse_seed(v: Any) -> int | None:
    if v is None or (isinstance(v, str) and v.strip().lower() in ("", "none")):
        return None
    return parse_int()(v)


def _non_finite(name: str, key: int) -> ValueError:
    # Same text as Codec._check_finite, for codecs that detect non-finite input in their own scan.
    return ValueError(f"{name}.compress key {key}: input has non-finite values (NaN/inf); pass "
                      f"nan_policy='allow' to encode them anyway")


class _Sparse(Codec):
    """Shared parts of the sparse codecs: the numel limit and the resolved count ``kk``."""

    def __init__(self, numel: int, params: Mapping[str, Any], **kwargs: Any) -> None:
        # int32 indices (topk) and exact int64 position arithmetic (randomk) need numel < 2**31.
        if isinstance(numel, int) and numel > _MAX_NUMEL:
            raise ValueError(f"{self.name}: numel {numel} exceeds the int32 index range "
                             f"(at most {_MAX_NUMEL}); use smaller chunks")
        super().__init__(numel, params, **kwargs)

    @cached_property
    def kk(self) -> int:
        """Number of elements this codec sends, fixed by ``k`` and ``numel``."""
        return resolve_k(self.params["k"], self.numel)

    def _values_f32(self, body: torch.Tensor, offset: int) -> torch.Tensor:
        return body[offset:offset + 4 * self.kk].view(torch.float32)


@register
class TopK(_Sparse):
    """Top-k sparsification: the ``kk`` largest-magnitude elements with their int32 indices."""

    name = "topk"
    codec_id = 4
    checks_finite = True
    PARAMS = (
        Param("k", 0.01, parse_k, "fraction (< 1) of the chunk or count (>= 1) of elements sent"),
        Param("values", "fp32", choice("fp32", "fp16"), "precision of the values sent"),
    )

    @property
    def _value_bytes(self) -> int:
        return 2 if self.params["values"] == "fp16" else 4

    def _body_bytes(self) -> int:
        return self.kk * (4 + self._value_bytes)

    def _split(self, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the body: int32 indices and the values (fp32 or fp16)."""
        kk = self.kk
        idx = body[:4 * kk].view(torch.int32)
        vdt = torch.float16 if self._value_bytes == 2 else torch.float32
        return idx, body[4 * kk:4 * kk + self._value_bytes * kk].view(vdt)

    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int, step: int) -> None:
        if self.use_torch(x.device):
            idx, vals = self._split(body)
            self._encode_torch(x, idx, vals, key)
            return
        self._encode_numba(x.numpy(), body, key)

    def _encode_numba(self, xa: np.ndarray, body: torch.Tensor, key: int) -> None:
        """Select the top-k of float32 ``xa`` and write indices and values into ``body``."""
        idx, vals = self._split(body)
        ia = idx.numpy()
        mx = K.topk_select(xa.view(np.uint32), ia)
        if mx >= K.EXP_BITS and self.nan_policy == "raise":
            raise _non_finite(self.name, key)
        if vals.dtype == torch.float32:
            K.gather(xa, ia, vals.numpy())
        else:  # saturate to the fp16 range (an inf would poison error-feedback residuals)
            v32 = np.clip(xa[ia], -_FP16_MAX, _FP16_MAX)
            np.copyto(vals.numpy(), v32, casting="same_kind")

    # -- error feedback (see Codec's docstring): p stored once, the residual fixed at k entries --
    def _encode_ef(self, p: torch.Tensor, body: torch.Tensor, residual: torch.Tensor, key: int,
                   step: int) -> bool:
        if self.use_torch(p.device):
            return False
        _require_cpu(self, p)
        self._encode_numba(p.numpy(), body, key)  # raises before residual is written
        residual.copy_(p)
        self._scatter_numba(body, residual.numpy(), -1.0, key, accumulate=True)
        return True

    def _encode_ef_fused(self, g: torch.Tensor, e: torch.Tensor, ratio: float, body: torch.Tensor,
                         spare: torch.Tensor, key: int, step: int) -> torch.Tensor | None:
        if self.use_torch(g.device):
            return None
        _require_cpu(self, g)
        ga, ea, (r, mode) = g.numpy(), e.numpy(), ef_args(ratio)
        # 1. "raise": p must be finite before it may overwrite the residual (a rejected input
        #    leaves e intact); checked in a read-only pass, so no second residual-sized buffer
        if self.nan_policy == "raise" and not p_all_finite(ga, ea, r, mode):
            raise _non_finite(self.name, key)
        # 2. p = g + ratio * e, stored over e, where the residual lives
        fill_p(ga, ea, r, mode, ea, True)
        # 3. select and gather from p; 4. residual = p - decode: only the k sent entries change
        self._encode_numba(ea, body, key)
        self._scatter_numba(body, ea, -1.0, key, accumulate=True)
        return e

    def _encode_torch(self, x: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor,
                      key: int) -> None:
        """Torch twin: exact ``torch.topk`` on ``|x|`` (ties may differ from the numba path)."""
        if self.nan_policy == "raise":
            self._check_finite(x, key)
        sel = torch.topk(x.abs(), self.kk, sorted=False).indices.sort().values
        idx.copy_(sel)
        v = x[sel]
        vals.copy_(v.clamp(-_FP16_MAX, _FP16_MAX) if vals.dtype == torch.float16 else v)

    def _checked_indices(self, idx: torch.Tensor, h: Header) -> torch.Tensor:
        sel = idx.long()
        if self.kk and (int(sel.min()) < 0 or int(sel.max()) >= self.numel):
            raise ValueError(f"topk payload key {h.key}: index out of range [0, {self.numel})")
        return sel

    def _scatter(self, body: torch.Tensor, out: torch.Tensor, alpha: float, h: Header,
                 accumulate: bool) -> None:
        idx, vals = self._split(body)
        if self.use_torch(out.device):
            sel = self._checked_indices(idx, h)
            v = vals.to(torch.float32)
            if accumulate:
                out.index_add_(0, sel, v, alpha=alpha)
            else:
                out.index_copy_(0, sel, v)
            return
        self._scatter_numba(body, out.numpy(), alpha, h.key, accumulate)

    def _scatter_numba(self, body: torch.Tensor, out: np.ndarray, alpha: float, key: int,
                       accumulate: bool) -> None:
        """``out[idx] = vals`` or ``out[idx] += float32(alpha) * vals`` (numba), indices checked."""
        idx, vals = self._split(body)
        va = vals.numpy()
        if va.dtype != np.float32:
            va = va.astype(np.float32)
        bad = K.scatter(va, idx.numpy(), out, alpha, accumulate)
        if bad >= 0:
            raise ValueError(f"topk payload key {key}: index {int(idx[bad])} at position {bad} "
                             f"is out of range [0, {self.numel})")

    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        out.zero_()
        self._scatter(body, out, 1.0, h, accumulate=False)

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        self._scatter(body, acc, alpha, h, accumulate=True)


@register
class RandomK(_Sparse):
    """Random-k sparsification: ``kk`` fp32 values at positions derived from (seed, key, step).

    Args (beyond :class:`Codec`): ``params["seed"]`` overrides the ``seed`` given to
    :func:`gradpress.compress.build` when not None.
    """

    name = "randomk"
    codec_id = 5
    PARAMS = (
        Param("k", 0.01, parse_k, "fraction (< 1) of the chunk or count (>= 1) of elements sent"),
        Param("seed", None, _parse_seed, "seed of the positions (default: build()'s seed)"),
    )

    def __init__(self, numel: int, params: Mapping[str, Any], *, seed: int = 0,
                 **kwargs: Any) -> None:
        params = dict(params)
        if params.get("seed") is None:
            params["seed"] = int(seed)
        super().__init__(numel, params, seed=params["seed"], **kwargs)

    def _body_bytes(self) -> int:
        return 4 * self.kk

    def _words(self, key: int, step: int) -> tuple[int, int]:
        return K.stream_words(self.seed, key, step)

    def indices(self, key: int, step: int, *,
                device: torch.device | str | None = None) -> torch.Tensor:
        """The sorted, unique int64 positions sent for ``(key, step)`` (same on every instance).

        Computed with numba on CPU (unless ``backend='torch'``) and torch ops elsewhere; both
        give identical results.
        """
        dev = torch.device("cpu" if device is None else device)
        s0, s1 = self._words(key, step)
        if self.use_torch(dev):
            return K.randomk_positions_torch(self.numel, self.kk, s0, s1, dev)
        out = torch.empty(self.kk, dtype=torch.int64)
        if self.kk:
            K.randomk_positions(self.numel, s0, s1, out.numpy())
        return out if dev.type == "cpu" else out.to(dev)

    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int, step: int) -> None:
        vals = self._values_f32(body, 0)
        if self.use_torch(x.device):
            vals.copy_(x[self.indices(key, step, device=x.device)])
        else:
            s0, s1 = self._words(key, step)
            K.randomk_gather(x.numpy(), s0, s1, vals.numpy())

    def _scatter(self, body: torch.Tensor, out: torch.Tensor, alpha: float, h: Header,
                 accumulate: bool) -> None:
        vals = self._values_f32(body, 0)
        if self.use_torch(out.device):
            sel = self.indices(h.key, h.step, device=out.device)
            if accumulate:
                out.index_add_(0, sel, vals, alpha=alpha)
            else:
                out.index_copy_(0, sel, vals)
        else:
            s0, s1 = self._words(h.key, h.step)
            K.randomk_scatter(vals.numpy(), s0, s1, out.numpy(), alpha, accumulate)

    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        out.zero_()
        self._scatter(body, out, 1.0, h, accumulate=False)

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        self._scatter(body, acc, alpha, h, accumulate=True)

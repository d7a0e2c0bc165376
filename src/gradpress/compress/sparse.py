"""Sparse codecs: ``topk`` (largest magnitudes, with their indices) and ``randomk`` (values at
positions every worker and server derives from ``(seed, key, step)``, so no indices travel).

Wire formats (after the 40-byte header), with ``kk`` the resolved count (see :func:`resolve_k`):

- ``topk`` with ``indices=packed`` (the default): ``kk`` values (fp32, or fp16 with
  ``values=fp16``, saturated to +-65504 rather than overflowing to inf), then the ``kk``
  ascending indices as a little-endian bit stream of ``w = max(1, ceil(log2(numel)))`` bits each
  (``(numel - 1).bit_length()``, at least 1): index ``j`` occupies stream bits
  ``[j*w, j*w + w)``, stream bit ``b`` is bit ``b % 8`` of byte ``b // 8``, and the last byte is
  padded with zero bits. Body bytes: ``kk * value_bytes + ceil(kk * w / 8)``. Values come first
  so they stay aligned for a ``.view(dtype)`` after the 40-byte header (the codec itself reads
  and writes through aligned copies of ``kk`` entries, so a payload may start at any byte, as in
  the DDP hook's back-to-back slots).
- ``topk`` with ``indices=int32``: ``kk`` int32 indices in ascending order, then ``kk`` values as
  above (the layout before packing; body bytes ``kk * (4 + value_bytes)``).

  Why pack: at ``k=0.001`` the 40-byte header weighs on small chunks (16k-49k elements), and on
  BERT-size chunks (2**20 elements) an index needs 20 bits, not 32, so ``topk:k=0.001,
  values=fp16`` sends 36 instead of 48 bits per selected element. A decoded index ``>= numel``
  (possible when ``2**w > numel``, i.e. only from a corrupted payload) is rejected with a
  ValueError naming the key and the range. The
  ``indices`` setting is part of the config fingerprint in the header, so a peer using the other
  layout is rejected by the header check rather than mis-decoded.

  The numba path selects the exact top-k (ties broken by lowest index) with a sampled threshold;
  the torch path (GPU tensors, ``backend='torch'``) uses ``torch.topk``, which may break ties
  differently, so its payload can differ from the numba one on tied magnitudes. Counts,
  sortedness and the packing are identical (same indices give the same bytes).
- ``randomk``: ``kk`` fp32 values only. Positions are stratified: one per bucket of
  ``[0, numel)``, drawn by a counter-based hash (see :mod:`.kernels.sparse`); the numba and torch
  paths produce byte-identical payloads. The effective seed is part of the config fingerprint, so
  peers built with different seeds reject each other's payloads instead of mis-decoding them.

Error feedback with ``topk`` on CPU (``_encode_ef_fused``) stores ``p = x + e`` over the residual
(under ``nan_policy="raise"`` only after a read-only pass found every ``p`` finite, so a rejected
input leaves the residual intact without a second residual-sized buffer), selects from it and
fixes only the ``kk`` sent entries (no dense decode); with ``indices=packed`` the selection goes
to an int32 scratch of ``kk`` entries that is packed into the body and reused for the fix.

References: Aji & Heafield, "Sparse Communication for Distributed Gradient Descent", EMNLP 2017
(top-k); Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018 (top-k, random-k).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from typing import Any

import numpy as np
import torch

from .base import Codec, _NonFiniteInputError, register
from .cast import _aligned, _require_cpu
from .header import Header
from .kernels import sparse as K
from .kernels.common import ef_args, fill_p, p_all_finite
from .spec import Param, choice, parse_int, parse_k

__all__ = ["TopK", "RandomK", "resolve_k", "pack_indices_torch", "unpack_indices_torch"]

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
    return _NonFiniteInputError(f"{name}.compress key {key}: input has non-finite values "
                               f"(NaN/inf); pass nan_policy='allow' to encode them anyway")


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
    """Top-k sparsification: the ``kk`` largest-magnitude elements with their indices
    (bit-packed by default, see the module docstring)."""

    name = "topk"
    codec_id = 4
    checks_finite = True
    PARAMS = (
        Param("k", 0.01, parse_k, "fraction (< 1) of the chunk or count (>= 1) of elements sent"),
        Param("values", "fp32", choice("fp32", "fp16"), "precision of the values sent"),
        Param("indices", "packed", choice("packed", "int32"),
              "index encoding: packed (values first, then ceil(log2(numel))-bit indices) or "
              "int32 (32-bit indices first, then values)"),
    )

    @property
    def _value_bytes(self) -> int:
        return 2 if self.params["values"] == "fp16" else 4

    @property
    def _packed(self) -> bool:
        return self.params["indices"] == "packed"

    @cached_property
    def index_bits(self) -> int:
        """Bits per index on the wire: 32 (``int32``) or ``max(1, ceil(log2(numel)))``."""
        return max(1, (self.numel - 1).bit_length()) if self._packed else 32

    def _body_bytes(self) -> int:
        return self.kk * self._value_bytes + (self.kk * self.index_bits + 7) // 8

    # The body may start at any byte offset (e.g. payloads packed back to back in one buffer), so
    # typed data is never viewed in place: it goes through aligned copies of kk entries.
    def _regions(self, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The body's index bytes and value bytes (uint8 slices, in wire order per layout)."""
        ib, vb = (self.kk * self.index_bits + 7) // 8, self._value_bytes * self.kk
        if self._packed:
            return body[vb:vb + ib], body[:vb]
        return body[:ib], body[ib:ib + vb]

    def _split(self, body: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Aligned copies of the int32 indices (unpacked for ``packed``, with numba on CPU unless
        ``backend='torch'``) and of the values (fp32 or fp16), on ``body``'s device."""
        iraw, vraw = self._regions(body)
        vals = _read(vraw, torch.float16 if self._value_bytes == 2 else torch.float32)
        if not self._packed:
            return _read(iraw, torch.int32), vals
        if self.use_torch(body.device):
            return unpack_indices_torch(iraw, self.index_bits, self.kk).to(torch.int32), vals
        idx = torch.empty(self.kk, dtype=torch.int32, device="cpu")
        K.unpack_indices(iraw.numpy(), self.index_bits, idx.numpy())
        return idx, vals

    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int,
                step: int) -> torch.Tensor | None:
        if self.use_torch(x.device):
            return self._encode_torch(x, body)
        self._encode_numba(x.numpy(), body, key)
        return None

    def _encode_numba(self, xa: np.ndarray, body: torch.Tensor,
                      key: int) -> tuple[np.ndarray, np.ndarray]:
        """Select the top-k of float32 ``xa`` and write indices and values into ``body``; return
        the int32 indices and the values as sent, in float32 (for the error-feedback fix)."""
        iraw, vraw = self._regions(body)
        ia = np.empty(self.kk, np.int32)
        mx = K.topk_select(xa.view(np.uint32), ia)
        if mx >= K.EXP_BITS and self.nan_policy == "raise":
            raise _non_finite(self.name, key)
        if self._packed:
            K.pack_indices(ia, self.index_bits, iraw.numpy())
        else:
            iraw.numpy()[:] = ia.view(np.uint8)
        va = np.empty(self.kk, np.float32)
        K.gather(xa, ia, va)
        if self._value_bytes == 2:  # saturate to the fp16 range (an inf would poison residuals)
            v16 = np.clip(va, -_FP16_MAX, _FP16_MAX).astype(np.float16)
            vraw.numpy()[:] = v16.view(np.uint8)
            return ia, v16.astype(np.float32)
        vraw.numpy()[:] = va.view(np.uint8)
        return ia, va

    # -- error feedback (see Codec's docstring): p stored once, the residual fixed at k entries --
    def _encode_ef(self, p: torch.Tensor, body: torch.Tensor, residual: torch.Tensor, key: int,
                   step: int) -> bool:
        if self.use_torch(p.device):
            return False
        _require_cpu(self, p)
        ia, va = self._encode_numba(p.numpy(), body, key)  # raises before residual is written
        residual.copy_(p)
        self._scatter_numba(ia, va, residual.numpy(), -1.0, key, True)
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
        ia, va = self._encode_numba(ea, body, key)
        self._scatter_numba(ia, va, ea, -1.0, key, True)
        return e

    def _encode_torch(self, x: torch.Tensor, body: torch.Tensor) -> torch.Tensor | None:
        """Torch twin: exact ``torch.topk`` on ``|x|`` (ties may differ from the numba path);
        nothing read on the host, the finiteness flag returned under "raise"."""
        iraw, vraw = self._regions(body)
        sel = torch.topk(x.abs(), self.kk, sorted=False).indices.sort().values
        if self._packed:
            iraw.copy_(pack_indices_torch(sel, self.index_bits, iraw.numel()))
        else:
            iraw.copy_(sel.to(torch.int32).view(torch.uint8))
        v = x.index_select(0, sel)
        if self._value_bytes == 2:
            v = v.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
        vraw.copy_(v.view(torch.uint8))
        return torch.isfinite(x).all() if self.nan_policy == "raise" else None

    def _check_body(self, body: torch.Tensor, h: Header) -> None:
        """Host bounds check of the indices before a device decode (same error text)."""
        if self.kk:
            idx, _ = self._split_host(body)
            if int(idx.min()) < 0 or int(idx.max()) >= self.numel:
                raise ValueError(f"topk payload key {h.key}: index out of range "
                                 f"[0, {self.numel})")

    def _split_host(self, body: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """The indices (int32) and values of a host body, with numba/numpy."""
        iraw, vraw = (r.numpy() for r in self._regions(body))
        vals = _aligned(vraw, np.float16 if self._value_bytes == 2 else np.float32)
        if not self._packed:
            return _aligned(iraw, np.int32), vals
        idx = np.empty(self.kk, np.int32)
        K.unpack_indices(iraw, self.index_bits, idx)
        return idx, vals

    def _body_finite(self, body: np.ndarray) -> bool:
        vals = self._split_host(torch.from_numpy(body))[1]
        return bool(np.isfinite(vals).all())

    def _checked_indices(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Device-side bounds check without a host read: ``(indices, any_bad)``, an index
        outside ``[0, numel)`` (only from a corrupted payload; host payloads were checked by
        :meth:`_check_body`) replaced by 0, so nothing is touched out of bounds."""
        sel = idx.long()
        bad = (sel < 0) | (sel >= self.numel)
        return torch.where(bad, 0, sel), bad.any()

    def _scatter(self, body: torch.Tensor, out: torch.Tensor, alpha: float, h: Header,
                 accumulate: bool) -> None:
        idx, vals = self._split(body)
        if self.use_torch(out.device):
            sel, any_bad = self._checked_indices(idx)
            v = vals.to(torch.float32)
            if accumulate:
                out.index_add_(0, sel, v, alpha=alpha)
            else:
                out.index_copy_(0, sel, v)
            # a bad index makes element 0 NaN, so the receiver's finiteness check rejects it
            out[:1].copy_(torch.where(any_bad, torch.nan, out[:1]))
            return
        va = vals.numpy().astype(np.float32, copy=False)
        self._scatter_numba(idx.numpy(), va, out.numpy(), alpha, h.key, accumulate)

    def _scatter_numba(self, ia: np.ndarray, va: np.ndarray, out: np.ndarray, alpha: float,
                       key: int, accumulate: bool) -> None:
        """``out[ia] = va`` or ``out[ia] += float32(alpha) * va`` (numba), indices checked."""
        bad = K.scatter(va, ia, out, alpha, accumulate)
        if bad >= 0:
            raise ValueError(f"topk payload key {key}: index {int(ia[bad])} at position {bad} "
                             f"is out of range [0, {self.numel})")

    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        out.zero_()
        self._scatter(body, out, 1.0, h, accumulate=False)

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        self._scatter(body, acc, alpha, h, accumulate=True)


def _read(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An aligned copy of the uint8 bytes ``raw`` as ``dtype`` (``raw`` may be misaligned)."""
    out = torch.empty(raw.numel() // dtype.itemsize, dtype=dtype, device=raw.device)
    out.view(torch.uint8).copy_(raw)
    return out


# -- torch twins of the index packing (GPU tensors, backend='torch') ----------------------------
def pack_indices_torch(idx: torch.Tensor, w: int, nbytes: int) -> torch.Tensor:
    """:func:`.kernels.sparse.pack_indices` with torch ops: a (kk, w) bit matrix, flattened,
    padded to whole bytes and summed with weights 1, 2, ..., 128; ``nbytes`` uint8."""
    dev = idx.device
    bits = (idx.to(torch.int64).unsqueeze(1) >> torch.arange(w, device=dev)) & 1
    bits = torch.nn.functional.pad(bits.reshape(-1), (0, 8 * nbytes - bits.numel()))
    weights = 1 << torch.arange(8, dtype=torch.int64, device=dev)  # built on the device
    return (bits.view(nbytes, 8) * weights).sum(1).to(torch.uint8)


def unpack_indices_torch(raw: torch.Tensor, w: int, kk: int) -> torch.Tensor:
    """Inverse of :func:`pack_indices_torch`: ``kk`` int64 indices (not range-checked)."""
    dev = raw.device
    bits = (raw.to(torch.int64).unsqueeze(1) >> torch.arange(8, device=dev)) & 1
    bits = bits.reshape(-1)[:kk * w].view(kk, w)
    return (bits << torch.arange(w, device=dev)).sum(1)


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
        out = torch.empty(self.kk, dtype=torch.int64, device="cpu")
        if self.kk:
            K.randomk_positions(self.numel, s0, s1, out.numpy())
        return out if dev.type == "cpu" else out.to(dev)

    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int, step: int) -> None:
        vals = self._values_f32(body, 0)
        if self.use_torch(x.device):
            vals.copy_(x.index_select(0, self.indices(key, step, device=x.device)))
        else:
            s0, s1 = self._words(key, step)
            K.randomk_gather(x.numpy(), s0, s1, vals.numpy())

    def _body_finite(self, body: np.ndarray) -> bool:
        return bool(np.isfinite(_aligned(body[:4 * self.kk], np.float32)).all())

    def _gather_clear(self, e: torch.Tensor, body: torch.Tensor, key: int, step: int) -> None:
        """Sparse error feedback on the CPU (numba): send ``e`` at the positions of
        ``(key, step)`` and zero them, each position computed once."""
        s0, s1 = self._words(key, step)
        K.randomk_gather_clear(e.numpy(), s0, s1, self._values_f32(body, 0).numpy())

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

"""Block-scaled symmetric integer codecs ``int2``, ``int3``, ``int4``, ``int8`` (codec ids 7-10).

Every block of ``B`` elements (``intN:block=B``, default 128) carries its own bfloat16 scale and
each element an ``N``-bit sign-magnitude code, magnitudes ``0..L`` with ``L = 2**(N-1) - 1``
(int2: {-1, 0, 1}, int4: -7..7, int8: -127..127). The gradient-quantization choice of ZeRO++'s qgZ
(INT4 with a scale per group) and LoCo (4-bit gradients with error feedback), built so that
**zero is exact**: a zero element decodes to zero whatever its block's scale, so with error
feedback a parameter without gradient stays exactly where uncompressed training leaves it.

Encoding (steps numbered as in :mod:`gradpress.compress.kernels.blockint`):

1. ``m = max|x|`` over the block.
2. ``s = m / L`` in float32, rounded up to the bfloat16 grid (8 significant bits, float32's
   range: gradients of any magnitude keep a scale). A zero block has scale 0.
3. Magnitude ``q = min(int(|x| / s + 0.5), L)``: round to nearest. Nearest rounding, not
   stochastic: error feedback (on by default on workers and servers) carries what it drops into
   the next step, and nearest rounding halves the error each step adds (the measurements are in
   ``docs/guide.md``).
4. Decoding: ``sign * q * s`` in float32.

Payload body (after the 40-byte header)::

    bytes [0, 2 * nblocks)                      the scales, bfloat16 little endian, block order
    next ceil(numel * N / 8) bytes              codes, LSB-first N-bit stream (as ``dithering``):
                                                element i in stream bits [i*N, i*N + N),
                                                code = q | sign << (N-1), sign 1 = negative

``nblocks = ceil(numel / B)``; bits per element ``N + 16 / B`` (int4, B = 128: 4.125).
Every code is a valid value, so a payload can only be hostile through its header (checked
like every codec's) or its scales (a NaN/inf scale decodes to NaN; :meth:`payload_finite`
sees it from the bytes).

Non-finite input: ``nan_policy='raise'`` raises ValueError (found by step 1, no extra pass);
``'allow'`` gives the block the NaN scale, so the NaN reaches the receiver as it would
uncompressed. CPU paths are numba kernels with error feedback fused in (one pass: ``p = g + e``,
the codes and the residual); other devices (or ``backend="torch"``) use torch ops that give the
same bytes.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch

from .base import Codec, register
from .cast import _aligned, _require_cpu
from .dithering import _pack_torch, _unpack_torch
from .header import Header
from .kernels import blockint as K
from .kernels.common import MODE_P, all_finite, ef_args
from .spec import Param, parse_int

__all__ = ["BlockInt", "Int2", "Int3", "Int4", "Int8", "DEFAULT_BLOCK"]

#: Elements per scale: 128 gives 4.125 bits at int4; 16/B bits is the scales' whole cost.
DEFAULT_BLOCK = 128
_EXP = 0x7F800000


def _parse_block(v: Any) -> int:
    b = parse_int(8, 1 << 16)(v)
    if b % 8:
        raise ValueError(f"expected a multiple of 8 (blocks start on a byte), got {v!r}")
    return b


class BlockInt(Codec):
    """Shared machinery of the ``intN`` codecs; see the module docstring for the wire format."""

    bits: ClassVar[int]
    PARAMS = (Param("block", DEFAULT_BLOCK, _parse_block,
                    "elements per bfloat16 scale, a multiple of 8 in [8, 65536]"),)
    checks_finite = True

    def __init__(self, numel: int, params: Any, **kwargs: Any) -> None:
        super().__init__(numel, params, **kwargs)
        self.block: int = self.params["block"]
        self.nblocks = -(-numel // self.block)
        self.scale_bytes = 2 * self.nblocks
        self.levels = (1 << (self.bits - 1)) - 1

    def _body_bytes(self) -> int:
        nblocks = -(-self.numel // self.params["block"])
        return 2 * nblocks + (self.numel * self.bits + 7) // 8

    # -- encode -----------------------------------------------------------------------------
    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int,
                step: int) -> torch.Tensor | None:
        if self.use_torch(x.device):
            return self._encode_torch(x, body)
        _require_cpu(self, x)
        xa = x.numpy()
        self._run(xa, xa, np.float32(1.0), MODE_P, body, xa, False, key)
        return None

    def _run(self, g: np.ndarray, e: np.ndarray, r: np.float32, mode: int, body: torch.Tensor,
             res: np.ndarray, write_res: bool, key: int) -> None:
        """The numba encode (steps 1-3, the residual with ``write_res``); ValueError for a
        non-finite input under ``nan_policy='raise'`` (the body is scratch then)."""
        out = body.numpy()
        top = K.encode(g, e, r, mode, out[:self.scale_bytes].view(np.uint16),
                       out[self.scale_bytes:], self.bits, self.block, res, write_res)
        if top >= _EXP and self.nan_policy == "raise":
            raise self._non_finite_error(key)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` zero-padded to whole blocks, as ``(nblocks, block)``."""
        pad = self.nblocks * self.block - self.numel
        if pad:
            x = torch.cat([x, x.new_zeros(pad)])
        return x.view(self.nblocks, self.block)

    def _encode_torch(self, x: torch.Tensor, body: torch.Tensor) -> torch.Tensor | None:
        """Torch twin of :func:`.kernels.blockint.encode` (same float32 operations, same
        bytes), nothing read on the host; the finiteness flag is returned under "raise"."""
        xv = self._blocks(x)
        xb = xv.view(torch.int32)
        mb = (xb & 0x7FFFFFFF).amax(1)  # 1.
        finite, live = mb < _EXP, (mb != 0) & (mb < _EXP)
        mf = mb.view(torch.float32)
        s = torch.div(mf, torch.full_like(mf, float(self.levels)))  # 2. a true division
        u = (s.view(torch.int32) + 0xFFFF) & -0x10000
        u = torch.where(u < _EXP, u, 0x7F7F0000)
        unused = torch.where(finite, 0, 0x7FC00000).to(torch.int32)
        u = torch.where(live, u, unused)
        sp = torch.where(live, u, 0x3F800000).view(torch.float32)  # 1.0 where unused
        y = torch.div(xv.abs(), sp[:, None])  # 3.
        q = (y + 0.5).to(torch.int32).clamp_max(self.levels)
        q = torch.where(live[:, None], q, 0)
        codes = q | ((xb < 0).to(torch.int32) << (self.bits - 1))
        body[:self.scale_bytes].copy_((u >> 16).to(torch.int16).view(torch.uint8))
        packed = _pack_torch(codes.reshape(-1)[:self.numel].to(torch.int64), self.bits,
                             body.numel() - self.scale_bytes)
        body[self.scale_bytes:].copy_(packed)
        return finite.all() if self.nan_policy == "raise" else None

    # -- error feedback (see Codec's docstring): one pass, p never stored --------------------
    def _encode_ef(self, p: torch.Tensor, body: torch.Tensor, residual: torch.Tensor, key: int,
                   step: int) -> bool:
        if self.use_torch(p.device):
            return False
        _require_cpu(self, p)
        pa = p.numpy()
        if self.nan_policy == "raise" and not all_finite(pa):
            raise self._non_finite_error(key)  # before the residual is written
        self._run(pa, pa, np.float32(1.0), MODE_P, body, residual.numpy(), True, key)
        return True

    def _encode_ef_fused(self, g: torch.Tensor, e: torch.Tensor, ratio: float, body: torch.Tensor,
                         spare: torch.Tensor, key: int, step: int) -> torch.Tensor | None:
        if self.use_torch(g.device):
            return None
        _require_cpu(self, g)
        r, mode = ef_args(ratio)
        # the finite check comes at the pass's end: under "raise" the residual goes to the
        # scratch, so e survives a rejected input
        res = spare if self.nan_policy == "raise" else e
        self._run(g.numpy(), e.numpy(), r, mode, body, res.numpy(), True, key)
        return res

    # -- decode -----------------------------------------------------------------------------
    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        self._apply(body, out, 1.0, add=False)

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        """``acc += v * alpha`` (float32; ``acc += v`` for alpha 1), straight from the codes."""
        self._apply(body, acc, alpha, add=True)

    def _apply(self, body: torch.Tensor, out: torch.Tensor, alpha: float, add: bool) -> None:
        if self.use_torch(out.device):
            vals = self._values_torch(body)
            if not add:
                out.copy_(vals)
            elif alpha == 1.0:
                out.add_(vals)
            else:
                out.add_(vals.mul_(alpha))  # two roundings, as the numba kernel
            return
        _require_cpu(self, out)
        raw = body.numpy()
        K.decode(_aligned(raw[:self.scale_bytes], np.uint16), raw[self.scale_bytes:], self.bits,
                 self.block, out.numpy(), np.float32(alpha), add)

    def _values_torch(self, body: torch.Tensor) -> torch.Tensor:
        """Step 4 with torch ops: the decoded float32 values."""
        scales = body[:self.scale_bytes].clone().view(torch.int16).to(torch.int32) << 16
        codes = _unpack_torch(body[self.scale_bytes:], self.bits, self.numel)
        pad = self.nblocks * self.block - self.numel
        if pad:
            codes = torch.cat([codes, codes.new_zeros(pad)])
        codes = codes.view(self.nblocks, self.block)
        mag = (codes & self.levels).to(torch.float32)
        v = mag * scales.view(torch.float32)[:, None]
        v = torch.where((codes >> (self.bits - 1)).bool(), -v, v)
        return v.reshape(-1)[:self.numel]

    def _body_finite(self, body: np.ndarray) -> bool:
        """Every scale finite (every code is a valid magnitude)."""
        scales = _aligned(body[:self.scale_bytes], np.uint16)
        return not bool(((scales & 0x7F80) == 0x7F80).any())


@register
class Int2(BlockInt):
    """2-bit codes {-1, 0, 1} with a bfloat16 scale per block (2 + 16/B bits/element)."""

    name = "int2"
    codec_id = 7
    bits = 2


@register
class Int3(BlockInt):
    """3-bit codes -3..3 with a bfloat16 scale per block (3 + 16/B bits/element)."""

    name = "int3"
    codec_id = 8
    bits = 3


@register
class Int4(BlockInt):
    """4-bit codes -7..7 with a bfloat16 scale per block (4 + 16/B bits/element)."""

    name = "int4"
    codec_id = 9
    bits = 4


@register
class Int8(BlockInt):
    """8-bit codes -127..127 with a bfloat16 scale per block (8 + 16/B bits/element)."""

    name = "int8"
    codec_id = 10
    bits = 8

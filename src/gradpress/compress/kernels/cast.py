"""numba kernels of the 16-bit cast codecs ``fp16`` and ``bf16``.

numba has no float16 type, so both formats travel as uint16 bit patterns. fp16 conversions use
LLVM's ``fptrunc``/``fpext`` to ``half`` (one instruction each with F16C or on ARM), through a
small numba intrinsic; :func:`fp16_impl` verifies them once against the portable integer kernels
below and falls back to those if the hardware path fails to compile or disagrees. The integer
kernels work on uint32 lanes (every intermediate wrapped in ``np.uint32`` so numba does not widen
it to 64 bits, which would halve the vector width). All kernels agree bit for bit with torch's
``.to(torch.float16)`` / ``.to(torch.bfloat16)`` (round to nearest, ties to even; overflow to inf)
on every non-NaN input; NaN becomes the canonical quiet NaN with the input's sign (fp16
``0x7E00``, bf16 ``0x7FC0``), where torch's CPU kernels keep payload bits or set the sign.

float32 -> float16, per element (F. Giesen, "float->half variants", 2016,
``float_to_half_fast3_rtne``), as selects so the loop vectorizes:

1. ``a = |x|`` bits, ``sign`` = the float sign moved to bit 15.
2. Normal result (``2**-14 <= |x| < 65520``): rebias the exponent (-112 << 23), add the rounding
   bias ``0xFFF + bit 13`` (ties to even) and shift right by 13; a carry out of the mantissa
   correctly bumps the exponent (up to inf).
3. Subnormal result (``|x| < 2**-14``): the float add ``|x| + 0.5`` rounds ``|x|`` to a multiple
   of 2**-24 in hardware (ties to even); the low 10 mantissa bits are the half.
4. ``|x| >= 65536`` (which includes inf and NaN): inf ``0x7C00``, or ``0x7E00`` for NaN.

float32 -> bfloat16: ``(bits + 0x7FFF + bit16) >> 16`` (ties to even; NaN canonical), as in
c10::BFloat16. Both encoders return the maximum exponent field seen (``0x7F800000`` means a NaN or
inf was present), so the non-finite check is fused into the same pass.

Decode-accumulate (``acc += alpha * value``) converts on the fly without a dense temporary; a
plain decode uses torch's vectorized conversion, which already runs at memory bandwidth.

Error feedback (:func:`encode_ef`): one pass computes ``p`` (:mod:`.common`), its 16-bit
pattern by the same element conversion as the encoders, and the residual ``p + (-1) * value``
by the same conversion back as the decode-add kernels, so it is bit-identical to encode then
decode-add on a stored ``p``.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .common import bits_f32, ef_p, f32_bits

__all__ = ["encode_fp16", "encode_bf16", "decode_add_fp16", "decode_add_bf16", "fp16_impl",
           "encode_ef"]

_U = np.uint32
_EXP = 0x7F800000


@numba.njit(cache=True, nogil=True, inline="always")
def _h_fp16_int(v: np.uint32) -> np.uint16:
    """fp16 bits of the float32 with bits ``v``, steps 1-4 of the module docstring."""
    # 1. magnitude bits, sign to bit 15
    a = _U(v & _U(0x7FFFFFFF))
    sign = _U(_U(v >> _U(16)) & _U(0x8000))
    # 2. normal: rebias by -112 << 23 (mod 2**32), round half to even on bit 13
    odd = _U(_U(a >> _U(13)) & _U(1))
    nrm = _U(_U(_U(a + _U(0xC8000FFF)) + odd) >> _U(13))
    # 3. subnormal: the float add rounds to a multiple of 2**-24
    f = np.float32(bits_f32(a) + np.float32(0.5))
    sub = _U(f32_bits(f) - _U(0x3F000000))
    # 4. overflow / inf / NaN
    big = _U(0x7E00) if a > _U(_EXP) else _U(0x7C00)
    r = big if a >= _U(0x47800000) else (sub if a < _U(0x38800000) else nrm)
    return np.uint16(_U(r | sign))


@numba.njit(cache=True, nogil=True)
def _enc_fp16_int(x: np.ndarray, h: np.ndarray) -> np.uint32:
    u = x.view(np.uint32)
    m = _U(0)
    for i in range(u.shape[0]):
        v = u[i]
        m = max(m, _U(v & _U(_EXP)))  # running max of the exponent field
        h[i] = _h_fp16_int(v)
    return m


@numba.njit(cache=True, nogil=True, inline="always")
def _h_bf16(v: np.uint32) -> np.uint16:
    """bf16 bits of the float32 with bits ``v`` (nearest even; NaN canonical, signed)."""
    a = _U(v & _U(0x7FFFFFFF))
    r = _U(_U(_U(v + _U(0x7FFF)) + _U(_U(v >> _U(16)) & _U(1))) >> _U(16))
    nan = _U(_U(_U(v >> _U(16)) & _U(0x8000)) | _U(0x7FC0))
    return np.uint16(nan if a > _U(_EXP) else r)


@numba.njit(cache=True, nogil=True)
def _enc_bf16(x: np.ndarray, h: np.ndarray) -> np.uint32:
    u = x.view(np.uint32)
    m = _U(0)
    for i in range(u.shape[0]):
        v = u[i]
        m = max(m, _U(v & _U(_EXP)))
        h[i] = _h_bf16(v)
    return m


@numba.njit(cache=True, nogil=True)
def _fp16_to_fp32_bits(hv: np.uint32) -> np.uint32:
    """Exact half -> float bits: normals/inf/NaN by rebiasing, subnormals by int -> float."""
    mag = _U(hv & _U(0x7FFF))
    sign = _U(_U(hv & _U(0x8000)) << _U(16))
    nrm = _U(_U(mag << _U(13)) + _U(112 << 23))
    # inf/NaN: exponent all ones; NaNs are quieted (bit 22) as the hardware conversion does
    special = _U(_U(nrm + _U(112 << 23)) | _U(0x400000 if mag > _U(0x7C00) else 0))
    sub = np.float32(np.float32(np.int32(mag)) * np.float32(2.0**-24)).view(np.uint32)
    r = sub if mag < _U(0x0400) else (special if mag >= _U(0x7C00) else nrm)
    return _U(r | sign)


@numba.njit(cache=True, nogil=True)
def _dec_add_fp16_int(h: np.ndarray, acc: np.ndarray, alpha: np.float32) -> None:
    for i in range(h.shape[0]):
        v = np.uint32(_fp16_to_fp32_bits(_U(h[i]))).view(np.float32)
        acc[i] += alpha * v


@numba.njit(cache=True, nogil=True)
def decode_add_bf16(h: np.ndarray, acc: np.ndarray, alpha: np.float32) -> None:
    """acc += alpha * float32(h) for uint16 bf16 bit patterns ``h``."""
    for i in range(h.shape[0]):
        v = np.uint32(_U(_U(h[i]) << _U(16))).view(np.float32)
        acc[i] += alpha * v


@intrinsic
def _f32_to_f16_bits(typingctx, x):  # type: ignore[no-untyped-def]
    """float32 -> fp16 bit pattern (uint16) by LLVM ``fptrunc`` (round to nearest even)."""
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def _f16_bits_to_f32(typingctx, h):  # type: ignore[no-untyped-def]
    """fp16 bit pattern (uint16) -> float32 by LLVM ``fpext`` (exact)."""
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def _h_fp16_hw(x: np.float32) -> np.uint16:
    """fp16 bits of ``x`` by the hardware conversion; NaN canonical with the input's sign."""
    v = f32_bits(x)
    nan = np.uint16(_U(_U(_U(v >> _U(16)) & _U(0x8000)) | _U(0x7E00)))
    return nan if _U(v & _U(0x7FFFFFFF)) > _U(_EXP) else _f32_to_f16_bits(x)


@numba.njit(cache=True, nogil=True)
def _enc_fp16_hw(x: np.ndarray, h: np.ndarray) -> np.uint32:
    u = x.view(np.uint32)
    m = _U(0)
    for i in range(u.shape[0]):
        m = max(m, _U(u[i] & _U(_EXP)))
        h[i] = _h_fp16_hw(x[i])
    return m


@numba.njit(cache=True, nogil=True)
def _dec_add_fp16_hw(h: np.ndarray, acc: np.ndarray, alpha: np.float32) -> None:
    for i in range(h.shape[0]):
        acc[i] += alpha * _f16_bits_to_f32(h[i])


# -- error feedback: encode p, residual p + alpha * decoded, one pass ------------------------------
@numba.njit(cache=True, nogil=True, inline="always")
def _enc_one(p, kind):  # type: ignore[no-untyped-def]
    """16-bit pattern of float32 ``p``; kind 0: bf16, 1: fp16 (hardware), 2: fp16 (integer)."""
    if kind == 0:
        return _h_bf16(f32_bits(p))
    if kind == 1:
        return _h_fp16_hw(p)
    return _h_fp16_int(f32_bits(p))


@numba.njit(cache=True, nogil=True, inline="always")
def _dec_one(hv, kind):  # type: ignore[no-untyped-def]
    """float32 value of the 16-bit pattern ``hv``, exactly as the decode-add kernels compute it."""
    if kind == 0:
        return bits_f32(_U(_U(hv) << _U(16)))
    if kind == 1:
        return _f16_bits_to_f32(hv)
    return bits_f32(_fp16_to_fp32_bits(_U(hv)))


@numba.njit(cache=True, nogil=True, inline="always")
def _cast_ef(g, e, r, mode, h, alpha, res, inplace, kind):  # type: ignore[no-untyped-def]
    """``h = enc(p)`` and ``res = p + alpha * dec(h)`` (into ``e`` when ``inplace``) in one pass,
    ``p`` from :func:`.common.ef_p`; returns the max exponent field of ``p``."""
    m = _U(0)
    if inplace:
        for i in range(g.shape[0]):
            p = ef_p(g, e, r, mode, i)
            m = max(m, _U(f32_bits(p) & _U(_EXP)))
            hv = _enc_one(p, kind)
            h[i] = hv
            e[i] = p + alpha * _dec_one(hv, kind)
    else:
        for i in range(g.shape[0]):
            p = ef_p(g, e, r, mode, i)
            m = max(m, _U(f32_bits(p) & _U(_EXP)))
            hv = _enc_one(p, kind)
            h[i] = hv
            res[i] = p + alpha * _dec_one(hv, kind)
    return m


@numba.njit(cache=True, nogil=True)
def _ef_bf16(g, e, r, mode, h, alpha, res, inplace):  # type: ignore[no-untyped-def]
    return _cast_ef(g, e, r, mode, h, alpha, res, inplace, 0)


@numba.njit(cache=True, nogil=True)
def _ef_fp16_hw(g, e, r, mode, h, alpha, res, inplace):  # type: ignore[no-untyped-def]
    return _cast_ef(g, e, r, mode, h, alpha, res, inplace, 1)


@numba.njit(cache=True, nogil=True)
def _ef_fp16_int(g, e, r, mode, h, alpha, res, inplace):  # type: ignore[no-untyped-def]
    return _cast_ef(g, e, r, mode, h, alpha, res, inplace, 2)


_FP16 = {"hw": (_enc_fp16_hw, _dec_add_fp16_hw, _ef_fp16_hw),
         "int": (_enc_fp16_int, _dec_add_fp16_int, _ef_fp16_int)}
_fp16_choice: list[str] = []


def fp16_impl() -> str:
    """``"hw"`` (LLVM half conversions) when they compile and match the integer kernels on
    probe values covering every rounding case, else ``"int"``; decided once per process."""
    if not _fp16_choice:
        _fp16_choice.append("int")
        probe = np.concatenate([np.arange(0, 2**32, 2**32 // 65521 + 12345, dtype=np.uint64),
                                np.arange(0x33000000, 0x47900000, 977)]).astype(np.uint32)
        x = np.concatenate([probe, probe | np.uint32(1 << 31)]).view(np.float32)
        halves = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
        try:
            got, ref = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
            _enc_fp16_hw(x, got)
            _enc_fp16_int(x, ref)
            acc_hw, acc_int = np.zeros(2**16, np.float32), np.zeros(2**16, np.float32)
            _dec_add_fp16_hw(halves, acc_hw, np.float32(1))
            _dec_add_fp16_int(halves, acc_int, np.float32(1))
            if np.array_equal(got, ref) and np.array_equal(acc_hw.view(np.uint32),
                                                           acc_int.view(np.uint32)):
                _fp16_choice[0] = "hw"
        except Exception:  # noqa: BLE001 - any failure to build or run the hardware path
            pass
    return _fp16_choice[0]


def decode_add_fp16(h: np.ndarray, acc: np.ndarray, alpha: np.float32) -> None:
    """acc += alpha * float32(h) for uint16 fp16 bit patterns ``h``."""
    _FP16[fp16_impl()][1](h, acc, np.float32(alpha))


def encode_fp16(x: np.ndarray, h: np.ndarray) -> bool:
    """Round float32 ``x`` to fp16 bit patterns in uint16 ``h``; False if ``x`` had NaN/inf."""
    return x.shape[0] == 0 or int(_FP16[fp16_impl()][0](x, h)) != _EXP


def encode_bf16(x: np.ndarray, h: np.ndarray) -> bool:
    """Round float32 ``x`` to bf16 bit patterns in uint16 ``h``; False if ``x`` had NaN/inf."""
    return x.shape[0] == 0 or int(_enc_bf16(x, h)) != _EXP


def encode_ef(dtype: str, g: np.ndarray, e: np.ndarray, r: np.float32, mode: int, h: np.ndarray,
              res: np.ndarray | None) -> bool:
    """Error feedback in one pass: ``h`` = the ``dtype`` (``"fp16"``/``"bf16"``) bit patterns of
    ``p`` (:func:`.common.ef_p` of ``g, e, r, mode``) and ``res = p - decoded`` (into ``e`` when
    ``res`` is None), with the arithmetic of the decode-add kernels (``p + (-1) * decoded``).
    Returns False if ``p`` had a NaN/inf (everything is written regardless)."""
    kernel = _ef_bf16 if dtype == "bf16" else _FP16[fp16_impl()][2]
    inplace = res is None
    m = kernel(g, e, r, mode, h, np.float32(-1.0), e if inplace else res, inplace)
    return g.shape[0] == 0 or int(m) != _EXP

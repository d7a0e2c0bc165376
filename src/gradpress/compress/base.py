"""The codec protocol and the shared machinery every codec family builds on.

A codec maps a float32 chunk of ``numel`` elements to a uint8 payload of exactly
``payload_bytes`` (fixed by codec, parameters and numel, so receivers can post buffers in
advance) and back. Payloads start with the header of :mod:`gradpress.compress.header`.

Subclasses implement ``_body_bytes()``, ``_encode(x, body, key, step)`` and
``_decode(body, out, header)``; optionally ``_decode_add(body, acc, alpha, header)`` for a
decode-accumulate without a dense temporary. ``x``/``body``/``out`` are torch tensors on one
device; CPU paths call numba kernels on ``.numpy()`` views, other devices use torch ops (so does
``backend="torch"`` on the CPU). Torch-op paths never read a device value on the host: a codec
with ``checks_finite`` returns from ``_encode`` a 0-d bool flag ("input all finite") under
``nan_policy="raise"`` instead of raising, and :meth:`Codec.compress` reads it together with the
body (host payload) or leaves it to the caller (device payload, :attr:`Codec.last_finite`).

Stateful wrappers (error feedback, momentum) derive from
:class:`~gradpress.compress.wrapper.CodecWrapper`, which keeps the wrapped codec's wire identity.
Codec families add their classes to the registry with :func:`register`
(:func:`gradpress.compress.build` looks them up by name).

Two optional hooks let :class:`~gradpress.compress.ef.ErrorFeedback` run in fewer passes. Both
must give results bit-identical to the unfused path, ``_encode(p)`` then ``residual = p`` followed
by ``_decode_add(body, residual, -1.0)`` (same payload bytes, same float32 residual, NaN bits
included). A codec with ``checks_finite`` must reject non-finite ``p`` (``nan_policy="raise"``,
with :meth:`Codec._non_finite_error`) and leave the residual (``residual``, ``e``) untouched then:

* ``_encode_ef(p, body, residual, key, step) -> bool``: encode ``p`` into ``body`` and write
  ``residual = p - decode(body)`` (``p`` and ``residual`` are distinct buffers); return False,
  having written nothing, to fall back to ``_encode`` + ``_decode_add``.
* ``_encode_ef_fused(g, e, ratio, body, spare, key, step) -> torch.Tensor | None``: the whole
  vanilla/corrected step with the input sum fused in: ``p = g + e`` when ``ratio == 1``, else
  ``p = g + float32(float32(ratio) * e)`` (float32 throughout, two roundings, no FMA: exactly
  :func:`gradpress.compress.kernels.common.fill_p`, which the unfused path uses to store ``p``);
  encode ``p`` into ``body`` and write ``p - decode(body)`` either over ``e`` (in place; only
  once ``p`` is known to be accepted) or into the scratch ``spare`` (distinct from ``g`` and
  ``e``), and return the tensor written. Return None, with ``e`` untouched (``spare`` and
  ``body`` are scratch until the hook returns), to fall back to ``_encode_ef`` or the unfused
  path. ``ratio`` is a Python float; ``g``, ``e``, ``spare`` are contiguous 1-D float32 tensors of
  ``numel`` (> 0) elements on one device.

The server's fused reduce (:func:`gradpress.ps.reduce.reduce_pushes`): where the reply codec's
:meth:`Codec.fuses_sum` is True (onebit), :meth:`Codec.compress_sum` encodes the pushes' sum
without storing it (``_step_sum``; error feedback: the codec's ``_encode_sum_ef``).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch

from . import transfer
from .header import HEADER_BYTES, Header, header_bytes, read_header
from .spec import CodecSpec, Param

__all__ = ["Codec", "register", "REGISTRY", "NAN_POLICIES", "BACKENDS"]

log = logging.getLogger(__name__)

NAN_POLICIES = ("raise", "allow")
_FLAGS_AT = 36  # offset of the header's reserved flags field (see .header)
BACKENDS = ("auto", "numba", "torch")


class _NonFiniteInputError(ValueError):
    """A compress rejected non-finite input (``nan_policy="raise"``), or an input that error
    feedback made non-finite; the codec's state is as it was before the call."""


class Codec(abc.ABC):
    """Base class of all codecs (and, through delegation, of the stateful wrappers).

    Args:
        numel: number of float32 elements of the chunk this codec encodes.
        params: resolved parameter values (see each codec's ``PARAMS``).
        spec: the parsed spec (used for the header fingerprint).
        seed: seed for codecs that draw random numbers; all randomness is derived from
            ``(seed, key, step)`` so it is identical on every worker and server.
        nan_policy: ``"raise"`` rejects non-finite input with ValueError; ``"allow"`` encodes it.
        backend: ``"auto"`` (numba on CPU, torch ops elsewhere), ``"numba"`` or ``"torch"``.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    PARAMS: ClassVar[tuple[Param, ...]] = ()
    #: True when ``_encode`` itself rejects non-finite input (saves a pass over the data).
    checks_finite: ClassVar[bool] = False

    def __init__(self, numel: int, params: Mapping[str, Any], *, spec: CodecSpec | None = None,
                 seed: int = 0, nan_policy: str = "raise", backend: str = "auto") -> None:
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        if nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {', '.join(NAN_POLICIES)}, "
                             f"got {nan_policy!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.numel = numel
        self.params = dict(params)
        self.seed = int(seed)
        self.nan_policy = nan_policy
        self.backend = backend
        spec = spec or CodecSpec(self.name)
        self.spec_text = spec.canonical(self.params)
        self.fingerprint = spec.fingerprint(self.params)
        self.payload_bytes = HEADER_BYTES + self._body_bytes()

    # -- subclass hooks -------------------------------------------------------------------------
    @abc.abstractmethod
    def _body_bytes(self) -> int:
        """Bytes of the payload after the header, fixed by parameters and numel."""

    @abc.abstractmethod
    def _encode(self, x: torch.Tensor, body: torch.Tensor, key: int,
                step: int) -> torch.Tensor | None:
        """Encode float32 ``x`` (1-D, contiguous) into uint8 ``body``; torch ops under
        ``nan_policy="raise"`` with ``checks_finite``: return the device flag "x all finite"
        (numba paths raise instead and return None)."""

    @abc.abstractmethod
    def _decode(self, body: torch.Tensor, out: torch.Tensor, h: Header) -> None:
        """Decode ``body`` into float32 ``out`` (1-D, numel)."""

    def _decode_add(self, body: torch.Tensor, acc: torch.Tensor, alpha: float, h: Header) -> None:
        """acc += alpha * decode(body). Default: decode into a reused scratch, then add."""
        tmp = self._scratch("decode_add", acc.device)
        self._decode(body, tmp, h)
        acc.add_(tmp, alpha=alpha)

    # -- public API -----------------------------------------------------------------------------
    def compress(self, x: torch.Tensor, *, key: int = 0, step: int = 0, lr: float | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Encode ``x`` (any shape, ``numel`` elements, floating) into a uint8 payload.

        Returns ``out`` when given (a 1-D uint8 tensor of ``payload_bytes``, on the CPU or on
        ``x``'s device), else a new tensor on ``x``'s device. ``lr`` is carried in the header
        (corrected error feedback). Where the payload lives decides how a non-finite input is
        reported under ``nan_policy="raise"``:

        * on the host: ValueError. With torch ops (``x`` on a GPU, or ``backend="torch"``) the
          body and a one-byte finiteness flag, both computed on ``x``'s device, come back in ONE
          copy (the call's only host synchronisation); the header is written on the host. A
          rejected input leaves the codec's state (error-feedback residual, momentum) as it was.
        * on a device (``out`` there, or ``out=None`` with ``x`` there): nothing is read back
          and nothing raises; :attr:`last_finite` is a 0-d bool tensor on the device, False when
          the input had a NaN/inf, for the caller to check (then the payload must not be sent).
          The state is kept as it was for a rejected input, at the cost of one blend pass
          (``torch.where``) per state buffer.
        """
        flat = self._as_input(x)
        payload = self._out_payload(out, flat.device)
        h = Header(self.codec_id, int(key), self.numel, int(step), lr, self.fingerprint)
        raw = header_bytes(h)  # a bad key raises before anything is encoded
        self.last_finite = None
        if self._staged(flat, payload):
            self._compress_staged(flat, payload, h, raw)
            return payload
        transfer.bytes_to(payload[:HEADER_BYTES], raw)
        flag = self._step(flat, payload[HEADER_BYTES:], h)
        self.last_finite = flag
        self._commit(flag)
        return payload

    #: After a compress into a device payload: a 0-d bool device tensor, False if the input was
    #: rejected (``nan_policy="raise"``), or None when nothing was checked on the device.
    last_finite: torch.Tensor | None = None

    def _staged(self, flat: torch.Tensor, payload: torch.Tensor) -> bool:
        """Torch ops into a host payload: encode on ``flat``'s device, one copy back."""
        return payload.device.type == "cpu" and self.use_torch(flat.device)

    def _compress_staged(self, flat: torch.Tensor, payload: torch.Tensor, h: Header,
                         raw: bytes) -> None:
        """Encode into a device buffer laid out as the payload's tail from the header's flags
        field on (``[flags (4) | body]``, first byte 1 for a rejected input), copy it into
        ``payload`` in one transfer, then write the header over the flags on the host."""
        stage = torch.empty(self.payload_bytes - _FLAGS_AT, dtype=torch.uint8, device=flat.device)
        flag = self._step(flat, stage[HEADER_BYTES - _FLAGS_AT:], h)
        stage[:HEADER_BYTES - _FLAGS_AT].zero_()
        if flag is not None:
            stage[:1].copy_(torch.logical_not(flag).reshape(1))
        transfer.to_host(payload[_FLAGS_AT:], stage)
        host = payload.numpy()
        rejected = bool(host[_FLAGS_AT])  # a host byte: read after the synchronising copy
        host[:HEADER_BYTES] = memoryview(raw)
        if rejected:
            raise self._non_finite_error(h.key)
        self._commit(None)

    def _step(self, flat: torch.Tensor, body: torch.Tensor, h: Header) -> torch.Tensor | None:
        """Encode ``flat`` into ``body`` (``numel`` may be 0); return the device finiteness flag
        (torch ops under ``nan_policy="raise"``) or None. Stateful codecs prepare their new
        state here and install it in :meth:`_commit`; numba paths raise here instead."""
        if not self.numel:
            body.zero_()  # e.g. onebit's scale: deterministic bytes at numel=0
            return None
        flag = None
        if self.nan_policy == "raise" and not self.checks_finite:
            flag = self._finite_flag(flat, h.key)
        return _both(flag, self._encode(flat, body, h.key, h.step))

    def _commit(self, flag: torch.Tensor | None) -> None:
        """Install the state :meth:`_step` prepared: unconditionally for None (the input was
        accepted, or not checked), else only where the device flag ``flag`` is True."""
        return None  # stateless

    # -- the server's fused reduce (optional; see the module docstring) --------------------------
    def fuses_sum(self, decoder: Codec, device: torch.device) -> bool:
        """Whether :meth:`compress_sum` takes payloads of ``decoder`` summed on ``device``."""
        return False

    def compress_sum(self, payloads: list[torch.Tensor], decoder: Codec, divisor: int, *,
                     key: int, step: int, lr: float | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """``compress(sum_w decoder.decompress(payloads[w]) / divisor)`` (float32, added in
        the order given from +0.0, then divided unless ``divisor`` is 1), bit for bit, without
        storing the sum; only where :meth:`fuses_sum` (headers already validated). Returns None,
        state untouched and ``out`` scratch, for a non-finite sum (or payloads not taken): the
        caller then runs the generic path, which raises the error."""
        payload = self._out_payload(out, torch.device("cpu"))
        h = Header(self.codec_id, int(key), self.numel, int(step), lr, self.fingerprint)
        raw = header_bytes(h)  # a bad key raises before anything is encoded
        self.last_finite = None
        if not self._step_sum([p[HEADER_BYTES:] for p in payloads], divisor,
                              payload[HEADER_BYTES:], h):
            return None
        transfer.bytes_to(payload[:HEADER_BYTES], raw)
        self._commit(None)
        return payload

    def _step_sum(self, bodies: list[torch.Tensor], divisor: int, body: torch.Tensor,
                  h: Header) -> bool:
        """:meth:`_step` of :meth:`compress_sum`: False (nothing changed) to decline."""
        return False

    def decompress(self, payload: torch.Tensor, *, out: torch.Tensor | None = None,
                   key: int | None = None, step: int | None = None) -> torch.Tensor:
        """Decode a payload into a float32 tensor of ``numel`` (``out`` when given).

        ``key``/``step``, when given, must match the header; every mismatch is a ValueError.
        A host payload decoded with torch ops (``out`` on a GPU, or ``backend="torch"``) is
        validated on the host (header, index bounds), then its body is copied to ``out``'s
        device without a host synchronisation (:func:`.transfer.host_to`: a pinned payload must
        not be overwritten before the current stream has passed this call).
        """
        h = self.check_header(payload, key=key, step=step)
        if out is None:
            out = torch.empty(self.numel, dtype=torch.float32, device=payload.device)
        else:
            self._check_out(out, "out")
        if self.numel:
            self._decode(self._body_on(payload, out.device, h), out, h)
        return out

    def decompress_add(self, payload: torch.Tensor, acc: torch.Tensor, *, alpha: float = 1.0,
                       key: int | None = None, step: int | None = None) -> Header:
        """``acc += alpha * decompress(payload)``, without a dense temporary where possible
        (host payloads as in :meth:`decompress`)."""
        h = self.check_header(payload, key=key, step=step)
        self._check_out(acc, "acc")
        if self.numel:
            self._decode_add(self._body_on(payload, acc.device, h), acc, float(alpha), h)
        return h

    def payload_finite(self, payload: torch.Tensor) -> bool:
        """Whether the host ``payload`` (header already validated) decodes to finite values,
        decided from its bytes (e.g. onebit's scale, the values sent), without decoding."""
        if not self.numel:
            return True
        return self._body_finite(payload[HEADER_BYTES:].numpy())

    def _body_finite(self, body: np.ndarray) -> bool:
        """:meth:`payload_finite` of a body; default: decode on the host and scan."""
        out = torch.empty(self.numel, dtype=torch.float32, device="cpu")
        h = Header(self.codec_id, 0, self.numel, 0, None, self.fingerprint)
        self._decode(torch.from_numpy(body), out, h)
        return bool(torch.isfinite(out).all())

    def _check_body(self, body: torch.Tensor, h: Header) -> None:
        """Bounds checks of a host body before it goes to a device (memory safety of the
        device decode, e.g. topk's indices); ValueError. Default: none needed."""
        return None

    def _body_on(self, payload: torch.Tensor, device: torch.device, h: Header) -> torch.Tensor:
        """The payload's body on ``device``: a checked copy for a host payload decoded with
        torch ops (also CPU to CPU, so ``backend="torch"`` runs the GPU's path), else in place."""
        body = payload[HEADER_BYTES:]
        if payload.device.type == "cpu" and self.use_torch(device):
            self._check_body(body, h)
            dev = torch.empty(body.numel(), dtype=torch.uint8, device=device)
            transfer.host_to(dev, body)
            return dev
        if payload.device != device:
            raise ValueError(f"{self.name}: payload on {payload.device} cannot be decoded into a "
                             f"tensor on {device}; put the payload on the host or on {device}")
        return body

    def check_header(self, payload: torch.Tensor, *, key: int | None = None,
                     step: int | None = None, sender: str | None = None) -> Header:
        """Validate ``payload`` against this codec; ValueError naming the field that differs."""
        where = f" from {sender}" if sender else ""
        h = read_header(payload)
        if h.codec_id != self.codec_id:
            raise ValueError(f"payload{where} key {h.key}: codec id {h.codec_id}, expected "
                             f"{self.codec_id} ({self.name})")
        if h.numel != self.numel:
            raise ValueError(f"payload{where} key {h.key}: numel {h.numel}, expected {self.numel}")
        if h.fingerprint != self.fingerprint:
            raise ValueError(f"payload{where} key {h.key}: codec config fingerprint "
                             f"{h.fingerprint:#010x}, expected {self.fingerprint:#010x} "
                             f"({self.spec_text})")
        if payload.numel() != self.payload_bytes:
            kind = "truncated" if payload.numel() < self.payload_bytes else "too long"
            raise ValueError(f"payload{where} key {h.key}: {kind}, {payload.numel()} bytes, "
                             f"expected {self.payload_bytes}")
        if key is not None and h.key != key:
            raise ValueError(f"payload{where}: key {h.key}, expected {key}")
        if step is not None and h.step != step:
            raise ValueError(f"payload{where} key {h.key}: step {h.step}, expected {step}")
        return h

    # stateless codecs have no state; wrappers and stateful codecs override these.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise ValueError(f"{self.name} codec is stateless, got state keys {sorted(state)}")

    @property
    def residual(self) -> torch.Tensor | None:
        """The error-feedback residual (None for a codec without error feedback)."""
        return None

    def use_torch(self, device: torch.device) -> bool:
        """Whether to run torch-op kernels (non-CPU device, or ``backend='torch'``)."""
        return self.backend == "torch" or (self.backend == "auto" and device.type != "cpu")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec_text!r}, numel={self.numel}, " \
               f"payload_bytes={self.payload_bytes})"

    # -- helpers --------------------------------------------------------------------------------
    def _as_input(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name}.compress expects a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise TypeError(f"{self.name}.compress expects a floating tensor, got {x.dtype}")
        if x.numel() != self.numel:
            raise ValueError(f"{self.name}.compress: input has {x.numel()} elements, codec was "
                             f"built for numel={self.numel}")
        flat = x.reshape(-1)
        if flat.dtype != torch.float32:
            flat = flat.to(torch.float32)
        return flat.contiguous()

    def _out_payload(self, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        if out is None:
            return torch.empty(self.payload_bytes, dtype=torch.uint8, device=device)
        if isinstance(out, torch.Tensor) and out.device.type != "cpu" and out.device != device:
            raise ValueError(f"out must be on the CPU or on the input's device ({device}), got "
                             f"a tensor on {out.device}")
        if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() != self.payload_bytes \
                or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous 1-D uint8 tensor of {self.payload_bytes} "
                             f"bytes, got dtype={out.dtype} shape={tuple(out.shape)}")
        return out

    def _check_out(self, out: torch.Tensor, what: str) -> None:
        if out.dtype != torch.float32 or out.dim() != 1 or out.numel() != self.numel \
                or not out.is_contiguous():
            raise ValueError(f"{what} must be a contiguous 1-D float32 tensor of {self.numel} "
                             f"elements, got dtype={out.dtype} shape={tuple(out.shape)}")

    def _check_finite(self, flat: torch.Tensor, key: int) -> None:
        """Raise the non-finite error now (host paths: CPU tensors are scanned by numba)."""
        if flat.device.type == "cpu":
            from .kernels.common import all_finite
            ok = all_finite(flat.numpy())
        else:
            ok = bool(torch.isfinite(flat).all())  # a host synchronisation: host paths only
        if not ok:
            raise self._non_finite_error(key)

    def _finite_flag(self, flat: torch.Tensor, key: int) -> torch.Tensor | None:
        """Torch ops: the device flag "all finite" (nothing is read); numba: raise or None."""
        if self.use_torch(flat.device):
            return torch.isfinite(flat).all()
        self._check_finite(flat, key)
        return None

    def _non_finite_error(self, key: int) -> ValueError:
        """The error every codec raises for non-finite input under ``nan_policy='raise'``."""
        return _NonFiniteInputError(f"{self.name}.compress key {key}: input has non-finite values "
                          f"(NaN/inf); pass nan_policy='allow' to encode them anyway")

    def _scratch(self, name: str, device: torch.device, numel: int | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A buffer reused across calls (allocated once per name/device/size/dtype)."""
        cache = self.__dict__.setdefault("_scratch_cache", {})
        n = self.numel if numel is None else numel
        k = (name, str(device), n, dtype)
        buf = cache.get(k)
        if buf is None:
            buf = cache[k] = torch.empty(n, dtype=dtype, device=device)
        return buf


def _both(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The conjunction of two optional device flags."""
    if a is None or b is None:
        return b if a is None else a
    return a & b


#: Codec classes by name, filled by :func:`register` when a family module is imported.
REGISTRY: dict[str, type[Codec]] = {}


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator adding a codec to the registry (name and codec id must be unique)."""
    for other in REGISTRY.values():
        if other.codec_id == cls.codec_id and other is not cls:
            raise ValueError(f"codec id {cls.codec_id} of {cls.name} already used by {other.name}")
    REGISTRY[cls.name] = cls
    return cls

"""Error feedback: a stateful wrapper that makes any codec's compression error a residual
added back into the next step's input.

Kinds (:class:`~gradpress.compress.spec.EFSpec`; how to choose: docs/guide.md):

* ``vanilla`` (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "Error Feedback Fixes
  SignSGD"): p = x + e; c = C(p); e = p - D(c).
* ``corrected`` (Zheng, Huang, Kwok 2019; the BytePS "corrected" EF): the residual lives in update
  units, so when the learning rate changes it is rescaled: p = x + (lr_prev / lr_now) * e; then
  as vanilla. ``lr`` is required and travels in the payload header.
* ``vanilla:decay=B`` (B in [0, 1]): p = x + B * e; then as vanilla. The part of ``x`` not
  delivered yet ages by ``B`` per step instead of being kept until it is sent; with ``B`` the
  momentum coefficient of a compressed momentum (1-bit Adam / 1-bit LANS), the residual ages as
  the momentum does. ``B = 1`` is vanilla.
  ``vanilla:decay=B,server_decay=S``: workers use ``B``, the servers' codecs ``S``
  (:meth:`~gradpress.compress.spec.EFSpec.for_server`).
  ``vanilla:decay=B,anneal=1`` (workers only; ``lr`` required): the part lost per step shrinks
  with the learning rate, ``p = x + B_t * e`` with ``B_t = 1 - (1 - B) * lr / lr_max`` and
  ``lr_max`` the highest lr this residual's pushes have carried: ``B`` at the peak of a
  schedule, 1 (vanilla) as the lr reaches 0.
* ``sparse`` (BytePS's EF for ``randomk``): e += x; send e[idx] for the indices ``idx`` the codec
  draws from (seed, key, step); e[idx] = 0. Only the selected positions are read and cleared;
  the positions are computed once per step (numba: a gather-and-clear pass on the CPU; torch
  ops: on the residual's device, the same positions).

The residual is float32, allocated lazily on the device of the first input and zero-initialised.
Steady-state calls allocate nothing: the residual and one scratch buffer (from ``_scratch``)
may swap roles (vanilla/corrected), so ``residual`` is a live view of the current residual:
copy it to keep a snapshot.

Vanilla/corrected steps run in as few passes as the codec allows (see :mod:`.base` for the
hooks): ``_encode_ef_fused`` computes ``p`` inside the codec's own passes (onebit: 2 passes,
fp16/bf16: 1, dithering: 2, topk: ``p`` stored once, then the selection); else ``p`` is stored
and ``_encode_ef`` or ``_encode`` + ``_decode_add`` finish the step. Every path computes ``p``
with the same float32 operations (``x + e``, or ``x + float32(float32(ratio) * e)``: two
roundings, no FMA) and gives bit-identical payloads and residuals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .base import Codec, _both
from .header import Header
from .spec import EFSpec, parse_ef
from .wrapper import CodecWrapper, check_state_keys

__all__ = ["ErrorFeedback"]


def _positive_or_none(state: Mapping[str, Any], key: str) -> float | None:
    """``state[key]`` as a float if it is a number > 0, None if None; else ValueError."""
    v = state[key]
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
        raise ValueError(f"ErrorFeedback.load_state_dict: {key} must be None or > 0, got {v!r}")
    return None if v is None else float(v)


class ErrorFeedback(CodecWrapper):
    """Error feedback around ``codec`` (see the module docstring for the kinds).

    Args:
        codec: the codec whose compression error is fed back.
        kind: an :class:`~gradpress.compress.spec.EFSpec` or its text (:func:`parse_ef`):
            ``"vanilla"``, ``"vanilla:decay=B"`` (with ``",server_decay=S"``: ``B`` here, on a
            worker; with ``",anneal=1"`` ``compress`` needs ``lr``), ``"corrected"``
            (``compress`` needs ``lr``) or ``"sparse"`` (only for codecs that draw their indices
            from (seed, key, step), i.e. ``randomk``).
    """

    kind: str

    def __init__(self, codec: Codec, *, kind: str | EFSpec = "vanilla") -> None:
        super().__init__(codec)
        if isinstance(codec, ErrorFeedback):
            raise TypeError(f"codec {codec.spec_text!r} already has error feedback "
                            f"({codec.kind}); wrap the plain codec")
        self.ef = parse_ef(kind)  # ValueError listing the valid kinds
        if not self.ef.enabled:
            raise ValueError(f"ErrorFeedback needs an error-feedback kind, got {kind!r}; "
                             f"use the plain codec for none")
        self.kind_text = str(self.ef)
        self.kind, self.decay, self.anneal = self.ef.kind, self.ef.factor, self.ef.anneal
        if self.kind == "sparse" and not callable(getattr(codec, "indices", None)):
            raise ValueError(f"ef='sparse' needs a codec that draws its indices from (seed, key, "
                             f"step) (randomk); codec {codec.name!r} does not")
        self.lr_prev: float | None = None
        self.lr_max: float | None = None  # anneal: the highest lr seen
        self._e: torch.Tensor | None = None       # the residual
        self._spare: torch.Tensor | None = None   # scratch for p and p - D(c)
        self._loaded: torch.Tensor | None = None  # residual restored before the first compress
        self._pending: tuple[Any, ...] | None = None  # state prepared by _step for _commit
        self._pending_lr: float | None = None

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r}, kind={self.kind_text!r})"

    @property
    def residual(self) -> torch.Tensor | None:
        """The current residual (live buffer; None before the first compress)."""
        return self._e if self._e is not None else self._loaded

    # -- compress ---------------------------------------------------------------------------------
    def compress(self, x: torch.Tensor, *, key: int = 0, step: int = 0, lr: float | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Compress ``x`` plus the residual and update the residual (see the module docstring).

        Payload placement and non-finite input as in :meth:`Codec.compress`: a rejected input
        leaves the residual as it was (host payload: the new residual is built in the scratch
        and installed only after the check; device payload: blended with ``torch.where`` on
        the device flag :attr:`last_finite`, one extra pass; ``lr_prev`` and, with
        ``anneal=1``, ``lr_max`` still advance there, as nothing is read on the host: the
        engine that gets a rejected push stops anyway)."""
        self._check_lr(lr)
        return super().compress(x, key=key, step=step, lr=lr, out=out)

    def _check_lr(self, lr: float | None) -> None:
        if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                               or not math.isfinite(lr) or lr <= 0):
            raise ValueError(f"{self.name} error feedback: lr must be a finite number > 0, "
                             f"got lr={lr!r}")

    def _step(self, flat: torch.Tensor, body: torch.Tensor, h: Header) -> torch.Tensor | None:
        self._check_lr(h.lr)  # also when a wrapper (momentum) calls this directly
        ratio = self._lr_ratio(h.lr)
        self._pending = None
        self._pending_lr = h.lr
        if not self.numel:
            body.zero_()  # deterministic bytes at numel=0, as Codec.compress
            return None
        self._ensure_buffers(flat.device)
        if self.kind == "sparse":
            return self._compress_sparse(flat, body, h)
        return self._compress_dense(flat, body, h, ratio)

    def fuses_sum(self, decoder: Codec, device: torch.device) -> bool:
        """Dense kinds without ``anneal``, where the codec has ``_encode_sum_ef`` for these."""
        return (self.kind != "sparse" and not self.anneal
                and callable(getattr(self.inner, "_encode_sum_ef", None))
                and self.inner.fuses_sum(decoder, device))

    def compress_sum(self, payloads: list[torch.Tensor], decoder: Codec, divisor: int, *,
                     key: int, step: int, lr: float | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor | None:
        """:meth:`Codec.compress_sum` plus the residual, as :meth:`compress` adds it."""
        self._check_lr(lr)
        return super().compress_sum(payloads, decoder, divisor, key=key, step=step, lr=lr,
                                    out=out)

    def _step_sum(self, bodies: list[torch.Tensor], divisor: int, body: torch.Tensor,
                  h: Header) -> bool:
        ratio = self._lr_ratio(h.lr)  # no side effect: no anneal here
        self._ensure_buffers(body.device)
        # only codecs with a fused sum (onebit) reach here
        if not self.inner._encode_sum_ef(  # type: ignore[attr-defined]
                bodies, divisor, self._e, ratio, body):
            return False  # rejected: the residual is untouched
        self._pending, self._pending_lr = None, h.lr  # _commit: lr_prev, e written in place
        return True

    def _commit(self, flag: torch.Tensor | None) -> None:
        """Install the new residual (where ``flag`` holds, for a device flag) and lr_prev."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == "dense":
            new, old = pending[1], pending[2]
            if flag is not None:
                torch.where(flag, new, old, out=new)
            self._e, self._spare = new, old
        elif pending is not None:
            self._clear_sent(pending[1], pending[2], flag)
        if self._pending_lr is not None:  # device mode: also for a rejected input
            self.lr_prev = float(self._pending_lr)

    def _lr_ratio(self, lr: float | None) -> float:
        """lr_prev / lr for corrected EF (1 on the first call), else 1 (lr validated)."""
        if self.kind != "corrected" and not self.anneal:
            return self.decay
        if lr is None:
            raise ValueError(f"{self.kind_text} error feedback ({self.spec_text}) needs the "
                             f"current learning rate: pass lr > 0 to compress(), got lr=None")
        if self.anneal:  # B_t = 1 - (1 - B) * lr / lr_max
            self.lr_max = max(self.lr_max or 0.0, float(lr))
            return 1.0 - (1.0 - self.decay) * float(lr) / self.lr_max
        return 1.0 if self.lr_prev is None else self.lr_prev / float(lr)

    def _compress_dense(self, flat: torch.Tensor, body: torch.Tensor, h: Header,
                        ratio: float) -> torch.Tensor | None:
        """Vanilla/corrected EF; the residual is untouched if the input is rejected (numba
        paths raise before writing it; torch paths leave ``p - D(c)`` pending in the scratch
        for :meth:`_commit`). Returns the device finiteness flag of the torch paths."""
        e, p = self._e, self._spare
        assert e is not None and p is not None  # _ensure_buffers ran
        inner = self.inner
        fused = getattr(inner, "_encode_ef_fused", None)
        # 1.-3. fused (numba): p = x + ratio * e, c = C(p) into body and e = p - D(c) in as few
        #    passes as the codec can; the codec writes e in place or into the scratch
        if fused is not None and (inner.checks_finite or self.nan_policy == "allow"):
            r = fused(flat, e, ratio, body, p, h.key, h.step)
            if r is not None:
                if r is not e:
                    self._e, self._spare = r, e
                return None
        # 1. p = x + ratio * e   (ratio = lr_prev / lr_now for corrected EF, else the decay)
        self._ef_input(flat, e, ratio, p)
        flag = None
        if self.nan_policy == "raise" and not inner.checks_finite:
            flag = self._finite_flag(p, h.key)  # numba: raises now; torch ops: a device flag
        hook = getattr(inner, "_encode_ef", None)
        # 2.+3. fused (numba): c = C(p) into body and e = p - D(c) in one pass
        if hook is not None and hook(p, body, e, h.key, h.step):
            return None
        # 2. c = C(p)
        flag = _both(flag, inner._encode(p, body, h.key, h.step))
        # 3. e = p - D(c): subtract the decoding in place (sparse codecs touch only k entries);
        #    the buffer holding p - D(c) becomes the residual in _commit, the old one the scratch
        inner._decode_add(body, p, -1.0, h)
        self._pending = ("dense", p, e)
        return flag

    def _ef_input(self, flat: torch.Tensor, e: torch.Tensor, ratio: float,
                  p: torch.Tensor) -> None:
        """``p = x + e`` (ratio 1) or ``x + float32(float32(ratio) * e)``: two float32 roundings,
        the arithmetic of :func:`~gradpress.compress.kernels.common.fill_p` and of every fused
        error-feedback kernel (numba on CPU, the same float32 operations as torch ops elsewhere)."""
        if flat.device.type == "cpu" and not self.inner.use_torch(flat.device):
            from .kernels.common import ef_args, fill_p  # numba, loaded with the first codec
            r, mode = ef_args(ratio)
            fill_p(flat.numpy(), e.numpy(), r, mode, p.numpy(), False)
        elif ratio == 1.0:
            torch.add(flat, e, out=p)
        else:
            torch.mul(e, ratio, out=p)  # torch rounds the Python float ratio to float32 first
            p.add_(flat)

    def _compress_sparse(self, flat: torch.Tensor, body: torch.Tensor,
                         h: Header) -> torch.Tensor | None:
        """Sparse EF (randomk): only the selected positions are read and cleared; the
        positions are computed once per step, on the residual's device."""
        e, inner = self._e, self.inner
        assert e is not None  # _ensure_buffers ran
        # randomk's own methods (kind "sparse" is refused in __init__ for other codecs)
        if not inner.use_torch(flat.device):
            if self.nan_policy == "raise":
                self._check_finite(flat, h.key)  # before e is touched: a rejected x leaves e
            e.add_(flat)  # 1. e += x (full pass)
            inner._gather_clear(e, body, h.key, h.step)  # type: ignore[attr-defined]
            # 2. send e[idx]; 3. e[idx] = 0 (numba)
            return None
        # torch ops: 2. send (e + x)[idx] (the same float32 sums), 1. and 3. in _commit
        idx = inner.indices(h.key, h.step, device=e.device)  # type: ignore[attr-defined]
        vals = inner._values_f32(body, 0)  # type: ignore[attr-defined]
        vals.copy_(e.index_select(0, idx) + flat.index_select(0, idx))
        self._pending = ("sparse", flat, idx)
        return torch.isfinite(flat).all() if self.nan_policy == "raise" else None

    def _clear_sent(self, flat: torch.Tensor, idx: torch.Tensor,
                    flag: torch.Tensor | None) -> None:
        """Sparse EF steps 1 and 3: e += x, e[idx] = 0 (the sent values are exact fp32, so the
        sent mass leaves the residual); with a device flag only where it holds."""
        e = self._e
        assert e is not None  # a step is pending
        if flag is None:
            e.add_(flat)
            e.index_fill_(0, idx, 0.0)
            return
        torch.where(flag, e + flat, e, out=e)
        e.index_copy_(0, idx, torch.where(flag, 0.0, e.index_select(0, idx)))

    def _ensure_buffers(self, device: torch.device) -> None:
        if self._e is None:
            self._e = self._scratch("ef_residual_a", device)
            if self._loaded is not None:
                self._e.copy_(self._loaded)
                self._loaded = None
            else:
                self._e.zero_()
            if self.kind != "sparse":
                self._spare = self._scratch("ef_residual_b", device)
        elif self._e.device != device:
            raise ValueError(f"{self.name} error feedback: input on {device}, but the residual "
                             f"lives on {self._e.device} (the device of the first input)")

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residual (a CPU clone, or None before the first compress), lr_prev, lr_max (only
        with ``anneal=1``) and inner state."""
        r = self.residual
        out = {"kind": self.kind_text, "residual": None if r is None else r.detach().cpu().clone(),
               "lr_prev": self.lr_prev, "inner": self.inner.state_dict()}
        if self.anneal:
            out["lr_max"] = self.lr_max
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; ValueError naming any mismatching key or shape."""
        if isinstance(state, Mapping) and "kind" in state and state["kind"] != self.kind_text:
            raise ValueError(f"ErrorFeedback.load_state_dict: state is for kind "
                             f"{state['kind']!r}, this codec has kind {self.kind_text!r}")
        check_state_keys("ErrorFeedback", state, {"kind", "residual", "lr_prev", "inner"}
                    | ({"lr_max"} if self.anneal else set()))
        lrs = {k: _positive_or_none(state, k) for k in ("lr_prev", "lr_max") if k in state}
        r = self._state_tensor(state, "residual")
        self.inner.load_state_dict(state["inner"])
        self.lr_prev = lrs["lr_prev"]
        self.lr_max = lrs.get("lr_max")
        self._loaded = None
        if r is None:
            if self._e is not None:
                self._e.zero_()
        elif self._e is not None:
            self._e.copy_(r)
        else:
            self._loaded = r

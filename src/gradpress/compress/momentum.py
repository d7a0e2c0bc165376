"""Nesterov momentum applied before compression (worker side only; dist-EF-SGDM).

The recipe of Zheng, Huang and Kwok 2019 ("Communication-Efficient Distributed Blockwise Momentum
SGD with Error-Feedback", dist-EF-SGDM), as BytePS applies it: each worker keeps a momentum
buffer m per chunk and compresses the Nesterov look-ahead gradient instead of the raw gradient:

1. m = mu * m + g
2. p = g + mu * m
3. payload = C(p), where C is the wrapped codec (usually error feedback around a codec).

Because the momentum is already inside the compressed gradient, the optimizer's own momentum must
be off (e.g. ``torch.optim.SGD(momentum=0)``), or the update would apply momentum twice. Servers do
not apply momentum: they sum, error-feed and recompress as usual.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .base import Codec
from .header import Header
from .wrapper import CodecWrapper, check_state_keys

__all__ = ["NesterovMomentum"]


class NesterovMomentum(CodecWrapper):
    """Nesterov momentum in front of ``codec`` (see the module docstring).

    Args:
        codec: the codec to feed, possibly an :class:`~gradpress.compress.ef.ErrorFeedback`.
        mu: momentum coefficient in [0, 1).
    """

    def __init__(self, codec: Codec, *, mu: float = 0.9) -> None:
        super().__init__(codec)
        if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not math.isfinite(mu) \
                or not 0.0 <= mu < 1.0:
            raise ValueError(f"momentum mu must be a number in [0, 1), got mu={mu!r}")
        self.mu = float(mu)
        self._m: torch.Tensor | None = None       # momentum buffer
        self._loaded: torch.Tensor | None = None  # momentum restored before the first compress
        self._pending_g: torch.Tensor | None = None  # the gradient of a step not committed yet

    def __repr__(self) -> str:
        return f"NesterovMomentum({self.inner!r}, mu={self.mu})"

    @property
    def momentum(self) -> torch.Tensor | None:
        """The momentum buffer m (live; None before the first compress)."""
        return self._m if self._m is not None else self._loaded

    @property
    def residual(self) -> torch.Tensor | None:
        """The wrapped codec's error-feedback residual."""
        return self.inner.residual

    def compress(self, x: torch.Tensor, *, key: int = 0, step: int = 0, lr: float | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """Update the momentum with gradient ``x`` and compress the Nesterov gradient.

        A rejected input (``nan_policy="raise"``) leaves the momentum as it was: ``m`` is
        written only after the wrapped codec accepted ``p`` (host payload, numba), or blended
        with ``torch.where`` on the device flag :attr:`last_finite` (device payload)."""
        self._check_lr(lr)
        return super().compress(x, key=key, step=step, lr=lr, out=out)

    def _check_lr(self, lr: float | None) -> None:
        check = getattr(self.inner, "_check_lr", None)
        if check is not None:
            check(lr)

    def _step(self, g: torch.Tensor, body: torch.Tensor, h: Header) -> torch.Tensor | None:
        self._pending_g = None
        if self.numel == 0:
            return self.inner._step(g, body, h)
        m = self._ensure_buffer(g.device)
        p = self._scratch("nesterov_p", g.device)
        # 1. the new m = mu * m + g (one pass: g + mu * m), into p; m itself waits for _commit
        torch.add(g, m, alpha=self.mu, out=p)
        # 2. p = g + mu * m_new
        torch.add(g, p, alpha=self.mu, out=p)
        self._pending_g = g
        # 3. compress p with the wrapped codec (error feedback, if any, happens there)
        return self.inner._step(p, body, h)

    def _commit(self, flag: torch.Tensor | None) -> None:
        """Step 1 for real: m = g + mu * m (the same operation, so the same bits), where the
        device flag holds (into the free scratch first, then ``torch.where``)."""
        self.inner._commit(flag)
        g, self._pending_g = self._pending_g, None
        if g is None or self._m is None:
            return
        if flag is None:
            torch.add(g, self._m, alpha=self.mu, out=self._m)
            return
        p = self._scratch("nesterov_p", g.device)
        torch.add(g, self._m, alpha=self.mu, out=p)
        torch.where(flag, p, self._m, out=self._m)

    def _ensure_buffer(self, device: torch.device) -> torch.Tensor:
        if self._m is None:
            self._m = self._scratch("nesterov_m", device)
            if self._loaded is not None:
                self._m.copy_(self._loaded)
                self._loaded = None
            else:
                self._m.zero_()
        elif self._m.device != device:
            raise ValueError(f"{self.name} momentum: input on {device}, but the momentum buffer "
                             f"lives on {self._m.device} (the device of the first input)")
        return self._m

    def state_dict(self) -> dict[str, Any]:
        """Momentum buffer (a CPU clone, or None before the first compress), mu, inner state."""
        m = self.momentum
        return {"momentum": None if m is None else m.detach().cpu().clone(), "mu": self.mu,
                "inner": self.inner.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; ValueError naming any mismatching key or shape."""
        check_state_keys("NesterovMomentum", state, {"momentum", "mu", "inner"})
        if state["mu"] != self.mu:
            raise ValueError(f"NesterovMomentum.load_state_dict: state has mu={state['mu']!r}, "
                             f"this codec has mu={self.mu}")
        m = self._state_tensor(state, "momentum")
        self.inner.load_state_dict(state["inner"])
        self._loaded = None
        if m is None:
            if self._m is not None:
                self._m.zero_()
        elif self._m is not None:
            self._m.copy_(m)
        else:
            self._loaded = m

"""OneBitLANS's idle rows (step 2b of :class:`~gradpress.optim.OneBitLANSCore`).

A tensor of two or more dimensions whose averaged dense-phase gradient had a row of zeros (an
embedding) is marked on every worker alike. In the compression stage each worker sends, exact,
which of its rows have a gradient and the norm of what it sent; a row without gradient on any
worker takes its last shared value decayed as LANS's moments decay (``b1/sqrt(b2)``) instead of
what a one-bit code delivered (every element the same magnitude: unused rows would walk), and
the step scales the rows in use up to the workers' mean sent norm (a one-bit scale averaged over
idle rows shrinks them, which would inflate weight decay's share of the trust-ratio step).
See ``docs/optimizers.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import Bucket

__all__ = ["IdleRows", "has_idle_rows"]


def has_idle_rows(st: dict[str, Any]) -> bool:
    """Whether step 1b marked the tensor of optimizer state ``st`` (read once, then kept as a
    bool: one host read a tensor on a device)."""
    mark = st.get("idle_rows", False)
    if isinstance(mark, torch.Tensor):
        mark = st["idle_rows"] = bool(mark)
    return bool(mark)


def _scale_up(a: torch.Tensor, used: torch.Tensor, sent_norm: torch.Tensor) -> torch.Tensor:
    """The factor (>= 1, a 0-d tensor: no host read) that brings the norm of ``a`` to
    ``sent_norm`` by scaling its rows in use alone."""
    held_sq = a.masked_fill(used, 0).square().sum()
    used_sq = a.masked_fill(~used, 0).square().sum()
    scale_sq = (sent_norm.square() - held_sq) / used_sq.clamp_min(torch.finfo(a.dtype).tiny)
    return torch.where((used_sq > 0) & (scale_sq > 1), scale_sq, 1.0).sqrt()


class IdleRows:
    """Mixin of :class:`~gradpress.optim.OneBitLANSCore`: needs ``state``, ``_communicate`` and
    ``_holds(index)`` (whether ``hold_idle_rows`` applies to a flat parameter index)."""

    state: Any
    _communicate: Any

    def _holds(self, index: int) -> bool:
        raise NotImplementedError

    def _note_idle_rows(self, b: Bucket) -> None:
        """Step 1b: mark a tensor of two or more dimensions whose averaged dense-phase gradient
        has a row of zeros (an embedding's unused rows); the same on every worker. The mark
        stays a tensor on the gradient's device (no host read a step) until :func:`has_idle_rows`
        first reads it."""
        for p, g in zip(b.params, b.grads):
            st = self.state[p]
            if g.dim() >= 2 and st.get("idle_rows") is not True:
                # 1.0 or 0.0 in the gradient's dtype: a checkpoint hands it back unchanged
                zero_row = g.reshape(g.shape[0], -1).any(dim=1).logical_not().any().to(g.dtype)
                mark = st.get("idle_rows")
                st["idle_rows"] = zero_row if mark is None or mark is False \
                    else torch.maximum(mark, zero_row.to(mark.dtype))

    def _row_flags(self, b: Bucket, group: dict[str, Any]) -> dict[int, torch.Tensor]:
        """Step 2b: for each tensor whose idle rows are held (by position in ``b``), which of
        its rows have a gradient on this worker (1.0) or none (0.0). At the first compressed
        step, keep the dense phase's shared ``m/(sqrt(vh)+eps)`` for :meth:`_hold_idle_rows`."""
        out = {}
        for j, (p, g) in enumerate(zip(b.params, b.grads)):
            st = self.state[p]
            if self._holds(b.indices[j]) and has_idle_rows(st):
                if "shared_momentum" not in st:   # m and v are still the dense phase's
                    st["shared_momentum"] = b.exp_avgs[j] / self._last_denominator(p, group)
                out[j] = g.reshape(g.shape[0], -1).any(dim=1).to(g.dtype)
        return out

    def _send_rows(self, b: Bucket, flags: dict[int, torch.Tensor],
                   sent: list[torch.Tensor]) -> dict[int, Any]:
        """Step 2b: communicate (exact, key ``"<i>.rows"``) each held tensor's row flags and,
        as one more value, the norm of what this worker sent for it."""
        out = {}
        for j, touched in flags.items():
            msg = torch.cat([touched, sent[j].norm().reshape(1).to(touched.dtype)])
            key = f"{b.indices[j]}.rows"
            out[j] = msg if self._communicate is None else self._communicate(key, msg)
        return out

    def _hold_idle_rows(self, b: Bucket, group: dict[str, Any], got: list[torch.Tensor],
                        rows: dict[int, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Step 2b, on receipt: in the averaged ``a`` of a tensor with idle rows, a row with no
        gradient on any worker takes its last shared value decayed as LANS's moments decay
        without a gradient (``b1/sqrt(b2)``), not the codec's: a one-bit code gives every
        element the same magnitude, so unused rows would walk. Rows never used keep ``a = 0``.
        Returns (``a``, the direction of the step): in the step, the rows in use are scaled up
        to the mean norm of what the workers sent, since a one-bit scale averaged over idle
        rows shrinks them."""
        if not rows:
            return got, got
        beta1, beta2 = group["betas"]
        got, step = list(got), list(got)
        for j, pending in rows.items():
            p, a = b.params[j], got[j]
            msg = pending.wait() if hasattr(pending, "wait") else pending
            used = (msg[:-1] > 0).reshape((-1,) + (1,) * (a.dim() - 1))
            st = self.state[p]
            got[j] = torch.where(used, a, st["shared_momentum"] * (beta1 / beta2 ** 0.5))
            st["shared_momentum"] = got[j].clone()
            step[j] = torch.where(used, got[j] * _scale_up(got[j], used, msg[-1]), got[j])
        return got, step

    def _last_denominator(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """``sqrt(vh)+eps`` of ``p``'s second moment before this step's update (bias-corrected
        at the previous step): the dense phase's, identical on every worker."""
        st, beta2 = self.state[p], group["betas"][1]
        t = int(st["step"]) - 1
        return (st["exp_avg_sq"] / (1.0 - beta2 ** t)).sqrt_().add_(group["eps"])

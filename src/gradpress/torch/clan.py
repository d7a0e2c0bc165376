"""CLAN in one call: the headline method of gradpress (Zhong, Xie, Zheng, Lin 2021).

CLAN is LANS (Zheng et al. 2020) without per-layer gradient normalisation, stepped on the
two-way compressed gradient:

1. each worker compresses its gradient chunks with error feedback (``ef``) and pushes them;
2. each server decodes all workers' chunks, averages, adds its own residual and compresses again;
3. every worker decodes the same bytes into ``p.grad`` and takes the LANS step of
   :func:`gradpress.optim.clan` (``docs/optimizers.md``).

Defaults come from ``docs/convergence.md``: one-bit compression with vanilla error feedback and
100 uncompressed warm-up steps. On stdlib-mlm (3 seeds, validation loss against uncompressed
LANS at lr 0.01) CLAN onebit was 9.0% behind without warm-up and 1.3% with 50 steps (200-step
runs); top-k 0.1% fp16 was 2.9 +- 1.6% behind with 50 steps and 0.0 +- 0.3% with 100, and at
400 steps 100 warm-up steps beat 50 for both codecs (onebit +2.1% vs +2.4%, top-k +2.4% vs
+3.4%). Corrected error feedback and finer scales helped less than the warm-up.

Known limit: in 800-step runs the gap grows to about 8.6% (3 seeds): uncompressed LANS starts to
use the context late in the run and compressed CLAN does not; about 3.4 points of it are CLAN's
missing gradient normalisation (uncompressed CLAN is that far behind too). On that task 1-bit
Adam (:class:`gradpress.optim.OneBitAdam`, momentum compression after a dense warm-up) kept up
with uncompressed Adam (``docs/convergence.md``, sections 2.4-2.5).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..compress.spec import CodecSpec, parse_spec
from ..optim import OneBitLANS
from ..optim import clan as clan_optimizer
from .optimizer import DistributedOptimizer

__all__ = ["CLAN"]

#: What ``gp.CLAN`` compresses after its warm-up.
COMMUNICATES = ("gradient", "momentum")

#: Uncompressed warm-up steps chosen by the 3-seed runs in docs/convergence.md (50 was enough
#: for onebit at 200 steps; top-k 0.1% and 400-step runs needed 100).
DEFAULT_WARMUP_STEPS = 100


def CLAN(named_parameters: Iterable[tuple[str, torch.nn.Parameter]],  # noqa: N802
         lr: float = 1e-3, *, compression: str | Mapping[str, Any] | CodecSpec = "onebit",
         ef: str = "vanilla", warmup_steps: int = DEFAULT_WARMUP_STEPS,
         weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.999),
         eps: float = 1e-6, freeze_variance: bool = False,
         min_compress_bytes: int | None = 1 << 20,
         backward_passes_per_step: int = 1, nan_policy: str = "raise",
         communicate: str = "gradient") -> torch.optim.Optimizer:
    """Build the CLAN optimizer: ``gradpress.optim.clan`` wrapped in a ``DistributedOptimizer``.

    Args:
        named_parameters: ``model.named_parameters()`` (names key the tensors on all workers).
        lr: learning rate. The paper's BERT-base values (batch 2k): 0.0014865 with onebit,
            0.001051 with topk 0.1%. Tune it per codec: on stdlib-mlm (200 steps) onebit did
            best at 0.01 and topk 0.1% at 0.02 (0.005 and 0.04 were far worse), while
            uncompressed LANS did best at 0.02 (``docs/convergence.md``).
        compression: codec spec; ``"onebit"`` (32x) or ``"topk:k=0.001,values=fp16"`` (333x
            against fp16 in the paper's int32-index layout; about 440x on 4 MiB chunks with
            gradpress's default bit-packed indices) are the paper's settings.
        ef: error feedback on workers and servers (``"vanilla"``; ``"corrected"`` scales the
            residual by lr_prev/lr_now, useful with steep lr schedules). With
            ``communicate="momentum"`` also ``"ef21"``: the workers send differences to a
            shared estimate of the averaged momentum and the codec keeps no residuals
            (``OneBitLANS(ef21=True)``).
        warmup_steps: uncompressed steps before compression starts (default 100; raise it if
            a transformer's loss lags the uncompressed run; 0 for small CNNs, which show no
            gap). They cost dense traffic: negligible in a long run, half of a 200-step one.
        weight_decay, betas, eps: LANS hyperparameters (``docs/optimizers.md``).
        freeze_variance: freeze LANS's second moment when compression starts (after
            ``warmup_steps``, which must then be >= 1), as 1-bit Adam does; see
            ``docs/convergence.md`` for what it did on stdlib-mlm.
        min_compress_bytes: tensors smaller than this travel uncompressed and exact.
        backward_passes_per_step, nan_policy: as in :func:`DistributedOptimizer`.
        communicate: ``"gradient"`` (the paper's CLAN: the two-way compressed gradient drives
            LANS without gradient normalisation) or ``"momentum"`` (1-bit LANS,
            :class:`gradpress.optim.OneBitLANS`: LANS proper on the dense gradient for
            ``warmup_steps`` steps, then the second moment frozen and each worker's momentum,
            divided by the frozen ``sqrt(v)+eps``, compressed two-way with error feedback).
            ``freeze_variance`` is implied by ``"momentum"``.
    """
    if not isinstance(freeze_variance, bool):
        raise TypeError(f"freeze_variance must be a bool, got {freeze_variance!r}")
    if communicate not in COMMUNICATES:
        raise ValueError(f"communicate must be one of {', '.join(COMMUNICATES)}, got "
                         f"{communicate!r}")
    if ef == "ef21" and communicate != "momentum":
        raise ValueError("ef='ef21' needs communicate='momentum' (the optimizer keeps the shared "
                         f"estimate), got communicate={communicate!r}")
    freezes = freeze_variance or communicate == "momentum"
    if freezes and not (isinstance(warmup_steps, int) and warmup_steps >= 1):
        raise ValueError(f"freeze_variance=True or communicate='momentum' needs warmup_steps "
                         f">= 1 (the second moment is frozen when compression starts), got "
                         f"warmup_steps={warmup_steps!r}")
    named = list(named_parameters)
    if communicate == "momentum":
        return _momentum_clan(named, lr, compression, ef, warmup_steps, weight_decay, betas, eps,
                              min_compress_bytes, backward_passes_per_step, nan_policy)
    opt = clan_optimizer([p for _, p in named], lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay,
                         freeze_step=warmup_steps if freeze_variance else None)
    return DistributedOptimizer(opt, named_parameters=named, compression=compression, ef=ef,
                                min_compress_bytes=min_compress_bytes,
                                backward_passes_per_step=backward_passes_per_step,
                                nan_policy=nan_policy, warmup_steps=warmup_steps)


def _momentum_clan(named: list[tuple[str, torch.nn.Parameter]], lr: float,
                   compression: str | Mapping[str, Any] | CodecSpec, ef: str, warmup_steps: int,
                   weight_decay: float, betas: tuple[float, float], eps: float,
                   min_compress_bytes: int | None, backward_passes_per_step: int,
                   nan_policy: str) -> torch.optim.Optimizer:
    """``communicate="momentum"``: OneBitLANS whose compression stage push_pulls momenta."""
    from ..api import push_pull_async
    from ..compress import build

    cs = parse_spec(compression)  # checked now, not when the warm-up ends
    ef21 = ef == "ef21"           # the estimate is the feedback: no residuals in the codec
    spec = CodecSpec(cs.name, dict(cs.params), {**cs.wrappers, "ef": None if ef21 else ef})
    build(spec, 4096)
    prefix = named[0][0] if named else "clan"  # distinct per model: names key the tensors

    def communicate(key: str, m: torch.Tensor) -> Any:
        return push_pull_async(m, name=f"{prefix}.clan_m.{key}", average=True,
                               compression=spec, min_compress_bytes=min_compress_bytes)

    opt = OneBitLANS([p for _, p in named], lr=lr, betas=betas, eps=eps,
                     weight_decay=weight_decay, freeze_step=warmup_steps,
                     communicate=communicate, ef21=ef21)
    # The wrapper averages dense gradients during the warm-up and stops once the optimizer's
    # compression_active turns true (it communicates momenta from then on).
    return DistributedOptimizer(opt, named_parameters=named, compression="none",
                                backward_passes_per_step=backward_passes_per_step,
                                nan_policy=nan_policy)

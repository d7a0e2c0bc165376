"""CLAN in one call: the headline method of gradpress (Zhong, Xie, Zheng, Lin 2021).

CLAN is LANS (Zheng et al. 2020) without per-layer gradient normalisation, stepped on the
two-way compressed gradient:

1. each worker compresses its gradient chunks with error feedback (``ef``) and pushes them;
2. each server decodes all workers' chunks, averages, adds its own residual and compresses again;
3. every worker decodes the same bytes into ``p.grad`` and takes the LANS step of
   :func:`gradpress.optim.clan` (``docs/optimizers.md``).

Defaults come from ``docs/convergence.md``: one-bit compression with vanilla error feedback and
50 uncompressed warm-up steps (on stdlib-mlm, CLAN onebit was 9.0% behind uncompressed LANS
without warm-up and 1.4% with it; corrected error feedback and finer scales helped less).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..compress.spec import CodecSpec
from ..optim import clan as clan_optimizer
from .optimizer import DistributedOptimizer

__all__ = ["CLAN"]

#: Uncompressed warm-up steps chosen by the ablation in docs/convergence.md.
DEFAULT_WARMUP_STEPS = 50


def CLAN(named_parameters: Iterable[tuple[str, torch.nn.Parameter]],  # noqa: N802
         lr: float = 1e-3, *, compression: str | Mapping[str, Any] | CodecSpec = "onebit",
         ef: str = "vanilla", warmup_steps: int = DEFAULT_WARMUP_STEPS,
         weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.999),
         eps: float = 1e-6, min_compress_bytes: int | None = 1 << 20,
         backward_passes_per_step: int = 1, nan_policy: str = "raise") -> torch.optim.Optimizer:
    """Build the CLAN optimizer: ``gradpress.optim.clan`` wrapped in a ``DistributedOptimizer``.

    Args:
        named_parameters: ``model.named_parameters()`` (names key the tensors on all workers).
        lr: learning rate. The paper's BERT-base values (batch 2k): 0.0014865 with onebit,
            0.001051 with topk 0.1%; on small models compressed runs often want the same or a
            slightly higher lr than uncompressed LANS (``docs/convergence.md``).
        compression: codec spec; ``"onebit"`` (32x) or ``"topk:k=0.001,values=fp16"`` (333x
            against fp16) are the paper's settings.
        ef: error feedback on workers and servers (``"vanilla"``; ``"corrected"`` scales the
            residual by lr_prev/lr_now, useful with steep lr schedules).
        warmup_steps: uncompressed steps before compression starts (raise it if a transformer's
            loss lags the uncompressed run early; 0 for small CNNs, which show no gap).
        weight_decay, betas, eps: LANS hyperparameters (``docs/optimizers.md``).
        min_compress_bytes: tensors smaller than this travel uncompressed and exact.
        backward_passes_per_step, nan_policy: as in :func:`DistributedOptimizer`.
    """
    named = list(named_parameters)
    opt = clan_optimizer([p for _, p in named], lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay)
    return DistributedOptimizer(opt, named_parameters=named, compression=compression, ef=ef,
                                min_compress_bytes=min_compress_bytes,
                                backward_passes_per_step=backward_passes_per_step,
                                nan_policy=nan_policy, warmup_steps=warmup_steps)

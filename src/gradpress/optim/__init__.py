"""Optimizers for (compressed) data-parallel training: LANS/CLAN, LAMB and 1-bit Adam.

They are plain single-process ``torch.optim.Optimizer`` subclasses that read ``p.grad``; the
distributed layer (:class:`gradpress.DistributedOptimizer`) puts the averaged, decompressed
gradient there before ``step()``. See ``docs/reference/api.md`` for the math and
``docs/guide.md`` for choosing one.

    from gradpress.optim import LANS, LAMB, OneBitAdam, OneBitLANSCore, clan_core
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .lamb import LAMB
from .lans import LANS
from .onebit_adam import Communicate, OneBitAdam
from .onebit_lans import OneBitLANSCore

__all__ = ["LANS", "LAMB", "OneBitAdam", "OneBitLANSCore", "Communicate", "clan_core",
           "CLAN_REFERENCE_LR", "weight_decay_groups"]

#: The paper's learning rates for BERT-base at total batch 2k (Zhong et al. 2021, phase 1).
CLAN_REFERENCE_LR = {
    "lans": 0.00125,        # uncompressed LANS (normalize_grad=True)
    "onebit": 0.0014865,    # CLAN with onebit compression and error feedback
    "topk": 0.001051,       # CLAN with topk:k=0.001 and error feedback
}


def weight_decay_groups(params: Iterable[torch.nn.Parameter],
                        weight_decay: float) -> list[dict[str, Any]]:
    """Param groups with ``weight_decay`` on weight matrices and kernels only.

    Tensors of two or more dimensions get ``weight_decay``; biases and normalisation weights
    (one dimension or none) get 0, as BERT's and LANS's recipes do (decaying a LayerNorm gain
    pulls it towards zero). Parameters with ``requires_grad=False`` are left out; an empty
    group is dropped. The decayed group comes first, each in the order given.
    """
    ps = [p for p in params if p.requires_grad]
    decay, rest = [p for p in ps if p.dim() > 1], [p for p in ps if p.dim() <= 1]
    return [g for g in ({"params": decay, "weight_decay": weight_decay},
                        {"params": rest, "weight_decay": 0.0}) if g["params"]]


def clan_core(params: Iterable[Any], lr: float = 1e-3,
              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
              weight_decay: float = 0.01, min_trust: float | None = None,
              max_trust: float | None = None) -> LANS:
    """The single-process core of CLAN (``gp.CLAN`` builds it for a cluster): :class:`LANS`
    with per-layer gradient normalisation off.

    CLAN (Zhong, Xie, Zheng, Lin 2021, "Compressed Communication for Distributed Training:
    Adaptive Methods and System") is LANS driven by the two-way compressed gradient with
    error feedback: workers compress with error feedback, servers average, compress again
    (with their own residual) and every worker decompresses the same bytes into ``p.grad``.
    Gradient normalisation is off because the compressed gradient carries the error-feedback
    residual, whose scale must survive into the update.

    The paper's reference learning rates for BERT-base at total batch 2k (phase 1, with
    warm-up and decay; see :data:`CLAN_REFERENCE_LR`): uncompressed LANS 0.00125; CLAN
    ``onebit`` 0.0014865; CLAN ``topk:k=0.001`` 0.001051. Scale roughly with the square root of
    the batch size for other batches, and re-tune per compressor.

    This builds only the optimizer; wrap it with
    ``gp.DistributedOptimizer(opt, named_parameters=..., compression="onebit", ef="vanilla")``.
    :func:`gradpress.CLAN` builds both in one call.

    Args:
        params: iterable of parameters or of param-group dicts.
        lr: learning rate, >= 0 (see the reference rates above).
        betas: ``(b1, b2)``, each in [0, 1).
        eps: term added to the root of the second moment, > 0.
        weight_decay: decoupled weight decay, >= 0 (use a group with 0 for biases/LayerNorm).
        min_trust: optional lower bound of the LANS trust ratios.
        max_trust: optional upper bound of the LANS trust ratios.

    Returns:
        A :class:`LANS` with ``normalize_grad=False``.

    Raises:
        ValueError: a hyperparameter is out of range.
    """
    return LANS(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                normalize_grad=False, min_trust=min_trust, max_trust=max_trust)

"""Compressed gradients for FSDP2 (``torch.distributed.fsdp.fully_shard``)::

    import gradpress.fsdp
    model = ...; fully_shard(layer) for each layer; fully_shard(model)
    st = gradpress.fsdp.compress(model, compression="onebit", ef="vanilla")
    ... train with any torch optimizer on model.parameters() ...
    st.save(ckpt_dir)  # beside torch.distributed.checkpoint's model/optimizer; st.load(ckpt_dir)

Every ``FSDPModule``'s reduce-scatter is replaced by a compressed exchange with error feedback
on the workers (:class:`CompressedReduceScatter`); the parameter all-gather is unchanged.

* ``comm.py``: :class:`CompressedReduceScatter` (the exchange) and the torch API check;
* ``state.py``: :class:`FSDPCompressionState` (hyperparameters, residuals, statistics,
  checkpoints).
"""

from __future__ import annotations

import torch

from .. import defaults
from ..compress import EFSpec
from ..compress.spec import Compression
from .comm import CompressedReduceScatter, require_fsdp_api
from .state import FSDPCompressionState

__all__ = ["compress", "FSDPCompressionState", "CompressedReduceScatter", "check_optimizer"]

#: gradpress optimizers whose update needs whole-tensor norms (layer-wise trust ratios), which
#: a rank holding one shard of each parameter cannot compute alone.
_LAYERWISE = ("LANS", "LAMB", "CLAN", "OneBitLANS")


def compress(module: torch.nn.Module, compression: Compression = defaults.COMPRESSION,
             ef: str | EFSpec | None = defaults.EF, *,
             min_compress_bytes: int = defaults.HOOK_MIN_COMPRESS_BYTES, dense_steps: int = 0,
             seed: int = 0, lr: float | None = None,
             state: FSDPCompressionState | None = None) -> FSDPCompressionState:
    """Install a compressed reduce-scatter on every ``FSDPModule`` under ``module`` (call it
    once, after ``fully_shard``, on the root) and return their shared state.

    Args: as :class:`FSDPCompressionState` (``compression``, ``ef``, ``min_compress_bytes``,
    ``dense_steps``, ``seed``, ``lr``); or ``state``, an existing state to use instead.

    Each module's residuals are keyed by its qualified name under ``module`` (``""``: the root),
    so the same model resumes into the same residuals. Raises ImportError (naming the torch
    version) without FSDP2's custom comm API, TypeError when ``module`` holds no
    ``FSDPModule``.
    """
    require_fsdp_api()
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"gradpress.fsdp.compress: module must be a torch.nn.Module after "
                        f"fully_shard, got {type(module).__name__}")
    targets = [(n, m) for n, m in module.named_modules() if isinstance(m, FSDPModule)]
    if not targets:
        raise TypeError(f"gradpress.fsdp.compress: {type(module).__name__} holds no FSDPModule; "
                        f"call torch.distributed.fsdp.fully_shard on it (and its layers) first")
    if state is None:
        state = FSDPCompressionState(compression, ef, min_compress_bytes=min_compress_bytes,
                                     dense_steps=dense_steps, seed=seed, lr=lr)
    for index, (name, m) in enumerate(targets):
        try:
            m.set_custom_reduce_scatter(CompressedReduceScatter(state, name, index))
        except ValueError as e:  # e.g. several parameter groups (shard_placement_fn meshes)
            raise ValueError(f"gradpress.fsdp.compress: module {name!r}: {e}") from e
    return state


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse (TypeError) a gradpress layer-wise optimizer (LANS, LAMB, CLAN, OneBitLANS) on
    sharded parameters: its trust ratio needs each tensor's whole norm, and gradpress does not
    compute norms across FSDP shards. Plain torch optimizers (SGD, Adam, AdamW, ...) are
    element-wise and pass."""
    from torch.distributed.tensor import DTensor
    name = type(optimizer).__name__
    if not type(optimizer).__module__.startswith("gradpress") or name not in _LAYERWISE:
        return
    sharded = any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
    if sharded:
        raise TypeError(f"gradpress.fsdp: {name} computes a layer-wise trust ratio from whole-"
                        f"tensor norms, which FSDP2's sharded parameters do not have on one "
                        f"rank; gradpress does not reduce those norms across shards. Use an "
                        f"element-wise torch optimizer (AdamW, SGD) with FSDP2, or {name} with "
                        f"the DDP hook or gp.DistributedOptimizer")

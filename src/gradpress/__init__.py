"""gradpress: data-parallel PyTorch training with two-way compressed communication.

The public API (see ``docs/reference/api.md``)::

    import gradpress as gp
    gp.init(); gp.rank(); gp.size(); gp.local_rank()
    y = gp.push_pull(t, name="w", average=True, compression="onebit", ef="vanilla")
    h = gp.push_pull_async(t, name="w"); y = h.wait()
    opt = gp.DistributedOptimizer(torch_opt, named_parameters=model.named_parameters(), ...)
    opt = gp.CLAN(model.named_parameters(), lr=1e-3, compression="onebit")       # the paper's
    opt = gp.OneBitLANS(model.named_parameters(), lr=1e-3, compression="onebit")  # transformers
    with gp.DiLoCo(model, torch.optim.AdamW(model.parameters()), sync_every=50): ...  # slow links
    print(opt.plan().format())    # per tensor: exact or which codec, bytes per step, and why
    gp.broadcast_parameters(model.state_dict(), root_rank=0)
    gp.stats(); gp.shutdown()
    gp.GradpressError, gp.CommTimeoutError, gp.CheckpointError, ...  # exceptions to catch
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> module that defines it; imported on first use so `import gradpress` stays light.
_LAZY = {
    "init": "gradpress.api",
    "shutdown": "gradpress.api",
    "rank": "gradpress.api",
    "size": "gradpress.api",
    "local_rank": "gradpress.api",
    "local_size": "gradpress.api",
    "is_initialized": "gradpress.api",
    "push_pull": "gradpress.api",
    "push_pull_async": "gradpress.api",
    "Handle": "gradpress.api",
    "stats": "gradpress.api",
    "barrier": "gradpress.api",
    "worker_state_dict": "gradpress.api",
    "load_worker_state_dict": "gradpress.api",
    "save_server_state": "gradpress.api",
    "load_server_state": "gradpress.api",
    "DistributedOptimizer": "gradpress.torch.optimizer",
    "CLAN": "gradpress.torch.clan",
    "DiLoCo": "gradpress.torch.diloco",
    "OneBitLANS": "gradpress.torch.clan",
    "Plan": "gradpress.torch.plan",
    "TensorPlan": "gradpress.torch.plan",
    "broadcast_parameters": "gradpress.torch.broadcast",
    "broadcast_optimizer_state": "gradpress.torch.broadcast",
    "broadcast_object": "gradpress.torch.broadcast",
    # the exceptions a program catches (docs/reference/api.md, "Exceptions")
    "GradpressError": "gradpress.ps.errors",
    "CommTimeoutError": "gradpress.ps.errors",
    "PeerError": "gradpress.ps.errors",
    "PayloadError": "gradpress.ps.errors",
    "AuthError": "gradpress.ps.errors",
    "ConfigMismatchError": "gradpress.ps.errors",
    "KeyCollisionError": "gradpress.ps.errors",
    "NotInitializedError": "gradpress.ps.errors",
    "CheckpointError": "gradpress.ps.errors",
    "TrainingDiverged": "gradpress.train.guard",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name == "checkpoint":  # the submodule gradpress.checkpoint, imported on first use
        return importlib.import_module("gradpress.checkpoint")
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'gradpress' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value

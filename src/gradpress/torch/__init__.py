"""PyTorch integration: :class:`DistributedOptimizer` (gradient push_pull overlapped with backward),
the one-call adaptive methods :func:`CLAN` and :func:`OneBitLANS`, and broadcasts of parameters
and optimizer state."""

from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .clan import CLAN, OneBitLANS
from .optimizer import DistributedOptimizer

__all__ = ["CLAN", "OneBitLANS", "DistributedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state", "broadcast_object"]

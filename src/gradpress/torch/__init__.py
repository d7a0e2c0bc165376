"""PyTorch integration: :class:`DistributedOptimizer` (gradient push_pull overlapped with backward),
broadcasts of parameters and optimizer state, and checkpoint helpers."""

from .broadcast import broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .clan import CLAN
from .optimizer import DistributedOptimizer

__all__ = ["CLAN", "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state",
           "broadcast_object"]

"""The parameter-server runtime: cluster rendezvous, partitioning, transport, worker pipeline
and server engine. The public entry points are in :mod:`gradpress.api` (``gradpress.init``,
``gradpress.push_pull``, ...) and :mod:`gradpress.launch` (``gradpress launch``)."""

from .config import ClusterConfig, PSConfig
from .errors import (
    CommTimeoutError,
    ConfigMismatchError,
    GradpressError,
    KeyCollisionError,
    NotInitializedError,
    PeerError,
)

__all__ = ["PSConfig", "ClusterConfig", "GradpressError", "CommTimeoutError", "PeerError",
           "ConfigMismatchError", "KeyCollisionError", "NotInitializedError"]

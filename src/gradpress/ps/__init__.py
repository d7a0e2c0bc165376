"""The parameter-server runtime: cluster rendezvous, partitioning, transport, worker pipeline
and server engine. The public entry points are in :mod:`gradpress.api` (``gradpress.init``,
``gradpress.push_pull``, ...) and :mod:`gradpress.launch` (``gradpress launch``)."""

from .config import ClusterConfig, PSConfig
from .errors import (
    AuthError,
    CommTimeoutError,
    ConfigMismatchError,
    GradpressError,
    KeyCollisionError,
    NotInitializedError,
    PayloadError,
    PeerError,
)

__all__ = ["PSConfig", "ClusterConfig", "GradpressError", "CommTimeoutError", "PeerError",
           "PayloadError", "AuthError", "ConfigMismatchError", "KeyCollisionError",
           "NotInitializedError"]

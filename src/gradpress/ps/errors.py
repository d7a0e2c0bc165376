"""Exceptions of the parameter-server runtime and of its checkpoints (all importable from
``gradpress``).

Every error raised while waiting names what was waited for: the key (and the tensor name and
chunk when known), the peer (role and rank, e.g. ``server 1 (rank 3)``) and the stage
(``"pull"``, ``"push"``, ``"control"``, ...).
"""

from __future__ import annotations

__all__ = ["GradpressError", "CommTimeoutError", "PeerError", "PayloadError", "AuthError",
           "ConfigMismatchError", "KeyCollisionError", "NotInitializedError", "CheckpointError"]


class GradpressError(RuntimeError):
    """Base class of runtime failures of the parameter-server engine."""


class _WaitError(GradpressError):
    """A wait that failed; carries ``key``, ``peer`` and ``stage``."""

    def __init__(self, message: str, *, key: str | int | None = None, peer: str | None = None,
                 stage: str | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.peer = peer
        self.stage = stage


class CommTimeoutError(_WaitError, TimeoutError):
    """A wait ran past the configured timeout (``GRADPRESS_TIMEOUT``)."""


class PeerError(_WaitError):
    """A peer failed or closed its connection while we waited on it."""


class PayloadError(_WaitError, ValueError):
    """A message failed validation (header, size, step, key, non-finite values); it names the
    sender (``peer``) and the key, and was never decoded into a result (docs/reliability.md)."""


class AuthError(GradpressError):
    """A process could not prove the job secret at rendezvous, or the job could not prove it
    back (``GRADPRESS_SECRET``; see :mod:`gradpress.ps.auth`)."""


class ConfigMismatchError(GradpressError, ValueError):
    """Workers disagree on a key: tensor size, codec spec, error feedback or averaging."""


class KeyCollisionError(GradpressError):
    """Two different (tensor, chunk) pairs hash to the same key; rename one tensor."""


class NotInitializedError(GradpressError):
    """A gradpress function was called before ``gradpress.init()`` (or after ``shutdown()``)."""


class CheckpointError(GradpressError, ValueError):
    """A checkpoint was refused: incomplete (no ``meta.json``), a file missing, corrupt or
    truncated (its sha256 differs from ``meta.json``'s), files of two saves mixed, or saved by
    a job of other world sizes, model or compression; the message names the file."""

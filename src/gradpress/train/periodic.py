"""Periodic checkpoints of a ``gradpress train`` run and resuming from them.

With ``--checkpoint-every K`` the workers of a bundled task save, after every K-th step, into
``OUT/checkpoints/step-<N>/`` through :func:`gradpress.checkpoint.save`: the parameters, the
optimizer, every worker's and server's codec state (error-feedback residuals), the RNG state, and
as ``extra`` what the training loop needs to go on bit-identically: the data position (epoch and
batches drawn in it; the batch order is a function of the seed and the epoch), the step counter
(which gives the lr schedule's position) and the divergence guard's state. After a checkpoint is
complete (its ``meta.json`` written, with the sha256 of every file) the older ones beyond the
newest :data:`KEEP` are deleted, so a crash during a save leaves the previous one valid.

``--resume DIR`` restarts from that checkpoint; ``--resume auto`` from the newest complete one
under ``OUT/checkpoints`` whose files match their checksums (:func:`gradpress.checkpoint.latest`:
a refused one is skipped with a warning), or from the start when there is none.
:func:`params_sha256` is the fingerprint of the final parameters in ``report.json``.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["SUBDIR", "KEEP", "params_sha256", "tensors_sha256", "checkpoints", "resolve_resume",
           "TrainCheckpoints"]

log = logging.getLogger(__name__)

#: The run directory's subdirectory of the checkpoints.
SUBDIR = "checkpoints"
#: Complete checkpoints kept (the newest ones).
KEEP = 2
_PREFIX = "step-"


def params_sha256(model: nn.Module) -> str:
    """The hex sha256 of a model's ``state_dict``, in sorted name order
    (:func:`tensors_sha256`)."""
    return tensors_sha256(sorted(model.state_dict().items())).hex()


def tensors_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """The sha256 of named tensors: per tensor, in the order given, the name, dtype, shape and
    the tensor's bytes (so equal digests mean bit-identical tensors)."""
    h = hashlib.sha256()
    for name, t in named:
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def step_dir(out: str | Path, step: int) -> Path:
    """``OUT/checkpoints/step-<step>``."""
    return Path(out) / SUBDIR / f"{_PREFIX}{step}"


def checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """The ``step-<N>`` directories under ``root`` (complete or not), newest first."""
    found = []
    for d in Path(root).glob(f"{_PREFIX}*"):
        tail = d.name[len(_PREFIX):]
        if d.is_dir() and tail.isdigit():
            found.append((int(tail), d))
    return sorted(found, reverse=True)


def resolve_resume(value: str | None, out: str | Path,
                   world: tuple[int, int] | None = None) -> str | None:
    """The checkpoint directory ``--resume`` names: ``auto`` is the newest valid one under
    ``OUT/checkpoints`` (None when there is none: start afresh); a directory is verified
    (ValueError naming the file and checksums if it is refused). With ``world`` (workers,
    servers), a checkpoint of other world sizes is announced on stdout, naming both (the
    workers apply the resize rule of :mod:`gradpress.elastic`)."""
    from ..checkpoint import latest, verify
    from ..ps.codec_state import read_meta

    if value is None:
        return None
    if value == "auto":
        found = latest(Path(out) / SUBDIR)
        if found is None:
            return None
        meta, path = read_meta(found) or {}, Path(found)  # verified by latest
    else:
        meta, path = verify(value), Path(value)
    saved = (meta.get("num_workers"), meta.get("num_servers"))
    if world is not None and saved != tuple(world):
        print(f"gradpress train: --resume {value}: checkpoint {path} was saved by a job with "
              f"{saved[0]} workers and {saved[1]} servers, this run has {world[0]} workers and "
              f"{world[1]} servers: the workers fold the saved residuals (resize rule 'fold', "
              f"gradpress.elastic)", flush=True)
    return str(path.resolve())


def checkpoint_step(directory: str | Path) -> int:
    """The step a complete checkpoint was saved at (its ``meta.json``)."""
    from ..ps.codec_state import read_meta

    meta = read_meta(directory)
    if meta is None:
        raise ValueError(f"{directory} is not a complete gradpress checkpoint")
    return int(meta["step"])


class TrainCheckpoints:
    """Saves and restores one run's checkpoints on one worker (collective over the workers).

    Args:
        session: the run's :class:`~gradpress.train.session.Session` (its config gives
            ``checkpoint_every``, ``resume`` and ``out``).
        model, optimizer: what is saved and restored.
    """

    def __init__(self, session: Any, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.s, self.model, self.opt = session, model, optimizer
        self.every = session.cfg.checkpoint_every
        self.root = Path(session.cfg.out) / SUBDIR
        self.position = (0, 0)  # (epoch, batches drawn in it) to go on from

    def resume(self, directory: str) -> int:
        """Load ``directory`` (:func:`gradpress.checkpoint.load`), set the session's step and
        lr and :attr:`position`; returns the step.

        Steps:

        1. load the model, optimizer, codec, server and RNG state (a checkpoint of another
           number of workers under the resize rule of :mod:`gradpress.elastic`);
        2. read this worker's ``extra``: data position (resized: the batches drawn in the epoch
           scaled by saved workers / workers, so as many samples count as drawn), step counter,
           guard state; a resize is recorded in the metrics (``report.json``: ``resized``);
        3. set the session's step and apply the lr schedule for it.
        """
        from .. import checkpoint, elastic

        step = checkpoint.load(directory, self.model, self.opt)  # step 1
        extra = checkpoint.extra(directory) or {}  # step 2
        self.position = (int(extra.get("epoch", 0)), int(extra.get("index", 0)))
        resized = elastic.last_resize()
        if resized is not None and resized["checkpoint"] != str(Path(directory).resolve()):
            resized = None  # an earlier load's
        if resized is not None:  # as many samples of the epoch count as drawn
            self.position = (self.position[0],
                             self.position[1] * resized["saved_workers"] // resized["workers"])
        if self.s.guard is not None and extra.get("guard") is not None:
            self.s.guard.load_state_dict(extra["guard"])
        self.s.steps = step  # step 3
        self.s.set_lr(self.opt)
        if resized is not None:
            self.s.note_resize(resized)
        return step

    def after_step(self, epoch: int, index: int) -> None:
        """Save when the session's step is a multiple of ``checkpoint_every`` (``index``:
        batches drawn in ``epoch``), then delete the checkpoints older than the newest
        :data:`KEEP`."""
        from .. import api, checkpoint

        step = self.s.steps
        if not self.every or step % self.every:
            return
        guard = self.s.guard.state_dict() if self.s.guard is not None else None
        extra = {"epoch": epoch, "index": index, "steps": step, "guard": guard}
        settle = getattr(self.opt, "settle", None)
        if settle is not None:  # diloco: a round on the wire lands first (no push in flight)
            settle()
        checkpoint.save(step_dir(self.s.cfg.out, step), self.model, self.opt, step, extra)
        if api.rank() == 0:
            self.prune()

    def prune(self) -> None:
        """Delete every checkpoint older than the newest :data:`KEEP` complete ones
        (incomplete ones too: a save that crashed)."""
        from ..ps.codec_state import META_FILE

        found = checkpoints(self.root)
        complete = [step for step, d in found if (d / META_FILE).is_file()]
        if len(complete) < KEEP:
            return
        oldest_kept = complete[KEEP - 1]
        for step, d in found:
            if step < oldest_kept:
                shutil.rmtree(d, ignore_errors=True)

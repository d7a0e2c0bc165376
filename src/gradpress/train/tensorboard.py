"""TensorBoard scalars of ``gradpress train``, from the records that go to ``metrics.jsonl``.

Rank 0's :class:`~gradpress.train.session.Session` hands every record it writes to
``metrics.jsonl`` to a :class:`TensorBoardWriter` too (when the run's ``tensorboard`` option is
on), which writes event files into ``<run dir>/tensorboard/`` with
``torch.utils.tensorboard.SummaryWriter``. The tags, with the training step as ``global_step``
(:func:`scalars`):

* ``train/loss`` (rank 0's), ``train/lr``;
* ``eval/<metric>`` for each metric of an evaluation;
* ``comm/bytes_pushed_per_step``, ``comm/bytes_pulled_per_step``,
  ``comm/dense_fp32_bytes_per_step`` (this worker's, as in ``metrics.jsonl``) and
  ``comm/compression_ratio``: fp32 bytes over bytes on the wire, both directions
  (``2 * dense / (pushed + pulled)``, the report's ``model_ratio_vs_fp32`` for one step);
* ``time/step`` (seconds since the previous record) and ``time/<stage>`` for each stage timed
  (``data``, ``compute``, ``sync``, ``update``, ``eval``, and the runtime's ``compress``,
  ``send``, ``wait``, ``decompress``).

The ``tensorboard`` package is the optional extra ``gradpress[tensorboard]``; it is imported
only when a writer is built, never by ``import gradpress``. ``TrainConfig.tensorboard=None``
(auto) is decided by ``gradpress train`` (:func:`resolve`) before the workers start; a session
whose config still says None (``gradpress demo``'s runs) writes no event files.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["TensorBoardWriter", "scalars", "available", "resolve", "SUBDIR", "INSTALL"]

#: The directory of the event files inside the run directory.
SUBDIR = "tensorboard"
#: How to get the package.
INSTALL = 'pip install "gradpress[tensorboard]"'


def available() -> bool:
    """Whether the ``tensorboard`` package is installed (found, not imported)."""
    return importlib.util.find_spec("tensorboard") is not None


def resolve(requested: bool | None) -> bool:
    """The ``tensorboard`` option's effect: ``None`` (auto) is on when the package is
    installed; ``True`` without it is a ``ValueError`` that says how to install it."""
    if requested is None:
        return available()
    if requested and not available():
        raise ValueError(f"--tensorboard needs the tensorboard package: {INSTALL} (or give "
                         "--no-tensorboard)")
    return bool(requested)


def scalars(record: Mapping[str, Any]) -> list[tuple[str, float, int]]:
    """``(tag, value, step)`` for each scalar of one ``metrics.jsonl`` record (see the module
    docstring); records other than ``step`` and ``eval`` give none."""
    kind, step = record.get("kind"), int(record.get("step", 0))
    out: list[tuple[str, float]] = []
    if kind == "step":
        out += [("train/loss", record["loss"]), ("train/lr", record["lr"])]
        push, pull = record["bytes_pushed"], record["bytes_pulled"]
        dense = record["dense_fp32_bytes"]
        out += [("comm/bytes_pushed_per_step", push), ("comm/bytes_pulled_per_step", pull),
                ("comm/dense_fp32_bytes_per_step", dense)]
        if push + pull > 0:
            out.append(("comm/compression_ratio", 2 * dense / (push + pull)))
        if "step_s" in record:
            out.append(("time/step", record["step_s"]))
        for name, seconds in record.get("stages", {}).items():
            out.append((f"time/{name.removesuffix('_s')}", seconds))
    elif kind == "eval":
        out += [(f"eval/{name}", value) for name, value in record["metrics"].items()]
    return [(tag, float(value), step) for tag, value in out]


class TensorBoardWriter:
    """Writes the scalars of ``metrics.jsonl`` records as TensorBoard event files.

    Args:
        log_dir: the event files' directory (``<run dir>/tensorboard``), created if missing.
        flush_secs: how often the writer's thread flushes pending events to disk (a running
            ``tensorboard`` sees them that late at most); :meth:`close` flushes the rest.

    Raises:
        ValueError: the ``tensorboard`` package is missing (the message says how to install).
    """

    def __init__(self, log_dir: str | Path, flush_secs: int = 10) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ValueError(f"TensorBoard scalars need the tensorboard package: {INSTALL} "
                             f"({e})") from None
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._w: Any = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs)

    def write(self, record: Mapping[str, Any]) -> None:
        """Add the record's scalars (nothing after :meth:`close`)."""
        if self._w is None:
            return
        for tag, value, step in scalars(record):
            self._w.add_scalar(tag, value, global_step=step)
        if record.get("kind") in ("summary", "end"):
            self._w.flush()  # the run's last record: on disk now, whatever happens next

    def close(self) -> None:
        """Flush and close the event file; later writes are ignored (a closed
        ``SummaryWriter`` would open a new file)."""
        if self._w is not None:
            w, self._w = self._w, None
            w.close()

"""Exact checkpoints of a gradpress training job: model, optimizer, and the compression state
of every worker and server (error-feedback residuals, momentum buffers, step counters), so a
resumed run continues bit-identically (residuals are state: DeepSpeed resets them, we do not).
Layout of a checkpoint directory::

    meta.json        format, step, world sizes, compression spec, save tag, the sha256 of
                     every file below (written last, atomically)
    worker<r>.pt     per worker: its codec state, RNG state and ``extra``; worker 0 also holds
                     the model and the wrapped optimizer's state (replicas are identical;
                     every worker holds its own if the optimizer's ``per_worker_state``)
    server<i>.pt     per server: residuals and step counters of its keys

Usage (the script runs under ``gradpress launch``; ``--resume DIR`` sets ``GRADPRESS_RESUME``)::

    start = 0
    if gradpress.checkpoint.resume_dir() is not None:
        start = gradpress.checkpoint.load(gradpress.checkpoint.resume_dir(), model, opt)
    else:
        gp.broadcast_parameters(model.state_dict())
    for step in range(start, total):
        ...
        if step % 1000 == 999:
            gradpress.checkpoint.save("ckpt", model, opt, step + 1)

Every file is written under a temporary name and renamed; ``meta.json`` records each file's
sha256 and :func:`load` (and :func:`verify`) refuse a file whose checksum differs (a truncated or
corrupt file) with a :class:`~gradpress.CheckpointError` (a ValueError) naming the file and both
checksums.

See docs/design.md (checkpoints) and docs/checkpoints.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import api
from .elastic import ResizeEvent, check_rule, resized_engine_state
from .ps.codec_state import FORMAT, META_FILE, atomic_save, load_file, read_meta, worker_file
from .ps.errors import CheckpointError
from .torch.broadcast import (
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    load_optimizer_state,
    shared_state_dict,
)

__all__ = ["save", "load", "extra", "resume_dir", "checkpoints_dir", "latest", "verify",
           "file_sha256"]


log = logging.getLogger(__name__)


def resume_dir() -> str | None:
    """The directory given to ``gradpress launch --resume`` (``GRADPRESS_RESUME``), or None.
    Under ``gradpress launch --max-restarts``, a restarted job gets the newest valid checkpoint
    of ``--checkpoints`` here."""
    return os.environ.get("GRADPRESS_RESUME") or None


def checkpoints_dir() -> str | None:
    """The directory given to ``gradpress launch --checkpoints`` (``GRADPRESS_CHECKPOINTS``),
    under which the script saves each checkpoint in a subdirectory of its own, or None."""
    return os.environ.get("GRADPRESS_CHECKPOINTS") or None


def latest(root: str | os.PathLike) -> str | None:
    """The newest (by saved step) checkpoint among the subdirectories of ``root`` that is
    complete and whose files match their checksums; None if there is none. Needs no running
    job. Each subdirectory refused is logged as a warning and skipped: no ``meta.json`` (a save
    that did not finish), unreadable metadata, a file that does not match its checksum. The one
    finder of ``--resume auto`` and of the restarts of ``gradpress launch --max-restarts`` and
    ``gradpress train --max-restarts``."""
    found = []
    for d in sorted(Path(root).iterdir()) if Path(root).is_dir() else ():
        if not d.is_dir():
            continue
        try:
            meta = read_meta(d)
            if meta is None:
                raise ValueError(f"{META_FILE} is missing (the save did not finish)")
            found.append((int(meta["step"]), d))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("gradpress: skipping checkpoint %s: %s", d, e)
    for _, d in sorted(found, reverse=True):
        try:
            verify(d)
        except ValueError as e:
            log.warning("gradpress: skipping checkpoint %s: %s", d, e)
            continue
        return str(d.resolve())
    return None


def save(directory: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         step: int, extra: Any = None) -> str:
    """Write a checkpoint of the job into ``directory``; collective over the workers.

    Steps:

    1. agree on a tag (a fresh id from worker 0) and invalidate the directory's old
       ``meta.json``;
    2. every worker writes ``worker<rank>.pt`` atomically (temporary file, then rename):
       its codec state (every tensor it push_pulled), RNG state (CPU, and the CUDA generator
       of each device the model is on, :func:`rng_state`) and ``extra``; worker 0 adds
       the model and the optimizer's state (without the per-worker codec part); every worker
       adds its own optimizer state when it differs between workers (an optimizer class with
       ``per_worker_state = True``, such as :class:`gradpress.optim.OneBitLANSCore`);
    3. every server writes ``server<i>.pt`` (:func:`gradpress.save_server_state`);
    4. after a barrier, the first worker of each node writes ``meta.json`` (step, world sizes,
       spec, tag, the sha256 of every worker and server file it sees), atomically: a directory
       without it is not a complete checkpoint.

    Call it after ``optimizer.step()`` (no push_pull in flight), with the same ``directory`` and
    ``step`` on every worker. ``extra`` is this worker's plain data (tensors, numbers, strings,
    lists, dicts), returned by :func:`extra`. Returns the absolute directory.
    """
    path = _check_args(directory, model, optimizer)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint.save: step must be an int >= 0, got {step!r}")
    rank, rt = api.rank(), api._rt()
    tag = broadcast_object(uuid.uuid4().hex if rank == 0 else None)  # step 1
    path.mkdir(parents=True, exist_ok=True)
    if api.local_rank() == 0:
        (path / META_FILE).unlink(missing_ok=True)
    api.barrier()
    blob: dict[str, Any] = {"format": FORMAT, "tag": tag, "step": step, "rank": rank,
                            "engine": api.worker_state_dict(),
                            "rng": rng_state(train_devices(model)),
                            "extra": extra}
    per_worker = _per_worker(optimizer)
    if rank == 0:
        blob["model"] = model.state_dict()
    if rank == 0 or per_worker:
        blob["optimizer"] = _inner_state(optimizer)
    atomic_save(blob, worker_file(path, rank))  # step 2
    rt.worker.checkpoint.server_state("save", str(path), tag)  # step 3
    api.barrier()
    if api.local_rank() == 0:  # step 4
        lay = rt.cluster.layout
        meta = {"format": FORMAT, "tag": tag, "step": step, "num_workers": lay.num_workers,
                "num_servers": lay.num_servers, "colocate": lay.colocate, "nnodes": lay.nnodes,
                "hierarchical": lay.hierarchical, "spec": _spec(optimizer),
                "per_worker_optimizer": per_worker,
                "files": _checksums(path, lay.num_workers, lay.num_servers)}
        _write_json(path / META_FILE, meta)
    api.barrier()
    return str(path)


def load(directory: str | os.PathLike, model: torch.nn.Module,
         optimizer: torch.optim.Optimizer, *, resize: str = "fold") -> int:
    """Restore a checkpoint written by :func:`save`; returns its step. Collective over workers.

    Steps:

    1. read ``meta.json``; with other world sizes than the saved ones, apply ``resize``
       (:mod:`gradpress.elastic`: ``"fold"`` the saved workers' residuals into their mean,
       ``"reset"`` them, or ``"refuse"``: a CheckpointError naming both layouts); check the
       checksums of the files this worker reads and of the server files (:func:`verify`);
    2. worker 0 loads the model and the optimizer state and broadcasts both to every worker
       (the per-worker codec state is not broadcast; a per-worker optimizer state is loaded
       by each worker from its own file instead); the state arrives through the CPU, each
       tensor onto its parameter's device, after the old state is released;
    3. every worker restores its own codec state (resized: the rule's) and RNG state from
       ``worker<rank>.pt`` (a worker the saved job did not have: worker 0's RNG state; the
       CUDA generators into the devices the model is on now, :func:`set_rng_state`);
    4. every server restores its keys (:func:`gradpress.load_server_state`), re-sharded over
       the servers of this job.

    Call it after ``gradpress.init()`` and creating the model and optimizer, before the first
    training step (with a ``DistributedOptimizer``, before any ``backward``).
    """
    path = _check_args(directory, model, optimizer)
    meta, event = _check_meta(path, check_rule(resize))  # step 1
    rank, rt = api.rank(), api._rt()
    own = rank if event is None or rank < event.saved_workers else 0
    readers = range(event.saved_workers) if event is not None and resize == "fold" else [own]
    verify(path, [*(worker_file(path, r).name for r in {own, *readers}),
                  *(f"server{i}.pt" for i in range(int(meta["num_servers"])))])
    blob = _worker_blob(path, own, meta["tag"])
    per_worker = bool(meta.get("per_worker_optimizer"))
    engine = blob["engine"] if event is None else resized_engine_state(
        event, per_worker, lambda r: blob["engine"] if r == own else
        _worker_blob(path, r, meta["tag"])["engine"])
    if rank == 0:  # step 2
        model.load_state_dict(blob["model"])
    if rank == 0 or per_worker:
        load_optimizer_state(optimizer, blob["optimizer"])
    broadcast_parameters(model.state_dict(), root_rank=0)
    if not per_worker:
        broadcast_optimizer_state(optimizer, root_rank=0)
    api.load_worker_state_dict(engine)  # step 3
    set_rng_state(blob["rng"], train_devices(model))
    rt.worker.checkpoint.server_state("load", str(path), meta["tag"])  # step 4
    return int(meta["step"])


def _worker_blob(path: Path, rank: int, tag: str) -> dict[str, Any]:
    """Saved worker ``rank``'s file, checked to belong to the save ``tag``."""
    blob = load_file(worker_file(path, rank), f"worker {rank}")
    if blob.get("tag") != tag:
        raise CheckpointError(f"checkpoint {path}: worker{rank}.pt belongs to another save (tag "
                              f"{blob.get('tag')!r}, meta.json has {tag!r})")
    return blob


def extra(directory: str | os.PathLike) -> Any:
    """The ``extra`` this worker passed to :func:`save` (None if it passed none); a worker the
    saved job did not have (it had fewer workers) gets worker 0's."""
    path = Path(directory).resolve()
    rank = api.rank()
    meta = read_meta(path)
    if meta is not None and rank >= int(meta["num_workers"]):
        rank = 0
    return load_file(worker_file(path, rank), f"worker {rank}").get("extra")


def verify(directory: str | os.PathLike, names: list[str] | None = None) -> dict[str, Any]:
    """Check a checkpoint directory's files against the checksums in its ``meta.json``;
    returns the metadata. Needs no running job.

    Steps:

    1. read ``meta.json`` (CheckpointError if it is missing: the save did not finish);
    2. for each file it lists (only ``names`` of them, if given), compute the sha256 of the
       file's bytes and compare: a missing file or a different checksum is a CheckpointError naming
       the file, the expected and the actual checksum.
    """
    path = Path(directory).resolve()
    meta = read_meta(path)  # step 1
    if meta is None:
        raise CheckpointError(f"{path} is not a complete gradpress checkpoint: {META_FILE} is "
                              f"missing (the save did not finish, or this is not a checkpoint "
                              f"directory)")
    files = meta.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{path / META_FILE} lists no checksums (\"files\"): not a "
                              f"checkpoint written by gradpress.checkpoint.save")
    for name in sorted(files if names is None else set(names) & set(files)):  # step 2
        f = path / name
        actual = file_sha256(f) if f.is_file() else "missing"
        if actual != files[name]:
            raise CheckpointError(f"checkpoint file {f} is corrupt or truncated: its sha256 is "
                                  f"{actual}, {META_FILE} expects {files[name]}")
    return meta


def file_sha256(path: str | os.PathLike) -> str:
    """The hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _checksums(path: Path, num_workers: int, num_servers: int) -> dict[str, str]:
    """The sha256 of every worker and server file of the save present in ``path``."""
    names = [*(f"worker{r}.pt" for r in range(num_workers)),
             *(f"server{i}.pt" for i in range(num_servers))]
    return {n: file_sha256(path / n) for n in names if (path / n).is_file()}


def _check_args(directory: Any, model: Any, optimizer: Any) -> Path:
    if not isinstance(directory, str | os.PathLike) or not str(directory):
        raise TypeError(f"checkpoint directory must be a non-empty path, got {directory!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer) and not all(
            hasattr(optimizer, a) for a in ("param_groups", "state_dict", "load_state_dict")):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer (or have its param_groups, "
                        f"state_dict and load_state_dict), got {type(optimizer).__name__}")
    return Path(directory).resolve()


def _check_meta(path: Path, rule: str) -> tuple[dict[str, Any], ResizeEvent | None]:
    """The metadata, and the resize to apply when the job's sizes differ from the saved ones
    (a CheckpointError naming both layouts under the rule ``"refuse"``)."""
    meta = read_meta(path)
    if meta is None:
        raise CheckpointError(f"{path} is not a complete gradpress checkpoint: {META_FILE} is "
                              f"missing (the save did not finish, or this is not a checkpoint "
                              f"directory)")
    lay = api._rt().cluster.layout
    saved = (int(meta["num_workers"]), int(meta["num_servers"]))
    if saved == (lay.num_workers, lay.num_servers):
        return meta, None
    if rule == "refuse":
        raise CheckpointError(f"checkpoint {path} was saved by a job with {saved[0]} workers and "
                              f"{saved[1]} servers, this job has {lay.num_workers} workers and "
                              f"{lay.num_servers} servers; resume with the same world sizes, or "
                              f"load with resize='fold' or 'reset'")
    return meta, ResizeEvent(checkpoint=str(path), step=int(meta["step"]),
                             saved_workers=saved[0], saved_servers=saved[1],
                             workers=lay.num_workers, servers=lay.num_servers, rule=rule)


def _inner_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state without the per-worker codec part of a DistributedOptimizer."""
    return shared_state_dict(optimizer)


def _per_worker(optimizer: torch.optim.Optimizer) -> bool:
    """Whether each worker's optimizer state differs (``per_worker_state`` of its class)."""
    return bool(getattr(optimizer, "per_worker_state", False))


def _spec(optimizer: torch.optim.Optimizer) -> str | None:
    """The DistributedOptimizer's compression as spec text (None for a plain optimizer)."""
    spec = getattr(optimizer, "_gp_spec", None)
    if spec is None:
        return None
    opts = {**spec.params, **{k: v for k, v in spec.wrappers.items() if v is not None}}
    body = ",".join(f"{k}={v}" for k, v in sorted(opts.items()))
    return f"{spec.name}:{body}" if body else spec.name


def train_devices(model: torch.nn.Module) -> list[torch.device]:
    """The CUDA devices this process trains on, by index: those of the model's parameters and
    buffers, else the current CUDA device when CUDA is initialized, else none."""
    found = {t.device for t in (*model.parameters(), *model.buffers()) if t.is_cuda}
    if not found and torch.cuda.is_available() and torch.cuda.is_initialized():
        found = {torch.device("cuda", torch.cuda.current_device())}
    return sorted(found, key=lambda d: d.index or 0)


def rng_state(devices: list[torch.device],
              get_cuda: Callable[[torch.device], torch.Tensor] | None = None) -> dict[str, Any]:
    """The CPU RNG state and, under ``"cuda_devices"``, the CUDA generator state of each of
    ``devices`` (:func:`train_devices`) in that order: keyed by position, not by device index,
    so a restore with another visible-device mapping (``CUDA_VISIBLE_DEVICES``) or another GPU
    count sets the generators of the devices the resumed process trains on. ``get_cuda`` is
    ``torch.cuda.get_rng_state`` (a parameter for tests)."""
    get = get_cuda or torch.cuda.get_rng_state
    state: dict[str, Any] = {"torch": torch.get_rng_state()}
    if devices:
        state["cuda_devices"] = [get(d) for d in devices]
    return state


def set_rng_state(state: dict[str, Any], devices: list[torch.device],
                  set_cuda: Callable[[torch.Tensor, torch.device], None] | None = None) -> None:
    """Restore :func:`rng_state` output into the generators of ``devices`` (position by
    position). A saved list of another length is a CheckpointError naming both counts; a process
    that trains on no CUDA device ignores the saved CUDA state. ``set_cuda`` is
    ``torch.cuda.set_rng_state`` (a parameter for tests)."""
    put = set_cuda or torch.cuda.set_rng_state
    torch.set_rng_state(state["torch"])
    saved = state.get("cuda_devices")
    if saved is None or not devices:
        return
    if len(saved) != len(devices):
        raise CheckpointError(f"the checkpoint holds the CUDA RNG state of {len(saved)} "
                              f"device(s), this worker trains on {len(devices)} "
                              f"({', '.join(map(str, devices))}); resume with as many GPUs per "
                              f"worker as the saved run")
    for s, d in zip(saved, devices):
        put(s, d)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(obj, indent=1, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)

"""Exact checkpoints of the parameter-server runtime: worker and server codec state.

What is state (residuals are saved and restored, never reset): per key, the error-feedback
residual and ``lr_prev`` (workers and servers), the Nesterov momentum buffer (workers), and the
key's step counter, which seeds ``randomk``/``dithering`` and is checked in every payload header.
State is addressed by tensor name and chunk index, not by numeric key (keys carry a generation
number and hash collisions are resolved by renaming), so it survives a restart in fresh
processes. Each engine reaches its state through one object, :class:`WorkerCheckpoint` or
:class:`ServerCheckpoint`, which uses only the methods the engine exposes for it.

Server state travels through the transport's control channel, so that a save or load is ordered
after every push a worker made before it:

1. Every worker agrees on a request ``{"op", "dir", "tag"}`` in the TCP store under
   ``state/<seq>`` (``compare_set``; ``seq`` counts the requests of the job, which are collective
   over the workers).
2. Each pushing worker, with no push_pull in flight, sends a control message ``OP_SAVE`` or
   ``OP_LOAD`` (``step = seq``) to every server, behind its push announcements.
3. A server acts when all pushers' messages for ``seq`` arrived: it waits until every key is
   quiescent (all announced steps reduced), then writes ``server<index>.pt`` atomically (save:
   its keys, and the keys its file of the loaded checkpoint held that no push revived yet) or
   reads every ``server*.pt`` of the directory and restores existing keys, keeping the rest
   pending until the key's first push (load). It acknowledges under ``state/<seq>/ack/<index>``:
   ``"ok"`` or the error text; a failed save or load does not stop the server.
4. Workers wait for every acknowledgement (bounded by ``timeout``; a failure reported by any
   process ends the wait early) and raise naming the server on error.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .errors import CheckpointError, CommTimeoutError
from .protocol import (
    OP_SAVE,
    ArrivalCounter,
    Control,
    acknowledge,
    read_request,
    request_server_op,
)

if TYPE_CHECKING:
    from .calls import Plan
    from .cluster import Cluster, Layout
    from .config import PSConfig
    from .transport import Transport

__all__ = ["FORMAT", "META_FILE", "worker_file", "server_file", "atomic_save", "load_file",
           "read_meta", "WorkerCheckpoint", "ServerCheckpoint", "plan_state", "restore_plan",
           "check_worker_state", "read_server_states", "own_keys", "saved_sizes"]

log = logging.getLogger(__name__)

class WorkerSide(Protocol):
    """What :class:`WorkerCheckpoint` uses of the worker engine."""

    cluster: Cluster
    transport: Transport
    cfg: PSConfig

    def plans(self, names: set[str] | None = None) -> dict[str, Plan]:
        """The plans of the tensors pushed so far (``names``: only those), by name."""

    def check_idle(self, what: str) -> None:
        """Raise naming the tensors in flight unless no push_pull is."""


class ServerSide(Protocol):
    """What :class:`ServerCheckpoint` uses of the server engine."""

    cluster: Cluster
    cfg: PSConfig
    index: int
    name: str
    pushers: list[int]

    def keys(self) -> list[Any]:
        """The keys the server has seen so far (``gradpress.ps.server.KeyState``: ``desc``,
        ``step``, ``next_step``, ``arrived``, ``lock``, ``label`` and the server codec
        ``enc``)."""

FORMAT = 1
META_FILE = "meta.json"
_POLL_S = 0.01


def worker_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"worker{rank}.pt"


def server_file(directory: str | os.PathLike, index: int) -> Path:
    return Path(directory) / f"server{index}.pt"


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` into a temporary file of the same directory, then rename over ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_file(path: str | os.PathLike, what: str) -> dict[str, Any]:
    """Load a checkpoint file (CPU, ``weights_only``, memory-mapped); ValueError naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what}: checkpoint file {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(f"{what}: cannot read checkpoint file {path}: {e}") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise CheckpointError(f"{what}: {path} is not a gradpress checkpoint file of format "
                              f"{FORMAT}")
    return obj


def read_meta(directory: str | os.PathLike) -> dict[str, Any] | None:
    """``meta.json`` of a checkpoint directory, or None when there is none."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read checkpoint metadata {path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not gradpress checkpoint metadata of format {FORMAT}")
    return meta


# -- worker side ----------------------------------------------------------------------------
def _signature(sig: tuple) -> dict[str, Any]:
    numel, codec, params, wrappers, average = sig
    return {"numel": numel, "codec": codec, "params": dict(params), "wrappers": dict(wrappers),
            "average": average}


def plan_state(plan: Plan) -> dict[str, Any]:
    """State of one tensor's plan: signature, per chunk step and codec."""
    return {"signature": _signature(plan.signature),
            "chunks": [{"numel": c.desc.numel, "step": c.step, "codec": c.enc.state_dict()}
                       for c in plan.chunks]}


def check_worker_state(state: Any) -> dict[str, dict[str, Any]]:
    """Validate the structure of ``WorkerEngine.state_dict()`` output; returns its tensors."""
    if not isinstance(state, Mapping):
        raise TypeError(f"worker state must be a mapping, got {type(state).__name__}")
    if state.get("format") != FORMAT or not isinstance(state.get("tensors"), Mapping):
        raise CheckpointError(f"worker state: expected format {FORMAT} with a 'tensors' mapping, "
                              f"got keys {sorted(state)}")
    tensors = dict(state["tensors"])
    for name, entry in tensors.items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("chunks"), list) \
                or not isinstance(entry.get("signature"), Mapping):
            raise CheckpointError(f"worker state of tensor {name!r}: expected 'signature' and "
                                  f"'chunks' entries")
        for ch in entry["chunks"]:
            step = ch.get("step") if isinstance(ch, Mapping) else None
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise CheckpointError(f"worker state of tensor {name!r}: chunk step must be an "
                                      f"int >= 0, got {step!r}")
    return tensors


def restore_plan(plan: Plan, entry: Mapping[str, Any]) -> None:
    """Load a saved tensor ``entry`` into a fresh ``plan``; ValueError naming the tensor."""
    name, saved = plan.name, dict(entry["signature"])
    current = _signature(plan.signature)
    if saved != current:
        diff = [f"{k}: saved {saved.get(k)!r}, now {current[k]!r}" for k in current
                if saved.get(k) != current[k]]
        raise CheckpointError(f"saved worker state of tensor {name!r} does not match this run "
                              f"({'; '.join(diff)}); use the same model, compression and "
                              f"min_compress_bytes as the saved run")
    chunks = entry["chunks"]
    layout = [c.desc.numel for c in plan.chunks]
    if [ch.get("numel") for ch in chunks] != layout:
        raise CheckpointError(f"saved worker state of tensor {name!r} has chunks of "
                              f"{[ch.get('numel') for ch in chunks]} elements, this run cuts it "
                              f"into {layout}; use the same partition_bytes as the saved run")
    for chunk, ch in zip(plan.chunks, chunks):
        try:
            chunk.enc.load_state_dict(ch["codec"])
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(f"saved worker state of tensor {name!r} chunk "
                                  f"{chunk.desc.chunk}: {e}") from e
        chunk.step = int(ch["step"])


class WorkerCheckpoint:
    """``state_dict``/``load_state_dict`` and server state requests of a ``WorkerEngine``.

    Uses the engine's ``cluster``, ``transport``, ``cfg``, :meth:`plans` and
    :meth:`check_idle`; owns the loaded state of tensors not pushed yet.
    """

    def __init__(self, engine: WorkerSide) -> None:
        self.engine = engine
        self._pending: dict[str, dict[str, Any]] = {}  # loaded state of tensors not yet seen
        self._seq = 0  # server state requests so far (collective over workers)
        self._lock = threading.Lock()

    def state_dict(self, names: set[str] | None = None) -> dict[str, Any]:
        """Per tensor (``names``, default all): each chunk's step counter and worker codec state
        (error-feedback residual, momentum) as CPU copies; no push_pull may be in flight.

        Tensors are keyed by name and chunk index, so the state loads into fresh processes.
        """
        self.engine.check_idle("state_dict")
        plans = self.engine.plans(names)
        with self._lock:
            pending = {n: e for n, e in self._pending.items() if names is None or n in names}
        return {"format": FORMAT,
                "tensors": {**pending, **{n: plan_state(p) for n, p in plans.items()}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Tensors already pushed are restored at once; the others when their first push_pull
        creates them, which then raises ValueError naming the tensor if its size, codec or
        chunking differs from the saved one.
        """
        tensors = check_worker_state(state)
        self.engine.check_idle("load_state_dict")
        plans = self.engine.plans(set(tensors))
        with self._lock:
            self._pending.update({n: e for n, e in tensors.items() if n not in plans})
        for name, plan in plans.items():
            restore_plan(plan, tensors[name])

    def server_state(self, op: str, directory: str, tag: str | None = None) -> None:
        """Ask every server to ``"save"`` its state to, or ``"load"`` it from, ``directory``.

        Collective over the workers, bounded by ``cfg.timeout``; errors name the server.
        """
        if op not in ("save", "load"):
            raise ValueError(f"server state operation must be 'save' or 'load', got {op!r}")
        self.engine.check_idle(f"{op} of server state")
        seq, self._seq = self._seq, self._seq + 1
        e = self.engine
        request_server_op(e.cluster, e.transport, e.cfg.timeout, seq, op, directory, tag)

    def pending(self) -> set[str]:
        """Names of the tensors whose loaded state waits for their first push."""
        with self._lock:
            return set(self._pending)

    def restore_pending(self, plan: Plan) -> None:
        """Apply loaded state to a new plan; on a mismatch keep it pending and raise."""
        with self._lock:
            entry = self._pending.pop(plan.name, None)
        if entry is None:
            return
        try:
            restore_plan(plan, entry)
        except BaseException:
            with self._lock:
                self._pending.setdefault(plan.name, entry)
            raise


# -- server side ----------------------------------------------------------------------------
def key_entry(ks: Any) -> dict[str, Any]:
    """State of one server key."""
    d = ks.desc
    return {"generation": d.generation, "numel": d.numel, "spec": d.spec, "ef": d.ef,
            "seed": d.seed, "average": d.average, "step": ks.step, "codec": ks.enc.state_dict()}


def server_snapshot(keys: Iterable[Any], layout: Layout, index: int,
                    tag: str | None) -> dict[str, Any]:
    """Server ``index``'s file content: the newest generation of every (tensor, chunk)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for ks in sorted(keys, key=lambda k: k.desc.generation):
        out.setdefault(ks.desc.name, {})[ks.desc.chunk] = key_entry(ks)
    return {"format": FORMAT, "role": "server", "index": index, "tag": tag,
            "num_workers": layout.num_workers, "num_servers": layout.num_servers, "keys": out}


def read_server_states(directory: str | os.PathLike, layout: Layout, who: str,
                       tag: str | None) -> dict[tuple[str, int], dict[str, Any]]:
    """Every saved server key of ``directory`` by (tensor, chunk).

    All server files of the saved job are read (memory-mapped), so a key may have moved to
    another server, and the saved job may have had another number of servers (an elastic
    resize: the workers decide whether a checkpoint of other sizes may load,
    :mod:`gradpress.elastic`; the server residuals are re-sharded whatever the sizes)."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    sizes = saved_sizes(directory, who)
    for index in range(sizes[1]):
        path = server_file(directory, index)
        obj = load_file(path, who)
        if (obj.get("num_workers"), obj.get("num_servers")) != sizes:
            raise CheckpointError(f"{who}: {path} was written by a job with "
                                  f"{obj.get('num_workers')} workers and {obj.get('num_servers')} "
                                  f"servers, server0.pt by one with {sizes[0]} and {sizes[1]}; "
                                  f"the checkpoint directory mixes two jobs")
        if tag is not None and obj.get("tag") != tag:
            raise CheckpointError(f"{who}: {path} belongs to another save (tag "
                                  f"{obj.get('tag')!r}, expected {tag!r}); the checkpoint "
                                  f"directory mixes two saves")
        for name, chunks in obj["keys"].items():
            for chunk, entry in chunks.items():
                seen = found.get((name, int(chunk)))  # in two files: the further stepped
                if seen is None or int(entry.get("step", 0)) >= int(seen.get("step", 0)):
                    found[(name, int(chunk))] = entry
    if sizes != (layout.num_workers, layout.num_servers):
        log.info("%s: re-sharding the keys of %d saved servers over %d", who, sizes[1],
                 layout.num_servers)
    return found


def saved_sizes(directory: str | os.PathLike, who: str) -> tuple[int, int]:
    """(workers, servers) of the job that saved ``directory`` (from its ``server0.pt``)."""
    obj = load_file(server_file(directory, 0), who)
    return int(obj.get("num_workers", 0)), int(obj.get("num_servers", 0))


def own_keys(directory: str | os.PathLike, index: int, who: str,
             num_servers: int) -> set[tuple[str, int]]:
    """The (tensor, chunk) pairs that server ``index`` of ``num_servers`` saves again while no
    push revived them: those of ``server<index>.pt``, or, when the saved job had another
    number of servers, those of every saved ``server<j>.pt`` with ``j % num_servers == index``
    (each saved key is saved again by one server)."""
    saved = saved_sizes(directory, who)[1]
    mine = [index] if saved == num_servers else \
        [j for j in range(saved) if j % num_servers == index]
    out: set[tuple[str, int]] = set()
    for j in mine:
        obj = load_file(server_file(directory, j), who)
        out |= {(name, int(chunk)) for name, chunks in obj["keys"].items() for chunk in chunks}
    return out


def restore_key(ks: Any, entry: Mapping[str, Any], pushers: int, who: str) -> None:
    """Load a saved server key into ``ks`` (codec state and step counters)."""
    d = ks.desc
    for field, now in (("numel", d.numel), ("spec", d.spec), ("ef", d.ef), ("seed", d.seed),
                       ("average", d.average)):
        if entry.get(field) != now:
            raise CheckpointError(f"{who}: saved state of tensor {d.name!r} chunk {d.chunk} has "
                                  f"{field}={entry.get(field)!r}, this run has {now!r}")
    try:
        ks.enc.load_state_dict(entry["codec"])
    except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{who}: saved state of tensor {d.name!r} chunk {d.chunk}: "
                              f"{e}") from e
    step = int(entry["step"])
    with ks.lock:
        ks.step = step
        ks.next_step = [step] * pushers


def wait_quiescent(keys: Iterable[Any], timeout: float, who: str) -> None:
    """Wait until every announced step of every key was reduced (bounded by ``timeout``)."""
    deadline = time.monotonic() + timeout
    for ks in keys:
        while True:
            with ks.lock:
                steps = set(ks.next_step)
                done = ks.arrived == 0 and len(steps) == 1 and ks.step == ks.next_step[0]
            if done:
                break
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"{who}: {ks.label} is not quiescent after {timeout:g} s "
                                       f"(announced steps {sorted(steps)}, reduced {ks.step}); "
                                       f"save or load server state only with no push_pull in "
                                       f"flight, on every worker", key=ks.label, stage="state")
            time.sleep(_POLL_S)


class ServerCheckpoint:
    """Save/load of a ``ServerEngine``'s keys (residuals, step counters).

    Uses the engine's ``cluster``, ``cfg``, ``index``, ``name``, ``pushers`` and :meth:`keys`;
    owns the saved entries of keys not created yet. Loads ``cfg.resume`` when built.
    """

    def __init__(self, engine: ServerSide) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], dict[str, Any]] = {}
        self._own: set[tuple[str, int]] = set()  # pending keys this server saves again
        self._arrivals = ArrivalCounter(len(engine.pushers))
        resume = engine.cfg.resume
        if resume:
            meta = read_meta(resume)
            self._pending = read_server_states(resume, engine.cluster.layout, engine.name,
                                               None if meta is None else meta.get("tag"))
            self._own = own_keys(resume, engine.index, engine.name,
                                 engine.cluster.layout.num_servers)
            log.info("%s: %d saved keys pending from %s", engine.name, len(self._pending),
                     resume)

    def restore(self, ks: Any) -> None:
        """Apply pending saved state to key ``ks`` (a new key, or one loaded into)."""
        with self._lock:
            entry = self._pending.pop((ks.desc.name, ks.desc.chunk), None)
        if entry is not None:
            restore_key(ks, entry, len(self.engine.pushers), self.engine.name)

    def request(self, w: int, msg: Control) -> None:
        """Pusher ``w``'s save/load message; the last of all pushers runs the request."""
        seq, e = msg.step, self.engine
        if not self._arrivals.arrive(seq, w):
            return
        try:
            req = read_request(e.cluster, seq, msg.op)
            keys = e.keys()
            wait_quiescent(keys, e.cfg.timeout, e.name)
            if msg.op == OP_SAVE:
                snap = self._with_pending(server_snapshot(keys, e.cluster.layout, e.index,
                                                          req["tag"]))
                atomic_save(snap, server_file(req["dir"], e.index))
            else:
                self._load(req["dir"], req["tag"])
        except Exception as err:  # noqa: BLE001 - reported to the workers; serving goes on
            log.error("%s: server state request %d failed: %s", e.name, seq, err)
            acknowledge(e.cluster, seq, e.index, err)
            return
        acknowledge(e.cluster, seq, e.index, None)

    def _with_pending(self, snap: dict[str, Any]) -> dict[str, Any]:
        """Add to a save the loaded keys not pushed since (still pending) that this server's
        file held: they stay state of the job, saved once (a key pushed since is live on
        some server and saved from there)."""
        with self._lock:
            pending = [(k, e) for k, e in self._pending.items() if k in self._own]
        for (name, chunk), entry in pending:
            snap["keys"].setdefault(name, {}).setdefault(chunk, entry)
        return snap

    def _load(self, directory: str, tag: str | None) -> None:
        loaded = read_server_states(directory, self.engine.cluster.layout, self.engine.name, tag)
        own = own_keys(directory, self.engine.index, self.engine.name,
                       self.engine.cluster.layout.num_servers)
        with self._lock:
            self._pending.update(loaded)
            self._own |= own
        # keys created from now on restore themselves; each entry is applied once (popped)
        for ks in sorted(self.engine.keys(), key=lambda k: -k.desc.generation):  # newest first
            self.restore(ks)

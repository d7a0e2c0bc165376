"""Exact checkpoints of the parameter-server runtime: worker and server codec state.

What is state (design brief §3: residuals are saved and restored, never reset): per key, the
error-feedback residual and ``lr_prev`` (workers and servers), the Nesterov momentum buffer
(workers), and the key's step counter, which seeds ``randomk``/``dithering`` and is checked in
every payload header. State is addressed by tensor name and chunk index, not by numeric key (keys
carry a generation number and hash collisions are resolved by renaming), so it survives a restart
in fresh processes.

Server state travels through the transport's control channel, so that a save or load is ordered
after every push a worker made before it:

1. Every worker agrees on a request ``{"op", "dir", "tag"}`` in the TCP store under
   ``state/<seq>`` (``compare_set``; ``seq`` counts the requests of the job, which are collective
   over the workers).
2. Each pushing worker, with no push_pull in flight, sends a control message ``OP_SAVE`` or
   ``OP_LOAD`` (``step = seq``) to every server, behind its push announcements.
3. A server acts when all pushers' messages for ``seq`` arrived: it waits until every key is
   quiescent (all announced steps reduced), then writes ``server<index>.pt`` atomically (save) or
   reads every ``server*.pt`` of the directory and restores existing keys, keeping the rest
   pending until the key's first push (load). It acknowledges under ``state/<seq>/ack/<index>``:
   ``"ok"`` or the error text; a failed save or load does not stop the server.
4. Workers wait for every acknowledgement (bounded by ``timeout``; a failure reported by any
   process ends the wait early) and raise naming the server on error.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import CommTimeoutError, GradpressError
from .protocol import OP_LOAD, OP_SAVE, Control, pack_control
from .transport import CTRL_TAG

if TYPE_CHECKING:
    from .cluster import Cluster, Layout
    from .plan import Plan
    from .transport import Transport

__all__ = ["FORMAT", "META_FILE", "worker_file", "server_file", "atomic_save", "load_file",
           "read_meta", "plan_state", "restore_plan", "check_worker_state", "key_entry",
           "server_snapshot", "read_server_states", "restore_key", "wait_quiescent",
           "request_server_op", "read_request", "acknowledge"]

FORMAT = 1
META_FILE = "meta.json"
OPS = {"save": OP_SAVE, "load": OP_LOAD}
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
        raise ValueError(f"{what}: checkpoint file {path} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad file
        raise ValueError(f"{what}: cannot read checkpoint file {path}: {e}") from e
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise ValueError(f"{what}: {path} is not a gradpress checkpoint file of format {FORMAT}")
    return obj


def read_meta(directory: str | os.PathLike) -> dict[str, Any] | None:
    """``meta.json`` of a checkpoint directory, or None when there is none."""
    path = Path(directory) / META_FILE
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read checkpoint metadata {path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not gradpress checkpoint metadata of format {FORMAT}")
    return meta


# -- worker side ----------------------------------------------------------------------------
def _signature(sig: tuple) -> dict[str, Any]:
    numel, codec, params, wrappers, average = sig
    return {"numel": numel, "codec": codec, "params": dict(params), "wrappers": dict(wrappers),
            "average": average}


def plan_state(plan: Plan) -> dict[str, Any]:
    """State of one tensor's plan: signature, per chunk step and codec."""
    return {"signature": _signature(plan.signature),
            "chunks": [{"numel": cs.desc.numel, "step": cs.step, "codec": cs.enc.state_dict()}
                       for cs in plan.chunks]}


def check_worker_state(state: Any) -> dict[str, dict[str, Any]]:
    """Validate the structure of ``WorkerEngine.state_dict()`` output; returns its tensors."""
    if not isinstance(state, Mapping):
        raise TypeError(f"worker state must be a mapping, got {type(state).__name__}")
    if state.get("format") != FORMAT or not isinstance(state.get("tensors"), Mapping):
        raise ValueError(f"worker state: expected format {FORMAT} with a 'tensors' mapping, got "
                         f"keys {sorted(state)}")
    tensors = dict(state["tensors"])
    for name, entry in tensors.items():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("chunks"), list) \
                or not isinstance(entry.get("signature"), Mapping):
            raise ValueError(f"worker state of tensor {name!r}: expected 'signature' and "
                             f"'chunks' entries")
        for ch in entry["chunks"]:
            step = ch.get("step") if isinstance(ch, Mapping) else None
            if isinstance(step, bool) or not isinstance(step, int) or step < 0:
                raise ValueError(f"worker state of tensor {name!r}: chunk step must be an int "
                                 f">= 0, got {step!r}")
    return tensors


def restore_plan(plan: Plan, entry: Mapping[str, Any]) -> None:
    """Load a saved tensor ``entry`` into a fresh ``plan``; ValueError naming the tensor."""
    name, saved = plan.name, dict(entry["signature"])
    current = _signature(plan.signature)
    if saved != current:
        diff = [f"{k}: saved {saved.get(k)!r}, now {current[k]!r}" for k in current
                if saved.get(k) != current[k]]
        raise ValueError(f"saved worker state of tensor {name!r} does not match this run "
                         f"({'; '.join(diff)}); use the same model, compression and "
                         f"min_compress_bytes as the saved run")
    chunks = entry["chunks"]
    layout = [cs.desc.numel for cs in plan.chunks]
    if [ch.get("numel") for ch in chunks] != layout:
        raise ValueError(f"saved worker state of tensor {name!r} has chunks of "
                         f"{[ch.get('numel') for ch in chunks]} elements, this run cuts it into "
                         f"{layout}; use the same partition_bytes as the saved run")
    for cs, ch in zip(plan.chunks, chunks):
        try:
            cs.enc.load_state_dict(ch["codec"])
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"saved worker state of tensor {name!r} chunk {cs.desc.chunk}: "
                             f"{e}") from e
        cs.step = int(ch["step"])


# -- server side ----------------------------------------------------------------------------
def key_entry(ks: Any) -> dict[str, Any]:
    """State of one server key (a ``server._KeyState``)."""
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
    """Every saved server key of ``directory`` by (tensor, chunk), checked against the job.

    All server files are read (memory-mapped), so a key may have moved to another server.
    """
    found: dict[tuple[str, int], dict[str, Any]] = {}
    for index in range(layout.num_servers):
        path = server_file(directory, index)
        obj = load_file(path, who)
        if (obj.get("num_workers"), obj.get("num_servers")) != (layout.num_workers,
                                                               layout.num_servers):
            raise ValueError(f"{who}: {path} was written by a job with {obj.get('num_workers')} "
                             f"workers and {obj.get('num_servers')} servers; this job has "
                             f"{layout.num_workers} workers and {layout.num_servers} servers")
        if tag is not None and obj.get("tag") != tag:
            raise ValueError(f"{who}: {path} belongs to another save (tag {obj.get('tag')!r}, "
                             f"expected {tag!r}); the checkpoint directory mixes two saves")
        for name, chunks in obj["keys"].items():
            for chunk, entry in chunks.items():
                found[(name, int(chunk))] = entry
    return found


def restore_key(ks: Any, entry: Mapping[str, Any], pushers: int, who: str) -> None:
    """Load a saved server key into ``ks`` (codec state and step counters)."""
    d = ks.desc
    for field, now in (("numel", d.numel), ("spec", d.spec), ("ef", d.ef), ("seed", d.seed),
                       ("average", d.average)):
        if entry.get(field) != now:
            raise ValueError(f"{who}: saved state of tensor {d.name!r} chunk {d.chunk} has "
                             f"{field}={entry.get(field)!r}, this run has {now!r}")
    try:
        ks.enc.load_state_dict(entry["codec"])
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{who}: saved state of tensor {d.name!r} chunk {d.chunk}: {e}") from e
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


def read_request(cluster: Cluster, seq: int, op: int) -> dict[str, Any]:
    """The request ``seq`` the workers agreed on; ValueError if there is none or not ``op``."""
    if not cluster.store.check([f"state/{seq}"]):  # the workers write it before they send
        raise ValueError(f"server state request {seq} is unknown (no record in the store)")
    req = json.loads(cluster.store.get(f"state/{seq}"))
    if OPS.get(req.get("op")) != op:
        raise ValueError(f"server state request {seq} is {req.get('op')!r}, but the control "
                         f"message asked for op {op}")
    return req


def acknowledge(cluster: Cluster, seq: int, index: int, error: BaseException | None) -> None:
    """Tell the workers the outcome of request ``seq`` on server ``index``."""
    text = "ok" if error is None else f"error: {type(error).__name__}: {error}"
    cluster.store.set(f"state/{seq}/ack/{index}", text)


def request_server_op(cluster: Cluster, transport: Transport, timeout: float, seq: int, op: str,
                      directory: str, tag: str | None) -> None:
    """Worker side of steps 1, 2 and 4 (see the module docstring); collective over workers."""
    lay = cluster.layout
    record = json.dumps({"op": op, "dir": directory, "tag": tag}, sort_keys=True)
    agreed = cluster.store.compare_set(f"state/{seq}", "", record).decode()
    if agreed != record:
        text = (f"workers disagree on server state request {seq}: here {record}, elsewhere "
                f"{agreed}; call save/load on every worker with the same directory")
        cluster.report_error(text)  # the other workers stop waiting for acknowledgements
        raise ValueError(f"{cluster.describe(cluster.rank)}: {text}")
    servers = range(lay.num_servers)
    if cluster.rank in lay.pushers:  # step 2: behind this worker's push announcements
        msg = pack_control(Control(OPS[op], 0, seq))
        sends = [transport.isend(msg, lay.server_rank(s), CTRL_TAG, f"{op} of server state",
                                 "push") for s in servers]
        for s in sends:
            s.wait(timeout, f"{op} server state")
    acks = _wait_acks(cluster, seq, timeout, op)  # step 4
    failed = [f"{cluster.describe(lay.server_rank(s))}: {acks[s]}" for s in servers
              if acks[s] != "ok"]
    if failed:
        raise GradpressError(f"{op} of server state in {directory} failed on "
                             f"{'; '.join(failed)}")


def _wait_acks(cluster: Cluster, seq: int, timeout: float, op: str) -> list[str]:
    keys = [f"state/{seq}/ack/{s}" for s in range(cluster.layout.num_servers)]
    deadline = time.monotonic() + timeout
    last_check = 0.0
    while not cluster.store.check(keys):
        now = time.monotonic()
        if now - last_check > 0.5:
            last_check = now
            if errors := cluster.reported_errors():
                raise GradpressError(f"{op} of server state: a process failed:\n{errors}")
        if now > deadline:
            missing = [cluster.describe(cluster.layout.server_rank(s))
                       for s, k in enumerate(keys) if not cluster.store.check([k])]
            raise CommTimeoutError(f"{op} of server state: no answer from {', '.join(missing)} "
                                   f"within {timeout:g} s", peer=", ".join(missing),
                                   stage=f"{op} server state")
        time.sleep(_POLL_S)
    return [cluster.store.get(k).decode(errors="replace") for k in keys]


class ArrivalCounter:
    """Counts the pushers' control messages per request (server side of step 3)."""

    def __init__(self, pushers: int) -> None:
        self._pushers = pushers
        self._seen: dict[int, set[int]] = {}
        self._lock = threading.Lock()

    def arrive(self, seq: int, pusher: int) -> bool:
        """Record ``pusher``'s message for ``seq``; True once every pusher sent one (a repeat
        from the same pusher does not count)."""
        with self._lock:
            seen = self._seen.setdefault(seq, set())
            seen.add(pusher)
            if len(seen) < self._pushers:
                return False
            del self._seen[seq]
            return True

"""``gradpress launch``: start the worker and server processes of one node and watch them.

1. Node 0 binds ``master_addr:master_port`` (port 0 on a single node: a free port) and serves
   the job's ``torch.distributed.TCPStore`` on that socket; other nodes connect to it. The
   socket is bound before the children start, so they can be spawned while the launcher is
   still importing torch (the store clients retry until it answers).
2. The node's workers run the user's command, its servers run ``python -m gradpress.ps.server``;
   each child gets the torchrun-style environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus ``GRADPRESS_ROLE``,
   ``GRADPRESS_NUM_WORKERS``, ``GRADPRESS_NUM_SERVERS``, ``GRADPRESS_COLOCATE``,
   ``GRADPRESS_NNODES``, ``GRADPRESS_NODE_RANK`` and ``GRADPRESS_STORE_HOSTED=1``
   (rank layout: :mod:`gradpress.ps.cluster`), and ``GRADPRESS_SECRET`` (generated for a
   single-node job when unset; see :mod:`gradpress.ps.auth`).
3. Children run in their own sessions (process groups) and die with the launcher (Linux
   ``PR_SET_PDEATHSIG``). If one exits non-zero, the launcher names its role and rank, records
   the failure in the store (so launchers of other nodes stop too), sends SIGTERM to every other
   process group, SIGKILL after ``grace_s``, and exits non-zero.
4. When all workers exited 0, servers get ``timeout`` seconds to finish; node 0 then waits for
   every node to report success before it closes the store.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .ps.config import available_cores

if TYPE_CHECKING:  # torch is imported after the children started (it takes seconds)
    import torch.distributed as dist

__all__ = ["LaunchConfig", "launch", "layout_advice", "restart_loop", "INTERRUPTED"]

#: Exit statuses of a job stopped by SIGINT or SIGTERM (Ctrl-C, ``kill``): never restarted.
INTERRUPTED = (130, 143)

_FAILED_KEY = "launch/failed"
_POLL_S = 0.05


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What ``gradpress launch`` starts on this node."""

    #: The worker command (e.g. ``("python", "train.py")``).
    command: tuple[str, ...]
    #: Worker processes on this node.
    workers_per_node: int
    #: Server engines on this node (processes, or threads in the first workers if colocated).
    servers_per_node: int
    #: Run the server engines inside worker processes instead of separate processes.
    colocate: bool = False
    #: Number of nodes of the job.
    nnodes: int = 1
    #: This node's index, ``0 .. nnodes-1``; node 0 hosts the TCP store.
    node_rank: int = 0
    #: Address of node 0 (the TCP store).
    master_addr: str = "127.0.0.1"
    #: Port of the TCP store; 0 picks a free port (single node only).
    master_port: int = 0
    #: Seconds between SIGTERM and SIGKILL when stopping processes.
    grace_s: float = 5.0
    #: Seconds to wait for store connections, for servers after the workers finished, and for
    #: other nodes at the end.
    timeout: float = 300.0
    #: Extra environment variables for every child.
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.command or not self.command[0] \
                or not all(isinstance(c, str) for c in self.command):
            raise ValueError(f"LaunchConfig.command must be a non-empty sequence of strings, "
                             f"got {self.command!r}")
        for name, lo in (("workers_per_node", 1), ("servers_per_node", 1), ("nnodes", 1),
                         ("node_rank", 0), ("master_port", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"LaunchConfig.{name} must be an int >= {lo}, got {v!r}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"LaunchConfig.node_rank {self.node_rank} must be < nnodes "
                             f"{self.nnodes}")
        if self.colocate and self.servers_per_node > self.workers_per_node:
            raise ValueError(f"colocated servers live in workers: servers_per_node "
                             f"({self.servers_per_node}) must be <= workers_per_node "
                             f"({self.workers_per_node})")
        if self.nnodes > 1 and self.master_port == 0:
            raise ValueError("a multi-node launch needs an explicit --master-port (node 0 "
                             "listens on it, the other nodes connect to it)")
        if self.grace_s < 0 or self.timeout <= 0:
            raise ValueError(f"LaunchConfig.grace_s must be >= 0 and timeout > 0, got "
                             f"{self.grace_s} and {self.timeout}")

    @property
    def num_workers(self) -> int:
        return self.workers_per_node * self.nnodes

    @property
    def num_servers(self) -> int:
        return self.servers_per_node * self.nnodes


def layout_advice(workers_per_node: int, servers_per_node: int, colocate: bool,
                  cores: int | None = None) -> str | None:
    """The layout ``gradpress launch`` recommends for this node, or None when it has no advice.

    Separate server processes pay off only when they have cores of their own: on a node where
    workers + servers >= cores, the servers' processes, their threads and the extra network hop
    (worker to server process and back) take core-seconds from the workers' compute every step
    (measured on a 2-core machine: docs/performance.md, "Where the servers run"). Such a node
    should run the servers as threads inside the workers (``--colocate``).
    ``cores``: the cores this process may run on (default :func:`available_cores`).
    """
    if colocate:
        return None
    cores = available_cores() if cores is None else cores
    procs = workers_per_node + servers_per_node
    if procs < cores:
        return None
    fix = "--colocate" if servers_per_node <= workers_per_node else \
        f"--colocate --servers-per-node {workers_per_node} (colocated servers live in workers)"
    return (f"{workers_per_node} worker(s) + {servers_per_node} server process(es) on {cores} "
            f"core(s): the server processes take cores from the workers' compute; on a node "
            f"without spare cores, run the servers inside the workers with {fix} "
            f"(docs/performance.md, 'Where the servers run')")


@dataclass
class _Child:
    role: str
    index: int
    rank: int
    popen: subprocess.Popen
    returncode: int | None = None

    @property
    def title(self) -> str:
        return f"{self.role} {self.index} (rank {self.rank}, pid {self.popen.pid})"


class _Stop(Exception):
    """Raised by the signal handler to unwind the launcher."""


def _pdeathsig() -> Callable[[], None] | None:
    """A preexec function making the child die with the launcher (Linux; no-op elsewhere)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork
    except (OSError, AttributeError):
        return None

    def _setup() -> None:
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    return _setup


def _child_env(cfg: LaunchConfig, port: int, role: str, rank: int, local: int,
               local_size: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(cfg.env)
    world = cfg.num_workers + (0 if cfg.colocate else cfg.num_servers)
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(local_size), "MASTER_ADDR": cfg.master_addr,
        "MASTER_PORT": str(port), "GRADPRESS_ROLE": role,
        "GRADPRESS_NUM_WORKERS": str(cfg.num_workers),
        "GRADPRESS_NUM_SERVERS": str(cfg.num_servers),
        "GRADPRESS_COLOCATE": "1" if cfg.colocate else "0",
        "GRADPRESS_NNODES": str(cfg.nnodes), "GRADPRESS_NODE_RANK": str(cfg.node_rank),
        "GRADPRESS_STORE_HOSTED": "1",
    })
    procs = cfg.workers_per_node + (0 if cfg.colocate else cfg.servers_per_node)
    env.setdefault("OMP_NUM_THREADS", str(max(1, available_cores() // procs)))
    return env


def _spawn(cfg: LaunchConfig, port: int) -> list[_Child]:
    children: list[_Child] = []
    preexec = _pdeathsig()
    n, wpn, spn = cfg.node_rank, cfg.workers_per_node, cfg.servers_per_node
    plan = [("worker", n * wpn + i, n * wpn + i, i, wpn, list(cfg.command))
            for i in range(wpn)]
    if not cfg.colocate:
        server_cmd = [sys.executable, "-m", "gradpress.ps.server"]
        plan += [("server", n * spn + j, cfg.num_workers + n * spn + j, j, spn, server_cmd)
                 for j in range(spn)]
    try:
        for role, index, rank, local, local_size, argv in plan:
            env = _child_env(cfg, port, role, rank, local, local_size)
            popen = subprocess.Popen(argv, env=env, start_new_session=True,
                                     preexec_fn=preexec)
            children.append(_Child(role, index, rank, popen))
    except OSError as e:
        _terminate(children, cfg.grace_s)
        raise OSError(f"gradpress launch: cannot start {argv[0]!r}: {e}") from e
    return children


def _terminate(children: list[_Child], grace_s: float) -> None:
    """SIGTERM every child's process group, SIGKILL after ``grace_s``.

    Groups of children that already exited are signalled too: descendants they left behind
    (in the same session) must not outlive the launcher.
    """
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for c in children:
            try:
                os.killpg(c.popen.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + grace_s
        for c in children:
            try:
                c.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass


def _listen(cfg: LaunchConfig) -> socket.socket | None:
    """Node 0: the bound, listening socket the TCP store will serve on."""
    if cfg.node_rank != 0:
        return None
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.master_addr else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.master_addr, cfg.master_port))
    except OSError as e:
        sock.close()
        raise OSError(f"gradpress launch: cannot listen on {cfg.master_addr}:"
                      f"{cfg.master_port} for the TCP store: {e}") from e
    sock.listen(1024)
    return sock


def _open_store(cfg: LaunchConfig, sock: socket.socket | None) -> dist.TCPStore:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=cfg.timeout)
    if sock is not None:
        return dist.TCPStore(cfg.master_addr, sock.getsockname()[1], None, True,
                             timeout=timeout, wait_for_workers=False,
                             master_listen_fd=sock.fileno())
    return dist.TCPStore(cfg.master_addr, cfg.master_port, None, False, timeout=timeout)


def _exit_code(rc: int) -> int:
    return rc if 0 < rc < 256 else 128 + (-rc) if rc < 0 else 1


def _say(cfg: LaunchConfig, msg: str) -> None:
    node = f" (node {cfg.node_rank})" if cfg.nnodes > 1 else ""
    print(f"gradpress launch{node}: {msg}", file=sys.stderr, flush=True)


def _watch(cfg: LaunchConfig, store: dist.TCPStore, children: list[_Child]) -> int:
    """Poll the children until all succeeded (0) or one failed (its exit code)."""
    last_check = 0.0
    workers_done_at: float | None = None
    while True:
        for c in children:
            if c.returncode is None and (rc := c.popen.poll()) is not None:
                c.returncode = rc
                if rc != 0:
                    msg = f"{c.title} exited with code {rc}"
                    _say(cfg, f"{msg}; stopping the other processes")
                    _record_failure(cfg, store, msg)
                    return _exit_code(rc)
        if all(c.returncode is not None for c in children):
            return 0
        now = time.monotonic()
        if all(c.returncode is not None for c in children if c.role == "worker"):
            workers_done_at = workers_done_at or now
            if now - workers_done_at > cfg.timeout:
                late = ", ".join(c.title for c in children if c.returncode is None)
                _say(cfg, f"{late} did not exit within {cfg.timeout:g} s after the workers")
                return 1
        if cfg.nnodes > 1 and now - last_check > 0.5:
            last_check = now
            if (remote := _remote_failure(store)) is not None:
                _say(cfg, f"stopping: {remote}")
                return 1
        time.sleep(_POLL_S)


def _record_failure(cfg: LaunchConfig, store: dist.TCPStore, msg: str) -> None:
    try:
        store.compare_set(_FAILED_KEY, "", f"node {cfg.node_rank}: {msg}")
    except Exception:  # noqa: BLE001 - best effort; other nodes notice the broken links anyway
        pass


def _remote_failure(store: dist.TCPStore) -> str | None:
    try:
        if store.check([_FAILED_KEY]):
            return store.get(_FAILED_KEY).decode(errors="replace")
    except Exception as e:  # noqa: BLE001 - node 0 (the store) is gone
        return f"lost the connection to the store on node 0 ({e})"
    return None


def _finish_nodes(cfg: LaunchConfig, store: dist.TCPStore) -> int:
    """Tell node 0 this node succeeded; node 0 waits for all nodes before closing the store."""
    store.set(f"launch/done/{cfg.node_rank}", "1")
    if cfg.node_rank != 0:
        return 0
    keys = [f"launch/done/{n}" for n in range(cfg.nnodes)]
    deadline = time.monotonic() + cfg.timeout
    while time.monotonic() < deadline:
        if store.check(keys):
            return 0
        if (remote := _remote_failure(store)) is not None:
            _say(cfg, f"another node failed: {remote}")
            return 1
        time.sleep(0.2)
    _say(cfg, f"other nodes did not finish within {cfg.timeout:g} s")
    return 1


def _with_job_secret(cfg: LaunchConfig) -> LaunchConfig:
    """A single-node job without ``GRADPRESS_SECRET`` gets a fresh random one, which the
    children inherit through their environment (never the command line); every process proves
    it at rendezvous (:mod:`gradpress.ps.auth`). Nodes of a multi-node job cannot share a
    generated secret: set ``GRADPRESS_SECRET`` on every node, or the job is not authenticated.
    """
    if cfg.env.get("GRADPRESS_SECRET") or os.environ.get("GRADPRESS_SECRET"):
        return cfg
    if cfg.nnodes > 1:
        _say(cfg, "warning: GRADPRESS_SECRET is not set: processes joining the job are not "
                  "authenticated (set the same secret on every node)")
        return cfg
    return dataclasses.replace(cfg, env={**cfg.env, "GRADPRESS_SECRET": secrets.token_hex(32)})


def launch(cfg: LaunchConfig) -> int:
    """Run this node's part of the job; returns the exit status for the launcher."""
    cfg = _with_job_secret(cfg)
    sock = _listen(cfg)
    port = sock.getsockname()[1] if sock is not None else cfg.master_port
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def _on_signal(signum: int, frame: object) -> None:
        for sig in previous:  # a second Ctrl-C must not interrupt the stopping
            signal.signal(sig, signal.SIG_IGN)
        raise _Stop(signal.Signals(signum).name)

    for s in previous:
        signal.signal(s, _on_signal)
    children: list[_Child] = []
    store = None
    try:
        children = _spawn(cfg, port)
        store = _open_store(cfg, sock)
        code = _watch(cfg, store, children)
        if code == 0 and cfg.nnodes > 1:
            code = _finish_nodes(cfg, store)
        return code
    except _Stop as e:
        _say(cfg, f"received {e}; stopping all processes")
        if store is not None:
            _record_failure(cfg, store, f"launcher received {e}")
        return 128 + getattr(signal, str(e)).value
    finally:
        for s in previous:  # a second Ctrl-C must not interrupt the cleanup
            signal.signal(s, signal.SIG_IGN)
        _terminate(children, cfg.grace_s)
        if sock is not None:
            sock.close()
        for s, h in previous.items():
            signal.signal(s, h)


def restart_loop(run: Callable[[str | None], int], *, checkpoints: str | os.PathLike | None,
                 resume: str | None, max_restarts: int,
                 announce: Callable[[int, int, str | None], None]) -> tuple[int, int]:
    """The one restart loop, of ``gradpress launch --max-restarts`` and ``gradpress train
    --max-restarts``. ``run(r)`` runs the whole job from checkpoint ``r`` (None: the start)
    and returns its exit status; the first run starts from ``resume``.

    After a failure (any status but 0 and :data:`INTERRUPTED`), at most ``max_restarts`` times:

    1. find the newest valid checkpoint under ``checkpoints``
       (:func:`gradpress.checkpoint.latest`; none there: ``resume``, where the job started);
    2. ``announce(status, restart number, checkpoint)``: the caller says what failed and where
       the job restarts (``gradpress train`` also cuts its run directory back to it);
    3. run the job again from it.

    Returns the last exit status and the number of restarts.
    """
    from .checkpoint import latest

    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    code, count = run(resume), 0
    while code != 0 and code not in INTERRUPTED and count < max_restarts:
        found = (latest(checkpoints) if checkpoints else None) or resume  # step 1
        count += 1
        announce(code, count, found)  # step 2
        code = run(found)  # step 3
    return code, count

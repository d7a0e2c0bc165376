"""Roles, rank layout, rendezvous and process groups of a gradpress job.

Rank layout of the world group (``W`` workers, ``S`` servers, ``N`` nodes)::

    separate servers:  workers 0 .. W-1, servers W .. W+S-1        (world size W+S)
                       node n runs workers n*W/N .. (n+1)*W/N-1 and servers W+n*S/N ..
    colocated:         workers 0 .. W-1 (world size W); server s runs as threads inside
                       worker (s // (S/N)) * (W/N) + s % (S/N), i.e. the first S/N workers
                       of each node host one server each (on one node: worker s hosts server s)

``gradpress.rank()`` is the worker index, which equals the world rank. With hierarchical
aggregation only the first worker of each node (its "leader") pushes to the servers.
Rendezvous goes through a ``torch.distributed.TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` (hosted
by the launcher, by torchrun's agent, or else by world rank 0); payloads travel by gloo
point-to-point messages of the default (world) process group. All processes also create the
workers' subgroup (barriers and broadcasts among workers) and, with hierarchical aggregation,
two subgroups per node (local reduce, local broadcast), because ``new_group`` is collective over
the world. Every process checks that it agrees with the others on the job's shape.

Every key gradpress writes to the store, the process group's rendezvous included, lives under
``gradpress/<attempt>/`` (:attr:`ClusterConfig.attempt`; under torchrun's agent store the one a
roll call gives the group, :mod:`gradpress.ps.rollcall`): torchrun's elastic agent keeps one
store for every restart of the group, and a restarted process must never read the descriptors,
server state requests, errors or gloo addresses of the processes it replaces
(docs/integrations.md, "Recovery with torchrun").
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import json
import logging
import os
import socket
from dataclasses import asdict, dataclass

import torch.distributed as dist

from .auth import authenticate
from .config import ClusterConfig
from .errors import GradpressError
from .rollcall import roll_call

__all__ = ["Layout", "Cluster", "store_prefix"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Where every worker and server lives in the world group (see the module docstring)."""

    num_workers: int
    num_servers: int
    colocate: bool
    nnodes: int = 1
    hierarchical: bool = False

    def __post_init__(self) -> None:
        if self.num_workers % self.nnodes:
            raise ValueError(f"{self.num_workers} workers cannot be spread evenly over "
                             f"{self.nnodes} nodes")
        if self.colocate and self.num_servers % self.nnodes:
            raise ValueError(f"colocated: {self.num_servers} servers cannot be spread evenly "
                             f"over {self.nnodes} nodes")

    @classmethod
    def of(cls, cfg: ClusterConfig, hierarchical: bool = False) -> Layout:
        return cls(cfg.num_workers, cfg.num_servers, cfg.colocate, cfg.nnodes, hierarchical)

    @property
    def world_size(self) -> int:
        return self.num_workers + (0 if self.colocate else self.num_servers)

    @property
    def workers_per_node(self) -> int:
        return self.num_workers // self.nnodes

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.num_workers))

    def server_rank(self, s: int) -> int:
        """World rank of the process that runs server ``s``."""
        if not 0 <= s < self.num_servers:
            raise ValueError(f"server index {s} out of range [0, {self.num_servers})")
        if not self.colocate:
            return self.num_workers + s
        spn = self.num_servers // self.nnodes
        return (s // spn) * self.workers_per_node + s % spn

    def servers_of(self, rank: int) -> list[int]:
        """Server indices hosted by world rank ``rank``."""
        return [s for s in range(self.num_servers) if self.server_rank(s) == rank]

    def node_of_worker(self, w: int) -> int:
        return w // self.workers_per_node

    def node_workers(self, node: int) -> list[int]:
        wpn = self.workers_per_node
        return list(range(node * wpn, (node + 1) * wpn))

    @property
    def pushers(self) -> list[int]:
        """Workers that push to servers: all, or each node's leader when hierarchical."""
        if not self.hierarchical:
            return self.worker_ranks
        return [n * self.workers_per_node for n in range(self.nnodes)]

    def describe(self, rank: int) -> str:
        """Human-readable role(s) of a world rank, e.g. ``"server 1 (rank 3)"`` (built once per
        rank: every message names its peer)."""
        name = self._names.get(rank)
        if name is None:
            name = self._names[rank] = self._describe(rank)
        return name

    @functools.cached_property
    def _names(self) -> dict[int, str]:
        return {}

    def _describe(self, rank: int) -> str:
        parts = []
        if rank < self.num_workers:
            parts.append(f"worker {rank}")
        parts += [f"server {s}" for s in self.servers_of(rank)]
        return f"{' + '.join(parts) or 'unknown'} (rank {rank})"


def store_prefix(attempt: int) -> str:
    """The prefix of every store key of attempt ``attempt`` of a job."""
    return f"gradpress/{attempt}/"


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _listen(addr: str, port: int) -> socket.socket:
    """A listening socket bound to ``addr:port`` only (port 0: a free one)."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
    except OSError as e:
        sock.close()
        raise GradpressError(f"cannot listen on {addr}:{port} for the TCP store: {e}") from e
    sock.listen(1024)
    return sock


def _gloo_on_loopback(master_addr: str) -> None:
    """With a loopback store address the job is local: gloo listens on loopback too, not on
    the address the host name resolves to (unless ``GLOO_SOCKET_IFNAME`` says otherwise)."""
    if not _is_loopback(master_addr) or "GLOO_SOCKET_IFNAME" in os.environ:
        return
    names = [name for _, name in socket.if_nameindex()]
    lo = next((n for n in ("lo", "lo0") if n in names), None)
    if lo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = lo


class Cluster:
    """A joined job: store, world process group, worker subgroups, and this process's role."""

    def __init__(self, cfg: ClusterConfig, timeout: float, hierarchical: bool = False) -> None:
        self.cfg = cfg
        self.layout = Layout.of(cfg, hierarchical)
        self.timeout = timeout
        self.rank = cfg.rank
        self._owns_store = not cfg.store_hosted and cfg.rank == 0
        self._listener: socket.socket | None = None  # the store's socket when this rank hosts
        self.raw_store = self._open_store()
        self._scope(cfg.attempt)  # a roll call may change it (_join)
        self.worker_group: dist.ProcessGroup | None = None
        #: (local reduce group, local broadcast group) of this worker's node (hierarchical)
        self.local_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
        self._joined = False

    def _scope(self, attempt: int) -> None:
        #: gradpress's own keys (descriptors, errors, process group) live under this prefix
        self.attempt = attempt
        self.prefix = store_prefix(attempt)
        self.store = dist.PrefixStore(self.prefix, self.raw_store)

    def _open_store(self) -> dist.TCPStore:
        cfg = self.cfg
        if self._owns_store:  # listen on MASTER_ADDR only (loopback by default), not on all
            self._listener = _listen(cfg.master_addr, cfg.master_port)
            return dist.TCPStore(cfg.master_addr, self._listener.getsockname()[1], None, True,
                                 timeout=_timedelta(self.timeout), wait_for_workers=False,
                                 master_listen_fd=self._listener.fileno())
        if cfg.master_port == 0:
            raise GradpressError(f"{self.describe(cfg.rank)}: MASTER_PORT is not set; start the "
                                 f"job with `gradpress launch` or set MASTER_ADDR/MASTER_PORT")
        return dist.TCPStore(cfg.master_addr, cfg.master_port, None, False,
                             timeout=_timedelta(self.timeout))

    @classmethod
    def connect(cls, cfg: ClusterConfig, timeout: float, hierarchical: bool = False) -> Cluster:
        """Rendezvous and create the process groups (collective over all processes)."""
        self = cls(cfg, timeout, hierarchical)
        try:
            self._join()
        except Exception:
            self.close()
            raise
        return self

    def _join(self) -> None:
        lay = self.layout
        if lay.world_size != self.cfg.world_size:
            raise GradpressError(f"layout world size {lay.world_size} != {self.cfg.world_size}")
        if dist.is_initialized():
            raise GradpressError("torch.distributed is already initialized in this process; "
                                 "gradpress creates its own process group")
        if self.cfg.roll_call:  # the agent's store: the restart counts may differ
            self._scope(roll_call(self.raw_store, self.rank, lay.world_size, self.timeout,
                                  self.describe))
        authenticate(self.store, rank=self.rank, world_size=lay.world_size,
                     describe=self.describe, secret=self.cfg.secret, timeout=self.timeout)
        self._agree_on_job()
        _gloo_on_loopback(self.cfg.master_addr)
        self.store.set(f"joined/{self.rank}", "1")
        try:
            dist.init_process_group("gloo", store=dist.PrefixStore("pg/", self.store),
                                    rank=self.rank, world_size=lay.world_size,
                                    timeout=_timedelta(self.timeout))
        except Exception as e:
            raise GradpressError(f"{self.describe(self.rank)}: process group rendezvous failed "
                                 f"(not arrived: {self._not_arrived()}): {e}") from e
        self._joined = True
        # new_group is collective over the world: every process creates every group, in order
        tmo = _timedelta(self.timeout)
        self.worker_group = dist.new_group(lay.worker_ranks, backend="gloo", timeout=tmo)
        if not lay.hierarchical:
            return
        for n in range(lay.nnodes):
            ranks = lay.node_workers(n)
            pair = (dist.new_group(ranks, backend="gloo", timeout=tmo),
                    dist.new_group(ranks, backend="gloo", timeout=tmo))
            if self.rank in ranks:
                self.local_groups = pair

    def _not_arrived(self) -> str:
        """The processes that did not reach the process group rendezvous (best effort)."""
        try:
            missing = [self.describe(r) for r in range(self.layout.world_size)
                       if not self.store.check([f"joined/{r}"])]
        except Exception:  # noqa: BLE001 - the store is gone: nothing more to say
            return "unknown"
        return ", ".join(missing) or "none"

    def _agree_on_job(self) -> None:
        """Every process must see the same job shape (the first to arrive sets it)."""
        mine = json.dumps(asdict(self.layout), sort_keys=True)
        agreed = self.store.compare_set("job", "", mine).decode()
        if agreed != mine:
            raise GradpressError(f"{self.describe(self.rank)} disagrees with the job: it has "
                                 f"{mine}, others have {agreed} (check GRADPRESS_HIERARCHICAL "
                                 f"and the launcher's counts)")

    @property
    def is_worker(self) -> bool:
        return self.rank < self.layout.num_workers

    @property
    def my_servers(self) -> list[int]:
        return self.layout.servers_of(self.rank)

    def describe(self, rank: int) -> str:
        return self.layout.describe(rank)

    def report_error(self, message: str) -> None:
        """Record a failure in the store so that peers can name the root cause."""
        try:
            self.store.append(  # type: ignore[attr-defined]  # not in torch's stubs
                "errors", f"{self.describe(self.rank)}: {message}\n")
        except Exception:
            log.debug("could not record the error in the store", exc_info=True)

    def reported_errors(self) -> str:
        """Failures other processes recorded (empty when none or the store is unreachable)."""
        try:
            if self.store.check(["errors"]):
                return self.store.get("errors").decode(errors="replace").strip()
        except Exception:  # noqa: BLE001 - best effort while already failing
            pass
        return ""

    def close(self) -> None:
        """Destroy the process groups (idempotent)."""
        if self._joined and dist.is_initialized():
            dist.destroy_process_group()
        self._joined = False

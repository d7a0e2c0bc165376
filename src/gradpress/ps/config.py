"""Configuration of the parameter-server runtime: :class:`PSConfig` (engine options) and
:class:`ClusterConfig` (this process's place in the job).

Both are frozen, keyword-only dataclasses validated on construction. ``GRADPRESS_*`` environment
variables only fill defaults: ``PSConfig.from_env(timeout=10)`` reads the environment for every
field not given explicitly. The variables are listed in docs/reference/environment.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..compress.spec import EFSpec, parse_ef

__all__ = ["PSConfig", "ClusterConfig", "ROLES", "COMPRESS_ON", "available_cores"]

ROLES = ("worker", "server")
#: Where a worker compresses tensors that live on an accelerator (see ``PSConfig.compress_on``).
COMPRESS_ON = ("host", "device")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def available_cores() -> int:
    """CPU cores this process may run on (affinity mask where the OS reports one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _default_threads() -> int:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(4, available_cores() // max(1, local)))


def _parse_bool(name: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name}={text!r}: expected a boolean (1|0|true|false)")


def _parse_optional_str(name: str, text: str) -> str | None:
    return text or None


def _parse_optional_int(name: str, text: str) -> int | None:
    return int(text) if text.strip() else None


def _parser(tp: Any) -> Callable[[str, str], Any]:
    table: dict[Any, Callable[[str, str], Any]] = {
        "int": lambda n, t: int(t), "float": lambda n, t: float(t), "str": lambda n, t: t,
        "bool": _parse_bool, "str | None": _parse_optional_str,
        "int | None": _parse_optional_int, "str | EFSpec | None": _parse_optional_str,
    }
    return table[tp]


def _from_env(cls: type, prefix: str, env: Mapping[str, str] | None,
              overrides: Mapping[str, Any]) -> Any:
    """Build ``cls`` from ``overrides``, filling the other fields from ``prefix + FIELD``."""
    env = os.environ if env is None else env
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown option(s) {', '.join(unknown)}; valid: "
                        f"{', '.join(names)}")
    kwargs = dict(overrides)
    for name, f in names.items():
        var = prefix + name.upper()
        if name in kwargs or var not in env:
            continue
        try:
            kwargs[name] = _parser(f.type)(var, env[var])
        except ValueError as e:
            raise ValueError(f"environment variable {var}={env[var]!r} is invalid for "
                             f"{cls.__name__}.{name} ({f.type}): {e}") from None
    return cls(**kwargs)


def _check_int(obj: Any, name: str, lo: int, optional: bool = False) -> None:
    v = getattr(obj, name)
    if optional and v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{type(obj).__name__}.{name} must be an int >= {lo}, got {v!r}")


def _check_float(obj: Any, name: str, lo: float) -> None:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < lo:
        raise ValueError(f"{type(obj).__name__}.{name} must be a finite number >= {lo}, "
                         f"got {v!r}")


@dataclass(frozen=True, kw_only=True)
class PSConfig:
    """Options of the worker pipeline and the server engine (env prefix ``GRADPRESS_``)."""

    #: Tensors are cut into chunks ("partitions") of at most this many bytes (4 MiB).
    partition_bytes: int = 4 << 20
    #: Tensors smaller than this travel uncompressed (fp32, exact, no error feedback).
    min_compress_bytes: int = 1 << 20
    #: Most bytes of a fused key: the optimizers pack the tensors below ``min_compress_bytes``
    #: into shared keys of up to this size (:mod:`gradpress.ps.fusion`). None: one chunk
    #: (``partition_bytes``); 0: no fusion, every tensor its own key. Must be the same in
    #: every worker.
    fusion_bytes: int | None = None
    #: Default codec spec of ``push_pull`` when the call gives none (e.g. ``"onebit"``).
    compression: str = "none"
    #: Default error feedback of ``push_pull``: an :class:`~gradpress.compress.EFSpec` or its
    #: text (``vanilla``, ``vanilla:decay=B``, ``vanilla:decay=B,server_decay=S``, with
    #: ``,anneal=1`` appended, ``corrected``, ``sparse``), or None.
    ef: str | EFSpec | None = None
    #: Seconds any wait inside an operation may last before it raises (gloo closes the link).
    timeout: float = 300.0
    #: Seconds a server waits for a worker's next message between operations; 0 = no limit
    #: (a crashed worker still ends the wait at once: its connection closes).
    idle_timeout: float = 0.0
    #: Seconds between the failure watchdog's polls of the store; 0 disables it. A failure
    #: any process records reaches every process within this; see docs/design.md.
    watchdog_interval: float = 1.0
    #: Where a worker compresses a tensor: ``"host"`` (numba kernels on CPU; a GPU tensor is
    #: copied to pinned host memory chunk by chunk) or ``"device"`` (the codecs' torch-op
    #: kernels where the tensor lives, error-feedback residual included; only payloads cross
    #: to the host). Servers always work on the host. See :mod:`gradpress.ps.worker`.
    compress_on: str = "host"
    #: Threads of a worker's compress/decompress pool.
    compress_threads: int = field(default_factory=_default_threads)
    #: Decode-accumulate-recompress threads of a server engine (keys balanced by bytes; a small
    #: key whose pushes all came inline is reduced on the control thread that read its last).
    engine_threads: int = field(default_factory=_default_threads)
    #: torch intra-op threads set by ``init`` (None: leave torch's setting). Keep
    #: compress_threads x torch_threads <= cores of the process.
    torch_threads: int | None = None
    #: Most payload bytes a worker keeps in flight (pushed, reply not yet decoded).
    inflight_bytes: int = 256 << 20
    #: Chrome-trace output path of the per-chunk stages (a suffix per process is added).
    trace: str | None = None
    #: Base seed of codecs that draw random numbers (randomk, dithering).
    seed: int = 0
    #: Hierarchical aggregation: reduce within each node, only the node's first worker pushes
    #: and pulls, then broadcast within the node. Must be the same in every process.
    hierarchical: bool = False
    #: Checkpoint directory whose server state the server engines load when they start (set
    #: by ``gradpress launch --resume DIR``; see docs/design.md).
    resume: str | None = None

    def __post_init__(self) -> None:
        _check_int(self, "partition_bytes", 4)
        _check_int(self, "min_compress_bytes", 0)
        _check_int(self, "fusion_bytes", 0, optional=True)
        _check_float(self, "timeout", 0.001)
        _check_float(self, "idle_timeout", 0.0)
        _check_float(self, "watchdog_interval", 0.0)
        _check_int(self, "compress_threads", 1)
        _check_int(self, "engine_threads", 1)
        _check_int(self, "torch_threads", 1, optional=True)
        _check_int(self, "inflight_bytes", 1)
        _check_int(self, "seed", 0)
        if not isinstance(self.compression, str) or not self.compression.strip():
            raise ValueError(f"PSConfig.compression must be a codec spec string such as 'none' "
                             f"or 'onebit', got {self.compression!r}")
        try:
            parse_ef(self.ef)
        except (TypeError, ValueError) as e:
            raise ValueError(f"PSConfig.ef={self.ef!r} is invalid: {e}") from None
        if self.compress_on not in COMPRESS_ON:
            raise ValueError(f"PSConfig.compress_on must be one of {', '.join(COMPRESS_ON)}, "
                             f"got {self.compress_on!r}")
        if not isinstance(self.hierarchical, bool):
            raise ValueError(f"PSConfig.hierarchical must be a bool, got {self.hierarchical!r}")
        if self.trace is not None and not isinstance(self.trace, str):
            raise ValueError(f"PSConfig.trace must be None or a path string, got {self.trace!r}")
        if self.resume is not None and not isinstance(self.resume, str):
            raise ValueError(f"PSConfig.resume must be None or a directory path, got "
                             f"{self.resume!r}")

    @property
    def fusion_cap(self) -> int:
        """The cap of a fused key in bytes: ``fusion_bytes``, or ``partition_bytes`` when
        None; 0 when fusion is off."""
        return self.partition_bytes if self.fusion_bytes is None else self.fusion_bytes

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> PSConfig:
        """Explicit ``overrides`` win; other fields come from ``GRADPRESS_<FIELD>`` or defaults."""
        return _from_env(cls, "GRADPRESS_", env, overrides)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """This process's place in the job (see :mod:`gradpress.ps.cluster` for the rank layout).

    ``from_env`` reads the torchrun-style variables ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` and ``GRADPRESS_ROLE``,
    ``GRADPRESS_NUM_SERVERS``, ``GRADPRESS_COLOCATE``, ``GRADPRESS_NNODES``,
    ``GRADPRESS_STORE_HOSTED``, ``GRADPRESS_SECRET``, and the attempt: ``GRADPRESS_ATTEMPT``,
    else, where another process hosts the store, torchrun's ``TORCHELASTIC_RESTART_COUNT``
    (under torchrun's agent store: a roll call), else 0.
    Without any of them it describes a single
    colocated process.
    """

    #: ``"worker"`` or ``"server"`` (a colocated worker also hosts a server engine).
    role: str
    #: Rank of this process in the world group.
    rank: int
    #: Number of worker processes (world ranks ``0..num_workers-1``).
    num_workers: int
    #: Number of server engines (separate processes, or threads inside workers if colocated).
    num_servers: int
    #: Whether server engines run inside the worker processes.
    colocate: bool = False
    #: Number of nodes (machines); workers and servers are spread evenly over them.
    nnodes: int = 1
    #: Address of the TCP store (rendezvous).
    master_addr: str = "127.0.0.1"
    #: Port of the TCP store; 0 lets the hosting process pick a free one (single process only).
    master_port: int = 0
    #: This worker's index among the workers of its node.
    local_rank: int = 0
    #: Number of workers on this node.
    local_size: int = 1
    #: Whether another process (the launcher, torchrun's agent) hosts the TCP store; if not,
    #: world rank 0 hosts it.
    store_hosted: bool = False
    #: The job secret every process proves at rendezvous (``GRADPRESS_SECRET``; None: the job
    #: is not authenticated). Never printed. See :mod:`gradpress.ps.auth`.
    secret: str | None = field(default=None, repr=False)
    #: Which start of the job this is: ``GRADPRESS_ATTEMPT``, or torchrun's restart count
    #: (``TORCHELASTIC_RESTART_COUNT``) where another process hosts the store; 0 where world
    #: rank 0 hosts it (a fresh store at every start). Every store key of gradpress is scoped
    #: to it, so a restarted group never reads what an earlier attempt left in a store that
    #: outlived it.
    attempt: int = 0
    #: Whether the processes agree on the attempt by a roll call instead
    #: (:mod:`gradpress.ps.rollcall`): under torchrun's agent store without
    #: ``GRADPRESS_ATTEMPT``, where restart counts differ between nodes after a membership change.
    roll_call: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"ClusterConfig.role must be one of {', '.join(ROLES)}, "
                             f"got {self.role!r}")
        for name in ("num_workers", "nnodes", "local_size"):
            _check_int(self, name, 1)
        for name in ("rank", "num_servers", "local_rank", "master_port", "attempt"):
            _check_int(self, name, 0)
        if self.num_servers < 1:
            raise ValueError(f"ClusterConfig.num_servers must be >= 1, got {self.num_servers}")
        if self.colocate and self.num_servers > self.num_workers:
            raise ValueError(f"colocated servers live inside workers: num_servers "
                             f"({self.num_servers}) must be <= num_workers ({self.num_workers})")
        if self.rank >= self.world_size:
            raise ValueError(f"ClusterConfig.rank {self.rank} is outside the world of "
                             f"{self.world_size} processes")
        if self.local_rank >= self.local_size:
            raise ValueError(f"ClusterConfig.local_rank {self.local_rank} must be < local_size "
                             f"{self.local_size}")
        if self.master_port > 65535:
            raise ValueError(f"ClusterConfig.master_port must be <= 65535, got {self.master_port}")
        if self.secret is not None and (not isinstance(self.secret, str) or not self.secret):
            raise ValueError("ClusterConfig.secret must be None or a non-empty string "
                             f"(GRADPRESS_SECRET), got a {type(self.secret).__name__}")

    @property
    def world_size(self) -> int:
        """Processes in the world group: workers, plus servers when not colocated."""
        return self.num_workers + (0 if self.colocate else self.num_servers)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ClusterConfig:
        """Read the job description from the environment (launcher or torchrun variables)."""
        env = os.environ if env is None else env
        vals: dict[str, Any] = {}
        world = int(env.get("WORLD_SIZE", "1"))
        servers_env = env.get("GRADPRESS_NUM_SERVERS", "")
        colocate = _parse_bool("GRADPRESS_COLOCATE", env["GRADPRESS_COLOCATE"]) \
            if "GRADPRESS_COLOCATE" in env else not servers_env
        servers = int(servers_env) if servers_env else world
        vals["colocate"] = colocate
        vals["num_servers"] = servers
        vals["num_workers"] = int(env.get("GRADPRESS_NUM_WORKERS",
                                          world if colocate else world - servers))
        vals["rank"] = int(env.get("RANK", "0"))
        vals["role"] = env.get("GRADPRESS_ROLE") or (
            "worker" if vals["rank"] < vals["num_workers"] else "server")
        vals["nnodes"] = int(env.get("GRADPRESS_NNODES", env.get("NNODES", "1")))
        vals["master_addr"] = env.get("MASTER_ADDR", "127.0.0.1")
        vals["master_port"] = int(env.get("MASTER_PORT", "0"))
        vals["local_rank"] = int(env.get("LOCAL_RANK", "0"))
        vals["local_size"] = int(env.get("LOCAL_WORLD_SIZE", "1"))
        hosted = env.get("GRADPRESS_STORE_HOSTED") or env.get("TORCHELASTIC_USE_AGENT_STORE", "")
        vals["store_hosted"] = _parse_bool("GRADPRESS_STORE_HOSTED", hosted)
        vals["secret"] = env.get("GRADPRESS_SECRET") or None
        # a store that world rank 0 hosts is new at every start and holds nothing of an
        # earlier attempt; torchrun's restart count (which differs between an old agent and a
        # replacement node's new one) must not name its keys then
        restarts = env.get("TORCHELASTIC_RESTART_COUNT") if vals["store_hosted"] else None
        vals["attempt"] = int(env.get("GRADPRESS_ATTEMPT") or restarts or "0")
        vals["roll_call"] = bool(vals["store_hosted"] and "TORCHELASTIC_RESTART_COUNT" in env
                                 and not env.get("GRADPRESS_ATTEMPT"))
        vals.update(overrides)
        return cls(**vals)

"""Pipeline model of one BytePS-Compress training iteration at cluster scale.

A discrete-event simulation of the system of Zhong, Xie, Zheng, Lin 2021 ("Compressed
Communication for Distributed Training: Adaptive Methods and System", BytePS-Compress), on top of
BytePS's hierarchical push/pull (Jiang et al., OSDI 2020). All N worker nodes and every server
are simulated explicitly; times are seconds inside, milliseconds in results. The model:

1. Compute. One iteration's compute time C (per GPU) splits into forward F = (1-f)*C and backward
   B = f*C (``backward_fraction`` f, default 2/3: backward costs about twice the forward). Backward
   runs the model's ops from the last to the first; each op takes B times its share of the
   model's forward MACs (FLOPs, not parameters: VGG16's fc layers hold most of the parameters but
   few of the MACs). The gradients of an op's tensors are ready when the op finishes.
2. Chunks. Every tensor is cut into partitions of ``partition_bytes`` (as the runtime does, by
   float32 elements), keyed by :func:`~gradpress.ps.partition.chunk_key` and spread over the
   servers by :func:`~gradpress.ps.partition.assign_balanced` (bytes), and over each server's
   engine threads by the same greedy (elements). Tensors of fewer than ``min_compress_bytes``
   float32 bytes use the baseline wire format; the others the compression spec. Payload sizes
   are ``gradpress.compress.build(spec, numel).payload_bytes``: the real wire format.
3. Hierarchy (per node, per chunk): intra-node reduce of the chunk in its dense dtype over NVLink
   (bytes / ``nvlink``, NCCL bus bandwidth; skipped with one GPU), copy to host memory over PCIe
   (bytes / ``pcie``), compress on the node's worker thread pool, push to the key's server; after
   the pull: decompress on the pool, copy back over PCIe, broadcast over NVLink. NVLink, PCIe
   device-to-host and PCIe host-to-device are FIFO resources of each node.
4. Network. Each machine has a full-duplex NIC of ``bandwidth`` bytes/s per direction. A transfer
   occupies the sender's uplink and the receiver's downlink, each FIFO in request order, cut
   through: it starts on the uplink when the uplink is free, on the downlink when both it has
   started and the downlink is free, and cannot finish on the downlink before it finished on the
   uplink. Pushes and pulls of one machine share its links (BytePS uses both directions).
   Servers are colocated (``servers_per_node`` per worker node, BytePS's default setup; a
   transfer to a server on the same node costs no network) or on ``server_machines`` dedicated
   machines with NICs of the same bandwidth.
5. Two-way compression on CPU. Worker compress (with error feedback when the spec has it) and
   worker decompress run on a pool of ``worker_threads`` per node; each push is
   decompress-accumulated by the key's server engine thread as it arrives, and after the last of
   the N pushes the thread recompresses the average once; the reply goes to every node. The
   dense baseline costs only the server's sum. Times per chunk are numel*4 bytes / the per-thread
   rate (:mod:`gradpress.sim.rates`). Worker and server threads are separate CPUs.
6. Iteration time. ``forward="all"`` (default; PyTorch's ``optimizer.step()`` waits for every
   gradient): max(F + B, last chunk done on any node). ``forward="layer"`` (MXNet-style per-layer
   dependencies): the next forward starts after backward and runs op by op, each op waiting for
   its own tensors; the iteration is the next forward's end minus F. Optimizer time is part of C.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from ..compress import build
from ..ps.partition import assign_balanced, chunk_key, chunk_layout
from .models import Model
from .rates import CodecRates, default_rates

__all__ = ["SimConfig", "ChunkPlan", "SimResult", "Comparison", "plan_chunks", "simulate",
           "compare", "BASELINES", "FORWARD_MODES"]

#: dense wire formats of the uncompressed baseline -> bytes per element of the gradient
BASELINES = {"none": 4, "fp16": 2, "bf16": 2}
FORWARD_MODES = ("all", "layer")


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """Inputs of one simulated iteration (see the module docstring for the model).

    ``bandwidth`` (NIC, per direction), ``nvlink`` and ``pcie`` are bytes/s; ``compression`` is
    a codec spec, ``baseline`` the dense wire format (its dtype is also the gradient's dtype on
    the GPU); ``compute_ms`` defaults to the model's published-throughput estimate;
    ``codec_rates`` (the compression spec) and ``dense_rates`` (the server's dense sum) default
    to :func:`~gradpress.sim.rates.default_rates`.
    """

    model: Model
    bandwidth: float
    nodes: int = 8
    gpus_per_node: int = 8
    compression: str = "none"
    baseline: str = "none"
    compute_ms: float | None = None
    backward_fraction: float = 2.0 / 3.0
    partition_bytes: int = 4 << 20
    min_compress_bytes: int = 1 << 20
    servers_per_node: int = 1
    server_machines: int = 0
    worker_threads: int = 8
    server_threads: int = 4
    codec_rates: CodecRates | None = None
    dense_rates: CodecRates | None = None
    nvlink: float = 100e9
    pcie: float = 10e9
    forward: str = "all"

    def __post_init__(self) -> None:
        if not isinstance(self.model, Model):
            raise TypeError(f"SimConfig.model must be a Model, got {type(self.model).__name__}")
        for name, lo in (("nodes", 1), ("gpus_per_node", 1), ("partition_bytes", 4),
                         ("min_compress_bytes", 0), ("servers_per_node", 1),
                         ("server_machines", 0), ("worker_threads", 1), ("server_threads", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"SimConfig.{name} must be an int >= {lo}, got {v!r}")
        positive = ["bandwidth", "nvlink", "pcie"] + ([] if self.compute_ms is None
                                                      else ["compute_ms"])
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v <= 0:
                raise ValueError(f"SimConfig.{name} must be a finite number > 0, got {v!r}")
        if not 0.0 < self.backward_fraction < 1.0:
            raise ValueError(f"SimConfig.backward_fraction must be in (0, 1), got "
                             f"{self.backward_fraction!r}")
        if self.baseline not in BASELINES:
            raise ValueError(f"SimConfig.baseline {self.baseline!r}: expected one of "
                             f"{', '.join(BASELINES)}")
        if self.forward not in FORWARD_MODES:
            raise ValueError(f"SimConfig.forward {self.forward!r}: expected one of "
                             f"{', '.join(FORWARD_MODES)}")
        build(self.compression, 1)  # ValueError naming the codec or parameter

    @property
    def compute_s(self) -> float:
        ms = self.model.default_compute_ms if self.compute_ms is None else self.compute_ms
        return ms / 1000.0


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk as the simulator moves it: wire spec, payload size and placement."""

    key: int
    tensor: str
    numel: int
    spec: str
    compressed: bool
    payload_bytes: int
    dense_bytes: int
    server: int
    thread: int


@dataclass(frozen=True)
class SimResult:
    """One simulated iteration (milliseconds; bytes per worker node and iteration)."""

    compression: str
    iteration_ms: float
    compute_ms: float
    exposed_ms: float
    network_ms: float
    worker_codec_ms: float
    server_codec_ms: float
    push_bytes: int
    dense_bytes: int
    chunks: int
    compressed_chunks: int


@dataclass(frozen=True)
class Comparison:
    """Baseline and compressed iterations of one configuration."""

    baseline: SimResult
    compressed: SimResult
    speedup: float = field(init=False)
    reduction_pct: float = field(init=False)

    def __post_init__(self) -> None:
        ratio = self.compressed.iteration_ms / self.baseline.iteration_ms
        object.__setattr__(self, "speedup", 1.0 / ratio)
        object.__setattr__(self, "reduction_pct", 100.0 * (1.0 - ratio))

    def to_dict(self) -> dict:
        return {"baseline": asdict(self.baseline), "compressed": asdict(self.compressed),
                "speedup": self.speedup, "training_time_reduction_pct": self.reduction_pct}


def _num_servers(cfg: SimConfig) -> int:
    return cfg.server_machines or cfg.nodes * cfg.servers_per_node


def _host(cfg: SimConfig, server: int) -> int:
    """Machine index of a server: worker nodes are 0..N-1, dedicated machines N.."""
    return cfg.nodes + server if cfg.server_machines else server // cfg.servers_per_node


def plan_chunks(cfg: SimConfig, compressed: bool) -> list[ChunkPlan]:
    """Chunks of every tensor, in declaration order (model step 2)."""
    itemsize = BASELINES[cfg.baseline]
    loads = [0] * _num_servers(cfg)
    thread_loads = [[0] * cfg.server_threads for _ in loads]
    payload_cache: dict[tuple[str, int], int] = {}
    out: list[ChunkPlan] = []
    seen: dict[int, str] = {}
    for t in cfg.model.tensors:
        small = 4 * t.numel < cfg.min_compress_bytes
        spec = cfg.compression if compressed and not small else cfg.baseline
        layout = chunk_layout(t.numel, cfg.partition_bytes)
        keys = [chunk_key(t.name, c.index) for c in layout]
        for k in keys:
            if k in seen:
                raise ValueError(f"key {k} of tensor {t.name!r} collides with {seen[k]!r}; "
                                 f"rename one of the tensors")
            seen[k] = t.name
        sizes = [payload_cache.setdefault((spec, c.numel), build(spec, c.numel).payload_bytes)
                 for c in layout]
        servers = assign_balanced(dict(zip(keys, sizes)), loads)
        for k, c, size in zip(keys, layout, sizes):
            s = servers[k]
            loads[s] += size
            th = assign_balanced({k: c.numel}, thread_loads[s])[k]
            thread_loads[s][th] += c.numel
            out.append(ChunkPlan(k, t.name, c.numel, spec, spec != cfg.baseline, size,
                                 c.numel * itemsize, s, th))
    return out


class _Fifo:
    """A resource serving one request at a time, in request order."""

    def __init__(self) -> None:
        self.free = 0.0
        self.busy = 0.0

    def run(self, now: float, dur: float) -> float:
        self.free = max(now, self.free) + dur
        self.busy += dur
        return self.free


class _Pool:
    """``n`` identical threads; a request takes the earliest free one."""

    def __init__(self, n: int) -> None:
        self.free = [0.0] * n
        self.busy = 0.0

    def run(self, now: float, dur: float) -> float:
        end = max(now, heapq.heappop(self.free)) + dur
        heapq.heappush(self.free, end)
        self.busy += dur
        return end


class _Path:
    """A cut-through transfer over the sender's uplink and the receiver's downlink (step 4)."""

    def __init__(self, up: _Fifo, down: _Fifo, rate: float) -> None:
        self.up, self.down, self.rate = up, down, rate

    def run(self, now: float, nbytes: float) -> float:
        d = nbytes / self.rate
        up_start = max(now, self.up.free)
        self.up.run(now, d)
        down_start = max(up_start, self.down.free)
        self.down.free = max(down_start + d, self.up.free)
        self.down.busy += d
        return self.down.free


Step = tuple[object, float]


class _Sim:
    """Event loop and resources of one simulated iteration (model steps 3-5)."""

    def __init__(self, cfg: SimConfig, chunks: list[ChunkPlan]) -> None:
        self.cfg, self.chunks = cfg, chunks
        n_hosts = cfg.nodes + cfg.server_machines
        self.up = [_Fifo() for _ in range(n_hosts)]
        self.down = [_Fifo() for _ in range(n_hosts)]
        self.nvlink = [_Fifo() for _ in range(cfg.nodes)]
        self.d2h = [_Fifo() for _ in range(cfg.nodes)]
        self.h2d = [_Fifo() for _ in range(cfg.nodes)]
        self.pool = [_Pool(cfg.worker_threads) for _ in range(cfg.nodes)]
        self.engine = [[_Fifo() for _ in range(cfg.server_threads)]
                       for _ in range(_num_servers(cfg))]
        self.rates = cfg.codec_rates or default_rates(cfg.compression)
        self.dense = cfg.dense_rates or default_rates("none")
        self.arrived: dict[int, int] = {}
        self.done: dict[str, float] = {}
        self._q: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()

    # -- event machinery ------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        heapq.heappush(self._q, (t, next(self._seq), fn, args))

    def run_events(self) -> None:
        while self._q:
            t, _, fn, args = heapq.heappop(self._q)
            fn(t, *args)

    def chain(self, t: float, steps: list[Step], done: Callable[[float], None]) -> None:
        """Run ``steps`` one after the other, each reserving its resource at its own start."""
        steps = [s for s in steps if s[0] is not None]
        if not steps:
            done(t)
            return
        res, amount = steps[0]
        end = res.run(t, amount)  # type: ignore[attr-defined]
        self.at(end, self.chain, steps[1:], done)

    def path(self, src: int, dst: int) -> _Path | None:
        return None if src == dst else _Path(self.up[src], self.down[dst], self.cfg.bandwidth)

    # -- the chunk's journey --------------------------------------------------------------------
    def push(self, t: float, node: int, c: ChunkPlan) -> None:
        cfg = self.cfg
        multi = cfg.gpus_per_node > 1
        steps: list[Step] = [
            (self.nvlink[node] if multi else None, c.dense_bytes / cfg.nvlink),  # reduce
            (self.d2h[node], c.dense_bytes / cfg.pcie),                          # to host
            (self.pool[node] if c.compressed else None,                          # compress
             self.rates.seconds("compress", c.numel)),
            (self.path(node, _host(cfg, c.server)), c.payload_bytes)]            # push
        self.chain(t, steps, lambda t2: self.server_add(t2, c))

    def server_add(self, t: float, c: ChunkPlan) -> None:
        rates = self.rates if c.compressed else self.dense
        thread = self.engine[c.server][c.thread]
        self.chain(t, [(thread, rates.seconds("decompress_add", c.numel))],
                   lambda t2: self.server_summed(t2, c))

    def server_summed(self, t: float, c: ChunkPlan) -> None:
        self.arrived[c.key] = self.arrived.get(c.key, 0) + 1
        if self.arrived[c.key] < self.cfg.nodes:
            return
        thread = self.engine[c.server][c.thread]
        steps: list[Step] = [(thread if c.compressed else None,
                              self.rates.seconds("compress", c.numel))]
        self.chain(t, steps, lambda t2: self.reply(t2, c))

    def reply(self, t: float, c: ChunkPlan) -> None:
        cfg = self.cfg
        host = _host(cfg, c.server)
        multi = cfg.gpus_per_node > 1
        for i in range(cfg.nodes):  # start with the next node, so no node is always first
            node = (host + 1 + i) % cfg.nodes
            steps: list[Step] = [
                (self.path(host, node), c.payload_bytes),                          # pull
                (self.pool[node] if c.compressed else None,                        # decompress
                 self.rates.seconds("decompress", c.numel)),
                (self.h2d[node], c.dense_bytes / cfg.pcie),                        # to GPU
                (self.nvlink[node] if multi else None, c.dense_bytes / cfg.nvlink)]  # bcast
            self.chain(t, steps,
                       lambda t2, name=c.tensor: self.finish(t2, name))  # type: ignore[misc]

    def finish(self, t: float, tensor: str) -> None:
        self.done[tensor] = max(self.done.get(tensor, 0.0), t)


def _ready_times(model: Model, fwd: float, bwd: float) -> dict[str, float]:
    """Model step 1: when backward (starting at ``fwd``) makes each tensor's gradient final."""
    total = model.macs
    t, ready = fwd, {}
    for op in reversed(model.ops):
        t += bwd * op.macs / total
        for tensor in op.tensors:
            ready[tensor.name] = t
    return ready


def _iteration(cfg: SimConfig, done: dict[str, float], fwd: float, bwd: float) -> float:
    """Model step 6."""
    if cfg.forward == "all":
        return max([fwd + bwd, *done.values()])
    t, total = fwd + bwd, cfg.model.macs
    for op in cfg.model.ops:
        t = max([t, *(done[x.name] for x in op.tensors)]) + fwd * op.macs / total
    return t - fwd


def simulate(cfg: SimConfig, compressed: bool = True) -> SimResult:
    """Simulate one iteration with ``cfg.compression`` (or the dense baseline)."""
    chunks = plan_chunks(cfg, compressed)
    c_s = cfg.compute_s
    fwd, bwd = (1.0 - cfg.backward_fraction) * c_s, cfg.backward_fraction * c_s
    ready = _ready_times(cfg.model, fwd, bwd)
    sim = _Sim(cfg, chunks)
    for c in chunks:
        for node in range(cfg.nodes):
            sim.at(ready[c.tensor], sim.push, node, c)
    sim.run_events()
    it = _iteration(cfg, sim.done, fwd, bwd)
    network = max(link.busy for link in sim.up + sim.down)
    hosts: dict[int, float] = {}
    for s, threads in enumerate(sim.engine):
        hosts[_host(cfg, s)] = hosts.get(_host(cfg, s), 0.0) + sum(th.busy for th in threads)
    return SimResult(
        compression=cfg.compression if compressed else cfg.baseline, iteration_ms=1e3 * it,
        compute_ms=1e3 * c_s, exposed_ms=1e3 * (it - c_s), network_ms=1e3 * network,
        worker_codec_ms=1e3 * sim.pool[0].busy, server_codec_ms=1e3 * max(hosts.values()),
        push_bytes=sum(c.payload_bytes for c in chunks),
        dense_bytes=sum(c.dense_bytes for c in chunks), chunks=len(chunks),
        compressed_chunks=sum(c.compressed for c in chunks))


def compare(cfg: SimConfig) -> Comparison:
    """The dense baseline and ``cfg.compression`` in the same configuration."""
    return Comparison(simulate(cfg, compressed=False), simulate(cfg, compressed=True))

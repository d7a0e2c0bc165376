"""The server: per key, sum the workers' pushes, add the server residual, re-compress and send
the same bytes to every worker (the two-way compression of BytePS-Compress, Zhong et al. 2021).

:func:`~gradpress.ps.reduce.reduce_pushes` is the server's arithmetic, the one implementation
shared by the parameter server below and the DDP hook (:mod:`gradpress.ddp`, whose ranks
each serve a shard).

Per key and step:

1. A control thread per worker reads that worker's push announcements in order and posts the
   payload receive into a buffer lent by the engine's pool until the push is decoded (the
   server never waits on a key a worker has not pushed, whatever order the workers push keys
   in, and holds receive buffers only for pushes in flight); an inline push's payload came
   with its announcement and is copied into such a buffer.
2. When all workers announced the step, the key goes to the engine thread that owns it (keys
   are balanced over engine threads by bytes, :func:`~gradpress.ps.partition.assign_balanced`),
   whose payload receives may still be in flight. A key whose pushes all came inline (payloads
   of at most 256 KiB, already copied) is reduced at once by the control thread that read its
   last push instead when that is quicker than the hand-off (:class:`~gradpress.ps.handoff.
   HandOff`, from the measured reduce speed and hand-off latency: small keys).
3. The engine thread waits until the sends that used this step's reply buffer two steps ago
   have left (two reply buffers by step parity: double buffering, so a step never overwrites
   bytes still in flight), then runs :func:`reduce_pushes`: it waits for the payloads *in worker
   rank order* and decode-accumulates them into ``acc`` (``acc = 0; acc += D(p_w)`` for
   w = 0..W-1), so results do not depend on arrival order; with ``average`` it then divides:
   ``acc /= W``.
4. :func:`reduce_pushes` compresses ``acc`` with the key's server codec, which carries the
   server's error-feedback residual (``ef`` of the key's spec, with its ``server_decay``; the
   learning rate pushed with the step is passed on for corrected error feedback), into the
   reply buffer.
5. It sends the same reply bytes to every worker, so all replicas decode identical gradients.

Run as ``python -m gradpress.ps.server`` by the launcher; colocated jobs run the engine as threads
inside worker processes.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator

import torch

from ..compress import build, parse_ef
from .cluster import Cluster
from .codec_state import ServerCheckpoint
from .config import ClusterConfig, PSConfig
from .errors import ConfigMismatchError, GradpressError, PayloadError
from .handoff import HandOff
from .partition import assign_balanced
from .protocol import (
    CTRL_BYTES,
    OP_LOAD,
    OP_PUSH_INLINE,
    OP_SAVE,
    OP_STOP,
    KeyDescriptor,
    read_control,
    require_declared,
)
from .reduce import reduce_pushes
from .trace import Tracer, trace_path
from .transport import (
    CTRL_TAG,
    FRAME_BYTES,
    HEAD_ROOM,
    INLINE_BYTES,
    BufferPool,
    Transfer,
    Transport,
    fits_inline,
    inline_payload,
    payload_buffer,
)
from .watchdog import Watchdog

__all__ = ["reduce_pushes", "ServerEngine", "serve", "main"]

log = logging.getLogger(__name__)


class KeyState:
    """Buffers, codecs and counters of one key on its server."""

    def __init__(self, key: int, desc: KeyDescriptor, pushers: int, thread: int) -> None:
        self.key = key
        self.desc = desc
        self.label = f"key {key} ({desc.label})"
        self.ef = parse_ef(desc.ef)
        self.dec = build(desc.spec, desc.numel, seed=desc.seed)
        # the workers' error feedback, with its server_decay when the kind has one
        self.enc = build(desc.spec, desc.numel, ef=self.ef.for_server(), seed=desc.seed)
        self.nbytes = self.dec.payload_bytes
        self.thread = thread
        # per worker: the buffer of its pending push, lent by the engine's pool (framed)
        self.recv: list[torch.Tensor | None] = [None] * pushers
        self.recv_ops: list[Transfer | None] = [None] * pushers
        self.lrs: list[float | None] = [None] * pushers
        self.next_step = [0] * pushers  # per worker: the step its next announcement must carry
        self.arrived = 0
        self.step = 0
        self.reply = [payload_buffer(self.nbytes) for _ in range(2)]
        self.sends: list[list[Transfer]] = [[], []]
        self.lock = threading.Lock()


class ServerEngine:
    """Server ``index`` of the job, running on threads of the current process (its keys' state,
    loaded from ``cfg.resume`` before serving: ``checkpoint``, a
    :class:`~gradpress.ps.codec_state.ServerCheckpoint`).

    Args:
        cluster: the joined job.
        cfg: engine options (timeouts, engine threads).
        transport: point-to-point transport of this process.
        index: which server this is.
        tracer: records the stages of every key's step.
        on_error: called once with the first error (colocated workers use it to fail fast).
    """

    def __init__(self, cluster: Cluster, cfg: PSConfig, transport: Transport, index: int, *,
                 tracer: Tracer | None = None, on_error: object = None) -> None:
        self.cluster = cluster
        self.cfg = cfg
        self.transport = transport
        self.index = index
        self.name = f"server {index}"
        #: world ranks that push: all workers, or the node leaders when hierarchical
        self.pushers = cluster.layout.pushers
        self.tracer = tracer or Tracer(None, cluster.rank, self.name)
        self._on_error = on_error
        self._keys: dict[int, KeyState] = {}
        self._keys_lock = threading.Lock()
        self._thread_loads = [0] * cfg.engine_threads
        self._queues: list[queue.SimpleQueue] = [queue.SimpleQueue()
                                                 for _ in range(cfg.engine_threads)]
        # one accumulator per engine and control thread (a thread reduces one key at a time),
        # grown to the largest key it reduced: memory does not grow with the number of keys
        self._accs = [torch.empty(0, dtype=torch.float32, device="cpu")
                      for _ in range(cfg.engine_threads + len(self.pushers))]
        # receive buffers of pending pushes: at most what the workers' budgets let fly
        self._buffers = BufferPool(len(self.pushers) * cfg.inflight_bytes)
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._live_controls = len(self.pushers)
        self._handoff = HandOff()  # reduce an inline key on its control thread, or hand it over
        self._threads: list[threading.Thread] = []
        self.stats = {"bytes_received": 0, "bytes_sent": 0, "steps": 0, "decode_s": 0.0,
                      "compress_s": 0.0, "wait_s": 0.0}
        self.checkpoint = ServerCheckpoint(self)

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> ServerEngine:
        """Start the control and engine threads (daemon threads; ``join`` ends them)."""
        for i in range(self.cfg.engine_threads):
            self._spawn(self._engine_loop, i, f"gp-{self.name}-engine{i}")
        for w in range(len(self.pushers)):
            self._spawn(self._control_loop, w, f"gp-{self.name}-ctrl{w}")
        return self

    def _spawn(self, fn: object, arg: int, name: str) -> None:
        t = threading.Thread(target=self._guard, args=(fn, arg), name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def join(self, timeout: float | None = None) -> None:
        """Wait until every worker sent stop and all replies left; re-raise the first error.

        ``timeout`` bounds the wait for the workers' stop messages (None: no limit; a crashed
        worker ends it anyway). Draining afterwards is bounded by ``cfg.timeout``.
        """
        if not self._stopped.wait(timeout):
            raise GradpressError(f"{self.name}: workers did not stop within {timeout} s")
        if self._error is not None:  # fail fast: threads may block on a dead peer (daemons)
            raise self._error
        for q in self._queues:
            q.put(None)
        deadline = time.monotonic() + self.cfg.timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive() and self._error is None:
                raise GradpressError(f"{self.name}: thread {t.name} did not finish within "
                                     f"{self.cfg.timeout:g} s of the stop")
        if self._error is not None:
            raise self._error
        for ks in self.keys():
            for op in ks.sends[0] + ks.sends[1]:
                op.wait(self.cfg.timeout, "pull (final replies)")
        self.tracer.write()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def keys(self) -> list[KeyState]:
        """The keys this server has seen so far."""
        with self._keys_lock:
            return list(self._keys.values())

    def _guard(self, fn: object, arg: int) -> None:
        try:
            fn(arg)  # type: ignore[operator]
        except BaseException as e:  # noqa: BLE001 - recorded, reported and re-raised by join
            self._fail(e)

    def _fail(self, e: BaseException) -> None:
        with self._keys_lock:
            first = self._error is None
            if first:
                self._error = e
        if not first:
            return
        log.error("%s failed: %s", self.name, e)
        self.cluster.report_error(f"{self.name}: {e}")
        for q in self._queues:
            q.put(None)
        self._stopped.set()
        if callable(self._on_error):
            self._on_error(e)

    # -- step 1: per-worker control threads ----------------------------------------------------
    def _control_loop(self, w: int) -> None:
        rank = self.pushers[w]
        # a control message, or an inline push
        buf = torch.empty(INLINE_BYTES, dtype=torch.uint8, device="cpu")
        head = buf.numpy()[:CTRL_BYTES]
        who = self.cluster.describe(rank)
        while self._error is None:
            head[:] = 0  # op 0 is invalid: a truncated message cannot pass for the last one
            op = self.transport.irecv(buf, rank, CTRL_TAG, f"control messages of {self.name}",
                                      "push")
            op.wait(self.cfg.idle_timeout, "waiting for the next push")
            msg = read_control(buf[:CTRL_BYTES], sender=who, receiver=self.name)  # hostile input
            if msg.op == OP_STOP:
                break
            if msg.op in (OP_SAVE, OP_LOAD):  # checkpoint request (gradpress.ps.codec_state)
                self.checkpoint.request(w, msg)
                continue
            if msg.key not in self._keys:
                require_declared(self.cluster.store, msg.key, sender=who, receiver=self.name)
            ks = self._key_state(msg.key)
            self._check_push(ks, w, msg.step, msg.nbytes)
            ks.recv[w] = buf_w = self._buffers.take(ks.nbytes)  # back after the reduce
            if msg.op == OP_PUSH_INLINE:
                buf_w.copy_(self._inline(buf, ks, who))
                ks.recv_ops[w] = None
            else:
                ks.recv_ops[w] = self.transport.irecv(buf_w, rank, ks.key, ks.label, "push")
            ks.lrs[w] = msg.lr
            with ks.lock:
                ks.next_step[w] += 1
                ks.arrived += 1
                ready = ks.arrived == len(self.pushers)
                if ready:
                    ks.arrived = 0
            if not ready:
                continue
            inline = all(op is None for op in ks.recv_ops)
            if inline and self._handoff.here(4 * ks.desc.numel, ks.desc.spec):
                self._reduce(ks, self.cfg.engine_threads + w)  # step 2: all here (inline)
            else:  # step 2: hand the key to its engine thread
                self._queues[ks.thread].put((ks, time.perf_counter()))
        with self._keys_lock:
            self._live_controls -= 1
            if self._live_controls == 0:
                self._stopped.set()

    def _check_push(self, ks: KeyState, w: int, step: int, nbytes: int) -> None:
        who = self.cluster.describe(self.pushers[w])
        if nbytes != ks.nbytes:
            raise ConfigMismatchError(f"{self.name}: {who} pushes {nbytes} bytes for "
                                      f"{ks.label}, expected {ks.nbytes} ({ks.desc.spec})")
        if step != ks.next_step[w]:
            raise ConfigMismatchError(f"{self.name}: {who} pushes {ks.label} at step {step}, "
                                      f"expected step {ks.next_step[w]}")

    def _inline(self, buf: torch.Tensor, ks: KeyState, who: str) -> torch.Tensor:
        if not fits_inline(ks.nbytes):
            raise PayloadError(f"{self.name}: {who} pushed {ks.label} ({ks.nbytes} bytes) "
                               f"inline, but only payloads of at most "
                               f"{INLINE_BYTES - HEAD_ROOM - FRAME_BYTES} bytes travel inline (a "
                               f"worker of another gradpress version?)", key=ks.label, peer=who,
                               stage="push")
        payload = inline_payload(buf, ks.nbytes)
        if payload is None:
            raise PayloadError(f"{self.name}: inline push of {ks.label} from {who} rejected: "
                               f"the message is truncated or corrupted (its trailer does not "
                               f"match its header)", key=ks.label, peer=who, stage="push")
        return payload

    def _key_state(self, key: int) -> KeyState:
        with self._keys_lock:
            ks = self._keys.get(key)
            if ks is not None:
                return ks
            raw = self.cluster.store.get(f"k/{key}")
            desc = KeyDescriptor.from_json(raw)
            if desc.server != self.index:
                raise GradpressError(f"{self.name}: received key {key} ({desc.label}), which "
                                     f"belongs to server {desc.server}")
            nbytes = build(desc.spec, desc.numel, seed=desc.seed).payload_bytes
            thread = assign_balanced({key: nbytes}, self._thread_loads)[key]
            self._thread_loads[thread] += nbytes
            ks = self._keys[key] = KeyState(key, desc, len(self.pushers), thread)
            self.checkpoint.restore(ks)  # saved state loaded from a checkpoint, if any
            return ks

    # -- steps 3-5: engine threads -------------------------------------------------------------
    def _engine_loop(self, i: int) -> None:
        q = self._queues[i]
        while True:
            item = q.get()
            if item is None or self._error is not None:
                return
            ks, handed_at = item
            self._handoff.started(handed_at)
            self._reduce(ks, i)

    def _accumulator(self, thread: int, numel: int) -> torch.Tensor:
        if self._accs[thread].numel() < numel:
            self._accs[thread] = torch.empty(numel, dtype=torch.float32, device="cpu")
        return self._accs[thread][:numel]

    def _reduce(self, ks: KeyState, thread: int) -> None:
        """Steps 3-5 of key ``ks`` on ``thread`` (its accumulator: engine threads first, then
        one per pusher's control thread)."""
        step, timeout, slot = ks.step, self.cfg.timeout, ks.step % 2
        t0 = time.perf_counter()
        for op in ks.sends[slot]:  # step 3: the reply buffer of step - 2 must have left
            op.wait(timeout, "pull (reply of step - 2)")
        times = {"wait": time.perf_counter() - t0}
        divisor = self.cluster.layout.num_workers if ks.desc.average else 1  # also when node
        reduce_pushes(self._pushes(ks, times), ks.dec, ks.enc,  # leaders push sums
                      self._accumulator(thread, ks.desc.numel), key=ks.key, step=step,
                      lr=self._step_lr(ks), divisor=divisor, label=ks.label,
                      out=ks.reply[slot])
        t2 = time.perf_counter()
        self._handoff.ran(4 * ks.desc.numel, t2 - t0 - times["wait"], ks.desc.spec)
        for w, buf in enumerate(ks.recv):  # decoded: the pushes' buffers go back to the pool
            self._buffers.give(buf)  # type: ignore[arg-type]
            ks.recv[w] = None
        ks.step += 1
        ks.sends[slot] = [self.transport.isend(ks.reply[slot], rank, ks.key, ks.label, "pull")
                          for rank in self.pushers]  # step 5: same bytes to every worker
        self._account(ks, t0, times["decoded"], t2, times["wait"])

    def _pushes(self, ks: KeyState,
                times: dict[str, float]) -> Iterator[tuple[str, torch.Tensor]]:
        """The key's pushes in rank order, each as soon as it arrived; records the waits in
        ``times["wait"]`` and when the last push was handed over in ``times["decoded"]``."""
        for w, rank in enumerate(self.pushers):  # rank order, not arrival order
            op = ks.recv_ops[w]
            if op is not None:  # None: an inline push, here already
                tw = time.perf_counter()
                op.wait(self.cfg.timeout, "push")
                times["wait"] += time.perf_counter() - tw
            yield self.cluster.describe(rank), ks.recv[w]  # type: ignore[misc]
        times["decoded"] = time.perf_counter()

    def _step_lr(self, ks: KeyState) -> float | None:
        lr = ks.lrs[0]
        if ks.ef.kind == "corrected" and any(x != lr for x in ks.lrs):
            raise ConfigMismatchError(f"{self.name}: workers pushed {ks.label} at step {ks.step} "
                                      f"with different learning rates {ks.lrs}")
        return lr

    def _account(self, ks: KeyState, t0: float, t1: float, t2: float, wait_s: float) -> None:
        s = self.stats
        with ks.lock:
            s["bytes_received"] += ks.nbytes * len(self.pushers)
            s["bytes_sent"] += ks.nbytes * len(self.pushers)
            s["steps"] += 1
            s["wait_s"] += wait_s
            s["decode_s"] += t1 - t0 - wait_s
            s["compress_s"] += t2 - t1
        if self.tracer.enabled:
            self.tracer.add("server.recv+decode_add", t0, t1, key=ks.key, step=ks.step - 1,
                            name=ks.desc.name, chunk=ks.desc.chunk, wait=wait_s)
            self.tracer.add("server.compress", t1, t2, key=ks.key, step=ks.step - 1)


def serve(ccfg: ClusterConfig, cfg: PSConfig) -> None:
    """Join the job as a server process and serve until every worker sent stop."""
    cluster = Cluster.connect(ccfg, cfg.timeout, cfg.hierarchical)
    servers = cluster.my_servers
    if len(servers) != 1:
        raise GradpressError(f"rank {ccfg.rank} is not a server process in this layout "
                             f"({cluster.describe(ccfg.rank)})")
    index = servers[0]
    tracer = Tracer(trace_path(cfg.trace, "server", index, ccfg.rank) if cfg.trace else None,
                    ccfg.rank, f"server {index}")
    transport = Transport(ccfg.rank, cluster.describe, cluster.reported_errors)
    engine = ServerEngine(cluster, cfg, transport, index, tracer=tracer).start()
    with Watchdog(cluster, interval=cfg.watchdog_interval, exit_within=cfg.timeout,
                  exit_at_once=True):
        engine.join()  # a failure recorded anywhere ends this process
    # only after a clean stop: with a failed peer, tearing gloo down could block
    cluster.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m gradpress.ps.server`` (configured by the environment)."""
    logging.basicConfig(level=os.environ.get("GRADPRESS_LOG_LEVEL", "WARNING").upper(),
                        format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    ccfg = ClusterConfig.from_env(role="server")
    try:
        serve(ccfg, PSConfig.from_env())
    except Exception as e:  # noqa: BLE001 - reported, then a non-zero exit for the launcher
        print(f"gradpress server (rank {ccfg.rank}) failed: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # engine threads may still block in gloo; do not wait for them
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Plans of ``push_pull``: what a tensor name becomes on the wire (BytePS-Compress, Zhong et al.
2021, section 3: tensors are partitioned into chunks, each a key on one server).

A name's plan is made at its first ``push_pull`` and again when the call's size or options
change, as a new generation with new keys:

1. validate the name and the codec options (ValueError/TypeError, before any I/O);
2. small tensors (under ``min_compress_bytes``) travel uncompressed, without a residual;
3. cut the tensor into chunks of ``partition_bytes`` (:func:`~gradpress.ps.partition.chunk_layout`);
4. hash every chunk to its key and reject a key two names share (:class:`KeyCollisionError`);
5. propose a server for every key, balancing payload bytes (``assign_balanced``), and agree on
   each key's descriptor through the store: the first worker's proposal wins, every other one
   must match it except in the server it proposed;
6. build the chunk's worker codec (its error-feedback state) and its reply decoder.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ..compress import build
from ..compress.registry import ef_needs_lr
from ..compress.spec import CodecSpec, EFSpec
from .calls import ChunkState, Plan, resolve_codec
from .cluster import Cluster
from .config import PSConfig
from .errors import KeyCollisionError
from .partition import assign_balanced, chunk_key, chunk_layout
from .protocol import KeyDescriptor

__all__ = ["Planner"]

Resolved = tuple[CodecSpec, dict[str, Any], bool, str]


class Planner:
    """The plans of one worker, by tensor name.

    Args:
        cluster: the joined job (its store holds the agreed key descriptors).
        cfg: runtime options (partition size, small-tensor limit, seed, where compression runs).
        on_new: called with every new plan before it is used (the checkpoint loads state saved
            for it there).
    """

    def __init__(self, cluster: Cluster, cfg: PSConfig,
                 on_new: Callable[[Plan], None] = lambda plan: None) -> None:
        self.cluster, self.cfg, self._on_new = cluster, cfg, on_new
        self._lock = threading.Lock()
        self._plans: dict[str, Plan] = {}
        self._key_owner: dict[int, str] = {}
        self._valid_specs: set[str] = set()
        self._resolved: dict[tuple[Any, Any], Resolved] = {}
        self._server_loads = [0] * cluster.layout.num_servers

    def plans(self, names: set[str] | None = None) -> dict[str, Plan]:
        """The plans made so far (``names``: only those), by name."""
        with self._lock:
            return {n: p for n, p in self._plans.items() if names is None or n in names}

    def check_call(self, name: str, compression: Any, ef: str | EFSpec | None,
                   lr: float | None = None) -> None:
        """Step 1: validate a call's name and codec options (ValueError/TypeError)."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"push_pull: name must be a non-empty str, got {name!r}")
        spec, wrappers, needs_lr, sig = self.resolve(compression, ef)
        if needs_lr and lr is None:
            raise ValueError(f"push_pull({name!r}): ef={wrappers['ef']!r} needs the step's "
                             f"learning rate: pass lr=...")
        if sig not in self._valid_specs:
            build(spec, 0, seed=self.cfg.seed, **wrappers)  # unknown codec or parameter: raise
            self._valid_specs.add(sig)

    def resolve(self, compression: Any, ef: str | EFSpec | None) -> Resolved:
        """``resolve_codec`` of a call's options, whether its error feedback needs the lr, and
        its signature; parsed once per distinct (hashable) pair of options, not per call (the
        optimizer passes the same options for every tensor of every step). Callers must not
        modify the returned spec or dict."""
        key: tuple[Any, Any] | None = (compression, ef)
        try:
            hit = self._resolved.get(key)  # type: ignore[arg-type]
        except TypeError:  # unhashable options (a dict spec): parsed every time
            key, hit = None, None
        if hit is not None:
            return hit
        spec, wrappers = resolve_codec(compression, ef, self.cfg)
        sig = repr((spec.name, sorted(spec.params.items()), sorted(wrappers.items())))
        hit = (spec, wrappers, ef_needs_lr(wrappers["ef"]), sig)
        if key is not None and len(self._resolved) < 256:
            self._resolved[key] = hit
        return hit

    def plan(self, name: str, numel: int, average: bool, compression: Any,
             ef: str | EFSpec | None, lr: float | None, min_compress_bytes: int | None) -> Plan:
        """The plan of a call: the name's current one if the call matches it, else a new
        generation (steps 1-6)."""
        self.check_call(name, compression, ef, lr)
        limit = self.cfg.min_compress_bytes if min_compress_bytes is None else min_compress_bytes
        spec, wrappers = self.resolve(compression, ef)[:2]
        if 4 * numel < limit:  # 2. fp32, exact, no residual; worker-side momentum
            # (dist-EF-SGDM) still applies to small tensors, as to every tensor
            spec = CodecSpec("none")
            wrappers = {"ef": None, **{k: wrappers[k] for k in ("momentum", "mu")
                                        if k in wrappers}}
        signature = (numel, spec.name, tuple(sorted(spec.params.items())),
                     tuple(sorted(wrappers.items())), bool(average))
        with self._lock:
            plan = self._plans.get(name)
        if plan is not None and plan.signature == signature:
            return plan
        gen = 0 if plan is None else plan.generation + 1
        plan = self._new_plan(name, numel, gen, spec, wrappers, bool(average), signature)
        self._on_new(plan)  # loaded state; ValueError naming a mismatch
        with self._lock:
            self._plans[name] = plan
        return plan

    def _new_plan(self, name: str, numel: int, gen: int, spec: CodecSpec,
                  wrappers: dict[str, Any], average: bool, signature: tuple) -> Plan:
        layout = chunk_layout(numel, self.cfg.partition_bytes)  # 3.
        backend = "torch" if self.cfg.compress_on == "device" else "auto"
        decs = [build(spec, c.numel, seed=self.cfg.seed, backend=backend) for c in layout]
        keys = [chunk_key(name, c.index, gen) for c in layout]
        for key, c in zip(keys, layout):  # 4.
            label = f"{name!r} chunk {c.index} generation {gen}"
            owner = self._key_owner.setdefault(key, label)
            if owner != label:
                raise KeyCollisionError(f"key {key} collides: {owner} and {label} hash to the "
                                        f"same key; rename one of the tensors")
        proposal = assign_balanced({k: d.payload_bytes for k, d in zip(keys, decs)},
                                   self._server_loads)
        chunks = []
        for key, c, dec in zip(keys, layout, decs):
            desc = KeyDescriptor(name, gen, c.index, c.numel, numel, dec.spec_text,
                                 wrappers["ef"], self.cfg.seed, average, proposal[key])
            desc = self._agree(key, desc)  # 5.
            self._server_loads[desc.server] += dec.payload_bytes
            enc = build(spec, c.numel, seed=self.cfg.seed, backend=backend, **wrappers)  # 6.
            srank = self.cluster.layout.server_rank(desc.server)
            chunks.append(ChunkState(key, desc, srank, self.cluster.describe(srank), enc, dec,
                                     dec.payload_bytes))
        return Plan(name, signature, gen, numel, chunks, [c.offset for c in layout])

    def _agree(self, key: int, desc: KeyDescriptor) -> KeyDescriptor:
        """First writer wins in the store; everyone else must match it (except the server)."""
        raw = self.cluster.store.compare_set(f"k/{key}", "", desc.to_json())
        agreed = KeyDescriptor.from_json(raw)
        desc.check_same(agreed, key, self.cluster.describe(self.cluster.rank))
        return agreed

    def check_device(self, plan: Plan, device: torch.device) -> None:
        """compress_on="device": a tensor's codec state stays on the device of its first call."""
        if self.cfg.compress_on != "device":
            return
        if plan.device is None:
            plan.device = device
        elif plan.device != device:
            raise ValueError(f"push_pull({plan.name!r}): tensor on {device}, but with "
                             f"compress_on='device' its error-feedback state lives on "
                             f"{plan.device} (the device of its first push_pull); expected a "
                             f"tensor on {plan.device}")

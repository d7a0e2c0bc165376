"""The state of :func:`gradpress.fsdp.compress`: hyperparameters, per-module shard codecs (the
workers' error-feedback residuals), statistics, and their checkpoints.

Residuals are per rank and per shard: rank r keeps, for every ``FSDPModule`` (keyed by its
qualified name under the root, ``""`` for the root itself), one codec per shard of that module's
flat gradient buffer, each with its own residual. :meth:`FSDPCompressionState.state_dict` holds
them (CPU tensors) with the world size and rank they belong to; a state saved at another world
size (or by another rank) is refused with a ValueError: the shards, hence the residuals, depend
on the world size (build a new state to continue at another size; its residuals start at zero).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import defaults
from ..compress import Codec, CodecSpec, EFSpec, build, parse_ef, parse_spec
from ..compress.registry import pick_ef
from ..compress.spec import Compression
from ..ps.codec_state import atomic_save
from .checks import ReduceCheck, raise_failed

__all__ = ["FSDPCompressionState", "ModuleCodecs"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1
_STATE_KEYS = {"version", "world_size", "rank", "compression", "dense", "modules"}


class ModuleCodecs:
    """The codecs and wire buffers of one ``FSDPModule`` on one rank: ``workers[s]`` compresses
    shard s of the flat gradient buffer with its own residual; ``decoder`` (no error feedback)
    validates and decodes the payloads this rank receives for the shard it owns."""

    def __init__(self, state: FSDPCompressionState, numel: int, world: int, rank: int,
                 device: torch.device) -> None:
        if numel % world:
            raise ValueError(f"gradpress.fsdp: a reduce-scatter input of {numel} elements does "
                             f"not split into {world} equal shards (FSDP2 pads to a multiple)")
        self.numel, self.world, self.rank = numel, world, rank
        self.shard = numel // world
        self.workers: list[Codec] = [state.build_codec(self.shard) for _ in range(world)]
        self.decoder: Codec = build(state.compression, self.shard, seed=state.seed)
        self.slot = self.decoder.payload_bytes
        u8: dict[str, Any] = dict(dtype=torch.uint8, device=device)
        self.send = torch.zeros(world * self.slot, **u8)
        self.recv = torch.zeros(world * self.slot, **u8)
        self.acc = torch.zeros(self.shard, dtype=torch.float32, device=device)
        self.checked: torch.Tensor | None = None  # the deferred checks' header mask
        self.step = 0

    def payload(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        return buf[i * self.slot:(i + 1) * self.slot]

    def state_dict(self) -> dict[str, Any]:
        return {"numel": self.numel, "step": self.step,
                "workers": [c.state_dict() for c in self.workers]}

    def load_state_dict(self, saved: Mapping[str, Any], name: str) -> None:
        if saved.get("numel") != self.numel or len(saved.get("workers", ())) != self.world:
            raise ValueError(f"gradpress.fsdp: the saved residuals of module {name!r} are for a "
                             f"buffer of {saved.get('numel')} elements in "
                             f"{len(saved.get('workers', ()))} shards; this module reduces "
                             f"{self.numel} elements in {self.world} shards (another model?)")
        for c, s in zip(self.workers, saved["workers"]):
            c.load_state_dict(s)
        self.step = int(saved["step"])


class FSDPCompressionState:
    r"""Hyperparameters, residuals and statistics of FSDP2's compressed reduce-scatter.

    Built by :func:`gradpress.fsdp.compress`, which installs one
    :class:`~gradpress.fsdp.CompressedReduceScatter` per ``FSDPModule``, all sharing this state.

    1. ``compression`` (default ``"onebit"``): the codec, as everywhere in gradpress (spec
       string, BytePS-style dict or :class:`~gradpress.compress.CodecSpec`); ``"none"`` sends
       fp32 through the same exchange (a reference: bit-identical to FSDP2's own reduce-scatter
       at world size 2, within the rounding of the summation order beyond, see
       ``docs/integrations.md``).
    2. ``ef`` (default ``"vanilla"``): the workers' error feedback (an
       :class:`~gradpress.compress.EFSpec` or its text; ``None``: the one inside
       ``compression``, else off). One fp32 residual per shard, i.e. one copy of every
       module's flat gradient buffer, per rank. There is no server side: the owner of a shard
       keeps the reduced shard, nothing is sent back.
    3. ``min_compress_bytes`` (default 1 MiB, as the DDP hook's): modules whose flat gradient
       buffer (counted in fp32) is smaller use FSDP2's own reduce-scatter.
    4. ``dense_steps`` (default 0): reduce-scatters per module that use FSDP2's own collective
       before compression starts.
    5. ``seed`` (default 0): base seed of codecs that draw random numbers (randomk).
    6. ``lr``: the learning rate, for ``ef="corrected"`` and ``anneal=1`` only; set it before
       each backward pass when it changes.
    """

    def __init__(self, compression: Compression = defaults.COMPRESSION,
                 ef: str | EFSpec | None = defaults.EF, *,
                 min_compress_bytes: int = defaults.HOOK_MIN_COMPRESS_BYTES,
                 dense_steps: int = 0, seed: int = 0, lr: float | None = None) -> None:
        if compression is None:
            raise TypeError("FSDPCompressionState: compression must be a spec string, a "
                            "BytePS-style dict or a CodecSpec (e.g. 'onebit'; 'none' for "
                            "fp32), got None")
        for name, v in (("min_compress_bytes", min_compress_bytes),
                        ("dense_steps", dense_steps), ("seed", seed)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"FSDPCompressionState: {name} must be an int >= 0, got {v!r}")
        cs = parse_spec(compression)  # the one parser of every gradpress entry point
        wrappers = dict(cs.wrappers)
        self._ef = parse_ef(pick_ef(ef, wrappers.pop("ef", None), compression))
        self._compression = CodecSpec(cs.name, dict(cs.params), wrappers)
        self._seed = seed
        # ValueError naming a bad value; the spec text (resolved parameters) names the codec
        self._spec_text = build(self._compression, 16, ef=self._ef, seed=seed).spec_text
        self._min_compress_bytes = min_compress_bytes
        self._dense_steps = dense_steps
        self.lr = lr
        self.modules: dict[str, ModuleCodecs] = {}
        self._loaded: dict[str, Mapping[str, Any]] = {}
        self._plain_steps: dict[str, int] = {}
        self._placement: tuple[int, int] | None = None  # (world, rank) of the exchanges
        self._stats = dict.fromkeys(("compressed_calls", "plain_calls", "dense_bytes",
                                     "payload_bytes", "plain_bytes"), 0)
        # deferred (device-side) checks: on for CUDA buffers when None; tests force them
        self._defer: bool | None = None
        self._checks: deque[ReduceCheck] = deque()

    compression = property(lambda self: self._compression, doc="the codec, a CodecSpec")
    ef = property(lambda self: self._ef, doc="the workers' error feedback, an EFSpec")
    min_compress_bytes = property(lambda self: self._min_compress_bytes)
    dense_steps = property(lambda self: self._dense_steps)
    seed = property(lambda self: self._seed)

    @property
    def lr(self) -> float | None:
        """Learning rate carried to the codecs (``ef="corrected"``, ``anneal=1``)."""
        return self._lr

    @lr.setter
    def lr(self, value: float | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            raise ValueError(f"FSDPCompressionState: lr must be None or a number > 0, "
                             f"got {value!r}")
        self._lr = None if value is None else float(value)

    def __repr__(self) -> str:
        return (f"FSDPCompressionState(compression={self.compression!r}, ef={str(self.ef)!r}, "
                f"min_compress_bytes={self.min_compress_bytes}, modules={len(self.modules)})")

    def build_codec(self, numel: int) -> Codec:
        """A worker codec of one shard (with this state's error feedback)."""
        return build(self._compression, numel, ef=self._ef, seed=self._seed)

    def stats(self) -> dict[str, int]:
        """Counters since construction: reduce-scatters compressed and plain (``*_calls``);
        bytes this rank sent to the other ranks in compressed calls (``payload_bytes``), what
        fp32 would have sent there (``dense_bytes``: a ring reduce-scatter's (world-1)/world of
        the buffer), and the fp32 bytes of the plain calls, counted the same way."""
        return dict(self._stats)

    def check_pending(self) -> None:
        """Wait for the device-side checks of the reduce-scatters made so far (CUDA; see
        :mod:`gradpress.fsdp.checks`) and raise the :class:`~gradpress.ps.errors.PayloadError`
        of one that failed. They are read one backward pass late by the reduce-scatters
        themselves; call this after the last backward pass to see an error of the last one
        (:meth:`state_dict` calls it)."""
        self.resolve_checks(None)

    def resolve_checks(self, before_step: int | None) -> None:
        """Read the flags of the deferred checks of steps before ``before_step`` (all of them
        with None), in call order; a failed one raises its PayloadError (the others are
        dropped: the residuals are not to be trusted after it)."""
        while self._checks and (before_step is None or self._checks[0].job.step < before_step):
            check = self._checks.popleft()
            if not check.passed():
                self._checks.clear()
                raise_failed(check.job)

    def uses_compression(self, name: str, numel: int) -> bool:
        """Whether module ``name``'s reduce-scatter of ``numel`` elements is compressed now;
        a call left to FSDP2 while ``dense_steps`` last is counted here."""
        if numel * 4 < max(self.min_compress_bytes, 1):
            return False
        done = self._plain_steps.get(name, 0)
        if done < self.dense_steps:
            self._plain_steps[name] = done + 1
            return False
        return True

    def codecs_for(self, name: str, numel: int, world: int, rank: int,
                   device: torch.device) -> ModuleCodecs:
        """Module ``name``'s codecs (created at its first compressed reduce-scatter, with the
        residuals of :meth:`load_state_dict` when there are saved ones)."""
        self._check_placement(world, rank, "a reduce-scatter")
        cur = self.modules.get(name)
        if cur is not None and cur.numel == numel:
            return cur
        if cur is not None:
            log.warning("gradpress.fsdp: module %r now reduces %d elements (was %d); its codecs "
                        "are re-created and its residuals restart from zero", name, numel,
                        cur.numel)
        cur = self.modules[name] = ModuleCodecs(self, numel, world, rank, device)
        saved = self._loaded.pop(name, None)
        if saved is not None:
            cur.load_state_dict(saved, name)
        return cur

    def _check_placement(self, world: int, rank: int, what: str, loading: bool = False) -> None:
        """The residuals belong to one (world size, rank) of the reduce-scatter group: the
        first call (or a loaded state) fixes it, and anything else is refused (ValueError).
        A loaded state is checked at once when this state has run, else at its first call."""
        if self._placement is None:
            self._placement = (world, rank)
        elif self._placement != (world, rank):
            saved, now = ((world, rank), self._placement) if loading else \
                (self._placement, (world, rank))
            raise ValueError(f"gradpress.fsdp: {what}: the residuals belong to rank {saved[1]} "
                             f"of world size {saved[0]}, this is rank {now[1]} of world size "
                             f"{now[0]}. The shards, hence the residuals, depend on the world "
                             f"size: resume at world size {saved[0]}, or build a new "
                             f"FSDPCompressionState (its residuals start at zero)")

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Residuals and step counters (per module), the uncompressed calls made so far of
        ``dense_steps``, and the world size and rank of the reduce-scatter group (None before
        the first call) of this rank (CPU tensors). Reads the pending device-side checks
        first (:meth:`check_pending`)."""
        self.check_pending()
        world, rank = self._placement if self._placement is not None else (None, None)
        modules = {n: dict(s) for n, s in self._loaded.items()}
        modules.update({n: c.state_dict() for n, c in self.modules.items()})
        return {"version": _STATE_VERSION, "world_size": world, "rank": rank,
                "compression": self._spec_text, "dense": dict(self._plain_steps),
                "modules": modules}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output of the same rank at the same world size; a state of
        another world size or rank is refused (ValueError) now if this state has run, else at
        its first reduce-scatter (on every rank, before any payload is exchanged; the group is
        known only then: with HSDP it is the shard group, not the whole world); a state of
        another codec is refused now."""
        if not isinstance(state, Mapping) or set(state) != _STATE_KEYS:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"FSDPCompressionState.load_state_dict: expected keys "
                             f"{sorted(_STATE_KEYS)}, got {got}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"FSDPCompressionState.load_state_dict: state version "
                             f"{state['version']!r}, expected {_STATE_VERSION}")
        mine = self._spec_text
        if state["compression"] != mine:
            raise ValueError(f"FSDPCompressionState.load_state_dict: the state was saved with "
                             f"compression {state['compression']!r}, this state has {mine!r}")
        if state["world_size"] is not None:
            self._check_placement(int(state["world_size"]), int(state["rank"]),
                                  "load_state_dict", loading=True)
        self._loaded = {}
        self._plain_steps = {str(n): int(v) for n, v in state["dense"].items()}
        for name, saved in state["modules"].items():
            codecs = self.modules.get(name)
            if codecs is not None:
                codecs.load_state_dict(saved, name)
            else:
                self._loaded[name] = saved

    def save(self, directory: str | os.PathLike) -> Path:
        """Write :meth:`state_dict` to ``directory/gradpress_fsdp/rank<r>.pt`` (``r``: the
        global rank; atomically), beside a ``torch.distributed.checkpoint`` of the sharded
        model and optimizer. Returns the file's path."""
        path = _rank_file(directory)
        atomic_save(self.state_dict(), path)
        return path

    def load(self, directory: str | os.PathLike) -> None:
        """Load what :meth:`save` wrote for this rank (ValueError for a missing file, or for
        residuals of another world size, rank or codec: see :meth:`load_state_dict`)."""
        path = _rank_file(directory)
        if not path.is_file():
            found = sorted(p.name for p in path.parent.glob("rank*.pt"))
            raise ValueError(f"FSDPCompressionState.load: no residuals for this rank at {path} "
                             f"(found {found or 'none'}: saved by a job of another world size?)")
        self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def _rank_file(directory: str | os.PathLike) -> Path:
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return Path(directory) / "gradpress_fsdp" / f"rank{rank}.pt"

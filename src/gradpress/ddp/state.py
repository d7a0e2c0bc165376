"""The state of the DDP hook: hyperparameters, per-bucket codecs and residuals, checkpoints.

Internal module of :mod:`gradpress.ddp`; import :class:`TwoWayCompressionState` from there.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from .. import defaults
from ..compress import Codec, CodecSpec, EFSpec, build, parse_ef, parse_spec
from ..compress.registry import pick_ef
from ..compress.spec import Compression
from .buckets import BucketCodecs, BucketExchange
from .checks import DeviceCheck
from .pipeline import BucketPipeline

__all__ = ["TwoWayCompressionState"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1


class TwoWayCompressionState(BucketPipeline):
    r"""Hyperparameters and per-bucket state of :func:`two_way_compression_hook`.

    Hyperparameters are fixed at construction (assigning one raises AttributeError; build a new
    state instead); ``process_group`` and ``lr`` may be reassigned. The state holds, per bucket
    index: one worker codec per shard (error-feedback residual per (bucket, shard)), one server
    codec for the shard this rank owns (the server residual), a step counter, and wire buffers.

    1. ``compression`` (default ``"int4"``) is the codec, given as everywhere in gradpress:
       a spec string (``"onebit"``, ``"topk:k=0.001,values=fp16"``, ``"randomk:k=0.01"``,
       ``"dithering:s=7"``), a BytePS-style dict (``{"compressor": "topk", "k": 0.01}``) or a
       :class:`~gradpress.compress.CodecSpec`. It sets the compression rate: onebit sends ~1
       bit/element; topk/randomk ``k`` is a fraction of each shard. Start with ``onebit`` or
       ``topk:k=0.01``; lower k only while accuracy holds. ``"none"`` sends fp32 (a reference
       that matches DDP's own allreduce). Read back as a ``CodecSpec`` (without ``ef``).
    2. ``ef`` (default ``"vanilla"``) is the error feedback on both sides, an
       :class:`~gradpress.compress.EFSpec` or its text (``"none"``: off, ``"vanilla"``,
       ``"corrected"`` which needs ``lr``, ``"sparse"`` for randomk; ``None``: the one inside
       ``compression``, e.g. a dict's ``"ef"`` key, else off). An ``ef`` inside
       ``compression`` must agree with this argument (ValueError). Keep it on for biased codecs
       (onebit, topk): without it they usually lose accuracy. It costs one fp32 copy of the
       gradients (plus a scratch) on every rank, and 1/world_size of that on the server side.
       Read back as an ``EFSpec``.
    3. ``min_compress_bytes`` (default 1 MiB): buckets whose fp32 size is below it are averaged
       with a plain allreduce; every shard of a larger bucket is compressed. Small tensors gain
       little from compression and pay its per-call cost; raise it if compression time shows up
       in profiles, lower it (0 compresses everything) if the network is the bottleneck.
    4. ``dense_steps`` (default 0): iterations averaged with a plain allreduce before
       compression starts. A few hundred uncompressed opening steps (as 1-bit Adam does) help
       adaptive optimizers; set it to at least the learning-rate warm-up length when accuracy
       suffers early (``docs/guide.md``). Any value >= 1 also skips DDP's first iteration,
       after which DDP rebuilds its buckets (a rebuilt bucket gets new codecs, and its
       residuals restart from zero).
    5. ``seed`` (default 0): base seed of codecs that draw random numbers (randomk); the same on
       every rank.
    6. ``overlap`` (default True): finish each bucket while the next one is being produced (see
       :func:`two_way_compression_hook`); False finishes every bucket inside its own hook call.
    7. ``lr``: the current learning rate, only for ``ef="corrected"`` and
       ``"vanilla:decay=B,anneal=1"``; set ``state.lr`` before each backward pass when the
       learning rate changes.
    8. ``nan_policy`` (default ``"raise"``, the policy of ``gp.DistributedOptimizer`` too): what
       a non-finite gradient in a compressed bucket does. ``"raise"``: an error naming the rank
       (:class:`~gradpress.ps.errors.PayloadError`), and the state stops. ``"skip"``: every rank
       gets that bucket as inf, so a ``torch.amp.GradScaler`` skips the step and lowers its
       scale, and training goes on (fp16 mixed precision, whose first steps usually overflow;
       ``docs/integrations.md``). The bucket's gradient is dropped; each codec's state stays
       as it was where the input was not finite. Without a scaler, skip the step yourself when
       a gradient is not finite. ``compression_stats()["skipped_buckets"]`` counts them (CUDA
       buckets one iteration late, as their checks).

    Picklable: the process group is dropped (None means the default group, resolved at the next
    hook call; set ``state.process_group`` after unpickling to use another). Residuals and step
    counters are saved by :meth:`state_dict` (per rank: each rank has its own residuals).
    """

    __slots__ = ("process_group", "_lr", "_compression", "_ef", "_min_compress_bytes",
                 "_dense_steps", "_seed", "_overlap", "_buckets", "_loaded", "_resumed_at")

    def __init__(self, compression: Compression = defaults.COMPRESSION,
                 ef: str | EFSpec | None = defaults.EF, *,
                 min_compress_bytes: int = defaults.HOOK_MIN_COMPRESS_BYTES,
                 dense_steps: int = defaults.WRAPPER_DENSE_STEPS, seed: int = 0,
                 overlap: bool = True, lr: float | None = None, process_group: Any = None,
                 nan_policy: str = defaults.NAN_POLICY) -> None:
        if compression is None:
            raise TypeError("TwoWayCompressionState: compression must be a spec string, a "
                            "BytePS-style dict or a CodecSpec (e.g. 'onebit'; 'none' for "
                            "fp32), got None")
        for name, v in (("min_compress_bytes", min_compress_bytes),
                        ("dense_steps", dense_steps), ("seed", seed)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TwoWayCompressionState: {name} must be an int >= 0, got {v!r}")
        if nan_policy not in defaults.NAN_POLICIES:
            raise ValueError(f"TwoWayCompressionState: nan_policy must be one of "
                             f"{', '.join(defaults.NAN_POLICIES)}, got {nan_policy!r}")
        self._nan_policy = nan_policy
        cs = parse_spec(compression)  # the one parser of push_pull and the optimizers
        wrappers = dict(cs.wrappers)
        self._ef = parse_ef(pick_ef(ef, wrappers.pop("ef", None), compression))
        self._compression = CodecSpec(cs.name, dict(cs.params), wrappers)
        self._seed = seed
        build(self._compression, 16, ef=self._ef, seed=seed)  # ValueError naming a bad value
        self._min_compress_bytes = min_compress_bytes
        self._dense_steps = dense_steps
        self._overlap = bool(overlap)
        self.process_group = process_group
        self.lr = lr
        # Internal switch: None checks CUDA buckets on the device, read one step late at most,
        # and CPU buckets at once; True/False forces deferred/immediate checks on any device.
        self._defer: bool | None = None
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self.iter = 0
        self._buckets: dict[int, BucketCodecs] = {}
        self._steps: dict[int, int] = {}
        self._loaded: dict[int, Mapping[str, Any]] = {}
        self._resumed_at: int | None = None  # iter at load_state_dict, while buckets are pending
        self._inflight: BucketExchange | None = None
        # "Type: message" of the first failure; the hook then refuses. A description, not the
        # exception: its traceback's frames would keep the bucket (and through DDP's reducer the
        # process group) alive in a cycle until interpreter exit, where gloo aborts.
        self._error: str | None = None
        self._checks: deque[DeviceCheck] = deque()  # deferred buckets' flags, in bucket order
        self._stats = dict.fromkeys(("compressed_buckets", "allreduced_buckets", "dense_bytes",
                                     "payload_bytes", "allreduce_bytes", "skipped_buckets"), 0)

    compression = property(lambda self: self._compression,
                           doc="the codec, a CodecSpec (its error feedback is ``ef``)")
    ef = property(lambda self: self._ef, doc="the error feedback (both sides), an EFSpec")
    min_compress_bytes = property(lambda self: self._min_compress_bytes)
    dense_steps = property(lambda self: self._dense_steps)
    seed = property(lambda self: self._seed)
    overlap = property(lambda self: self._overlap)
    nan_policy = property(lambda self: self._nan_policy,
                          doc='"raise" or "skip": what a non-finite gradient does')

    @property
    def lr(self) -> float | None:
        """Learning rate carried to the codecs (needed by ``ef="corrected"`` and ``anneal=1``)."""
        return self._lr

    @lr.setter
    def lr(self, value: float | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            raise ValueError(f"TwoWayCompressionState: lr must be None or a number > 0, "
                             f"got {value!r}")
        self._lr = None if value is None else float(value)

    def __repr__(self) -> str:
        return (f"TwoWayCompressionState(compression={self.compression!r}, ef={str(self.ef)!r}, "
                f"min_compress_bytes={self.min_compress_bytes}, iter={self.iter}, "
                f"buckets={len(self._buckets)})")

    def _build(self, numel: int) -> Codec:
        """A shard's codec: every shard of a compressed bucket uses the spec (the size rule is
        the bucket's: fp32 shards with headers would cost more than a plain allreduce)."""
        return build(self._compression, numel, ef=self._ef, seed=self._seed)

    def _group(self) -> Any:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def compression_stats(self) -> dict[str, int]:
        """Counters since construction: buckets compressed/allreduced, their fp32 bytes
        (``dense_bytes``, ``allreduce_bytes``), the payload bytes this rank produced, and the
        buckets skipped for a non-finite gradient (``nan_policy="skip"``)."""
        return {"iter": self.iter, **self._stats}

    # -- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Iteration, per-bucket step counters and residuals (CPU tensors) of this rank."""
        if self._inflight is not None:
            raise RuntimeError("TwoWayCompressionState.state_dict: a bucket is in flight; call "
                               "it between iterations (after backward has finished)")
        self.check_pending()
        buckets = {i: dict(s) for i, s in self._loaded.items()}
        buckets.update({i: c.state_dict() for i, c in self._buckets.items()})
        return {"version": _STATE_VERSION, "iter": self.iter, "steps": dict(self._steps),
                "buckets": buckets}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output of the same rank.

        A bucket's residuals are applied to its codecs now, or when the bucket is first seen with
        the saved layout (size and parameter shapes; DDP builds buckets at the first backward
        pass). In a new process DDP's first iteration may use other buckets than the ones saved
        (it rebuilds them in gradient order after that iteration): a bucket whose saved residuals
        do not fit is then averaged exactly (fp32 allreduce) for that one iteration, and the
        residuals are loaded at the next, into the rebuilt bucket they were saved from. Saved
        residuals that still fit no bucket after that restart from zero, with a warning.
        """
        if not isinstance(state, Mapping) or set(state) != {"version", "iter", "steps", "buckets"}:
            got = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"TwoWayCompressionState.load_state_dict: expected keys "
                             f"['buckets', 'iter', 'steps', 'version'], got {got}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"TwoWayCompressionState.load_state_dict: state version "
                             f"{state['version']!r}, expected {_STATE_VERSION}")
        if self._inflight is not None:
            raise RuntimeError("TwoWayCompressionState.load_state_dict: a bucket is in flight")
        self.iter = int(state["iter"])
        self._error = None
        self._checks.clear()
        self._steps = {int(i): int(s) for i, s in state["steps"].items()}
        self._loaded = {}
        for i, saved in state["buckets"].items():
            codecs = self._buckets.get(int(i))
            if codecs is not None and codecs.matches(saved):
                codecs.load_state_dict(saved)
            else:
                self._loaded[int(i)] = saved
        self._resumed_at = self.iter if self._loaded else None

    def __getstate__(self) -> dict[str, Any]:
        """Hyperparameters and :meth:`state_dict`; the process group is dropped (not picklable)."""
        log.info("TwoWayCompressionState: the process group is not pickled; the default group "
                 "is used after unpickling unless process_group is set")
        hyper = {n: getattr(self, n) for n in ("compression", "ef", "min_compress_bytes",
                                               "dense_steps", "seed", "overlap", "lr",
                                               "nan_policy")}
        return {"hyper": hyper, "state": self.state_dict()}

    def __setstate__(self, d: Mapping[str, Any]) -> None:
        """Rebuild from :meth:`__getstate__` output; codecs are re-created lazily."""
        h = dict(d["hyper"])
        TwoWayCompressionState.__init__(self, h.pop("compression"), h.pop("ef"), **h)
        self.load_state_dict(d["state"])

    # -- hook machinery ---------------------------------------------------------------------------
    def _codecs_for(self, bucket: dist.GradBucket, world: int, rank: int) -> BucketCodecs:
        """The bucket's codecs; re-created (residuals restart) when DDP changed its layout."""
        index, buf = bucket.index(), bucket.buffer()
        layout = (world, rank, buf.numel(), buf.dtype, str(buf.device),
                  tuple((tuple(p.shape), p.data_ptr()) for p in bucket.parameters()))
        cur = self._buckets.get(index)
        if cur is not None and cur.layout == layout:
            return cur
        if cur is not None:
            log.info("gradpress DDP hook: bucket %d changed layout (%d -> %d elements, e.g. DDP "
                     "rebuilt its buckets); re-creating its codecs, residuals restart from zero",
                     index, cur.numel, buf.numel())
        cur = self._buckets[index] = BucketCodecs(layout, buf.numel(), world, rank, self._build,
                                                  buf.device)
        saved = self._loaded.pop(index, None)
        if saved is not None and cur.matches(saved):
            cur.load_state_dict(saved)
        elif saved is not None:
            log.warning("gradpress DDP hook: the saved residuals of bucket %d (%s elements) do "
                        "not fit its layout (%d elements, parameter shapes %s); they restart "
                        "from zero", index, saved.get("numel"), cur.numel, cur.shapes)
        return cur

    def _awaits_saved_layout(self, bucket: dist.GradBucket) -> bool:
        """Whether this bucket should be averaged exactly this iteration because its saved
        residuals belong to another layout of the same elements: in a resumed process DDP's
        first iteration uses its initial buckets and rebuilds them afterwards into the layout
        the residuals were saved with, where they are loaded (see :meth:`load_state_dict`)."""
        saved = self._loaded.get(bucket.index())
        if saved is None or self.iter != self._resumed_at:
            return False
        shapes = [list(p.shape) for p in bucket.parameters()]
        return saved.get("shapes", shapes) != shapes

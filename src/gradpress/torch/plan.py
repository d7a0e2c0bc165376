"""What a distributed optimizer sends: :class:`Plan`, one :class:`TensorPlan` row per tensor.

``opt.plan()`` on an optimizer returned by :func:`gradpress.DistributedOptimizer`,
:func:`gradpress.CLAN` or :func:`gradpress.OneBitLANS` answers "what is compressed, and why",
computed locally from the parameters and the configuration (no communication, no random
draws), so it works before ``gradpress.init()`` and is the same on every worker:

1. Each communicated tensor gets a :class:`Decision`: its codec, or exact (fp32), and a
   reason. :func:`decide` is the rule the optimizers apply today: exact when compression is
   ``"none"``, when the tensor is named in ``uncompressed_params`` or when it is smaller than
   ``min_compress_bytes``; compressed with the codec otherwise.
2. The tensor is cut into chunks of ``partition_bytes`` as the runtime cuts it
   (:func:`gradpress.ps.partition.chunk_layout`), and each chunk costs its codec's
   ``payload_bytes`` (header included): the bytes this worker pushes for it per step, which
   ``gradpress.stats()["bytes_pushed"]`` counts. Which server a chunk goes to does not change
   its size, so the cluster's size plays no part.
3. Tensors small enough to travel exact share fused keys (:mod:`gradpress.torch.fusion`,
   computed by the same function as at run time): a member's row shows its fp32 bytes, and
   the first member of each fused key also its headers and chunks (:func:`fuse_rows`).

See ``docs/guide.md`` ("See what is compressed") for how to read the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

from ..compress.spec import CodecSpec

if TYPE_CHECKING:
    from ..ps.config import PSConfig
    from ..ps.fusion import FusedKey

__all__ = ["Plan", "TensorPlan", "Decision", "MomentumTraffic", "decide", "travels_exact",
           "dense_codec", "tensor_plan", "codec_text"]

#: The ``codec`` of a tensor that travels uncompressed (fp32 and a header, no error feedback).
EXACT = "exact"
#: The one-element push of ``nan_policy="skip"`` (the key :class:`DistributedOptimizer` uses).
NONFINITE_KEY = "gradpress.nonfinite"
#: Where :func:`set_momentum_traffic` leaves a 1-bit optimizer's :class:`MomentumTraffic`.
MOMENTUM_ATTR = "_gp_momentum_traffic"


@dataclass(frozen=True, kw_only=True)
class Decision:
    """How one tensor travels in the compressed phase, and why."""

    #: The codec, or None: exact (fp32).
    codec: CodecSpec | None
    #: A short sentence a user reads in the plan's table.
    reason: str


@dataclass(frozen=True, kw_only=True)
class TensorPlan:
    """One communicated tensor in the compressed phase."""

    #: The parameter's name (as in ``named_parameters``).
    name: str
    #: The name it is pushed under (the momentum's key for the 1-bit optimizers).
    key: str
    #: Elements of the tensor.
    numel: int
    #: The codec spec text, or ``"exact"`` (fp32, uncompressed).
    codec: str
    #: Chunks the runtime cuts it into (``partition_bytes`` each at most).
    chunks: int
    #: Bytes this worker pushes for it per step: the codecs' payloads, headers included.
    bytes_per_step: int
    #: Its bytes as fp32 (``4 * numel``).
    fp32_bytes: int
    #: Why it travels so.
    reason: str
    #: The fused key it shares with other small tensors (:mod:`gradpress.torch.fusion`), or
    #: None. A fused key's headers and chunks count on its first member's row; the other
    #: members' rows show their fp32 bytes and no chunks.
    fused: str | None = None

    @property
    def compressed(self) -> bool:
        """Whether a codec (not fp32) carries it."""
        return self.codec != EXACT


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What an optimizer pushes per step in its compressed phase, tensor by tensor.

    The rows are in the optimizer's parameter order (the order of ``param_groups``), which is
    also the order of the 1-bit optimizers' momentum keys. Pulls carry the servers' payloads,
    of the same sizes.
    """

    #: The rows, one per communicated tensor.
    tensors: tuple[TensorPlan, ...]
    #: What travels: ``"gradient"`` or ``"momentum"`` (1-bit Adam and OneBitLANS).
    communicates: str
    #: Opening steps that push every tensor uncompressed before the compressed phase.
    dense_steps: int
    #: Error feedback of the compressed tensors (its text), or None.
    ef: str | None
    #: Chunk size of the runtime (``GRADPRESS_PARTITION_BYTES``).
    partition_bytes: int
    #: Tensors below this many bytes travel exact.
    min_compress_bytes: int
    #: The dense phase's codec of the tensors not kept exact by name or size (None: fp32;
    #: :func:`dense_codec`).
    dense_codec: CodecSpec | None = None
    #: The names of the rows that travel fp32 in the dense phase whatever ``dense_codec``.
    dense_exact: frozenset[str] = frozenset()

    @property
    def bytes_per_step(self) -> int:
        """Bytes this worker pushes per compressed step (all rows)."""
        return sum(t.bytes_per_step for t in self.tensors)

    @property
    def fp32_bytes(self) -> int:
        """The rows' bytes as fp32."""
        return sum(t.fp32_bytes for t in self.tensors)

    @property
    def dense_bytes_per_step(self) -> int:
        """Bytes pushed per dense step: each tensor in :attr:`dense_codec` (fp32 below
        ``min_compress_bytes`` and in :attr:`dense_exact`), chunk headers included."""
        def codec(t: TensorPlan) -> CodecSpec | None:
            small = 4 * t.numel < self.min_compress_bytes
            return None if small or t.name in self.dense_exact else self.dense_codec

        fused = sum(t.bytes_per_step for t in self.tensors if t.fused)  # exact in both phases
        return fused + sum(_payload(codec(t), c) for t in self.tensors if not t.fused
                           for c in _chunk_sizes(t.numel, self.partition_bytes))

    @property
    def chunks_per_step(self) -> int:
        """Chunks (keys) pushed per step: ``gradpress.stats()["chunks"]`` grows by this."""
        return sum(t.chunks for t in self.tensors)

    @property
    def fused_keys(self) -> int:
        """How many fused keys carry the small tensors."""
        return len({t.fused for t in self.tensors if t.fused})

    @property
    def ratio(self) -> float | None:
        """fp32 bytes over pushed bytes in the compressed phase (None without tensors)."""
        return self.fp32_bytes / self.bytes_per_step if self.bytes_per_step else None

    @property
    def compressed_tensors(self) -> int:
        """How many rows a codec carries."""
        return sum(t.compressed for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (rows and totals)."""
        return {"communicates": self.communicates, "dense_steps": self.dense_steps,
                "ef": self.ef, "partition_bytes": self.partition_bytes,
                "min_compress_bytes": self.min_compress_bytes,
                "bytes_per_step": self.bytes_per_step, "fp32_bytes": self.fp32_bytes,
                "ratio_vs_fp32": self.ratio, "dense_bytes_per_step": self.dense_bytes_per_step,
                "dense_codec": EXACT if self.dense_codec is None else codec_text(self.dense_codec),
                "compressed_tensors": self.compressed_tensors,
                "chunks_per_step": self.chunks_per_step, "fused_keys": self.fused_keys,
                "tensors": [asdict(t) for t in self.tensors]}

    def format(self, label: str = "gradpress plan") -> str:
        """A fixed-width text table under a heading that starts with ``label``: one line per
        tensor, then the totals."""
        return _format(self, label)


@dataclass(frozen=True, kw_only=True)
class MomentumTraffic:
    """How a 1-bit optimizer's ``communicate`` pushes its momenta, described for the plan."""

    #: The key of the momentum of flat parameter ``i`` is ``prefix + str(i)``.
    prefix: str
    #: Its codec spec (error feedback in the wrappers).
    compression: CodecSpec
    #: The ``min_compress_bytes`` of its push_pulls (None: the runtime's default).
    min_compress_bytes: int | None
    #: The keys (flat positions, as text) that always travel exact.
    exact_keys: frozenset[str]
    #: The gradients' codec in the dense phase (:func:`dense_codec`); None: fp32.
    dense_compression: CodecSpec | None = None


#: The dense phase's codec of the 1-bit optimizers when the run compresses: bf16 keeps
#: float32's range (no overflow, unlike fp16) in half the bytes, as mixed-precision data
#: parallelism reduces gradients.
DENSE_CODEC = CodecSpec("bf16", {}, {"ef": "none"})


def dense_codec(spec: CodecSpec) -> CodecSpec | None:
    """The codec of a 1-bit optimizer's dense phase under the run's ``spec``: None (fp32,
    exact) with ``compression="none"``, else :data:`DENSE_CODEC`."""
    return None if spec.name == "none" else DENSE_CODEC


def codec_text(spec: CodecSpec) -> str:
    """The codec's spec text as written, without the wrappers: ``topk:k=0.001,values=fp16``."""
    body = ",".join(f"{k}={v}" for k, v in spec.params.items())
    return f"{spec.name}:{body}" if body else spec.name


def size_text(n: int) -> str:
    """``16384`` -> ``'16 KiB'``, ``1 << 20`` -> ``'1 MiB'``; other sizes in bytes."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def decide(name: str, numel: int, *, spec: CodecSpec, min_compress_bytes: int,
           exact: bool) -> Decision:
    """The optimizers' rule (step 1 of the module docstring) for one tensor.

    ``exact``: the tensor is named in ``uncompressed_params``. The runtime compares
    ``4 * numel`` (its fp32 bytes) with ``min_compress_bytes``, whatever the tensor's dtype.
    """
    if spec.name == "none":
        return Decision(codec=None, reason="compression is none")
    if exact:
        return Decision(codec=None, reason="named in uncompressed_params")
    if 4 * numel < min_compress_bytes:
        return Decision(codec=None,
                        reason=f"below min_compress_bytes ({size_text(min_compress_bytes)})")
    return Decision(codec=CodecSpec(spec.name, dict(spec.params)),
                    reason=f"compressed with {codec_text(spec)}")


def travels_exact(numel: int, *, spec: CodecSpec, min_compress_bytes: int | None,
                  exact: bool) -> bool:
    """Whether a tensor of ``numel`` elements arrives exact (fp32) under :func:`decide`;
    ``min_compress_bytes`` None: the runtime's (:func:`runtime_config`)."""
    limit = runtime_config().min_compress_bytes if min_compress_bytes is None \
        else min_compress_bytes
    return decide("", numel, spec=spec, min_compress_bytes=limit, exact=exact).codec is None


def tensor_plan(name: str, key: str, numel: int, decision: Decision, partition_bytes: int,
                *, what: str = "gradient") -> TensorPlan:
    """The row of one tensor: its chunks' payload bytes under ``decision`` (step 2).

    ``what="momentum"`` prefixes the reason (the 1-bit optimizers send the momentum).
    """
    sizes = _chunk_sizes(numel, partition_bytes)
    codec = decision.codec
    reason = decision.reason if what == "gradient" else f"momentum {decision.reason}"
    return TensorPlan(name=name, key=key, numel=numel,
                      codec=EXACT if codec is None else codec_text(codec), chunks=len(sizes),
                      bytes_per_step=sum(_payload(codec, n) for n in sizes),
                      fp32_bytes=4 * numel, reason=reason)


def plan_rows(entries: Iterable[tuple[str, str, int, bool]], *, spec: CodecSpec,
              min_compress_bytes: int, partition_bytes: int, what: str = "gradient",
              decide_fn: Callable[..., Decision] = decide) -> tuple[TensorPlan, ...]:
    """Rows of ``(name, key, numel, exact)`` entries under one spec and threshold.

    ``decide_fn`` (default :func:`decide`) is where a rule that measures the gradients would
    put its per-tensor decisions.
    """
    return tuple(tensor_plan(name, key, numel,
                             decide_fn(name, numel, spec=spec,
                                       min_compress_bytes=min_compress_bytes, exact=exact),
                             partition_bytes, what=what)
                 for name, key, numel, exact in entries)


def runtime_config() -> PSConfig:
    """The runtime's options: those in effect after ``gradpress.init()``, else those it would
    read from the environment (``partition_bytes``, ``min_compress_bytes``, ``ef``)."""
    from .. import api
    from ..ps.config import PSConfig

    return api.config() if api.is_initialized() else PSConfig.from_env()


def _chunk_sizes(numel: int, partition_bytes: int) -> list[int]:
    from ..ps.partition import chunk_layout

    return [c.numel for c in chunk_layout(numel, partition_bytes)]


_PAYLOADS: dict[tuple[str, int], int] = {}


def _payload(codec: CodecSpec | None, numel: int) -> int:
    """The payload bytes of one chunk of ``numel`` elements (cached: codecs are pure)."""
    from ..compress import build

    spec = CodecSpec("none") if codec is None else codec
    text = codec_text(spec)
    if (text, numel) not in _PAYLOADS:
        _PAYLOADS[(text, numel)] = build(spec, numel).payload_bytes
    return _PAYLOADS[(text, numel)]


def optimizer_plan(opt: Any) -> Plan:
    """The plan of a :func:`~gradpress.torch.optimizer.DistributedOptimizer` (its
    ``plan()``): its gradients, or the momenta its 1-bit optimizer pushes itself."""
    from ..ps.calls import resolve_codec
    from .fusion import fused_codec, tensor_fusion

    cfg = runtime_config()
    traffic: MomentumTraffic | None = getattr(opt, MOMENTUM_ATTR, None)
    dense = None
    if traffic is None:
        spec, limit, what = opt._gp_spec, opt._gp_min_bytes, "gradient"
        dense_steps = opt._gp_dense_steps
        pushed = [(n, p, p in opt._gp_dense) for p, n in opt._gp_names.items() if p.requires_grad]
    else:
        spec, limit, what = traffic.compression, traffic.min_compress_bytes, "momentum"
        dense = traffic.dense_compression
        dense_steps = int(opt.param_groups[0]["dense_steps"])
        flat = [p for g in opt.param_groups for p in g["params"]]
        pushed = [(f"{traffic.prefix}{i}", p, str(i) in traffic.exact_keys)
                  for i, p in enumerate(flat) if p.requires_grad]
    entries = [(opt._gp_names[p], key, p.numel(), exact) for key, p, exact in pushed]
    limit = cfg.min_compress_bytes if limit is None else limit
    push_limit = 0 if traffic is None and fused_codec(spec) is not None else limit
    rows = plan_rows(entries, spec=spec, min_compress_bytes=push_limit,
                     partition_bytes=cfg.partition_bytes, what=what,
                     decide_fn=_measured_rule(getattr(opt, "_gp_meter", None)))
    keys = tensor_fusion([(k, p) for k, p, _ in pushed], min_compress_bytes=limit, spec=spec,
                         cfg=cfg, exact=frozenset(k for k, _, x in pushed if x))
    rows = fuse_rows(rows, keys, cfg.partition_bytes, spec if traffic is None else None)
    if traffic is not None:
        rows = _health_notes(opt, traffic, flat, rows) + _held_rows(opt, traffic, flat,
                                                                    cfg.partition_bytes)
    if opt._gp_nan == "skip":  # one flag a step: the workers agree to skip non-finite steps
        flag = Decision(codec=None, reason="nan_policy='skip': agrees to skip non-finite steps")
        rows += (tensor_plan(NONFINITE_KEY, NONFINITE_KEY, 1, flag, cfg.partition_bytes),)
    return Plan(tensors=rows, communicates=what, dense_steps=dense_steps,
                ef=resolve_codec(spec, None, cfg)[1]["ef"], partition_bytes=cfg.partition_bytes,
                min_compress_bytes=limit, dense_codec=dense,
                dense_exact=frozenset(n for n, _, _, named in entries if named))


def _health_notes(opt: Any, traffic: MomentumTraffic, flat: Sequence[Any],
                  rows: Sequence[TensorPlan]) -> tuple[TensorPlan, ...]:
    """``rows`` with what the health watch measured (:mod:`gradpress.optim.health`): the last
    probe's cosine with the exact average and the drifts recovered from (``flat``: the
    parameters in the optimizer's flat order)."""
    by_key = {f"{traffic.prefix}{i}": opt.state.get(p, {}) for i, p in enumerate(flat)}
    out = []
    for t in rows:
        st = by_key.get(t.key, {})
        if "probe_cos" in st:
            note = f"; cos {st['probe_cos']:.2f} with the exact average at the last probe"
            if st.get("recoveries"):
                note += f", drifted and recovered {st['recoveries']} time(s)"
            t = replace(t, reason=t.reason + note)
        out.append(t)
    return tuple(out)


def _held_rows(opt: Any, traffic: MomentumTraffic, flat: Sequence[Any], partition_bytes: int
               ) -> tuple[TensorPlan, ...]:
    """A row per tensor whose idle rows :class:`~gradpress.optim.OneBitLANSCore` holds (step 2b):
    the exact flags of which rows have a gradient, one fp32 value a row (no model bytes)."""
    from ..optim.idle_rows import has_idle_rows

    hold = getattr(opt, "hold_idle_rows", False)
    if not getattr(opt, "compression_active", False):
        return ()  # decided when the dense phase ends (asking earlier would decide early)
    out = []
    for i, p in enumerate(flat):
        if p.dim() < 2 or not (hold(i) if callable(hold) else hold):
            continue
        if not has_idle_rows(opt.state.get(p, {})):
            continue
        why = Decision(codec=None, reason="which rows have a gradient on each worker: rows "
                                          "without one on any worker are held, not walked")
        row = tensor_plan(f"{opt._gp_names[p]} (rows)", f"{traffic.prefix}{i}.rows",
                          p.shape[0], why, partition_bytes)
        out.append(replace(row, fp32_bytes=0))
    return tuple(out)


def fuse_rows(rows: Sequence[TensorPlan], keys: Sequence[FusedKey],
              partition_bytes: int, spec: CodecSpec | None = None) -> tuple[TensorPlan, ...]:
    """``rows`` with the members of the fused ``keys`` (matched by row key) marked: each
    member's bytes are its share of the key's payload (its fp32 values, or its share by
    elements in the codec of a block-scaled ``spec``,
    :func:`~gradpress.torch.fusion.fused_codec`), and its key's first member also carries the
    key's headers, chunks and rounding, so the rows still add up to what is pushed."""
    from .fusion import fused_codec

    where = {m: (i, k, j) for i, k in enumerate(keys) for j, m in enumerate(k.members)}
    out = []
    for t in rows:
        if t.key not in where:
            out.append(t)
            continue
        i, k, j = where[t.key]
        codec = None if k.exact else fused_codec(spec)
        nbytes, chunks = member_bytes(k, j, t.numel, partition_bytes, codec)
        reason = f"{t.reason}; in bucket {i + 1} ({len(k.members)} tensors)" \
            if codec is None else (f"in bucket {i + 1} ({len(k.members)} tensors), compressed "
                                   f"with {codec.name}")
        out.append(replace(t, fused=k.name, chunks=chunks, bytes_per_step=nbytes,
                           codec=t.codec if codec is None else codec_text(codec),
                           reason=reason))
    return tuple(out)


def member_bytes(k: FusedKey, j: int, numel: int, partition_bytes: int,
                 codec: CodecSpec | None) -> tuple[int, int]:
    """``(bytes, chunks)`` the ``j``-th member of fused key ``k`` carries in :func:`fuse_rows`."""
    from .fusion import fused_key_bytes

    total, chunks = fused_key_bytes(k, partition_bytes, codec)
    if codec is None:  # fp32 values; the first member also the headers
        return (total if j == 0 else 4 * k.numel) - 4 * (k.numel - numel), chunks if j == 0 else 0
    if j == 0:
        return total - sum(total * n // k.numel for n in k.numels[1:]), chunks
    return total * numel // k.numel, 0


def _measured_rule(meter: Any) -> Callable[..., Decision]:
    """:func:`decide`, with the tensors that ``uncompressed_params="auto"`` measured
    (:mod:`gradpress.torch.agreement`) exact and every reason saying what was measured."""
    if meter is None:
        return decide

    def rule(name: str, numel: int, *, spec: CodecSpec, min_compress_bytes: int,
             exact: bool) -> Decision:
        result = meter.result
        if result is not None and name in result.exact and spec.name != "none":
            return Decision(codec=None, reason=result.reason(name))
        d = decide(name, numel, spec=spec, min_compress_bytes=min_compress_bytes, exact=exact)
        if d.codec is None:
            return d
        note = "agreement not measured yet (dense phase)" if result is None \
            else result.reason(name)
        return Decision(codec=d.codec, reason=f"{d.reason}; {note}")

    return rule


def set_momentum_traffic(opt: Any, traffic: MomentumTraffic) -> None:
    """Tell the plan of ``opt`` (a 1-bit optimizer, before it is wrapped in
    ``DistributedOptimizer``) how its ``communicate`` pushes the momenta."""
    setattr(opt, MOMENTUM_ATTR, traffic)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _format(plan: Plan, label: str) -> str:
    """:meth:`Plan.format`: a heading, one line per tensor and a total line."""
    head = ("tensor", "elements", "codec", "pushed/step", "fp32", "reason")
    rows = [(t.name, f"{t.numel:,}", t.codec, _human(t.bytes_per_step), _human(t.fp32_bytes),
             t.reason) for t in plan.tensors]
    ratio = "" if plan.ratio is None else f", {plan.ratio:.1f}x vs fp32"
    fused = sum(t.fused is not None for t in plan.tensors)
    ratio += f", {fused} fused into {plan.fused_keys} key(s)" if fused else ""
    rows.append(("total", f"{sum(t.numel for t in plan.tensors):,}", "",
                 _human(plan.bytes_per_step), _human(plan.fp32_bytes),
                 f"{plan.compressed_tensors} of {len(plan.tensors)} compressed{ratio}"))
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    right = (False, True, False, True, True, False)
    lines = ["  ".join(c.rjust(w) if rj else c.ljust(w)
                       for c, w, rj in zip(r, widths, right)).rstrip() for r in (head, *rows)]
    return "\n".join([_title(plan, label), *lines[:-1], "-" * max(map(len, lines)), lines[-1]])


def _title(plan: Plan, label: str) -> str:
    if not plan.compressed_tensors:
        return f"{label}: nothing is compressed; the {plan.communicates} travels as fp32"
    how = "" if plan.dense_codec is None else f"{codec_text(plan.dense_codec)}, "
    when = (f"after {plan.dense_steps} dense steps ({how}{_human(plan.dense_bytes_per_step)} "
            f"a step)" if plan.dense_steps else "from the first step")
    return (f"{label}: the {plan.communicates} travels compressed {when}, error "
            f"feedback {plan.ef or 'none'}")

"""The one builder of gradpress's distributed optimizers.

``gp.CLAN``, ``gp.OneBitLANS`` and ``gradpress train --optimizer NAME`` all call
:func:`build_optimizer` with an :class:`OptimizerConfig`, so the same settings give the same
optimizer (the same plan, bit-identical steps) whichever entry point a user takes. Defaults
live in :mod:`gradpress.defaults`. What each method builds:

1. ``clan``: LANS without per-layer gradient normalisation (:func:`gradpress.optim.clan_core`)
   behind ``DistributedOptimizer(compression, ef, dense_steps)``: the two-way compressed
   gradient drives it (BytePS-Compress, Zhong et al. 2021).
2. ``lans``, ``lamb``, ``adam`` (AdamW): the optimizer behind ``DistributedOptimizer`` as it is.
3. ``sgd-ef``: dist-EF-SGDM (Zheng, Huang, Kwok 2019): SGD without its own momentum behind
   ``DistributedOptimizer(momentum="nesterov")`` when compressed, torch's Nesterov SGD when not.
4. ``onebit-lans`` and ``onebit-adam``: :class:`gradpress.optim.OneBitLANSCore` or
   :class:`gradpress.optim.OneBitAdam`. ``DistributedOptimizer`` averages the dense phase's
   gradients (bf16; fp32 with ``compression="none"``) and steps aside once the optimizer's
   ``compression_active`` turns true; the optimizer then communicates each worker's momentum
   through :class:`_MomentumRoute` (small momenta fused, named tensors exact). 1-bit LANS also
   holds the idle rows of its compressed momenta and watches their health
   (:mod:`gradpress.optim.idle_rows`, :mod:`gradpress.optim.health`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .. import defaults
from ..compress.spec import CodecSpec, Compression, EFSpec, parse_spec

__all__ = ["METHODS", "MOMENTUM_METHODS", "OptimizerConfig", "build_optimizer"]

log = logging.getLogger(__name__)

#: The methods :func:`build_optimizer` builds (``gradpress train --optimizer`` takes the same).
METHODS = ("clan", "lans", "lamb", "adam", "sgd-ef", "onebit-adam", "onebit-lans")
#: The methods that communicate their momentum after ``dense_steps`` (>= 1) dense steps.
MOMENTUM_METHODS = ("onebit-adam", "onebit-lans")

NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The settings of one distributed optimizer (validated on construction, ValueError)."""

    #: One of :data:`METHODS`.
    method: str = "clan"
    #: The peak learning rate (a schedule may scale the groups' ``lr`` afterwards).
    lr: float = 1e-3
    #: Codec spec of the gradients (of the momenta for the 1-bit methods); None: the method's
    #: (:func:`gradpress.defaults.compression_for`: ``onebit`` for ``clan`` and the 1-bit
    #: methods, ``int4`` for an optimizer run as it is).
    compression: Compression | None = None
    #: Error feedback; None: the method's (:func:`gradpress.defaults.ef_for`).
    ef: str | EFSpec | None = None
    #: Uncompressed opening steps; None: the method's (:func:`gradpress.defaults.dense_steps_for`).
    dense_steps: int | None = None
    #: Decoupled weight decay on tensors of two or more dimensions.
    weight_decay: float = defaults.WEIGHT_DECAY
    #: ``(b1, b2)`` of the Adam-family methods.
    betas: tuple[float, float] = defaults.BETAS
    #: Added to ``sqrt(v)``; None: the optimizer class's own.
    eps: float | None = None
    #: ``sgd-ef``'s momentum.
    momentum: float = defaults.SGD_MOMENTUM
    #: Smaller tensors travel exact; ``"auto"``: measured from the model's sizes.
    min_compress_bytes: int | str | None = defaults.MIN_COMPRESS_BYTES
    #: Names or patterns that travel exact, or ``"auto"`` (measured in the dense phase).
    uncompressed_params: Iterable[str] | str = defaults.UNCOMPRESSED_PARAMS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown optimizer method {self.method!r}; valid: "
                             f"{', '.join(METHODS)}")
        if self.compression is None:
            object.__setattr__(self, "compression", defaults.compression_for(self.method))
        lo = 1 if self.method in MOMENTUM_METHODS else 0
        d = self.dense_steps
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < lo):
            raise ValueError(f"dense_steps must be an int >= {lo} for {self.method}, got {d!r}")
        if self.method == "sgd-ef" and d:
            raise ValueError(f"dense_steps is not for sgd-ef (its momentum runs on the "
                             f"compressed gradients from the first step), got {d}")
        if isinstance(self.uncompressed_params, str) and self.uncompressed_params != "auto":
            raise TypeError(f"uncompressed_params must be 'auto' or a collection of names or "
                            f"patterns, got the string {self.uncompressed_params!r}; write "
                            f"[{self.uncompressed_params!r}]")
        if not isinstance(self.uncompressed_params, str):
            object.__setattr__(self, "uncompressed_params", tuple(self.uncompressed_params))
        m = self.min_compress_bytes
        if m is not None and m != "auto" and (isinstance(m, bool) or not isinstance(m, int)
                                               or m < 0):
            raise ValueError(f"min_compress_bytes must be an int >= 0, 'auto' or None, got "
                             f"{m!r}")
        self.spec  # noqa: B018  (builds the codec once: an invalid spec is a ValueError now)

    @property
    def effective_dense_steps(self) -> int:
        """``dense_steps``, or the method's default."""
        return defaults.dense_steps_for(self.method, self.compression) if self.dense_steps is None \
            else self.dense_steps

    @functools.cached_property
    def spec(self) -> CodecSpec:
        """The codec spec with the effective error feedback in its wrappers (built once, on
        construction, to check it)."""
        from ..compress import build

        cs = parse_spec(self.compression)
        ef = defaults.ef_for(self.method) if self.ef is None else self.ef
        spec = CodecSpec(cs.name, dict(cs.params), {**cs.wrappers, "ef": ef})
        build(spec, 4096)
        return spec


def build_optimizer(named_parameters: NamedParameters, config: OptimizerConfig, *,
                    core: type | None = None, core_options: Mapping[str, Any] | None = None
                    ) -> torch.optim.Optimizer:
    """The distributed optimizer of ``config`` over ``named_parameters`` (steps 1-4 of the
    module docstring). ``core`` replaces the single-process optimizer class and
    ``core_options`` go to it as they are (the convergence study's variants in
    ``benchmarks/``); None: the method's own class, with none."""
    from ..optim import weight_decay_groups

    if not isinstance(config, OptimizerConfig):
        raise TypeError(f"config must be an OptimizerConfig, got {type(config).__name__}")
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    groups = weight_decay_groups([p for _, p in named], config.weight_decay)
    name_of = {id(p): n for n, p in named}
    named = [(name_of[id(p)], p) for g in groups for p in g["params"]]  # the groups' flat order
    log.info("gradpress optimizer: %s", config)
    if config.method in MOMENTUM_METHODS:
        return _momentum_optimizer(named, groups, config, core, dict(core_options or {}))
    return _gradient_optimizer(named, groups, config, core, dict(core_options or {}))


def _core_kwargs(config: OptimizerConfig, options: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay}
    if config.method != "sgd-ef":
        kw["betas"] = config.betas
    if config.eps is not None:
        kw["eps"] = config.eps
    return {**kw, **options}


def _gradient_optimizer(named: list[tuple[str, Any]], groups: list[dict[str, Any]],
                        config: OptimizerConfig, core: type | None,
                        options: dict[str, Any]) -> torch.optim.Optimizer:
    """Steps 1-3: an optimizer stepping on the averaged (compressed) gradient."""
    from ..optim import LAMB, LANS
    from .optimizer import DistributedOptimizer

    spec, kw = config.spec, _core_kwargs(config, options)
    wrap: dict[str, Any] = {}
    if config.method == "sgd-ef":
        if spec.name != "none":  # momentum before compression, on the workers (dist-EF-SGDM)
            wrap = {"momentum": "nesterov", "mu": config.momentum}
            opt = (core or torch.optim.SGD)(groups, momentum=0.0, **kw)
        else:  # uncompressed: torch's Nesterov momentum is the same update
            mu = config.momentum
            opt = (core or torch.optim.SGD)(groups, momentum=mu, nesterov=mu > 0, **kw)
    elif config.method == "clan":  # step 1: LANS without gradient normalisation
        opt = (core or LANS)(groups, **{"normalize_grad": False, **kw})
    else:
        cls = {"lans": LANS, "lamb": LAMB, "adam": torch.optim.AdamW}[config.method]
        opt = (core or cls)(groups, **kw)
    return DistributedOptimizer(opt, named_parameters=named, compression=spec,
                                ef=spec.wrappers["ef"], **wrap,
                                min_compress_bytes=config.min_compress_bytes,
                                dense_steps=config.effective_dense_steps,
                                uncompressed_params=_listed(config.uncompressed_params))


def _listed(uncompressed: Iterable[str] | str) -> Iterable[str] | str:
    return uncompressed if isinstance(uncompressed, str) else sorted(uncompressed)


def _momentum_optimizer(named: list[tuple[str, Any]], groups: list[dict[str, Any]],
                        config: OptimizerConfig, core: type | None,
                        options: dict[str, Any]) -> torch.optim.Optimizer:
    """Step 4: a 1-bit optimizer that communicates each worker's momentum itself."""
    from ..optim import OneBitAdam, OneBitLANSCore
    from ..optim.health import HealthWatch
    from ..optim.idle_rows import has_idle_rows
    from .agreement import auto_min_compress_bytes
    from .optimizer import DistributedOptimizer, match_names
    from .plan import dense_codec

    given = config.min_compress_bytes
    limit = auto_min_compress_bytes(4 * p.numel() for _, p in named) if given == "auto" \
        else None if given is None else int(given)
    listed = config.uncompressed_params
    exact = None if isinstance(listed, str) else match_names(
        [n for n, _ in named], listed, "uncompressed_params")
    route = _MomentumRoute(named, config.spec, limit, exact)
    kw = _core_kwargs(config, options)
    if config.method == "onebit-lans":
        kw = {"blend": route.blend, "hold_idle_rows": route.compressed, "watch": HealthWatch(),
              **kw}
    opt = (core or (OneBitLANSCore if config.method == "onebit-lans" else OneBitAdam))(
        groups, dense_steps=config.effective_dense_steps, communicate=route.communicate, **kw)
    route.attach(opt)
    warm = dense_codec(route.spec)
    # The wrapper averages dense gradients during the dense phase (bf16 unless nothing is
    # compressed) and stops once the optimizer's compression_active turns true.
    wrapper = DistributedOptimizer(opt, named_parameters=named, compression=warm or "none",
                                   ef="none", min_compress_bytes=limit,
                                   uncompressed_params=_listed(listed))
    # From here on the wrapper is the optimizer: its state is the one that steps and that
    # load_state_dict replaces (the core's dict would be left behind at a resume).
    route.opt = wrapper
    meter = getattr(wrapper, "_gp_meter", None)
    if meter is not None and getattr(opt, "hold_idle_rows", False) is not False:
        # the core holds the idle rows of these: compress them whatever they agree
        meter.held = lambda: [n for n, p in named if has_idle_rows(wrapper.state[p])]
    return wrapper


class _MomentumRoute:
    """How a 1-bit optimizer's momenta travel: each under ``PREFIX.clan_m.<i>`` (``i`` the
    parameter's position in the optimizer's flat order), small ones fused, exact ones (named or
    measured) uncompressed; 1-bit LANS's row flags and health probes exact."""

    def __init__(self, named: list[tuple[str, Any]], spec: CodecSpec, limit: int | None,
                 exact: frozenset[str] | None) -> None:
        from ..compress.registry import ef_needs_lr

        self.named, self.spec, self.limit = named, spec, limit
        self.prefix = f"{named[0][0] if named else 'clan'}.clan_m."  # names key the tensors
        self.exact = {str(i) for i, (n, _) in enumerate(named) if exact and n in exact}
        self.decided = exact is not None  # "auto": not until the dense phase has ended
        self.needs_lr = ef_needs_lr(spec.wrappers.get("ef"))
        self.opt: Any = None  # the core at attach, then the DistributedOptimizer wrapping it
        self.fusion: Any = None

    def attach(self, opt: torch.optim.Optimizer) -> None:
        """Tell ``opt``'s plan how the momenta travel (:mod:`gradpress.torch.plan`)."""
        from .plan import MomentumTraffic, dense_codec, set_momentum_traffic

        self.opt = opt
        opt.param_names = {i: n for i, (n, _) in enumerate(self.named)}  # type: ignore[attr-defined]
        set_momentum_traffic(opt, MomentumTraffic(
            prefix=self.prefix, compression=self.spec, min_compress_bytes=self.limit,
            exact_keys=frozenset(self.exact), dense_compression=dense_codec(self.spec)))

    def decide(self) -> None:
        """At the first compressed step: take the exact tensors the dense phase measured."""
        if not self.decided:
            chosen = self.opt.decide_exact().exact
            self.exact.update(str(i) for i, (n, _) in enumerate(self.named) if n in chosen)
            self.decided = True

    def exact_at(self, i: int) -> bool:
        from .plan import travels_exact

        return travels_exact(self.named[i][1].numel(), spec=self.spec,
                             exact=str(i) in self.exact, min_compress_bytes=self.limit)

    def blend(self, i: int) -> bool:
        """1-bit LANS's step 4 (LANS's step proper) when every momentum travels exact."""
        self.decide()
        return all(self.exact_at(j) for j in range(len(self.named)))

    def compressed(self, i: int) -> bool:
        """1-bit LANS's step 2b: hold the idle rows of compressed momenta."""
        self.decide()
        return not self.exact_at(i)

    def communicate(self, key: str, m: torch.Tensor) -> Any:
        """The optimizer's ``communicate``: the averaged momentum of ``key`` (a handle)."""
        from ..api import push_pull_async
        from .fusion import momentum_fuser
        from .optimizer import ALWAYS_EXACT
        from .plan import dense_codec

        self.decide()
        if self.fusion is None:  # small momenta share fused keys (gradpress.torch.fusion)
            self.fusion = momentum_fuser(self.opt.param_groups, prefix=self.prefix,
                                         spec=self.spec, min_compress_bytes=self.limit)
        name = f"{self.prefix}{key}"
        if self.fusion.fuses(name):
            return self.fusion.add(name, m)
        if key.endswith(".rows"):  # which rows of an embedding-like tensor have a gradient
            return push_pull_async(m, name=name, average=True, compression="none",
                                   min_compress_bytes=ALWAYS_EXACT)
        if key.endswith(".probe"):  # the health watch's exact average, as the dense phase's
            return push_pull_async(m, name=name, average=True,
                                   compression=dense_codec(self.spec) or "none",
                                   min_compress_bytes=0)
        name, recovering = self._generation(int(key), name)
        # corrected error feedback rescales the residuals by the change of the current lr
        lr = self.opt.param_groups[0]["lr"] if self.needs_lr else None
        limit = ALWAYS_EXACT if key in self.exact or recovering else self.limit
        return push_pull_async(m, name=name, average=True, compression=self.spec, lr=lr,
                               min_compress_bytes=limit)

    def _generation(self, i: int, name: str) -> tuple[str, bool]:
        """A drifted tensor travels exact for a while, then compressed under fresh keys (new
        residuals) named by its generation (:mod:`gradpress.optim.health`)."""
        from ..api import _rt

        if not hasattr(self.opt, "generation"):
            return name, False
        gen, recovering = self.opt.generation(i), self.opt.recovering(i)
        new = self.opt.new_drifts(i)  # the watch saw a drift at the last step: count it once
        if new:
            _rt().worker.account(drift_recoveries=new)
        return name + (f".x{gen}" if recovering else f".g{gen}" if gen else ""), recovering

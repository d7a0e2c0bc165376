"""Codec registry and :func:`build`, the one entry point that turns a spec into a codec."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from .base import REGISTRY, Codec
from .ef import ErrorFeedback
from .momentum import NesterovMomentum
from .spec import CodecSpec, EFSpec, parse_ef, parse_spec

__all__ = ["build", "codec_names", "codec_class", "MOMENTUM_KINDS", "ef_needs_lr"]

_FAMILY_MODULES = ("cast", "onebit", "sparse", "dithering", "blockint")
MOMENTUM_KINDS = ("nesterov",)
_loaded = False


def _load_families() -> None:
    """Import the codec families (each registers its codecs); deferred, so that importing
    :mod:`gradpress.compress` does not load the numba kernels."""
    global _loaded
    if not _loaded:
        for mod in _FAMILY_MODULES:
            importlib.import_module(f"{__package__}.{mod}")
        _loaded = True


def codec_names() -> list[str]:
    _load_families()
    return sorted(REGISTRY, key=lambda n: REGISTRY[n].codec_id)


def codec_class(name: str) -> type[Codec]:
    _load_families()
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; valid codecs: {', '.join(codec_names())}") \
            from None


def resolve_params(cls: type[Codec], given: Mapping[str, Any]) -> dict[str, Any]:
    """Fill defaults and parse values; ValueError naming unknown keys or bad values."""
    known = {p.name: p for p in cls.PARAMS}
    unknown = sorted(set(given) - set(known))
    if unknown:
        valid = ", ".join(known) or "(none)"
        raise ValueError(f"codec {cls.name!r}: unknown parameter(s) {', '.join(unknown)}; "
                         f"valid parameters: {valid}")
    out: dict[str, Any] = {}
    for name, p in known.items():
        raw = given.get(name, p.default)
        try:
            out[name] = p.parse(raw)
        except ValueError as e:
            raise ValueError(f"codec {cls.name!r} parameter {name}={raw!r}: {e}") from None
    return out


def _pick(what: str, arg: Any, from_spec: Any) -> Any:
    if arg is not None and from_spec is not None and str(arg).lower() != str(from_spec).lower():
        raise ValueError(f"{what} given twice with different values: {arg!r} (argument) and "
                         f"{from_spec!r} (compression spec)")
    return arg if arg is not None else from_spec


def pick_ef(arg: str | EFSpec | None, from_spec: str | EFSpec | None, what: Any) -> EFSpec | None:
    """The error feedback of a call: ``arg`` or, when it is None, the spec's ``ef``; ValueError
    when both are given and differ. None when neither is given (the caller's default applies)."""
    a = None if arg is None else parse_ef(arg)
    b = None if from_spec is None else parse_ef(from_spec)
    if a is not None and b is not None and a != b:
        raise ValueError(f"ef given twice with different values: {arg!r} (argument) and "
                         f"{from_spec!r} (compression spec {what!r})")
    return a if a is not None else b


def build(spec: str | Mapping[str, Any] | CodecSpec | None, numel: int, *,
          ef: str | EFSpec | None = None,
          momentum: str | None = None, mu: float | None = None, seed: int = 0,
          nan_policy: str = "raise", backend: str = "auto") -> Codec:
    """Build a codec for chunks of ``numel`` float32 elements.

    Args:
        spec: ``"name[:key=value,...]"``, a BytePS-style dict, or None (``"none"``).
        numel: elements per chunk; fixes ``payload_bytes``.
        ef: error feedback, an :class:`~gradpress.compress.spec.EFSpec` or its text: None or
            ``"none"``, ``"vanilla"``, ``"corrected"`` (needs ``lr`` in compress), ``"sparse"``
            (randomk only), ``"vanilla:decay=B"``, ...
        momentum: None or ``"nesterov"`` (momentum applied before compression, worker side).
        mu: momentum coefficient (default 0.9).
        seed: base seed of codecs that draw random numbers (randomk's own ``seed`` wins).
        nan_policy: ``"raise"`` (default) or ``"allow"`` non-finite input.
        backend: ``"auto"``, ``"numba"`` or ``"torch"`` kernels.
    """
    parsed = parse_spec(spec)
    cls = codec_class(parsed.name)
    params = resolve_params(cls, parsed.params)
    ef_spec = pick_ef(ef, parsed.wrappers.get("ef"), spec)
    momentum = _pick("momentum", momentum, parsed.wrappers.get("momentum"))
    mu = _pick("mu", mu, parsed.wrappers.get("mu"))
    if isinstance(momentum, str) and momentum.lower() in ("none", ""):
        momentum = None
    codec: Codec = cls(numel, params, spec=parsed, seed=seed, nan_policy=nan_policy,
                       backend=backend)
    if ef_spec is not None and ef_spec.enabled:
        codec = ErrorFeedback(codec, kind=ef_spec)
    if momentum is not None:
        _checked("momentum", momentum, MOMENTUM_KINDS)
        codec = NesterovMomentum(codec, mu=0.9 if mu is None else float(mu))
    elif mu is not None:
        raise ValueError(f"mu={mu!r} given without momentum; pass momentum='nesterov'")
    return codec


def ef_needs_lr(ef: str | EFSpec | None) -> bool:
    """Whether pushes with error feedback ``ef`` must carry the step's learning rate
    (:attr:`EFSpec.needs_lr <gradpress.compress.spec.EFSpec.needs_lr>`)."""
    return parse_ef(ef).needs_lr


def _checked(what: str, value: Any, valid: tuple[str, ...]) -> str:
    v = str(value).strip().lower()
    if v not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(valid)}, or None")
    return v

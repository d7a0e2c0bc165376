"""Codec registry and :func:`build`, the one entry point that turns a spec into a codec."""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from typing import Any

from .base import Codec
from .spec import CodecSpec, parse_spec

__all__ = ["register", "build", "codec_names", "codec_class", "EF_KINDS", "MOMENTUM_KINDS",
           "check_ef", "split_ef", "server_ef", "ef_needs_lr"]

_REGISTRY: dict[str, type[Codec]] = {}
_FAMILY_MODULES = ("cast", "onebit", "sparse", "dithering")
EF_KINDS = ("vanilla", "corrected", "sparse")
MOMENTUM_KINDS = ("nesterov",)


def register(cls: type[Codec]) -> type[Codec]:
    """Class decorator adding a codec to the registry (name and codec id must be unique)."""
    for other in _REGISTRY.values():
        if other.codec_id == cls.codec_id and other is not cls:
            raise ValueError(f"codec id {cls.codec_id} of {cls.name} already used by {other.name}")
    _REGISTRY[cls.name] = cls
    return cls


_loaded = False


def _load_families() -> None:
    global _loaded
    if not _loaded:
        for mod in _FAMILY_MODULES:
            importlib.import_module(f"{__package__}.{mod}")
        _loaded = True


def codec_names() -> list[str]:
    _load_families()
    return sorted(_REGISTRY, key=lambda n: _REGISTRY[n].codec_id)


def codec_class(name: str) -> type[Codec]:
    _load_families()
    try:
        return _REGISTRY[name]
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


def build(spec: str | Mapping[str, Any] | CodecSpec | None, numel: int, *, ef: str | None = None,
          momentum: str | None = None, mu: float | None = None, seed: int = 0,
          nan_policy: str = "raise", backend: str = "auto") -> Codec:
    """Build a codec for chunks of ``numel`` float32 elements.

    Args:
        spec: ``"name[:key=value,...]"``, a BytePS-style dict, or None (``"none"``).
        numel: elements per chunk; fixes ``payload_bytes``.
        ef: error feedback: None, ``"vanilla"``, ``"corrected"`` (needs ``lr`` in compress) or
            ``"sparse"`` (randomk only).
        momentum: None or ``"nesterov"`` (momentum applied before compression, worker side).
        mu: momentum coefficient (default 0.9).
        seed: base seed of codecs that draw random numbers (randomk's own ``seed`` wins).
        nan_policy: ``"raise"`` (default) or ``"allow"`` non-finite input.
        backend: ``"auto"``, ``"numba"`` or ``"torch"`` kernels.
    """
    cs = parse_spec(spec)
    cls = codec_class(cs.name)
    params = resolve_params(cls, cs.params)
    ef = _pick("ef", ef, cs.wrappers.get("ef"))
    momentum = _pick("momentum", momentum, cs.wrappers.get("momentum"))
    mu = _pick("mu", mu, cs.wrappers.get("mu"))
    if isinstance(ef, str) and ef.lower() in ("none", ""):
        ef = None
    if isinstance(momentum, str) and momentum.lower() in ("none", ""):
        momentum = None
    codec: Codec = cls(numel, params, spec=cs, seed=seed, nan_policy=nan_policy, backend=backend)
    if ef is not None:
        from .ef import ErrorFeedback
        codec = ErrorFeedback(codec, kind=check_ef(ef))
    if momentum is not None:
        from .momentum import NesterovMomentum
        _checked("momentum", momentum, MOMENTUM_KINDS)
        codec = NesterovMomentum(codec, mu=0.9 if mu is None else float(mu))
    elif mu is not None:
        raise ValueError(f"mu={mu!r} given without momentum; pass momentum='nesterov'")
    return codec


def check_ef(value: Any) -> str:
    """The canonical error-feedback kind of ``value``: one of :data:`EF_KINDS`,
    ``"vanilla:decay=B"`` (residuals that decay by ``B`` in [0, 1] each step, see :mod:`.ef`),
    optionally with ``",server_decay=S"`` (``S`` on the servers instead) and ``",anneal=1"``
    (the workers' loss ``1-B`` shrinks with the lr); ValueError naming the value otherwise."""
    return _ef_text(*_ef_parts(value))


def split_ef(kind: str) -> tuple[str, float]:
    """``(base kind, decay)`` of a kind :func:`check_ef` accepts (decay 1.0 unless given): what
    a worker's error feedback uses."""
    base, opts = _ef_parts(kind)
    return base, opts.get("decay", 1.0)


def ef_needs_lr(kind: str | None) -> bool:
    """Whether pushes with error-feedback ``kind`` must carry the step's learning rate:
    ``corrected`` (residuals rescaled by its change) and ``anneal=1`` (decay follows it)."""
    if kind is None or str(kind).strip().lower() in ("none", ""):
        return False
    base, opts = _ef_parts(kind)
    return base == "corrected" or bool(opts.get("anneal", 0.0))


def server_ef(kind: str | None) -> str | None:
    """The error-feedback kind a server's codec uses for keys pushed with ``kind``: the same,
    except that ``vanilla:decay=B,server_decay=S`` becomes ``vanilla:decay=S``; ``anneal`` is
    the workers' only (a server's replies carry no lr), so a server keeps its decay fixed."""
    if kind is None:
        return None
    base, opts = _ef_parts(kind)
    if "server_decay" in opts:
        opts = {"decay": opts["server_decay"]}
    opts.pop("anneal", None)
    return _ef_text(base, opts)


#: Options of ``vanilla:...`` and the values each accepts (:func:`_ef_parts`).
_EF_OPTIONS = {"decay": "B in [0, 1]", "server_decay": "S in [0, 1]", "anneal": "0 or 1"}


def _ef_parts(value: Any) -> tuple[str, dict[str, float]]:
    """``(base kind, {"decay": B, "server_decay": S, "anneal": A} as given)`` of an ef kind;
    ValueError naming the value unless each option is one of :data:`_EF_OPTIONS` on
    ``vanilla``, given once, with a value it accepts."""
    v = str(value).strip().lower().replace(" ", "")
    base, sep, opt = v.partition(":")
    if not sep:
        return _checked("ef", value, EF_KINDS), {}
    out: dict[str, float] = {}
    for item in opt.split(","):
        key, eq, num = item.partition("=")
        try:
            b = float(num) if base == "vanilla" and eq and key not in out else math.nan
        except ValueError:
            b = math.nan
        ok = b in (0.0, 1.0) if key == "anneal" else 0.0 <= b <= 1.0
        if key not in _EF_OPTIONS or not ok:
            raise ValueError(f"unknown ef {value!r}; valid: {', '.join(EF_KINDS)}, "
                             f"'vanilla:decay=B' with B in [0, 1] (optionally "
                             f"',server_decay=S', S in [0, 1], and ',anneal=1'), or None")
        out[key] = b
    if out.get("anneal") and out.get("decay", 1.0) == 1.0:
        raise ValueError(f"ef {value!r}: anneal=1 moves a decay B < 1 towards 1 as the lr "
                         f"falls; give 'decay=B' with B < 1 (B = 1 has nothing to anneal)")
    return "vanilla", out


def _ef_text(base: str, opts: dict[str, float]) -> str:
    """The canonical text of :func:`_ef_parts`'s result (``decay`` always written, 1.0 unless
    given, once an option is; ``anneal`` only when 1)."""
    if not opts:
        return base
    text = f"vanilla:decay={opts.get('decay', 1.0)!r}"
    if "server_decay" in opts:
        text += f",server_decay={opts['server_decay']!r}"
    if opts.get("anneal"):
        text += ",anneal=1"
    return text


def _checked(what: str, value: Any, valid: tuple[str, ...]) -> str:
    v = str(value).strip().lower()
    if v not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid: {', '.join(valid)}, or None")
    return v

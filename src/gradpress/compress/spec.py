"""Compression spec strings and BytePS-style dicts.

A spec names a codec and its parameters: ``name[:key=value,...]``, e.g. ``onebit``,
``topk:k=0.001,values=fp16``, ``randomk:k=0.01,seed=7``, ``dithering:s=7,partition=natural``.
BytePS-style dicts are accepted too: ``{"compressor": "topk", "k": 0.001, "ef": "vanilla",
"momentum": "nesterov", "scaling": True, "seed": 7}``; the keys ``ef``, ``momentum`` and ``mu``
describe the stateful wrappers and are returned apart from the codec parameters.

Error feedback is a value too, :class:`EFSpec`, written ``kind[:option=value,...]``
(``"vanilla"``, ``"vanilla:decay=0.9,server_decay=1"``, ``"corrected"``, ...) and parsed by
:func:`parse_ef` only.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Param", "CodecSpec", "Compression", "parse_spec", "parse_bool", "parse_k", "choice",
           "EFSpec", "parse_ef", "EF_KINDS"]

WRAPPER_KEYS = ("ef", "momentum", "mu")


@dataclass(frozen=True)
class Param:
    """One codec parameter: its name, default, a parser (str or value -> value) and a doc line."""

    name: str
    default: Any
    parse: Callable[[Any], Any]
    doc: str


@dataclass(frozen=True)
class CodecSpec:
    """A parsed spec: codec name, parameters (as given), wrapper options (ef, momentum, mu)."""

    name: str
    params: Mapping[str, Any] = field(default_factory=dict)
    wrappers: Mapping[str, Any] = field(default_factory=dict)

    def canonical(self, resolved: Mapping[str, Any]) -> str:
        """Canonical text of the codec with fully resolved parameters (sorted)."""
        body = ",".join(f"{k}={resolved[k]}" for k in sorted(resolved))
        return f"{self.name}:{body}" if body else self.name

    def fingerprint(self, resolved: Mapping[str, Any]) -> int:
        return zlib.crc32(self.canonical(resolved).encode()) & 0xFFFFFFFF


#: What every ``compression=`` argument takes (push_pull, the optimizers, the DDP hook and the
#: integrations), read by :func:`parse_spec`: a spec string, a BytePS-style dict or a CodecSpec.
Compression = str | Mapping[str, Any] | CodecSpec


def parse_bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1|0|true|false), got {v!r}")


def parse_k(v: Any) -> float:
    """``k`` below 1 is a fraction of the chunk, otherwise a whole count of elements."""
    try:
        k = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number (fraction < 1 or count >= 1), got {v!r}") from None
    if not k > 0 or k != k or k == float("inf"):
        raise ValueError(f"expected k > 0 (fraction < 1 or count >= 1), got {v!r}")
    if k >= 1 and k != int(k):
        raise ValueError(f"k >= 1 is a count and must be a whole number, got {v!r}")
    return k


def parse_int(lo: int | None = None, hi: int | None = None) -> Callable[[Any], int]:
    def _p(v: Any) -> int:
        try:
            f = float(v)
            i = int(f)
        except (TypeError, ValueError):
            raise ValueError(f"expected an integer, got {v!r}") from None
        if i != f:
            raise ValueError(f"expected an integer, got {v!r}")
        if (lo is not None and i < lo) or (hi is not None and i > hi):
            raise ValueError(f"expected an integer in [{lo}, {hi}], got {v!r}")
        return i

    return _p


def choice(*options: str) -> Callable[[Any], str]:
    def _p(v: Any) -> str:
        s = str(v).strip().lower()
        if s not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {v!r}")
        return s

    return _p


def _scalar(text: str) -> Any:
    return text.strip()


def parse_spec(spec: str | Mapping[str, Any] | CodecSpec | None) -> CodecSpec:
    """Parse a spec string or BytePS-style dict into a :class:`CodecSpec` (names unchecked)."""
    if spec is None:
        return CodecSpec("none")
    if isinstance(spec, CodecSpec):
        return spec
    if isinstance(spec, Mapping):
        return _parse_dict(spec)
    if not isinstance(spec, str):
        raise TypeError("compression spec must be a str like 'topk:k=0.001' or a dict, "
                        f"got {type(spec).__name__}")
    text = spec.strip()
    if not text:
        raise ValueError("compression spec is empty; expected e.g. 'onebit' or 'topk:k=0.001'")
    name, _, rest = text.partition(":")
    params: dict[str, Any] = {}
    wrappers: dict[str, Any] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"compression spec {spec!r}: item {item!r} is not of the form "
                             "key=value")
        key = key.strip().lower()
        target = wrappers if key in WRAPPER_KEYS else params
        if key in target:
            raise ValueError(f"compression spec {spec!r}: {key!r} given twice")
        target[key] = _scalar(value)
    return CodecSpec(name.strip().lower(), params, wrappers)


def _parse_dict(d: Mapping[str, Any]) -> CodecSpec:
    name = d.get("compressor", d.get("name"))
    if name is None:
        raise ValueError(f"compression dict {dict(d)!r} has no 'compressor' key (e.g. 'topk')")
    params: dict[str, Any] = {}
    wrappers: dict[str, Any] = {}
    for key, value in d.items():
        key = str(key).lower()
        if key in ("compressor", "name"):
            continue
        (wrappers if key in WRAPPER_KEYS else params)[key] = value
    return CodecSpec(str(name).strip().lower(), params, wrappers)


#: The error-feedback kinds (besides ``"none"``); see :class:`EFSpec`.
EF_KINDS = ("vanilla", "corrected", "sparse")
_NO_EF = ("none", "")
_EF_HELP = ("valid: vanilla, corrected, sparse, 'vanilla:decay=B' with B in [0, 1] (optionally "
            "',server_decay=S', S in [0, 1], and ',anneal=1'), or None")


@dataclass(frozen=True, kw_only=True)
class EFSpec:
    """Error feedback as a value: what a codec's residual does (see :mod:`gradpress.compress.ef`
    and docs/guide.md). ``str(spec)`` is its canonical text, which :func:`parse_ef` reads back.

    Build one with :func:`parse_ef` (``parse_ef("vanilla:decay=0.9")``) or directly
    (``EFSpec(kind="vanilla", decay=0.9)``); every ``ef=`` argument takes either.
    """

    #: ``"vanilla"`` (the residual is added to the next input), ``"corrected"`` (the residual
    #: is rescaled by ``lr_prev / lr``; pushes carry the lr), ``"sparse"`` (randomk only: the
    #: residual is read and cleared at the sent indices only) or ``"none"``.
    kind: str = "vanilla"
    #: vanilla only: the residual is multiplied by ``decay`` in [0, 1] before it is added.
    #: None (default) keeps it whole and writes the plain kind; 1.0 acts the same but is
    #: written ``vanilla:decay=1.0``.
    decay: float | None = None
    #: vanilla only: the servers' decay instead of ``decay`` (None: the same as the workers').
    server_decay: float | None = None
    #: vanilla with ``decay`` < 1 only: the workers' decay rises from ``decay`` towards 1 as
    #: the lr falls below its highest value (pushes carry the lr).
    anneal: bool = False

    def __post_init__(self) -> None:
        if self.kind not in EF_KINDS + ("none",):
            raise ValueError(f"unknown ef {self.kind!r}; {_EF_HELP}")
        opts = {"decay": self.decay, "server_decay": self.server_decay}
        given = {k: v for k, v in opts.items() if v is not None}
        if (given or self.anneal) and self.kind != "vanilla":
            raise ValueError(f"ef kind {self.kind!r} takes no options, got "
                             f"{dict(given, anneal=self.anneal)}; {_EF_HELP}")
        for name, v in given.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"EFSpec.{name} must be a number in [0, 1] or None, got {v!r}")
            object.__setattr__(self, name, float(v))
        if not isinstance(self.anneal, bool):
            raise TypeError(f"EFSpec.anneal must be a bool, got {self.anneal!r}")
        if (self.server_decay is not None or self.anneal) and self.decay is None:
            object.__setattr__(self, "decay", 1.0)
        if self.anneal and self.decay == 1.0:
            raise ValueError(f"ef {str(self)!r}: anneal=1 moves a decay B < 1 towards 1 as the "
                             f"lr falls; give 'decay=B' with B < 1 (B = 1 has nothing to anneal)")

    def __str__(self) -> str:
        if self.decay is None:
            return self.kind
        text = f"vanilla:decay={self.decay!r}"
        if self.server_decay is not None:
            text += f",server_decay={self.server_decay!r}"
        return text + (",anneal=1" if self.anneal else "")

    @property
    def enabled(self) -> bool:
        """Whether there is error feedback at all (kind is not ``"none"``)."""
        return self.kind != "none"

    @property
    def needs_lr(self) -> bool:
        """Whether pushes must carry the step's learning rate: ``corrected`` (residuals
        rescaled by its change) and ``anneal`` (the decay follows it)."""
        return self.kind == "corrected" or self.anneal

    @property
    def factor(self) -> float:
        """The residual's fixed decay per step (1.0 unless ``decay`` is given)."""
        return 1.0 if self.decay is None else self.decay

    def for_server(self) -> EFSpec:
        """What a server's codec uses: ``server_decay`` as its decay when given, and no
        ``anneal`` (a server's replies carry no lr, so it keeps its decay fixed)."""
        if self.server_decay is not None:
            return EFSpec(kind=self.kind, decay=self.server_decay)
        return EFSpec(kind=self.kind, decay=self.decay)


def parse_ef(value: str | EFSpec | None) -> EFSpec:
    """The :class:`EFSpec` of ``value``: an EFSpec, None or ``"none"`` (no error feedback), or
    a text ``kind[:option=value,...]`` (case and spaces ignored), e.g. ``"vanilla"``,
    ``"vanilla:decay=0.9"``, ``"vanilla:decay=0.8,server_decay=1,anneal=1"``; ValueError naming
    the value otherwise."""
    if isinstance(value, EFSpec):
        return value
    if value is None:
        return EFSpec(kind="none")
    if not isinstance(value, str):
        raise TypeError(f"ef must be a str like 'vanilla', an EFSpec or None, "
                        f"got {type(value).__name__}")
    text = value.strip().lower().replace(" ", "")
    kind, sep, rest = text.partition(":")
    if not sep:
        if kind in _NO_EF:
            return EFSpec(kind="none")
        if kind not in EF_KINDS:
            raise ValueError(f"unknown ef {value!r}; valid: {', '.join(EF_KINDS)}, or None")
        return EFSpec(kind=kind)
    opts: dict[str, float] = {}
    for item in rest.split(","):
        key, eq, num = item.partition("=")
        try:
            b = float(num) if kind == "vanilla" and eq and key not in opts else math.nan
        except ValueError:
            b = math.nan
        ok = b in (0.0, 1.0) if key == "anneal" else 0.0 <= b <= 1.0
        if key not in ("decay", "server_decay", "anneal") or not ok:
            raise ValueError(f"unknown ef {value!r}; {_EF_HELP}")
        opts[key] = b
    return EFSpec(kind="vanilla", decay=opts.get("decay", 1.0),
                  server_decay=opts.get("server_decay"), anneal=bool(opts.get("anneal")))

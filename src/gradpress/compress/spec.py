"""Compression spec strings and BytePS-style dicts.

A spec names a codec and its parameters: ``name[:key=value,...]``, e.g. ``onebit``,
``topk:k=0.001,values=fp16``, ``randomk:k=0.01,seed=7``, ``dithering:s=7,partition=natural``.
BytePS-style dicts are accepted too: ``{"compressor": "topk", "k": 0.001, "ef": "vanilla",
"momentum": "nesterov", "scaling": True, "seed": 7}``; the keys ``ef``, ``momentum`` and ``mu``
describe the stateful wrappers and are returned apart from the codec parameters.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Param", "CodecSpec", "parse_spec", "parse_bool", "parse_k", "choice"]

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

"""Codec CPU throughput for the simulator: a documented default table, or measured here.

Rates are per CPU thread, in GB/s of float32 data (4 bytes per element, whatever the payload
size), for the three operations the two-way pipeline runs:

* ``compress``: encode a chunk, including the error-feedback pass when the spec asks for one
  (workers compress their gradient, servers recompress the average);
* ``decompress``: decode a payload into a dense chunk (workers, after the pull);
* ``decompress_add``: decode-accumulate a push into the server's sum (once per worker per key).

The dense (uncompressed) path uses the ``decompress_add`` rate of ``none`` for the server's sum
and costs nothing on the worker (the gradient is already in its wire dtype).

:data:`DEFAULT_RATES` was measured with :func:`measure_rates` on the 2-core development machine
(one thread, torch intra-op threads 1, best of 10, 1,048,576-element chunks = the default 4 MB
partition) and rounded down; the machine was shared, so these are approximate. The tuple key
``(codec name, with error feedback)`` distinguishes the fused EF pass, which costs more than the
plain encode.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compress import build, parse_spec

__all__ = ["CodecRates", "DEFAULT_RATES", "best_time", "default_rates", "measure_rates",
           "parse_rates"]


@dataclass(frozen=True)
class CodecRates:
    """Per-thread GB/s (float32 bytes) of compress, decompress and decompress-accumulate."""

    compress: float
    decompress: float
    decompress_add: float

    def __post_init__(self) -> None:
        for f in ("compress", "decompress", "decompress_add"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v <= 0:
                raise ValueError(f"CodecRates.{f} must be a finite rate in GB/s above 0, got {v!r}")

    def seconds(self, op: str, numel: int) -> float:
        """Seconds one thread needs for ``op`` on ``numel`` float32 elements."""
        return 4.0 * numel / (getattr(self, op) * 1e9)


#: (codec name, error feedback?) -> per-thread rates; see the module docstring.
DEFAULT_RATES: dict[tuple[str, bool], CodecRates] = {
    ("none", False): CodecRates(20.0, 30.0, 30.0),
    ("fp16", False): CodecRates(40.0, 50.0, 50.0),
    ("bf16", False): CodecRates(30.0, 45.0, 45.0),
    ("onebit", False): CodecRates(25.0, 30.0, 17.0),
    ("onebit", True): CodecRates(6.0, 30.0, 17.0),
    ("topk", False): CodecRates(7.5, 55.0, 200.0),
    ("topk", True): CodecRates(5.0, 55.0, 200.0),
    ("randomk", False): CodecRates(25.0, 35.0, 50.0),
    ("randomk", True): CodecRates(12.0, 35.0, 50.0),
    ("dithering", False): CodecRates(8.5, 8.5, 8.5),
    ("dithering", True): CodecRates(3.0, 8.5, 8.5),
}


def _has_ef(spec: str) -> bool:
    ef = parse_spec(spec).wrappers.get("ef")
    return ef is not None and str(ef).strip().lower() not in ("", "none")


def default_rates(spec: str) -> CodecRates:
    """Default rates of ``spec`` (codec name and whether it carries error feedback)."""
    cs = parse_spec(spec)
    key = (cs.name, _has_ef(spec))
    if key not in DEFAULT_RATES:
        key = (cs.name, not key[1])
    if key not in DEFAULT_RATES:
        names = sorted({n for n, _ in DEFAULT_RATES})
        raise ValueError(f"no default codec rates for {cs.name!r} (known: {', '.join(names)}); "
                         f"pass --codec-gbps measure or numbers")
    return DEFAULT_RATES[key]


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Best wall time of ``reps`` calls after one warm-up call (compilation, page faults)."""
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_rates(spec: str, numel: int = 1 << 20, reps: int = 5) -> CodecRates:
    """Run the real codec of ``spec`` on a random chunk of ``numel`` and return its rates.

    One thread (torch intra-op threads set to 1 for the measurement), best of ``reps`` after a
    warm-up call; takes well under a second for the built-in codecs.
    """
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"measure_rates: numel must be an int >= 1, got {numel!r}")
    codec = build(spec, numel)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    payload = torch.empty(codec.payload_bytes, dtype=torch.uint8)
    dense, acc = torch.empty(numel), torch.zeros(numel)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tc = best_time(lambda: codec.compress(x, out=payload, lr=0.1), reps)
        td = best_time(lambda: codec.decompress(payload, out=dense), reps)
        ta = best_time(lambda: codec.decompress_add(payload, acc), reps)
    finally:
        torch.set_num_threads(threads)
    gb = 4.0 * numel / 1e9
    return CodecRates(gb / tc, gb / td, gb / ta)


_FORMS = "'measure', 'X' (GB/s for all three), 'C,D' or 'C,D,A' (compress, decompress, " \
         "decompress-accumulate GB/s per thread)"


def parse_rates(text: str | None, spec: str) -> CodecRates:
    """``--codec-gbps``: None (defaults), ``measure``, ``X``, ``C,D`` or ``C,D,A``."""
    if text is None or str(text).strip().lower() in ("", "default"):
        return default_rates(spec)
    s = str(text).strip().lower()
    if s == "measure":
        return measure_rates(spec)
    parts = [p.strip() for p in s.split(",")]
    try:
        vals = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"--codec-gbps {text!r}: expected {_FORMS}") from None
    if len(vals) not in (1, 2, 3):
        raise ValueError(f"--codec-gbps {text!r}: expected {_FORMS}")
    c, d, a = (vals * 3)[:3] if len(vals) == 1 else (vals[0], vals[1], vals[-1])
    try:
        return CodecRates(c, d, a)
    except ValueError as e:
        raise ValueError(f"--codec-gbps {text!r}: {e}; expected {_FORMS}") from None

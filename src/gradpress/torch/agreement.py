"""Which tensors travel exact, decided from the gradients of the dense phase.

A tensor whose gradient is mostly noise that differs from worker to worker (on a transformer,
typically a learned position embedding) loses its small common part when each worker
compresses it: exact averaging lets the noise cancel, a one-bit code with error feedback does
not. The dense phase measures this on the real gradients, the same way on every worker:

1. For each tensor, each worker adds up ``r_t = ||avg||^2 / ||g_r||^2``: the averaged
   gradient's squared norm (every worker has the average) over its own gradient's.
2. When the dense phase ends, one exact ``push_pull`` sums these over the workers; every
   worker receives the same bytes, so what follows is identical everywhere.
3. With ``r`` the mean over workers and steps and ``W`` workers, the agreement is
   ``a = (W r - 1) / (W - 1)``: the fraction of a worker's squared gradient norm that the
   workers have in common (1: every worker sends the same gradient; 0: independent noise,
   whose average has ``1/W`` of a worker's squared norm).
4. Tensors with ``a`` below :data:`AGREEMENT_THRESHOLD` travel exact; the others compressed.
   Except the tensors whose idle rows the optimizer holds (:class:`gradpress.optim.OneBitLANSCore`,
   an embedding's rows without gradient): their agreement is low because different workers
   touch different rows, which exact averaging cannot cancel either, so they are compressed.

The sums of step 1 stay where the gradients are (0-d device tensors): measuring adds no host
synchronisation to a step; :meth:`AgreementMeter.decide` reads them once, in step 2.

With one worker nothing can be measured and every tensor is compressed as configured.
Measured on the bundled tasks in ``benchmarks/tensor_stats.py`` (``docs/guide.md``).

Tensors too small to compress (``min_compress_bytes="auto"``, :func:`auto_min_compress_bytes`)
are chosen from the sizes alone: the largest tensors that together hold
:data:`COMPRESSED_SHARE` of the model's bytes are compressed, the rest (biases, norms) travel
exact, and no tensor of 1 MiB or more is left out, in a small model or a large one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["AGREEMENT_THRESHOLD", "COMPRESSED_SHARE", "Agreement", "AgreementMeter",
           "auto_min_compress_bytes"]

#: Tensors whose gradients agree less than this across workers travel exact. A learned
#: position embedding measured about 0.1, every other tensor of the bundled tasks 0.3 or more.
AGREEMENT_THRESHOLD = 0.2


#: ``min_compress_bytes="auto"`` compresses the largest tensors holding this share of the bytes.
COMPRESSED_SHARE = 0.95
#: ... and every tensor of this size or more, whatever the share.
MAX_MIN_COMPRESS_BYTES = 1 << 20


def auto_min_compress_bytes(sizes: Iterable[int]) -> int:
    """``min_compress_bytes="auto"``: the fp32 bytes of the smallest tensor among the largest
    ones that together hold :data:`COMPRESSED_SHARE` of ``sizes`` (fp32 bytes per tensor),
    at most :data:`MAX_MIN_COMPRESS_BYTES`; tensors below it travel exact. The same on every
    worker (a pure function of the model's shapes)."""
    ordered = sorted((int(n) for n in sizes), reverse=True)
    total, acc = sum(ordered), 0
    for n in ordered:
        acc += n
        if acc >= COMPRESSED_SHARE * total:
            return min(n, MAX_MIN_COMPRESS_BYTES)
    return MAX_MIN_COMPRESS_BYTES  # no tensors


@dataclass(frozen=True, kw_only=True)
class Agreement:
    """The measured agreement of each tensor's gradients across workers.

    Attributes:
        values: tensor name -> agreement in (-inf, 1]; 1 means identical gradients.
        steps: dense steps measured.
        workers: number of workers that measured.
        threshold: tensors below it travel exact.
        held: tensors whose idle rows the optimizer holds: compressed whatever their agreement.
    """

    values: Mapping[str, float]
    steps: int
    workers: int
    threshold: float = AGREEMENT_THRESHOLD
    held: frozenset[str] = frozenset()

    @property
    def exact(self) -> frozenset[str]:
        """Names of the tensors that travel exact."""
        return frozenset(n for n, a in self.values.items()
                         if a < self.threshold and n not in self.held)

    def reason(self, name: str) -> str:
        """One line: the measured agreement of ``name`` and what it decided."""
        a = self.values.get(name)
        if a is None:
            return "not measured"
        verdict = "exact: mostly noise, averaged exactly" if a < self.threshold \
            else "compressed"
        if name in self.held:
            verdict = "compressed: rows without gradient held, the workers touch different rows"
        return f"gradients agree {a:.2f} across workers ({verdict}; threshold {self.threshold})"


class AgreementMeter:
    """Accumulates step 1 during the dense phase; :meth:`decide` does steps 2-4.

    Args:
        names: the tensors measured, in an order identical on every worker.
        threshold: see :data:`AGREEMENT_THRESHOLD`.
    """

    def __init__(self, names: Iterable[str], threshold: float = AGREEMENT_THRESHOLD) -> None:
        if not isinstance(threshold, int | float) or not math.isfinite(threshold):
            raise ValueError(f"agreement threshold must be a finite number, got {threshold!r}")
        self.names = list(names)
        self.threshold = float(threshold)
        # float, or a 0-d float64 tensor on the gradients' device while measuring
        self._sums: dict[str, float | torch.Tensor] = dict.fromkeys(self.names, 0.0)
        self._local: dict[str, torch.Tensor] = {}
        self._seen = False
        self.steps = 0
        self.result: Agreement | None = None
        #: Set by an optimizer that holds idle rows (``gp.OneBitLANS``): called once at
        #: :meth:`decide`, the names of the tensors whose idle rows it holds (step 4).
        self.held: Callable[[], Iterable[str]] | None = None

    def add_local(self, name: str, grad: torch.Tensor) -> None:
        """This worker's gradient of ``name``, before it is averaged (step 1)."""
        if self.result is None and name in self._sums:
            self._local[name] = _square_norm(grad)

    def add_average(self, name: str, avg: torch.Tensor) -> None:
        """The averaged gradient of ``name`` (step 1)."""
        local = self._local.pop(name, None)
        if local is None:
            return
        a2 = _square_norm(avg).to(local.device)
        ratio = torch.where(local > 0, a2 / local, 1.0)  # no own gradient: no evidence
        self._sums[name] = ratio + self._sums[name]
        self._seen = True

    def _host_sums(self) -> dict[str, float]:
        """The sums of step 1 as floats: one read per device."""
        out = {n: v for n, v in self._sums.items() if not isinstance(v, torch.Tensor)}
        by_device: dict[torch.device, dict[str, torch.Tensor]] = {}
        for n, v in self._sums.items():
            if isinstance(v, torch.Tensor):
                by_device.setdefault(v.device, {})[n] = v
        for sums in by_device.values():
            values = torch.stack(list(sums.values())).tolist()
            out.update(zip(sums, (float(v) for v in values), strict=True))
        return out

    def end_step(self) -> None:
        """Count the step, if it measured anything."""
        if self.result is None and self._seen:
            self.steps += 1
        self._seen = False
        self._local.clear()

    def decide(self, sum_over_workers: Callable[[torch.Tensor], torch.Tensor],
               workers: int) -> Agreement:
        """Steps 2-4, once: ``sum_over_workers`` is an exact push_pull summing a float64
        vector over the workers (the same on every worker)."""
        if self.result is not None:
            return self.result
        if workers < 2 or self.steps < 1:
            values = dict.fromkeys(self.names, 1.0)
        else:
            sums = self._host_sums()
            local = torch.tensor([sums[n] for n in self.names], dtype=torch.float64,
                                 device="cpu")
            total = sum_over_workers(local)
            r = [float(t) / (workers * self.steps) for t in total]
            values = {n: (workers * ri - 1) / (workers - 1)
                      for n, ri in zip(self.names, r, strict=True)}
        held = frozenset(self.held()) if self.held is not None else frozenset()
        self.result = Agreement(values=values, steps=self.steps, workers=workers,
                                threshold=self.threshold, held=held)
        return self.result

    def state_dict(self) -> dict[str, Any]:
        """The sums so far and, once decided, the decision."""
        r = self.result
        return {"sums": self._host_sums(), "steps": self.steps,
                "result": None if r is None else {"values": dict(r.values), "steps": r.steps,
                                                  "workers": r.workers,
                                                  "held": sorted(r.held)}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same tensors, in any order)."""
        if set(state["sums"]) != set(self._sums):
            raise ValueError(f"agreement state is for tensors {sorted(state['sums'])}, this "
                             f"optimizer has {sorted(self._sums)}")
        self._sums = {n: float(state["sums"][n]) for n in self.names}
        self.steps = int(state["steps"])
        r = state.get("result")
        self.result = None if r is None else Agreement(
            values=dict(r["values"]), steps=int(r["steps"]), workers=int(r["workers"]),
            threshold=self.threshold, held=frozenset(r.get("held", ())))


def _square_norm(t: torch.Tensor) -> torch.Tensor:
    """``||t||^2`` as a 0-d float64 tensor on ``t``'s device, with no host read and no float64
    copy of ``t`` (a float32 dot product; ample for a ratio compared with 0.2)."""
    flat = t.detach().reshape(-1)
    flat = flat if flat.dtype == torch.float32 else flat.float()
    return torch.dot(flat, flat).double()

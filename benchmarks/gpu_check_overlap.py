"""Section ``overlap`` of ``gpu_check.py``: communication hidden behind a backward-like loop.

Worker side (``gpu_check.py`` starts it under ``gradpress launch`` with 2 workers, 1 server,
``GRADPRESS_COMPRESS_ON=host`` and ``GRADPRESS_COMPRESS_THREADS=2``)::

    python benchmarks/gpu_check_overlap.py --worker cfg.json

A "backward" is ``layers`` steps, each a chain of matmuls (about ``layer_ms`` on the device,
calibrated on the worker) followed by that layer's gradient (``numel`` float32 elements, written
after the matmuls). Three timings per step, each the median of ``steps`` steps after a warm-up,
barrier to done with the device synchronised:

1. ``compute``: the backward alone;
2. ``comm``: ``push_pull_async`` of the gradients (onebit, vanilla error feedback), made
   beforehand, then waiting for all;
3. ``both``: the backward with each gradient pushed as soon as its kernels are queued, then
   waiting for all.

The overlap ratio ``(compute + comm - both) / min(compute, comm)`` is the share of the shorter
of the two that the pipeline hid: 1 fully, 0 not at all (serial), negative slower than serial.
The driver reports the slower worker's timings and ratio; the check fails only when a run
fails or a result is not finite (the ratio is measured, not gated).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

SPEC, EF = "onebit", "vanilla"


def calibrate(a: torch.Tensor, b: torch.Tensor, layer_ms: float) -> int:
    """Matmuls per layer for about ``layer_ms`` milliseconds on ``a``'s device."""
    torch.mm(a, a, out=b)
    sync(a.device)
    t0 = time.perf_counter()
    for _ in range(5):
        torch.mm(a, a, out=b)
    sync(a.device)
    return max(1, round(layer_ms / (1e3 * (time.perf_counter() - t0) / 5)))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def backward(a: torch.Tensor, b: torch.Tensor, reps: int, srcs: list[torch.Tensor],
             grads: list[torch.Tensor], push: Callable[[int], Any] | None) -> list[Any]:
    """The backward-like loop: per layer, ``reps`` matmuls, then its gradient (pushed at once
    when ``push``); returns the handles."""
    handles = []
    for i, (src, g) in enumerate(zip(srcs, grads)):
        for _ in range(reps):
            torch.mm(a, a, out=b)
        torch.mul(src, 1.0, out=g)  # the gradient: after this layer's matmuls
        if push is not None:
            handles.append(push(i))
    return handles


def timed(gp: Any, dev: torch.device, fn: Callable[[], list[Any]]) -> float:
    """Seconds of one barrier-to-done run of ``fn`` (its handles waited for)."""
    sync(dev)
    gp.barrier()
    t0 = time.perf_counter()
    for h in fn():
        h.wait()
    sync(dev)
    return time.perf_counter() - t0


def worker(cfg_path: str) -> None:
    import gradpress as gp

    cfg = json.loads(Path(cfg_path).read_text())
    dev = torch.device(cfg["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    gp.init()
    n, layers = cfg["matmul_n"], cfg["layers"]
    a, b = torch.randn(n, n, device=dev) / n ** 0.5, torch.empty(n, n, device=dev)
    reps = calibrate(a, b, cfg["layer_ms"])
    gen = torch.Generator().manual_seed(gp.rank())
    srcs = [torch.randn(cfg["numel"], generator=gen).to(dev) for _ in range(layers)]
    grads = [torch.empty_like(s) for s in srcs]

    def push(i: int) -> Any:
        return gp.push_pull_async(grads[i], f"overlap/{i}", compression=SPEC, ef=EF,
                                  min_compress_bytes=0)

    runs: dict[str, Callable[[], list[Any]]] = {
        "compute": lambda: backward(a, b, reps, srcs, grads, None),
        "comm": lambda: [push(i) for i in range(layers)],
        "both": lambda: backward(a, b, reps, srcs, grads, push)}
    seconds: dict[str, list[float]] = {k: [] for k in runs}
    for step in range(cfg["steps"] + 1):  # step 0: warm-up (plans, kernels, buffers)
        for k, fn in runs.items():
            dt = timed(gp, dev, fn)
            if step:
                seconds[k].append(dt)
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    res = {"rank": gp.rank(), "reps": reps, "finite": finite,
           "median_s": {k: statistics.median(v) for k, v in seconds.items()}}
    Path(cfg["out_dir"], f"rank{gp.rank()}.json").write_text(json.dumps(res))
    gp.shutdown()


# == driver side ===============================================================================
def ratio(t: dict[str, float]) -> float:
    """The share of the shorter of compute and comm hidden in ``both``."""
    return (t["compute"] + t["comm"] - t["both"]) / min(t["compute"], t["comm"])


COLUMNS = ["rank", "matmuls/layer", "compute s", "comm s", "both s", "serial s",
           "overlap ratio", "finite"]


def table(ranks: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], float, bool]:
    """(columns, a row per worker, the slower worker's ratio, every result finite)."""
    rows = []
    for r in ranks:
        t = r["median_s"]
        rows.append([str(r["rank"]), str(r["reps"]), f"{t['compute']:.4f}", f"{t['comm']:.4f}",
                     f"{t['both']:.4f}", f"{t['compute'] + t['comm']:.4f}",
                     f"{ratio(t):.2f}", str(r["finite"])])
    slower = max(ranks, key=lambda r: r["median_s"]["both"])
    return COLUMNS, rows, ratio(slower["median_s"]), all(r["finite"] for r in ranks)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", required=True, help="the JSON configuration of this job")
    worker(ap.parse_args().worker)
    sys.exit(0)

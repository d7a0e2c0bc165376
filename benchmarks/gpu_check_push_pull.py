"""Section (c) of ``gpu_check.py``: push_pull with 2 workers on one device and 1 server.

Worker side (``gpu_check.py`` starts it under ``gradpress launch``, once per ``compress_on``)::

    GRADPRESS_COMPRESS_ON=device python -m gradpress.cli launch --workers 2 --servers 1 -- \\
        python benchmarks/gpu_check_push_pull.py --worker cfg.json

Every worker pushes ``tensors`` float32 tensors of ``numel`` elements plus one of ``odd_numel``
(a partial last chunk), all living on ``device``, for one untimed warm-up step and ``steps``
timed steps per codec. A step: barrier, ``push_pull_async`` of every tensor, wait for all (and
synchronize the device); its time is the slower worker's. Inputs are seeded per (rank, tensor)
and scaled by ``1 + step/8``, so each worker can compute every other worker's input.

Checks: the result lives on the input's device and is finite; ``none`` equals the float32
average of the inputs bit for bit (``sum(x_w) / W`` on the CPU, as the server computes it); every
codec gives both replicas identical bytes (compared by SHA-256 here, on the driver side). Results
of ``compress_on`` host and device are compared too, reported only (GPU kernels may round
differently; ``none`` is exact either way).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

NONE = "none"


def inputs(rank: int, sizes: list[int]) -> list[torch.Tensor]:
    """Worker ``rank``'s base tensors (CPU, float32), the same in every process."""
    return [torch.randn(n, generator=torch.Generator().manual_seed(1009 * rank + i))
            for i, n in enumerate(sizes)]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def one_step(gp: Any, codec: str, xs: list[torch.Tensor], dev: torch.device
             ) -> tuple[float, list[torch.Tensor]]:
    """Seconds of one barrier-to-done step, and the results (on ``dev``)."""
    ef = "none" if codec == NONE else "vanilla"
    _sync(dev)
    gp.barrier()
    t0 = time.perf_counter()
    hs = [gp.push_pull_async(x, f"{codec}/{i}", compression=codec, ef=ef, min_compress_bytes=0)
          for i, x in enumerate(xs)]
    ys = [h.wait() for h in hs]
    _sync(dev)
    return time.perf_counter() - t0, ys


def check_results(codec: str, ys: list[torch.Tensor], base: dict[int, list[torch.Tensor]],
                  scale: float, dev: torch.device) -> list[str]:
    """Problems with one step's results (empty when all is well)."""
    bad = []
    world = len(base)
    for i, y in enumerate(ys):
        if y.device != dev:
            bad.append(f"tensor {i}: result on {y.device}, expected {dev}")
        yc = y.cpu()
        if not bool(torch.isfinite(yc).all()):
            bad.append(f"tensor {i}: non-finite values in the result")
        if codec == NONE:
            ref = sum(base[w][i] * scale for w in range(world)) / world
            if not torch.equal(yc.view(torch.int32), ref.view(torch.int32)):
                diff = float((yc - ref).abs().max())
                bad.append(f"tensor {i}: differs from the float32 average (max |diff| {diff:g})")
    return bad


def digest(ys: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for y in ys:
        h.update(y.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_codec(gp: Any, codec: str, cfg: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    """All steps of one codec on this worker: seconds, digests and problems per step."""
    rank, world = gp.rank(), gp.size()
    sizes = [cfg["numel"]] * cfg["tensors"] + [cfg["odd_numel"]]
    base = {w: inputs(w, sizes) for w in range(world)}
    out: dict[str, Any] = {"seconds": [], "digests": [], "problems": []}
    for step in range(cfg["steps"] + 1):  # step 0: warm-up (plans, kernels, buffers)
        scale = 1.0 + step / 8
        xs = [(b * scale).to(dev) for b in base[rank]]
        dt, ys = one_step(gp, codec, xs, dev)
        if step:
            out["seconds"].append(dt)
        out["digests"].append(digest(ys))
        out["problems"] += [f"step {step}: {p}" for p in check_results(codec, ys, base, scale,
                                                                        dev)]
    return out


def worker(cfg_path: str) -> None:
    import gradpress as gp

    cfg = json.loads(Path(cfg_path).read_text())
    dev = torch.device(cfg["device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    gp.init()
    res = {"rank": gp.rank(), "mode": os.environ.get("GRADPRESS_COMPRESS_ON", "host"),
           "codecs": {c: run_codec(gp, c, cfg, dev) for c in cfg["codecs"]}}
    Path(cfg["out_dir"], f"rank{gp.rank()}.json").write_text(json.dumps(res))
    gp.shutdown()


# == driver side: turn the workers' JSON files into rows =======================================
def codec_row(mode: str, codec: str, ranks: list[dict[str, Any]], grad_bytes: int
              ) -> tuple[list[str], bool]:
    """One (mode, codec) row and whether its checks passed."""
    per = [r["codecs"][codec] for r in ranks]
    steps = [max(s) for s in zip(*(p["seconds"] for p in per))]  # the slower worker
    med = statistics.median(steps)
    problems = [f"rank {r['rank']} {p}" for r, c in zip(ranks, per) for p in c["problems"]]
    split = [i for i, d in enumerate(zip(*(c["digests"] for c in per))) if len(set(d)) > 1]
    if split:
        problems.append(f"replicas differ at steps {split}")
    what = "= float32 average, bit for bit; replicas identical" if codec == NONE \
        else "replicas identical"
    ok = not problems
    check = what if ok else "; ".join(problems)[:300]
    return [mode, codec, f"{med:.4f}", f"{min(steps):.4f}", f"{grad_bytes / med / 1e9:.2f}",
            check, "PASS" if ok else "FAIL"], ok


def cross_mode_rows(by_mode: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    """Host against device results of each codec (rank 0), reported only."""
    if set(by_mode) != {"host", "device"}:
        return []
    rows = []
    for codec in by_mode["host"][0]["codecs"]:
        a = by_mode["host"][0]["codecs"][codec]["digests"]
        b = by_mode["device"][0]["codecs"].get(codec, {}).get("digests")
        same = "identical" if a == b else "differ"
        rows.append(["host vs device", codec, "", "", "", f"results {same} at every step",
                     "(reported)"])
    return rows


COLUMNS = ["compress_on", "codec", "s/step (median)", "s/step (best)", "GB/s (median)",
           "checks", "verdict"]


def table(by_mode: dict[str, list[dict[str, Any]]], grad_bytes: int
          ) -> tuple[list[str], list[list[str]], int]:
    """(columns, rows, number of failures) for the report."""
    rows, fails = [], 0
    for mode, ranks in by_mode.items():
        for codec in ranks[0]["codecs"]:
            row, ok = codec_row(mode, codec, ranks, grad_bytes)
            rows.append(row)
            fails += not ok
    return COLUMNS, rows + cross_mode_rows(by_mode), fails


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", required=True, help="the JSON configuration of this job")
    worker(ap.parse_args().worker)
    sys.exit(0)

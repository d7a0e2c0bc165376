"""Codec throughput on one CPU thread, as ratios measured in the same run.

Usage::

    python benchmarks/codecs.py [--mb 64] [--only NAMES] [--reps 5] [--scaling SPEC]

For each codec spec: compress and decompress GB/s (input float32 bytes / best time) on one
``--mb`` MB float32 buffer with ``out=`` buffers (the codec allocates nothing); the ratio to a
numpy copy (``np.copyto`` into a preallocated array, measured right before each row); the
speed-up over a straightforward torch-ops implementation of the same codec (written below);
top-k recall against the exact top-k; and PASS/FAIL against the targets (compress and decompress
must each reach the target fraction of the copy). A last line measures two-thread scaling: two
threads compressing disjoint halves vs one thread compressing both halves in turn (target 1.6x),
with a compute-bound control that marks the verdict inconclusive when no second core is free.
Codecs not registered yet, or with parameters not known yet, are skipped with a note.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch

from gradpress.compress import build, codec_names

SPECS = ("none", "fp16", "bf16", "onebit", "topk:k=0.001", "topk:k=0.001,values=fp16",
         "randomk:k=0.01", "dithering:s=7", "dithering:s=7,partition=natural")
#: fraction of the copy speed each family must reach (compress and decompress)
TARGETS = {"fp16": 0.5, "bf16": 0.5, "onebit": 0.5, "randomk": 0.5, "dithering": 0.25,
           "topk": 0.25}
RECALL_TARGET = 0.95
SCALING_TARGET = 1.6


def best_time(fn: Callable[[], object], reps: int) -> float:
    """Best wall time of ``reps`` calls after one warm-up call (compilation, page faults)."""
    fn()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# -- naive torch-ops references: (compress, decompress) closures over the input -----------------
def _naive_onebit(x: torch.Tensor):
    w = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)
    pad = (-x.numel()) % 8

    def comp():
        scale = x.abs().mean()
        bits = torch.nn.functional.pad((x >= 0).to(torch.uint8), (0, pad)).view(-1, 8)
        return (bits * w).sum(1, dtype=torch.uint8), scale

    def decomp(c):
        packed, scale = c
        bits = (packed.unsqueeze(1) >> torch.arange(7, -1, -1, dtype=torch.uint8)) & 1
        return (bits.reshape(-1)[:x.numel()].to(torch.float32) * 2 - 1) * scale

    return comp, decomp


def _naive_topk(x: torch.Tensor, k: float, fp16: bool):
    kk = max(1, round(k * x.numel()))

    def comp():
        idx = torch.topk(x.abs(), kk, sorted=False).indices
        v = x[idx]
        return idx.to(torch.int32), v.half() if fp16 else v

    def decomp(c):
        out = torch.zeros_like(x)
        out[c[0].long()] = c[1].float()
        return out

    return comp, decomp


def _naive_randomk(x: torch.Tensor, k: float):
    kk = max(1, round(k * x.numel()))

    def comp():
        g = torch.Generator().manual_seed(7)
        idx = torch.randperm(x.numel(), generator=g)[:kk]
        return x[idx], idx

    def decomp(c):
        out = torch.zeros_like(x)
        out[c[1]] = c[0]
        return out

    return comp, decomp


def _naive_dithering(x: torch.Tensor, s: int, natural: bool):
    def comp():
        norm = x.abs().max()
        r = x.abs() / norm
        if natural:  # stochastic rounding between neighbouring powers of two
            lo = torch.exp2(torch.floor(torch.log2(r.clamp_min(2.0 ** -(s - 1)))))
            up = (torch.rand_like(r) < (r - lo) / lo).to(torch.float32)
            level = (torch.log2(lo) + (s - 1) + up).clamp(0, s).to(torch.uint8)
        else:
            level = torch.floor(r * s + torch.rand_like(r)).to(torch.uint8)
        code = level | ((x < 0).to(torch.uint8) << 3)
        code = torch.nn.functional.pad(code, (0, x.numel() % 2)).view(-1, 2)
        return code[:, 0] | (code[:, 1] << 4), norm

    def decomp(c):
        packed, norm = c
        code = torch.stack([packed & 15, packed >> 4], 1).reshape(-1)[:x.numel()]
        level = (code & 7).to(torch.float32)
        mag = torch.exp2(level - (s - 1)) * (level > 0) if natural else level / s
        return torch.where(code >= 8, -mag, mag) * norm

    return comp, decomp


def naive_pair(spec: str, x: torch.Tensor):
    """The torch-ops reference (compress, decompress) for ``spec``, or None."""
    name, _, rest = spec.partition(":")
    p = dict(item.split("=") for item in rest.split(",") if item)
    if name == "none":
        return (lambda: x.clone()), (lambda c: c.clone())
    if name in ("fp16", "bf16"):
        dt = torch.float16 if name == "fp16" else torch.bfloat16
        return (lambda: x.to(dt)), (lambda c: c.to(torch.float32))
    if name == "onebit":
        return _naive_onebit(x)
    if name == "topk":
        return _naive_topk(x, float(p.get("k", 0.01)), p.get("values") == "fp16")
    if name == "randomk":
        return _naive_randomk(x, float(p.get("k", 0.01)))
    if name == "dithering":
        return _naive_dithering(x, int(p.get("s", 7)), p.get("partition") == "natural")
    return None


# -- measurements ---------------------------------------------------------------------------
def copy_gbps(x: torch.Tensor, dst: np.ndarray, reps: int) -> float:
    src = x.numpy()
    return x.numel() * 4 / best_time(lambda: np.copyto(dst, src), reps) / 1e9


def topk_recall(codec, payload: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> float:
    kk = getattr(codec, "kk", None) or max(1, round(codec.params["k"] * x.numel()))
    codec.decompress(payload, out=dense)
    got = torch.nonzero(dense).reshape(-1)
    exact = torch.topk(x.abs(), kk, sorted=False).indices
    return float(torch.isin(exact, got).sum()) / kk


def bench_spec(spec: str, x: torch.Tensor, dst: np.ndarray, reps: int) -> dict | str:
    """Measure one spec; returns a result row or a note why it was skipped."""
    name = spec.partition(":")[0]
    if name not in codec_names():
        return "not registered yet"
    try:
        codec = build(spec, x.numel())
    except ValueError as e:
        return f"cannot build: {e}"
    payload = torch.empty(codec.payload_bytes, dtype=torch.uint8)
    dense = torch.empty(x.numel(), dtype=torch.float32)
    nbytes = x.numel() * 4
    t_c = best_time(lambda: codec.compress(x, key=1, step=1, out=payload), reps)
    t_d = best_time(lambda: codec.decompress(payload, out=dense), reps)
    row = {"spec": spec, "comp": nbytes / t_c / 1e9, "decomp": nbytes / t_d / 1e9,
           "copy": copy_gbps(x, dst, reps), "bits": 8 * codec.payload_bytes / x.numel()}
    pair = naive_pair(spec, x)
    if pair is not None:
        comp, decomp = pair
        c = comp()
        row["naive_c"] = best_time(comp, max(2, reps // 2)) / t_c
        row["naive_d"] = best_time(lambda: decomp(c), max(2, reps // 2)) / t_d
    if name == "topk":
        row["recall"] = topk_recall(codec, payload, x, dense)
    return row


def verdict(row: dict) -> str:
    target = TARGETS.get(row["spec"].partition(":")[0])
    if target is None:
        return "-"
    ok = min(row["comp"], row["decomp"]) >= target * row["copy"]
    if "recall" in row:
        ok = ok and row["recall"] >= RECALL_TARGET
    return f"{'PASS' if ok else 'FAIL'} (>= {target}x)"


def two_thread_ratio(job: Callable[[int], object], reps: int) -> tuple[float, float, float]:
    """(one-thread time for jobs 0 and 1 in turn, two-thread time, ratio) of ``job``."""
    with ThreadPoolExecutor(2) as pool:
        t_one = best_time(lambda: (job(0), job(1)), reps)
        t_two = best_time(lambda: list(pool.map(job, (0, 1))), reps)
    return t_one, t_two, t_one / t_two


def scaling(spec: str, x: torch.Tensor, reps: int) -> str:
    """Two threads on disjoint halves vs one thread over both halves, same codec and data.

    A control (``np.sin`` on the same halves: compute-bound, releases the GIL) shows whether a
    second core was free; when even the control does not scale, the verdict is inconclusive.
    """
    half = x.numel() // 2
    parts = [x[:half], x[half:2 * half]]
    codecs = [build(spec, half) for _ in range(2)]
    outs = [torch.empty(c.payload_bytes, dtype=torch.uint8) for c in codecs]
    scratch = np.empty(2 * half, dtype=np.float32)

    def job(i: int) -> None:
        codecs[i].compress(parts[i], key=i, step=1, out=outs[i])

    def control(i: int) -> None:
        np.sin(parts[i].numpy(), out=scratch[i * half:(i + 1) * half])

    t_one, t_two, ratio = two_thread_ratio(job, reps)
    ctl = two_thread_ratio(control, reps)[2]
    ok = ratio >= SCALING_TARGET
    result = "PASS" if ok else ("FAIL" if ctl >= SCALING_TARGET else "INCONCLUSIVE")
    return (f"two-thread scaling ({spec}, 2 x {half * 4 / 2**20:.0f} MB): one thread "
            f"{2 * half * 4 / t_one / 1e9:.2f} GB/s, two threads {2 * half * 4 / t_two / 1e9:.2f}"
            f" GB/s, {ratio:.2f}x  {result} (>= {SCALING_TARGET}x; control np.sin {ctl:.2f}x"
            f"{'' if ctl >= SCALING_TARGET else ': no free second core'})")


def fmt(row: dict) -> str:
    def g(k: str, f: str) -> str:
        return format(row[k], f) if k in row else f"{'-':>8}"

    c_cp, d_cp = row["comp"] / row["copy"], row["decomp"] / row["copy"]
    return (f"{row['spec']:<33}{row['bits']:>7.3f}{row['comp']:>8.2f}{row['decomp']:>8.2f}"
            f"{row['copy']:>7.2f}{c_cp:>7.2f}{d_cp:>7.2f}"
            f"{g('naive_c', '>8.1f')}{g('naive_d', '>8.1f')}{g('recall', '>8.4f')}  {verdict(row)}")


HEAD = (f"{'spec':<33}{'bits/el':>7}{'comp':>8}{'decomp':>8}{'copy':>7}{'c/cp':>7}{'d/cp':>7}"
        f"{'c/naive':>8}{'d/naive':>8}{'recall':>8}  target")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=64.0, help="buffer size in MB (default 64)")
    ap.add_argument("--only", default="", help="comma-separated codec names or specs to run")
    ap.add_argument("--reps", type=int, default=5, help="repetitions, best one counts")
    ap.add_argument("--scaling", default="onebit",
                    help="spec for the two-thread line (falls back to the first registered)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    numba.set_num_threads(1)  # in case a kernel uses prange
    numel = int(args.mb * 2**20) // 4
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    dst = np.empty(numel, dtype=np.float32)
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    specs = [s for s in SPECS if not only or s in only or s.partition(":")[0] in only]
    specs += sorted(s for s in only if s not in specs and s.partition(":")[0] not in SPECS)
    print(f"codecs on {numel * 4 / 2**20:.0f} MB float32, 1 thread, best of {args.reps}; "
          f"GB/s = input fp32 bytes / time; c/naive = speed-up over torch ops\n{HEAD}")
    fails = 0
    for spec in specs:
        row = bench_spec(spec, x, dst, args.reps)
        if isinstance(row, str):
            print(f"{spec:<33}skipped: {row}")
            continue
        print(fmt(row), flush=True)
        fails += verdict(row).startswith("FAIL")
    registered = codec_names()
    scal = args.scaling if args.scaling.partition(":")[0] in registered else next(
        s for s in ("onebit", "fp16", "bf16", "randomk:k=0.01", "none")
         if s.partition(":")[0] in registered)
    line = scaling(scal, x, max(args.reps, 5))
    print(line)
    return 1 if fails or "FAIL" in line else 0


if __name__ == "__main__":
    raise SystemExit(main())

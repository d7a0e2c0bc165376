"""Codec throughput on one CPU thread, as ratios measured in the same run.

Usage::

    python benchmarks/codecs.py [--mb 64] [--only NAMES] [--reps 5] [--scaling SPEC]
                                [--ef-mb 4,64] [--server-chunks 16]

For each codec spec: compress and decompress GB/s (input float32 bytes / best time) on one
``--mb`` MB float32 buffer with ``out=`` buffers (the codec allocates nothing); the ratio to a
numpy copy (``np.copyto`` into a preallocated array, measured right before each row); the
speed-up over a straightforward torch-ops implementation of the same codec (written below);
top-k recall against the exact top-k; and PASS/FAIL against the targets (compress and decompress
must each reach the target fraction of the copy). A last line measures two-thread scaling: two
threads compressing disjoint halves vs one thread compressing both halves in turn (target 1.6x),
with a compute-bound control that marks the verdict inconclusive when no second core is free.

Error-feedback rows (``--ef-mb``, one block per buffer size; empty to skip): compress GB/s of the
vanilla error-feedback wrapper three ways, timed interleaved round by round with the copy (each
call after an untimed one, data warm) so load from other processes hits all alike: ``fused``
(the codec's ``_encode_ef_fused`` hook: ``p = g + e`` computed inside the codec's passes),
``p+hook`` (``p`` stored, then the one-pass ``_encode_ef``) and ``unfused`` (``p`` stored,
encode, decode-add); the ratios to the copy, the fused speed-up over unfused, and PASS/FAIL of
the fused path against ``EF_TARGETS``.

Server line (``--server-chunks``, 0 to skip): the parameter server's reduce of a 4 MiB onebit
chunk with 2 pushes and error feedback on the reply, fused (``Codec.compress_sum``: the sum
computed from the pushes' bits inside onebit's two passes) and generic, per chunk and as ratios
to a copy, out of cache (distinct buffers per chunk).
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
from gradpress.sim.rates import best_time

SPECS = ("none", "fp16", "bf16", "onebit", "topk:k=0.001", "topk:k=0.001,values=fp16",
         "topk:k=0.001,values=fp16,indices=int32", "randomk:k=0.01", "dithering:s=7",
         "dithering:s=7,partition=natural", "int2", "int3", "int4", "int8")
#: fraction of the copy speed each family must reach (compress and decompress)
TARGETS = {"fp16": 0.5, "bf16": 0.5, "onebit": 0.5, "randomk": 0.5, "dithering": 0.25,
           "topk": 0.25, "int2": 0.8, "int3": 0.8, "int4": 0.8, "int8": 0.8}
RECALL_TARGET = 0.95
EF_SPECS = ("onebit", "fp16", "bf16", "topk:k=0.001", "topk:k=0.001,values=fp16", "dithering:s=7",
            "dithering:s=7,partition=natural", "int4", "int8")
#: fraction of the copy speed the fused error-feedback compress must reach
EF_TARGETS = {"fp16": 0.5, "bf16": 0.5, "onebit": 0.5, "topk": 0.25, "int4": 0.5, "int8": 0.5}
SCALING_TARGET = 1.6


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


def best_times(fns: list[Callable[[], object]], reps: int) -> list[float]:
    """Best wall time of each of ``fns``, interleaved: every round calls each function twice in
    turn and times the second call (its data warm in cache, as in :func:`best_time`)."""
    best = [math.inf] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            fn()
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _ef_variant(spec: str, numel: int, path: str):
    """A vanilla error-feedback codec that runs the ``fused``, ``p+hook`` or ``unfused`` path."""
    codec = build(spec, numel, ef="vanilla")
    if path != "fused":
        codec.inner._encode_ef_fused = None  # instance attributes hide the hooks
    if path == "unfused":
        codec.inner._encode_ef = None
    return codec


def bench_ef(spec: str, x: torch.Tensor, dst: np.ndarray, reps: int) -> dict | str:
    """Compress GB/s of vanilla error feedback around ``spec``: fused, p+hook, unfused, copy."""
    name = spec.partition(":")[0]
    if name not in codec_names():
        return "not registered yet"
    paths = ("fused", "p+hook", "unfused")
    codecs = [_ef_variant(spec, x.numel(), p) for p in paths]
    outs = [torch.empty(c.payload_bytes, dtype=torch.uint8) for c in codecs]
    src = x.numpy()
    fns = [lambda: np.copyto(dst, src)]
    fns += [lambda c=c, o=o: c.compress(x, key=1, step=1, out=o) for c, o in zip(codecs, outs)]
    times = best_times(fns, reps)
    gbps = [x.numel() * 4 / t / 1e9 for t in times]
    return {"spec": spec, "copy": gbps[0], **dict(zip(paths, gbps[1:]))}


def ef_verdict(row: dict) -> str:
    target = EF_TARGETS.get(row["spec"].partition(":")[0])
    if target is None:
        return "-"
    return f"{'PASS' if row['fused'] >= target * row['copy'] else 'FAIL'} (>= {target}x)"


EF_HEAD = (f"{'vanilla EF, spec':<33}{'fused':>8}{'p+hook':>8}{'unfused':>8}{'copy':>7}"
           f"{'f/cp':>7}{'u/cp':>7}{'f/u':>7}  target")


def fmt_ef(row: dict) -> str:
    cp = row["copy"]
    return (f"{row['spec']:<33}{row['fused']:>8.2f}{row['p+hook']:>8.2f}{row['unfused']:>8.2f}"
            f"{cp:>7.2f}{row['fused'] / cp:>7.2f}{row['unfused'] / cp:>7.2f}"
            f"{row['fused'] / row['unfused']:>7.2f}  {ef_verdict(row)}")


def ef_rows(sizes_mb: list[float], only: set[str], reps: int) -> int:
    """Print the error-feedback block for each buffer size; returns the number of FAILs."""
    fails = 0
    specs = [s for s in EF_SPECS if not only or s in only or s.partition(":")[0] in only]
    for mb in sizes_mb:
        numel = int(mb * 2**20) // 4
        x = torch.randn(numel, generator=torch.Generator().manual_seed(1))
        dst = np.empty(numel, dtype=np.float32)
        print(f"\nerror feedback (vanilla) on {mb:g} MB, compress GB/s, interleaved best of "
              f"{reps}\n{EF_HEAD}")
        for spec in specs:
            row = bench_ef(spec, x, dst, reps)
            if isinstance(row, str):
                print(f"{spec:<33}skipped: {row}")
                continue
            print(fmt_ef(row), flush=True)
            fails += ef_verdict(row).startswith("FAIL")
    return fails


def server_row(chunks: int, reps: int) -> str:
    """The server's reduce of one 4 MiB onebit chunk (2 onebit pushes, vanilla EF on the reply,
    divisor 2): the fused path (``Codec.compress_sum``) and the generic one (decode-add into
    ``acc``, divide, compress), as ratios to a copy of the chunk; out of cache: ``chunks``
    distinct chunks (pushes, residuals, copy buffers) per round, rounds interleaved, median."""
    from gradpress.ps.reduce import reduce_pushes
    n, gen = 1 << 20, torch.Generator().manual_seed(2)
    worker = build("onebit", n, ef="vanilla")
    pushes = [[worker.compress(torch.randn(n, generator=gen), key=1) for _ in range(2)]
              for _ in range(chunks)]
    dec = build("onebit", n)
    encs = {p: [build("onebit", n, ef="vanilla") for _ in range(chunks)]
            for p in ("fused", "generic")}
    for c in encs["generic"]:
        c.fuses_sum = lambda decoder, device: False  # an instance attribute hides the method
    acc, out = torch.empty(n), torch.empty(dec.payload_bytes, dtype=torch.uint8)
    srcs, dsts = ([np.empty(n, np.float32) for _ in range(chunks)] for _ in range(2))
    for a in srcs:
        a[:] = 1.0

    def reduce(path: str, k: int) -> None:
        reduce_pushes([("a", pushes[k][0]), ("b", pushes[k][1])], dec, encs[path][k], acc,
                      key=1, step=0, lr=None, divisor=2, label="bench", out=out)

    fns = {"copy": lambda k: np.copyto(dsts[k], srcs[k]),
           "fused": lambda k: reduce("fused", k), "generic": lambda k: reduce("generic", k)}
    ts: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for k in range(chunks):
                fn(k)
            if r:  # the first round warms up (compiles, faults the pages in)
                ts[name].append((time.perf_counter() - t0) / chunks)
    cp, fu, ge = (float(np.median(ts[k])) for k in ("copy", "fused", "generic"))
    return (f"server reduce, 2 onebit pushes + EF, per 4 MiB chunk ({chunks} distinct, median "
            f"of {reps}): copy {cp * 1e3:.3f} ms; fused {fu * 1e3:.3f} ms ({fu / cp:.2f} "
            f"copies); generic {ge * 1e3:.3f} ms ({ge / cp:.2f} copies); {ge / fu:.2f}x")


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
    ap.add_argument("--ef-mb", default="4,64",
                    help="buffer sizes (MB, comma-separated) of the error-feedback rows; '' skips")
    ap.add_argument("--server-chunks", type=int, default=16,
                    help="distinct 4 MiB chunks of the server-reduce line (0 skips it)")
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
    if args.server_chunks:
        print(server_row(args.server_chunks, max(args.reps, 5)), flush=True)
    ef_sizes = [float(v) for v in args.ef_mb.split(",") if v.strip()]
    fails += ef_rows(ef_sizes, only, max(args.reps, 5) * 4)
    return 1 if fails or "FAIL" in line else 0


if __name__ == "__main__":
    raise SystemExit(main())

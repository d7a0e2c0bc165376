"""CPU a worker spends per chunk of ``push_pull``, beside the codec kernels' own share.

Usage::

    python benchmarks/per_chunk.py [--tensors 120] [--kib 160] [--steps 60] [--codec onebit]

2 workers and 1 server on plain loopback (``gradpress launch``), each worker pushing
``--tensors`` float32 tensors of about ``--kib`` KiB (sizes cycle through 0.4x-1.6x of it, each
one chunk) with ``min_compress_bytes=0`` and ``ef="vanilla"`` (``none``: no EF), all started
with ``push_pull_async`` and then waited for, as ``DistributedOptimizer`` does. After warm-up
steps and a barrier, worker 0 reads every thread's CPU time (``/proc/self/task``) around the
timed steps and prints it per chunk, split into the training thread (``submit``: plans,
checks, chunking), gloo's threads (the kernel's TCP work of the messages: 2 per chunk, 3 above
the inline size), the engine's threads (compress and decompress pool, dispatcher, receiver),
and the whole machine's CPU per chunk (``/proc/stat``: both workers, the server, the kernel);
then the codec kernels alone on the same tensors in this process (worker ``compress`` with
error feedback, then ``decompress``), and the ratio of the engine's per-chunk CPU to that:
what the runtime's bookkeeping (Python glue, locks, queues, message posting) costs beside the
arithmetic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PARTS = ("training thread", "engine threads", "gloo threads")


def _sizes(tensors: int, kib: int) -> list[int]:
    return [max(1, int(kib * 256 * (0.4 + 0.4 * (i % 4)))) for i in range(tensors)]


def _threads() -> dict[str, tuple[str, float, float]]:
    """Per thread id: (name, user CPU seconds, system CPU seconds)."""
    tick, out = os.sysconf("SC_CLK_TCK"), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            st = open(f"/proc/self/task/{tid}/stat").read()
        except FileNotFoundError:
            continue
        f = st[st.rindex(")") + 2:].split()
        out[tid] = (st[st.index("(") + 1:st.rindex(")")], int(f[11]) / tick, int(f[12]) / tick)
    return out


def worker(cfg: dict) -> None:
    """One worker of the job; worker 0 writes the per-chunk CPU split to ``cfg["out"]``."""
    import torch

    import gradpress as gp
    from cluster_worker import cpu_counters  # this script's directory is on sys.path

    def _machine() -> tuple[float, float]:  # the whole machine's user and system seconds
        c = cpu_counters()
        return c["machine_user"], c["machine_sys"]

    gp.init()
    ts = [torch.randn(n) for n in _sizes(cfg["tensors"], cfg["kib"])]
    ef = None if cfg["codec"] == "none" else "vanilla"

    def step() -> None:
        hs = [gp.push_pull_async(t, name=f"t{i}", compression=cfg["codec"], ef=ef,
                                 min_compress_bytes=0, out=t) for i, t in enumerate(ts)]
        for h in hs:  # the averages of averages stay bounded: no refill needed
            h.wait()

    for _ in range(5):
        step()
    gp.barrier()
    th0, m0, t0 = _threads(), _machine(), time.perf_counter()
    for _ in range(cfg["steps"]):
        step()
    wall, th1, m1 = time.perf_counter() - t0, _threads(), _machine()
    if gp.rank() == 0:
        main = str(os.getpid())
        split = {p: [0.0, 0.0] for p in PARTS}
        for tid, (name, user, system) in th1.items():
            before = th0.get(tid, (name, 0.0, 0.0))
            part = PARTS[0] if tid == main else PARTS[2] if name.startswith("gloo") else PARTS[1]
            split[part][0] += user - before[1]
            split[part][1] += system - before[2]
        n = cfg["steps"] * len(ts)
        Path(cfg["out"]).write_text(json.dumps({"wall_s": wall / cfg["steps"], **{
            k: [x / n for x in v] for k, v in split.items()},
            "machine": [(b - a) / n for a, b in zip(m0, m1)]}))
    gp.shutdown()


def codec_only(tensors: int, kib: int, codec: str, reps: int = 20) -> float:
    """CPU seconds per tensor of the codec kernels alone: compress (+EF) and decompress."""
    import torch

    from gradpress.compress import build, parse_ef

    ef = parse_ef(None if codec == "none" else "vanilla")
    ts = [torch.randn(n) for n in _sizes(tensors, kib)]
    encs = [build(codec, t.numel(), ef=ef) for t in ts]
    decs = [build(codec, t.numel()) for t in ts]
    outs = [torch.empty(e.payload_bytes, dtype=torch.uint8) for e in encs]
    for r in range(reps + 1):
        if r == 1:
            c0 = time.thread_time()
        for t, e, d, o in zip(ts, encs, decs, outs):
            e.compress(t, key=1, step=r, out=o)
            d.decompress(o, out=t)
    return (time.thread_time() - c0) / (reps * tensors)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tensors", type=int, default=120, help="tensors (chunks) per step (120)")
    p.add_argument("--kib", type=int, default=160, help="mean KiB per tensor (160)")
    p.add_argument("--steps", type=int, default=60, help="timed steps (60)")
    p.add_argument("--codec", default="onebit", help="codec spec (onebit)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(json.loads(Path(a.worker).read_text()))
        return 0
    with tempfile.TemporaryDirectory(prefix="gp-per-chunk-") as tmp:
        cfg = {**vars(a), "out": str(Path(tmp) / "split.json")}
        path = Path(tmp) / "cfg.json"
        path.write_text(json.dumps(cfg))
        exe = Path(sys.executable).with_name("gradpress")
        launch = [str(exe)] if exe.exists() else [
            sys.executable, "-c", "import sys; from gradpress.cli import main; sys.exit(main())"]
        subprocess.run([*launch, "launch", "--workers", "2", "--servers", "1", "--",
                        sys.executable, __file__, "--worker", str(path)], check=True,
                       timeout=600)
        res = json.loads(Path(cfg["out"]).read_text())
    kernels = codec_only(a.tensors, a.kib, a.codec)
    engine = sum(res[PARTS[1]])
    total = sum(sum(res[k]) for k in PARTS)
    print(f"per_chunk: {a.tensors} tensors of ~{a.kib} KiB, {a.codec}, 2 workers + 1 server "
          f"on loopback, {a.steps} timed steps ({res['wall_s'] * 1e3:.1f} ms/step); worker 0's "
          f"CPU per chunk, load average {os.getloadavg()[0]:.1f}:")
    print("| part | us/chunk (user + system) |\n|---|---|")
    for k in PARTS:
        print(f"| {k} | {sum(res[k]) * 1e6:.0f} ({res[k][0] * 1e6:.0f} + {res[k][1] * 1e6:.0f}) |")
    print(f"| worker total | {total * 1e6:.0f} |")
    m = res["machine"]
    print(f"| whole machine: both workers, the server, the kernel | {sum(m) * 1e6:.0f} "
          f"({m[0] * 1e6:.0f} + {m[1] * 1e6:.0f}) |")
    print(f"| codec kernels alone (compress + decompress, same tensors) | {kernels * 1e6:.0f} |")
    print(f"engine threads / codec kernels: {engine / kernels:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Section (b) of ``gpu_check.py``: codec throughput on the device path against the host path.

Usage (``gpu_check.py`` runs it as a child process with a timeout)::

    python benchmarks/gpu_check_codecs.py --device cuda:0 --mib 64 --reps 10 \\
        --spec onebit --spec topk:k=0.001,values=fp16 --json out.json

Both paths do what the worker pipeline (``src/gradpress/ps/worker.py``, ``_compress`` and
``_decode``) does with one chunk of a tensor on ``--device``:

* **device** (``compress_on="device"``): the codec's torch-op kernels (``backend="torch"``) run
  on the device, error-feedback residual included; encode = compress on the device + copy of the
  payload into a pageable host wire buffer; decode = copy of the payload to the device +
  decompress into the device result.
* **host** (``compress_on="host"``): encode = copy of the chunk into a pinned host buffer + numba
  kernels; decode = numba decompress into a pinned buffer + copy into the device result. On a
  CPU device (``gpu_check.py --allow-cpu``) there is nothing to copy, as in the engine.

GB/s = input float32 bytes / best time (interleaved rounds, see ``codecs.best_times``; every
CUDA call is followed by a synchronize). ``rt`` is the round trip, encode + decode. References
measured in the same run: a device-to-device copy, a host copy (``np.copyto``) and the pinned
device-to-host and host-to-device copies. Payload check: a fresh codec on each path encodes the
same chunk; the cast codecs (none, fp16, bf16) must give identical bytes on any device, the
others are reported (GPU reductions may round differently from the sequential numba loops).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gradpress.compress import build

HERE = Path(__file__).resolve().parent
#: codecs whose payload must be byte-identical on every device (IEEE conversions only)
EXACT_ON_ANY_DEVICE = ("none", "fp16", "bf16")
KEY = 1


def _bench_codecs() -> Any:
    """``benchmarks/codecs.py`` as a module (its name shadows the stdlib ``codecs``)."""
    spec = importlib.util.spec_from_file_location("_gp_bench_codecs", HERE / "codecs.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {HERE / 'codecs.py'}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def synced(fn: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``fn`` followed by a synchronize of ``device`` (nothing to wait for on the CPU)."""
    if device.type != "cuda":
        return fn

    def call() -> None:
        fn()
        torch.cuda.synchronize(device)

    return call


def device_path(spec: str, ef: str | None, x: torch.Tensor) -> tuple[Callable, Callable, Any]:
    """(encode, decode, payload) of ``compress_on="device"`` for chunk ``x``."""
    enc = build(spec, x.numel(), ef=ef, backend="torch")
    dec = build(spec, x.numel(), backend="torch")
    send = torch.empty(enc.payload_bytes, dtype=torch.uint8)  # the engine's wire buffer
    y = torch.empty_like(x)

    def encode() -> None:
        send.copy_(enc.compress(x, key=KEY, step=1))

    def decode() -> None:
        dec.decompress(send.to(x.device), out=y)

    return encode, decode, send


def host_path(spec: str, ef: str | None, x: torch.Tensor) -> tuple[Callable, Callable, Any]:
    """(encode, decode, payload) of ``compress_on="host"`` for chunk ``x``."""
    enc = build(spec, x.numel(), ef=ef)  # backend "auto": numba on the host
    dec = build(spec, x.numel())
    send = torch.empty(enc.payload_bytes, dtype=torch.uint8)
    y = torch.empty_like(x)
    if x.device.type == "cpu":  # the engine compresses CPU tensors where they are
        return (lambda: enc.compress(x, key=KEY, step=1, out=send),
                lambda: dec.decompress(send, out=y), send)
    pinned = x.device.type == "cuda"
    host_in = torch.empty(x.numel(), dtype=torch.float32, pin_memory=pinned)
    host_out = torch.empty(x.numel(), dtype=torch.float32, pin_memory=pinned)

    def encode() -> None:
        host_in.copy_(x)
        enc.compress(host_in, key=KEY, step=1, out=send)

    def decode() -> None:
        dec.decompress(send, out=host_out)
        y.copy_(host_out)

    return encode, decode, send


def same_payload(spec: str, x: torch.Tensor) -> bool:
    """Whether fresh codecs of both paths encode ``x`` into identical bytes."""
    payloads = []
    for path in (device_path, host_path):
        encode, _, send = path(spec, None, x)
        encode()
        payloads.append(send.clone())
    return torch.equal(payloads[0], payloads[1])


def references(x: torch.Tensor, reps: int, best_times: Callable) -> dict[str, float]:
    """GB/s (input bytes / time) of the copies the two paths are made of."""
    dev = x.device
    src = x.cpu().numpy()
    dst = np.empty_like(src)
    fns = {"host memcpy": lambda: np.copyto(dst, src)}
    if dev.type == "cuda":
        d2 = torch.empty_like(x)
        pin = torch.empty(x.numel(), dtype=torch.float32, pin_memory=True)
        fns.update({"device memcpy": lambda: d2.copy_(x), "D2H pinned": lambda: pin.copy_(x),
                    "H2D pinned": lambda: d2.copy_(pin)})
    times = best_times([synced(f, dev) for f in fns.values()], reps)
    return {k: 4 * x.numel() / t / 1e9 for k, t in zip(fns, times)}


def measure(spec: str, ef: str | None, x: torch.Tensor, reps: int,
            best_times: Callable) -> dict[str, Any]:
    """One row: encode / decode GB/s of both paths, timed in the same interleaved rounds."""
    d_enc, d_dec, d_send = device_path(spec, ef, x)
    h_enc, h_dec, _ = host_path(spec, ef, x)
    t = best_times([synced(f, x.device) for f in (d_enc, d_dec, h_enc, h_dec)], reps)
    gb = 4 * x.numel() / 1e9
    return {"spec": spec, "ef": ef or "none", "bits": 8 * d_send.numel() / x.numel(),
            "device_enc": gb / t[0], "device_dec": gb / t[1], "host_enc": gb / t[2],
            "host_dec": gb / t[3], "device_rt": gb / (t[0] + t[1]),
            "host_rt": gb / (t[2] + t[3])}


def run(device: str, mib: float, reps: int, specs: list[str]) -> dict[str, Any]:
    """Every measurement of the section; a JSON-able dict."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    best_times = _bench_codecs().best_times
    numel = int(mib * 2**20) // 4
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(dev)
    torch.set_num_threads(1)  # the host path's kernels run on one thread, as in codecs.py
    rows, payload = [], {}
    for spec in specs:
        for ef in (None, "vanilla"):
            try:
                payload.setdefault(spec, same_payload(spec, x))
                rows.append(measure(spec, ef, x, reps, best_times))
            except Exception as e:  # noqa: BLE001 - recorded as a failed row; others still run
                rows.append({"spec": spec, "ef": ef or "none", "error": f"{type(e).__name__}: "
                             f"{e}"[:300]})
    return {"device": str(dev), "mib": mib, "numel": numel, "reps": reps,
            "refs": references(x, reps, best_times), "rows": rows, "same_payload": payload}


def table(data: dict[str, Any]) -> tuple[list[str], list[list[str]], int]:
    """(columns, rows, number of failures) of :func:`run`'s result, for the report; an
    error row carries its message in the "same payload" column."""
    refs = data["refs"]
    dcp, hcp = refs.get("device memcpy", refs["host memcpy"]), refs["host memcpy"]
    cols = ["spec", "EF", "bits/el", "dev enc", "dev dec", "host enc", "host dec", "dev rt",
            "host rt", "dev/host rt", "dev rt/cp", "host rt/cp", "same payload", "verdict"]
    rows, fails = [], 0
    for r in data["rows"]:
        if "error" in r:
            rows.append([r["spec"], r["ef"], *["-"] * (len(cols) - 4), r["error"], "FAIL"])
            fails += 1
            continue
        same = data["same_payload"][r["spec"]]
        exact = r["spec"].partition(":")[0] in EXACT_ON_ANY_DEVICE
        verdict = ("PASS" if same else "FAIL") if exact else "(reported)"
        fails += verdict == "FAIL"
        rows.append([r["spec"], r["ef"], f"{r['bits']:.3f}",
                     *(f"{r[k]:.2f}" for k in ("device_enc", "device_dec", "host_enc",
                                               "host_dec", "device_rt", "host_rt")),
                     f"{r['device_rt'] / r['host_rt']:.2f}x", f"{r['device_rt'] / dcp:.3f}",
                     f"{r['host_rt'] / hcp:.3f}", "yes" if same else "no", verdict])
    return cols, rows, fails


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="where the device path runs")
    p.add_argument("--mib", type=float, default=64.0, help="chunk size in MiB (float32)")
    p.add_argument("--reps", type=int, default=10, help="interleaved rounds, best counts")
    p.add_argument("--spec", action="append", required=True, help="codec spec; repeatable")
    p.add_argument("--json", required=True, help="write the results to this file")
    args = p.parse_args(argv)
    if args.mib <= 0 or args.reps < 1:
        p.error(f"--mib must be > 0 and --reps >= 1, got {args.mib} and {args.reps}")
    data = run(args.device, args.mib, args.reps, args.spec)
    Path(args.json).write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

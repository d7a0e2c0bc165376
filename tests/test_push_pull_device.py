"""push_pull with ``compress_on`` (``GRADPRESS_COMPRESS_ON``): real processes on loopback.

With ``compress_on="device"`` the worker compresses each chunk where the tensor lives with the
codecs' torch-op kernels, error-feedback residual included; on CPU tensors this is the torch
backend on CPU, which the first test runs. References, computed inside each worker as in
``tests/test_push_pull.py``:

* ``none``: ``sum(x_w for w in range(W)) / W`` in float32, bit for bit (several shapes, empty
  and odd sizes, several chunks through a small ``GRADPRESS_PARTITION_BYTES``), also in place;
* ``onebit`` with error feedback: the two-way simulation with worker codecs built by
  ``build(..., backend="torch")`` and, separately, with the numba kernels (the host path's
  result): the pushed result must equal both bit for bit, and each chunk's residual must live
  on the tensor's device and equal the simulated worker residual.

The CUDA test runs the same worker with CUDA tensors in both modes where a GPU is present.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from gradpress.ps.calls import check_out
from gradpress.ps.config import PSConfig
from test_push_pull import _check_replicas, _finish, _launch

WORKER = textwrap.dedent('''
    import os, sys, threading
    import torch
    import gradpress as gp
    from gradpress.api import _rt
    from gradpress.compress import build
    from gradpress.ps.partition import chunk_key, chunk_layout

    out_dir, dev = sys.argv[1], torch.device(sys.argv[2])
    MODE, PART = os.environ["GRADPRESS_COMPRESS_ON"], int(os.environ["GRADPRESS_PARTITION_BYTES"])
    SHAPES = [(0,), (), (1,), (7,), (3, 5), (999,), (1000,), (2503,), (33, 61)]
    gp.init()
    r, W = gp.rank(), gp.size()
    engine = _rt().worker
    assert engine.cfg.compress_on == MODE, engine.cfg
    backend = "torch" if MODE == "device" else "auto"

    def make(rank, i, step, shape, dtype=torch.float32):
        g = torch.Generator().manual_seed(10007 * step + 101 * i + rank)
        return torch.randn(shape, generator=g).to(dtype)

    def bits(t):
        return t.detach().reshape(-1).to("cpu", torch.float32).view(torch.int32)

    def codecs(name):
        return [cs.enc for cs in engine._plans[name].chunks]

    results = {}

    def check_none(step):
        cases = [(f"t{i}", s, torch.float32, True) for i, s in enumerate(SHAPES)]
        cases += [("sum", (2503,), torch.float32, False), ("f64", (17,), torch.float64, True)]
        hs = [gp.push_pull_async(make(r, i, step, s, dt).to(dev), name, average=avg)
              for i, (name, s, dt, avg) in enumerate(cases)]
        for i, (h, (name, s, dt, avg)) in enumerate(zip(hs, cases)):
            y = h.wait()
            ref = sum(make(w, i, step, s, dt).to(torch.float32) for w in range(W))
            ref = (ref / W if avg else ref).to(dt)
            assert y.shape == ref.shape and y.dtype == dt and y.device == dev, (name, y)
            assert torch.equal(bits(y), bits(ref)), (name, step, (y.cpu() - ref).abs().max())
            assert all(c.backend == backend for c in codecs(name)), (name, codecs(name))
            results[f"none/{name}/{step}"] = y.cpu()
        assert len(codecs("t7")) == 3, "2503 floats in 4000-byte partitions: 3 chunks"
        for i, s in enumerate(SHAPES[2:], start=2):  # out= the input itself, on its device
            ref = sum(make(w, i, step, s) for w in range(W)) / W
            x = make(r, i, step, s).to(dev)
            y = gp.push_pull(x, f"inplace{i}", out=x)
            assert y.data_ptr() == x.data_ptr() and torch.equal(bits(x), bits(ref)), (i, step)

    ONEBIT = [("ob_a", (2503,), "vanilla", None), ("ob_b", (3, 100), "vanilla", None),
              ("ob_c", (1200,), "corrected", 0.1)]
    sim = {}

    def reference_onebit(kind, name, shape, ef, lr, i, step):
        numel = int(torch.Size(shape).numel())
        out = torch.empty(numel)
        for c in chunk_layout(numel, PART):
            key = chunk_key(name, c.index)
            if (kind, name, c.index) not in sim:
                sim[(kind, name, c.index)] = (
                    [build("onebit", c.numel, ef=ef, backend=kind) for _ in range(W)],
                    build("onebit", c.numel, ef=ef), build("onebit", c.numel, backend=kind))
            encs, server, dec = sim[(kind, name, c.index)]
            acc = torch.zeros(c.numel)
            for w in range(W):
                x = make(w, i, step, shape).reshape(-1)[c.offset:c.offset + c.numel]
                dec.decompress_add(encs[w].compress(x, key=key, step=step, lr=lr), acc)
            acc /= W
            reply = server.compress(acc, key=key, step=step, lr=lr)
            out[c.offset:c.offset + c.numel] = dec.decompress(reply)
        return out.view(shape)

    def check_onebit(step):
        for i, (name, shape, ef, lr) in enumerate(ONEBIT):
            lr = None if lr is None else lr * (step + 1)
            y = gp.push_pull(make(r, i, step, shape).to(dev), name, compression="onebit", ef=ef,
                             lr=lr, min_compress_bytes=0)
            assert y.device == dev, y.device
            for kind in ("torch", "numba"):  # torch twin, and the host path's numba kernels
                ref = reference_onebit(kind, name, shape, ef, lr, i, step)
                assert torch.equal(bits(y), bits(ref)), (kind, name, step)
            for c, enc in enumerate(codecs(name)):
                res, want = enc.residual, sim[("torch", name, c)][0][r].residual
                where = dev if MODE == "device" else torch.device("cpu")
                assert enc.backend == backend and res.device == where, (name, enc, res.device)
                assert torch.equal(bits(res), bits(want)), (name, c, step)
            results[f"onebit/{name}/{step}"] = y.cpu()

    for step in range(3):
        check_none(step)
        check_onebit(step)
    if MODE == "device":  # the residual stays on the device of the tensor's first call
        try:
            gp.push_pull(torch.ones(1200, device="meta"), "ob_c", compression="onebit",
                         ef="corrected", lr=0.1, min_compress_bytes=0)
            raise AssertionError("push_pull accepted a tensor on another device")
        except ValueError as e:
            assert "'ob_c'" in str(e) and "meta" in str(e) and "compress_on" in str(e), e
    st = gp.stats()
    assert st["steps"] > 0 and st["bytes_pushed"] > 0, st
    torch.save(results, os.path.join(out_dir, f"worker{r}.pt"))
    gp.shutdown()
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    assert not left, f"threads left after shutdown: {left}"
''')


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def test_compress_on_device_with_cpu_tensors(tmp_path: Path, script: Path) -> None:
    _finish([_launch(["--workers", "2", "--servers", "1"], script, tmp_path, "cpu",
                     GRADPRESS_COMPRESS_ON="device")])
    _check_replicas(tmp_path, 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["host", "device"])
def test_cuda_tensors(tmp_path: Path, script: Path, mode: str) -> None:
    _finish([_launch(["--workers", "2", "--servers", "1"], script, tmp_path, "cuda",
                     GRADPRESS_COMPRESS_ON=mode)])
    _check_replicas(tmp_path, 2)


def test_compress_on_option() -> None:
    assert PSConfig().compress_on == "host"
    assert PSConfig.from_env({"GRADPRESS_COMPRESS_ON": "device"}).compress_on == "device"
    for bad in ("gpu", "", None):
        with pytest.raises(ValueError, match="compress_on must be one of host, device"):
            PSConfig(compress_on=bad)
    with pytest.raises(ValueError, match="compress_on must be one of"):
        PSConfig.from_env({"GRADPRESS_COMPRESS_ON": "gpu"})


def test_out_must_be_on_the_tensors_device() -> None:
    flat = torch.zeros(8)
    assert check_out(torch.zeros(2, 4), flat, "w").shape == (8,)
    with pytest.raises(TypeError, match=r"'w'.*float32 tensor on cpu.*on meta"):
        check_out(torch.empty(8, device="meta"), flat, "w")

"""A CUDA checkpoint round trip without a memory spike (issue 30; needs a GPU, skips without).

Two workers and one server on one GPU, ``compress_on="device"`` (the residuals live on the GPU):
a model and a DistributedOptimizer(LANS) with state train three steps; then each worker saves
and loads the checkpoint while the allocator's peak is measured. The state must stream through
the CPU one tensor at a time (torch.save copies each storage to the host, ``_save`` in
torch/serialization.py; loading releases the old state before the new arrives,
``gradpress.torch.broadcast.load_optimizer_state``): the peak over the memory allocated before
may not exceed 1.5x the largest single state tensor, and after the load the optimizer state,
the residuals (on the GPU) and the CUDA RNG state equal what was saved, bit for bit.
Written from PyTorch's sources; not yet run on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cluster  # every test here starts real processes

WORKER = textwrap.dedent('''
    import gc, sys, torch, gradpress as gp
    import gradpress.checkpoint as ck
    from gradpress.api import _rt
    from gradpress.optim import LANS

    out = sys.argv[1]
    gp.init()
    r = gp.rank()
    torch.cuda.set_device(gp.local_rank() % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.Tanh(),
                            torch.nn.Linear(2048, 512)).to(dev)
    opt = gp.DistributedOptimizer(LANS(m.parameters(), lr=1e-2), named_parameters=
                                  m.named_parameters(), compression="onebit", ef="vanilla",
                                  min_compress_bytes=0)
    for s in range(3):
        g = torch.Generator(device=dev).manual_seed(100 * s + r)
        x = torch.randn(64, 512, device=dev, generator=g)
        opt.zero_grad()
        m(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize()

    def host(obj):
        if isinstance(obj, torch.Tensor):
            return obj.detach().cpu().clone()
        if isinstance(obj, dict):
            return {k: host(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(host(v) for v in obj)
        return obj

    def same(a, b):
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    res = {}
    before = host(opt.state_dict())
    res["largest"] = max(t.nbytes for st in opt.state.values() for t in st.values()
                         if isinstance(t, torch.Tensor))
    res["state_devices"] = sorted({str(t.device) for st in opt.state.values()
                                   for t in st.values() if isinstance(t, torch.Tensor)})
    rng = torch.cuda.get_rng_state()
    gc.collect()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ck.save(f"{out}/ck", m, opt, 3)
    torch.cuda.synchronize()
    res["save_peak"] = torch.cuda.max_memory_allocated() - base
    torch.rand(10, device=dev)  # the CUDA RNG moves on; the load must put it back
    gc.collect()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    assert ck.load(f"{out}/ck", m, opt) == 3
    torch.cuda.synchronize()
    res["load_peak"] = torch.cuda.max_memory_allocated() - base
    res["load_growth"] = torch.cuda.memory_allocated() - base
    res["state_equal"] = same(before, host(opt.state_dict()))
    res["state_devices_after"] = sorted({str(t.device) for st in opt.state.values()
                                         for t in st.values() if isinstance(t, torch.Tensor)})
    res["residual_devices"] = sorted({str(c.enc.residual.device)
                                      for p in _rt().worker.plans().values() for c in p.chunks
                                      if getattr(c.enc, "residual", None) is not None})
    res["rng_equal"] = torch.equal(torch.cuda.get_rng_state(), rng)
    res["device"] = str(dev)
    torch.save(res, f"{out}/res{r}.pt")
    gp.shutdown()
''')


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_checkpoint_round_trip_without_memory_spike(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "GRADPRESS_COMPRESS_ON": "device", "GRADPRESS_TIMEOUT": "60",
           "GRADPRESS_COMPRESS_THREADS": "1", "GRADPRESS_ENGINE_THREADS": "1"}
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "1",
           "--timeout", "60", "--", sys.executable, str(script), str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    for w in range(2):
        res = torch.load(tmp_path / f"res{w}.pt", weights_only=False)
        dev = res["device"]
        assert res["state_devices"] == res["state_devices_after"] == [dev], res
        assert res["residual_devices"] == [dev], res
        limit = 1.5 * res["largest"]
        assert res["save_peak"] <= limit, (w, res["save_peak"], limit)
        assert res["load_peak"] <= limit, (w, res["load_peak"], limit)
        assert abs(res["load_growth"]) <= limit, (w, res["load_growth"])
        assert res["state_equal"], w
        assert res["rng_equal"], w

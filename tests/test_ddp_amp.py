"""Mixed precision through the DDP hook: ``nan_policy="skip"`` (issue #43, finding 1).

A rank whose bucket overflowed marks its push; under ``"skip"`` the owner sends a skip record
instead of its aggregate and every rank hands DDP the bucket filled with inf, so a
``torch.amp.GradScaler`` skips the step and lowers its scale on every rank, and training goes
on. Checked at three levels:

* the owner's reduce and the reply decode, immediate and deferred checks side by side (one
  process): the same skip record, the same inf bucket, the server codec's state untouched, and
  a bad header still an error;
* the hook in a world of one (gloo): an inf bucket comes back inf, no error, the next
  iteration runs, ``skipped_buckets`` counts it;
* two real gloo ranks with DDP and ``GradScaler("cpu")``: inf injected into rank 1's gradient
  makes both ranks skip the same step and halve their scale, then train on, replicas identical;
  a huge initial scale overflows (gradient plus error-feedback residual) on both ranks, those
  steps are skipped, and training goes on.

The CUDA tests run the same on NCCL (a world of one) with fp16 autocast.
"""

import datetime
import os
import socket
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gradpress.compress import build
from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook
from gradpress.ps.errors import PayloadError

SPEC = "onebit"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# -- the owner's reduce and the decode, one process (world 3, rank 0) ----------------------------
def _exchange(deferred: bool, numel: int = 100):
    from gradpress.ddp.buckets import BucketCodecs, BucketExchange
    layout = (3, 0, numel, torch.float32, "cpu", (((numel,), 0),))
    c = BucketCodecs(layout, numel, 3, 0, lambda n: build(SPEC, n, ef="vanilla"),
                     torch.device("cpu"))
    return BucketExchange(5, torch.full((numel,), 7.0), c, 2, None, None, deferred=deferred,
                          skip=True)


def _pushes(c, marked: set[int], bad_step: set[int] = frozenset()) -> None:
    """Slot i of ``recv``: rank i's push of shard 0 (key 15, step 2); ``marked`` ones are the
    header of a rejected input (``write_rejected``), ``bad_step`` ones carry a wrong step."""
    from gradpress.ddp.buckets import write_rejected
    lo, hi = c.bounds[0]
    for i in range(3):
        p = c.payload(c.recv, i, 0)
        if i in marked:
            write_rejected(build(SPEC, hi - lo), p, key=15, step=2, lr=None)
        else:
            x = torch.randn(hi - lo, generator=torch.Generator().manual_seed(i))
            build(SPEC, hi - lo).compress(x, key=15, step=2, out=p)
        if i in bad_step:
            p[16] += 5


def _reduce(deferred: bool, marked: set[int], bad_step: set[int] = frozenset()):
    from gradpress.ddp.buckets import reduce_shard
    from gradpress.ddp.checks import raise_failed, reduce_shard_deferred
    ex = _exchange(deferred)
    ex.codecs.server.compress(torch.randn(ex.codecs.acc.numel()), key=15, step=1)  # a residual
    before = ex.codecs.server.state_dict()
    _pushes(ex.codecs, marked, bad_step)
    try:
        (reduce_shard_deferred if deferred else reduce_shard)(ex, None)
        error = None
    except PayloadError as e:
        error = str(e)
    if deferred and bytes(ex.codecs.agg[:2]) == b"GX":  # the error, raised as the hook would
        with pytest.raises(PayloadError) as info:
            raise_failed(ex)
        error = str(info.value)
    return ex, before, error


@pytest.mark.parametrize("marked", [{1}, {0, 2}], ids=str)
def test_marked_push_under_skip_sends_a_skip_record_and_keeps_server_state(marked):
    for deferred in (False, True):
        ex, before, error = _reduce(deferred, marked)
        record = bytes(ex.codecs.agg[:8])
        assert error is None, (deferred, error)
        assert record == b"GS\0\0" + bytes([min(marked), 0, 0, 0]), (deferred, record)
        after = ex.codecs.server.state_dict()
        assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                   for a, b in zip(before.values(), after.values())), deferred


def test_bad_header_beats_a_marked_push_under_skip():
    errors = {d: _reduce(d, {0}, bad_step={2})[2] for d in (False, True)}
    assert errors[False] is not None and errors[False] == errors[True]
    assert "push from rank 2 rejected" in errors[False] and "step" in errors[False]


@pytest.mark.parametrize("bad", [None, "nan"], ids=["clean", "nan-reply"])
def test_skip_record_among_the_replies_fills_the_bucket_with_inf(bad):
    """Shard 1's owner sent a skip record: every rank's bucket becomes inf, immediate and
    deferred alike; a non-finite reply of another shard is still an error (bucket zeroed)."""
    from gradpress.ddp.buckets import _SKIP_MAGIC, finish
    from gradpress.ddp.checks import finish_deferred
    out, flags, errors = {}, {}, {}
    for deferred in (False, True):
        ex = _exchange(deferred)
        c = ex.codecs
        for s, (lo, hi) in enumerate(c.bounds):
            p = c.payload(c.gathered, s, s)
            build(SPEC, hi - lo).compress(torch.randn(hi - lo), key=15 + s, step=2, out=p)
        c.payload(c.gathered, 1, 1)[:4].copy_(torch.tensor(list(_SKIP_MAGIC) + [0, 0]))
        if bad:
            c.payload(c.gathered, 2, 2)[-4:].copy_(torch.tensor([float("nan")]).view(torch.uint8))
        try:
            flags[deferred] = (finish_deferred if deferred else finish)(ex)
        except PayloadError as e:
            errors[deferred] = str(e)
        out[deferred] = ex.buffer.clone()
    assert torch.equal(out[True], out[False])
    if bad:
        assert bool((out[True] == 0).all()) and "non-finite" in errors[False]
        assert flags[True].tolist() == [False, False]
    else:
        assert bool(torch.isinf(out[True]).all()) and not errors
        assert flags == {False: True, True: flags[True]} and flags[True].tolist() == [True, True]


# -- the hook in a world of one -----------------------------------------------------------------
class Bucket:
    """Duck-typed dist.GradBucket: one bucket that is the last of its iteration."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf, self.param = buf, torch.zeros_like(buf)

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self.buf

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return [self.param]


def overflow_is_skipped(device: torch.device, defer: bool | None, spec: str) -> None:
    """Iteration 1's bucket has an inf: handed back as inf without an error; iterations 0 and 2
    are finite and nonzero; the skip is counted (deferred: by the next hook call)."""
    state = TwoWayCompressionState(spec, "vanilla", min_compress_bytes=0, nan_policy="skip")
    state._defer = defer
    bucket = Bucket(torch.randn(1000, device=device, dtype=torch.float16))
    results = []
    for it in range(3):
        bucket.buf.normal_()
        if it == 1:
            bucket.buf[17] = float("inf")
        results.append(two_way_compression_hook(state, bucket).wait().clone())
    state.check_pending()
    assert bool(torch.isinf(results[1]).all()), "the overflowing bucket did not come back inf"
    for r in (results[0], results[2]):
        assert bool(torch.isfinite(r).all()) and r.abs().sum() > 0
    stats = state.compression_stats()
    assert stats["skipped_buckets"] == 1 and stats["compressed_buckets"] == 3


def world_of_one(backend: str, tmp_path):
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)


@pytest.mark.parametrize("spec", [SPEC, "topk:k=0.1", "randomk:k=0.1"])
@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_world_of_one_gloo_cpu_overflow_is_skipped(tmp_path, defer, spec):
    world_of_one("gloo", tmp_path)
    try:
        overflow_is_skipped(torch.device("cpu"), defer, spec)
    finally:
        dist.destroy_process_group()


def test_nan_policy_is_validated_and_pickled():
    with pytest.raises(ValueError, match="nan_policy must be one of raise, skip, got 'allow'"):
        TwoWayCompressionState(nan_policy="allow")
    import pickle
    state = pickle.loads(pickle.dumps(TwoWayCompressionState(nan_policy="skip")))
    assert state.nan_policy == "skip" and TwoWayCompressionState().nan_policy == "raise"


@needs_cuda
@pytest.mark.parametrize("defer", [None, False], ids=["deferred", "immediate"])
def test_cuda_nccl_overflow_is_skipped(tmp_path, defer):
    torch.cuda.set_device(0)
    world_of_one("nccl", tmp_path)
    try:
        overflow_is_skipped(torch.device("cuda", 0), defer, SPEC)
    finally:
        dist.destroy_process_group()


# -- DDP with a GradScaler ----------------------------------------------------------------------
def scaler_run(rank: int, device: torch.device, defer: bool | None, init_scale: float,
               inject: int | None, steps: int, dtype: torch.dtype | None = None,
               target: float = 1.0) -> dict:
    """Train a small MLP through DDP + the hook + GradScaler for ``steps`` steps (fp16
    autocast when ``dtype``); at step ``inject`` rank 1 (rank 0 in a world of one) makes one
    gradient inf. Returns per step: scale after update, whether the parameters moved; and
    the final parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
    ids = [device.index] if device.type == "cuda" else None
    net = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    state = TwoWayCompressionState(SPEC, "vanilla", min_compress_bytes=0, nan_policy="skip")
    state._defer = defer
    net.register_comm_hook(state, two_way_compression_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device.type, init_scale=init_scale, growth_interval=1000)
    gen = torch.Generator().manual_seed(10 + rank)
    poisoner = 1 if dist.get_world_size() > 1 else 0
    out: dict = {"scales": [], "moved": [], "losses": []}
    x = torch.randn(16, 32, generator=gen).to(device)
    y = (target * torch.randn(16, 8, generator=gen)).to(device)
    for step in range(steps):
        if step == inject and rank == poisoner:
            h = model[0].weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype or torch.float16, enabled=dtype is not None):
            loss = nn.functional.mse_loss(net(x).float(), y)
        scaler.scale(loss).backward()
        if step == inject and rank == poisoner:
            h.remove()
        scaler.step(opt)
        scaler.update()
        out["scales"].append(scaler.get_scale())
        out["moved"].append(any(not torch.equal(a, p) for a, p in zip(before, model.parameters())))
        out["losses"].append(float(loss.detach()))
    state.check_pending()
    out["params"] = [p.detach().cpu() for p in model.parameters()]
    out["stats"] = state.compression_stats()
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scaler_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))
    cpu = torch.device("cpu")
    res = {}
    for defer in (False, True):
        res[f"inject-{defer}"] = scaler_run(rank, cpu, defer, 2.0**10, inject=2, steps=6)
        # float32 overflows at 2**128: a loss near 100 scaled by 2**127 does, for some steps
        res[f"huge-{defer}"] = scaler_run(rank, cpu, defer, 2.0**127, inject=None, steps=16,
                                          target=10.0)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def scaler_results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp_amp")
    ctx = mp.start_processes(scaler_worker, args=(_free_port(), str(out)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail("the two GradScaler ranks did not finish within 120 s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _same_params(runs: list[dict]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"]))


@pytest.mark.cluster
@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_gloo_one_rank_overflows_both_skip_and_train_on(scaler_results, defer):
    runs = [r[f"inject-{defer}"] for r in scaler_results]
    for r in runs:
        assert r["moved"] == [True, True, False, True, True, True], r["moved"]
        assert r["scales"][1] == 2.0**10 and r["scales"][2] == 2.0**9, r["scales"]
        assert r["stats"]["skipped_buckets"] >= 1
    assert _same_params(runs), "the replicas differ"


@pytest.mark.cluster
@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_gloo_huge_initial_scale_recovers(scaler_results, defer):
    """At 2**127 the scaled gradients are finite but their sum with the error-feedback
    residual overflows float32: those steps are skipped on both ranks (the compress raised,
    the residual kept), the scale falls, and training goes on with finite parameters."""
    runs = [r[f"huge-{defer}"] for r in scaler_results]
    for r in runs:
        skipped = [not m for m in r["moved"]]
        assert sum(skipped) >= 2 and r["scales"][-1] <= 2.0**(127 - sum(skipped)), r["scales"]
        assert sum(r["moved"]) >= 6 and r["stats"]["skipped_buckets"] >= sum(skipped)
        assert all(bool(torch.isfinite(p).all()) for p in r["params"])
        assert r["losses"][-1] < r["losses"][0]
    assert runs[0]["scales"] == runs[1]["scales"] and _same_params(runs)


@needs_cuda
@pytest.mark.parametrize("defer", [None, False], ids=["deferred", "immediate"])
def test_cuda_nccl_fp16_autocast_gradscaler_through_the_hook(tmp_path, defer):
    """fp16 autocast at an initial scale of 2**28: the first steps overflow in fp16, are
    skipped with the scale halved each time, then training runs; a later injected inf is
    skipped too, and the state never fails."""
    torch.cuda.set_device(0)
    world_of_one("nccl", tmp_path)
    try:
        r = scaler_run(0, torch.device("cuda", 0), defer, 2.0**28, inject=20, steps=24,
                       dtype=torch.float16)
    finally:
        dist.destroy_process_group()
    assert not r["moved"][0] and r["scales"][0] == 2.0**27, r["scales"]
    assert r["moved"][19] and not r["moved"][20] and r["moved"][21], r["moved"]
    assert r["stats"]["skipped_buckets"] >= 2 and r["losses"][-1] < r["losses"][0]


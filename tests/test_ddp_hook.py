"""The two-way compression DDP communication hook, with real processes (gloo on loopback).

One spawn of two ranks runs every distributed scenario and saves its results; the tests below
check them:

* ``none`` spec: DDP with the hook gives bit-identical parameters to DDP without it (world 2:
  averaging divides by a power of two, so the summation order cannot differ).
* ``onebit`` (else topk) with error feedback: replicas stay bit-identical, the loss decreases.
* One bucket (uneven shards, two buckets in flight, several steps, overlap on and off): the hook's
  result equals a reference built from ``gradpress.compress.build`` only, bit for bit.
* A pickled state resumes: the next step gives the same bytes as the uninterrupted state.
"""

import datetime
import os
import pickle
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gradpress.compress import build, codec_names
from gradpress.ddp_hook import TwoWayCompressionState, two_way_compression_hook

WORLD = 2
SPEC = "onebit" if "onebit" in codec_names() else "topk:k=0.1"
REF_SPECS = [(SPEC, True), ("topk:k=0.05", False), ("randomk:k=0.1", True)]


# -- helpers run inside the ranks -----------------------------------------------------------------
class FakeBucket:
    """Duck-typed dist.GradBucket over a fixed gradient buffer and fixed parameters."""

    def __init__(self, index: int, numel: int, last: bool) -> None:
        self._index, self._last = index, last
        self.param = torch.zeros(numel)
        self.buf = torch.zeros(numel)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self.buf

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[torch.Tensor]:
        return [self.param]


def grad(rank: int, index: int, step: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * index + rank)
    return torch.randn(numel, generator=g)


def reference(spec: str, index: int, numel: int, steps: range) -> list[torch.Tensor]:
    """Two-way compression of one bucket from the codec API, for every rank's gradient, with
    codecs (and residuals) created at ``steps.start``."""
    base, rem = divmod(numel, WORLD)
    sizes = [base + (s < rem) for s in range(WORLD)]
    bounds = [(sum(sizes[:s]), sum(sizes[:s + 1])) for s in range(WORLD)]
    workers = [[build(spec, hi - lo, ef="vanilla") for lo, hi in bounds] for _ in range(WORLD)]
    servers = [build(spec, hi - lo, ef="vanilla") for lo, hi in bounds]
    outs = []
    for t in steps:
        out = torch.empty(numel)
        for s, (lo, hi) in enumerate(bounds):
            key, acc = index * WORLD + s, torch.zeros(hi - lo)
            for r in range(WORLD):
                acc += workers[r][s].decompress(
                    workers[r][s].compress(grad(r, index, t, numel)[lo:hi], key=key, step=t))
            acc /= WORLD
            out[lo:hi] = servers[s].decompress(servers[s].compress(acc, key=key, step=t))
        outs.append(out)
    return outs


def run_buckets(state: TwoWayCompressionState, buckets: list[FakeBucket], rank: int,
                steps: range) -> list[list[torch.Tensor]]:
    """Call the hook as DDP does (buckets in order, then wait for all futures)."""
    outs = []
    for t in steps:
        futs = []
        for b in buckets:
            b.buf.copy_(grad(rank, b.index(), t, b.buf.numel()))
            futs.append(two_way_compression_hook(state, b))
        outs.append([f.wait().clone() for f in futs])
    return outs


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), nn.Tanh(),
                         nn.Linear(8, 1))


def train(rank: int, state: TwoWayCompressionState | None, steps: int, lr: float):
    model = nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=0.001)
    if state is not None:
        model.register_comm_hook(state, two_way_compression_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(64, 16, generator=g)
    y = 0.5 * x[:, :2].sum(1, keepdim=True)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [p.detach().clone() for p in model.parameters()], losses


def scenario_reference(rank: int, res: dict) -> None:
    for spec, overlap in REF_SPECS:
        state = TwoWayCompressionState(spec, "vanilla", min_compress_bytes=0, overlap=overlap)
        buckets = [FakeBucket(1, 1001, last=False), FakeBucket(0, 37, last=True)]
        got = run_buckets(state, buckets, rank, range(3))
        for j, b in enumerate(buckets):
            ref = reference(spec, b.index(), b.buf.numel(), range(3))
            for t in range(3):
                diff = (got[t][j] - ref[t]).abs().max().item()
                res.setdefault("ref_diff", {})[(spec, b.index(), t)] = diff
        res.setdefault("ref_out", {})[spec] = got
        # pickle after 3 steps, then step 3 from the live state and from the unpickled copy
        blob = pickle.dumps(state)
        live = run_buckets(state, buckets, rank, range(3, 4))[0]
        restored = pickle.loads(blob)
        again = run_buckets(restored, buckets, rank, range(3, 4))[0]
        res.setdefault("resume_equal", {})[spec] = all(
            torch.equal(a, b) for a, b in zip(live, again))
        res.setdefault("resume_nonzero", {})[spec] = all(bool(a.abs().sum() > 0) for a in live)
        # bucket 0 changes size (as after DDP's bucket rebuild): fresh codecs, step continues
        resized = run_buckets(state, [buckets[0], FakeBucket(0, 50, last=True)], rank,
                              range(4, 5))[0][1]
        res.setdefault("resize_equal", {})[spec] = torch.equal(
            resized, reference(spec, 0, 50, range(4, 5))[0])


def worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    res: dict = {}
    plain, _ = train(rank, None, 6, lr=0.1)
    none_state = TwoWayCompressionState("none", "vanilla", min_compress_bytes=0)
    hooked, _ = train(rank, none_state, 6, lr=0.1)
    res["none_equal"] = all(torch.equal(a, b) for a, b in zip(plain, hooked))
    res["none_maxdiff"] = max((a - b).abs().max().item() for a, b in zip(plain, hooked))
    state = TwoWayCompressionState(SPEC, "vanilla", min_compress_bytes=0)
    res["params"], res["losses"] = train(rank, state, 40, lr=0.1)
    res["stats"], res["buckets"] = state.compression_stats(), len(state.state_dict()["buckets"])
    scenario_reference(rank, res)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


# -- the tests ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp_hook")
    # fork (as DataLoader workers do; each rank sets one intra-op thread first) starts in well
    # under a second; spawn re-imports torch and the codecs in every rank
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    ctx = mp.start_processes(worker, args=(_free_port(), str(out)), nprocs=WORLD, join=False,
                             start_method=method)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail("DDP hook workers did not finish within 120 s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_none_spec_matches_plain_ddp_bit_exactly(results):
    for r, res in enumerate(results):
        assert res["none_equal"], f"rank {r}: max |diff| {res['none_maxdiff']}"


def test_compressed_replicas_identical_and_loss_decreases(results):
    p0, p1 = results[0]["params"], results[1]["params"]
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    for res in results:
        losses = res["losses"]
        assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses
        assert res["stats"]["compressed_buckets"] > 0
        assert res["buckets"] >= 2  # several buckets: the overlap path was used


def test_hook_matches_codec_reference(results):
    for res in results:
        bad = {k: v for k, v in res["ref_diff"].items() if v != 0.0}
        assert not bad, bad
    for spec, _ in REF_SPECS:
        for a, b in zip(results[0]["ref_out"][spec], results[1]["ref_out"][spec]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_pickled_state_resumes_identically(results):
    for res in results:
        assert all(res["resume_equal"].values()), res["resume_equal"]
        assert all(res["resume_nonzero"].values())


def test_bucket_size_change_recreates_codecs(results):
    for res in results:
        assert all(res["resize_equal"].values()), res["resize_equal"]


# -- single-process checks -----------------------------------------------------------------------
def test_state_pickles_without_process_group():
    state = TwoWayCompressionState("topk:k=0.01", "vanilla", min_compress_bytes=4096,
                                   start_compress_iter=5, seed=3, overlap=False, lr=0.1)
    state.process_group = object()  # not picklable in general; must be dropped
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None
    assert (copy.spec, copy.ef, copy.min_compress_bytes, copy.start_compress_iter, copy.seed,
            copy.overlap, copy.lr) == ("topk:k=0.01", "vanilla", 4096, 5, 3, False, 0.1)
    assert copy.state_dict() == state.state_dict()


def test_state_dict_roundtrip_keeps_pending_buckets():
    state = TwoWayCompressionState("onebit")
    saved = {"version": 1, "iter": 7, "steps": {0: 7},
             "buckets": {0: {"numel": 10, "world_size": 2, "rank": 0, "worker": [{}, {}],
                             "server": {}}}}
    state.load_state_dict(saved)
    assert state.state_dict() == saved and state.iter == 7


@pytest.mark.parametrize("kwargs, match", [
    ({"spec": "nosuch"}, "nosuch"),
    ({"ef": "bogus"}, "bogus"),
    ({"min_compress_bytes": -1}, "min_compress_bytes"),
    ({"start_compress_iter": 1.5}, "start_compress_iter"),
    ({"lr": -0.1}, "lr"),
])
def test_invalid_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TwoWayCompressionState(**kwargs)


def test_hyperparameters_are_read_only_and_state_keys_checked():
    state = TwoWayCompressionState("onebit")
    with pytest.raises(AttributeError):
        state.spec = "topk"
    with pytest.raises(TypeError, match="spec"):
        TwoWayCompressionState(spec={"compressor": "onebit"})
    with pytest.raises(ValueError, match="expected keys"):
        state.load_state_dict({"iter": 0})

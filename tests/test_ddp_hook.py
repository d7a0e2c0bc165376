"""The two-way compression DDP communication hook, with real processes (gloo on loopback).

One spawn of two ranks runs every distributed scenario and saves its results; the tests below
check them:

* ``none`` spec: DDP with the hook gives bit-identical parameters to DDP without it (world 2:
  averaging divides by a power of two, so the summation order cannot differ).
* ``onebit`` (else topk) with error feedback: replicas stay bit-identical, the loss decreases.
* One bucket (uneven shards, two buckets in flight, several steps, overlap on and off): the hook's
  result equals a reference built from ``gradpress.compress.build`` and the servers' own
  ``reduce_pushes``, bit for bit.
* A pickled state resumes: the next step gives the same bytes as the uninterrupted state.

A second spawn: rank 1 corrupts a push or a reply (key, step, codec id, NaN); every rank raises a
PayloadError naming sender, bucket and shard, none hangs, the bucket buffer is zeroed.

Both spawns also run the deferred checks (the default for CUDA buckets, forced here on the CPU
with the internal switch ``state._defer = True``): the same results bit for bit, and the same
errors raised one hook call later (the next iteration's), the bucket zeroed at once.
"""

import copy
import datetime
import functools
import gc
import os
import pickle
import socket
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gradpress.compress import build, parse_ef, parse_spec
from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook
from gradpress.ps.reduce import reduce_pushes

WORLD = 2
SPEC = "onebit"
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


class ShapedBucket(FakeBucket):
    """A FakeBucket whose buffer holds parameters of the given shapes (its layout)."""

    def __init__(self, index: int, shapes: list[tuple[int, ...]], last: bool) -> None:
        super().__init__(index, sum(int(np.prod(s)) for s in shapes), last)
        self.params = [torch.zeros(s) for s in shapes]

    def parameters(self) -> list[torch.Tensor]:
        return self.params


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
            key = index * WORLD + s
            pushes = [(f"rank {r}", workers[r][s].compress(grad(r, index, t, numel)[lo:hi],
                                                           key=key, step=t)) for r in range(WORLD)]
            reply = reduce_pushes(pushes, servers[s], servers[s], torch.empty(hi - lo), key=key,
                                  step=t, lr=None, divisor=WORLD, label=f"shard {s}")
            out[lo:hi] = servers[s].decompress(reply)
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
        deferred = TwoWayCompressionState(spec, "vanilla", min_compress_bytes=0, overlap=overlap)
        deferred._defer = True
        got_d = run_buckets(deferred, buckets, rank, range(3))
        deferred.check_pending()
        res.setdefault("deferred_equal", {})[spec] = all(
            torch.equal(a, b) for ga, gb in zip(got, got_d) for a, b in zip(ga, gb))
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


def scenario_relayout(rank: int, res: dict) -> None:
    """A resumed process sees DDP's initial bucket (same elements, other parameter order) before
    the rebuilt one the residuals were saved from: that iteration is averaged exactly, and the
    residuals are loaded into the rebuilt bucket, which then continues as if never stopped."""
    rebuilt = ShapedBucket(0, [(4, 3), (5,)], last=True)
    initial = ShapedBucket(0, [(5,), (4, 3)], last=True)
    live = TwoWayCompressionState(SPEC, "vanilla", min_compress_bytes=0)
    run_buckets(live, [rebuilt], rank, range(3))
    saved = copy.deepcopy(live.state_dict())
    expect = run_buckets(live, [rebuilt], rank, range(3, 4))[0][0]
    resumed = TwoWayCompressionState(SPEC, "vanilla", min_compress_bytes=0)
    resumed.load_state_dict(saved)
    first = run_buckets(resumed, [initial], rank, range(3, 4))[0][0]
    exact = grad(0, 0, 3, 17) / WORLD + grad(1, 0, 3, 17) / WORLD
    res["relayout_first_exact"] = torch.equal(first, exact)
    res["relayout_allreduced"] = resumed.compression_stats()["allreduced_buckets"]
    again = run_buckets(resumed, [rebuilt], rank, range(3, 4))[0][0]
    res["relayout_equal"] = torch.equal(again, expect)


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
    scenario_relayout(rank, res)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    shutdown()


def shutdown() -> None:
    """End the rank without the interpreter's shutdown. After a failed DDP backward torch keeps
    ten references to the process group from C++ (plain DDP with a hook that raises does the
    same), so gloo's threads are still alive when the interpreter shuts down, and about one run
    in ten then aborts ("terminate called without an active exception"). The results are saved
    before this; an error before it still fails the rank."""
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# -- hostile senders: rank BAD corrupts what it sends -------------------------------------------
BAD, BUCKET, NUMEL = 1, 3, 1001  # shards of 501 and 500 elements; keys 6 (shard 0) and 7
HOSTILE = [(d, how, spec) for d in ("push", "reply") for how, spec in
           [("key", SPEC), ("step", SPEC), ("codec", SPEC), ("nan", "none"), ("nan", SPEC)]]
_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def corrupt(slot: torch.Tensor, how: str, spec: str, numel: int) -> None:
    """Corrupt the payload at the start of ``slot`` (uint8, CPU) of a shard of ``numel``."""
    a = slot.numpy()
    if how == "key":
        a[4:8].view(np.uint32)[0] += 1
    elif how == "step":
        a[16:24].view(np.int64)[0] += 5
    elif how == "codec":
        a[2] ^= 0xFF
    else:  # NaN: the first value of a "none" payload, else the trailing fp32 scale (onebit)
        at = 40 if spec == "none" else build(spec, numel).payload_bytes - 4
        a[at:at + 4] = np.array([np.nan], dtype=np.float32).view(np.uint8)


def corrupting(direction: str, how: str, spec: str, armed: list[bool]):
    """Rank BAD's collective (all_to_all for pushes, all-gather for replies), corrupting its
    payload for shard 0 (push) or its aggregate of shard BAD (reply) while ``armed[0]``."""
    name = "all_to_all_single" if direction == "push" else _GATHER
    orig = getattr(dist, name)

    def call(output, inp, *args, **kwargs):
        if armed[0] and direction == "push":  # slot 0 goes to rank 0, owner of shard 0 (501)
            corrupt(inp[:inp.numel() // WORLD], how, spec, NUMEL - NUMEL // WORLD)
        elif armed[0]:
            corrupt(inp, how, spec, NUMEL // WORLD)
        return orig(output, inp, *args, **kwargs)
    return name, orig, call


def outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test records whatever was raised
        return type(e).__name__, str(e)
    return "none", ""


def hostile_case(rank: int, direction: str, how: str, spec: str, defer: bool) -> dict:
    """Step 1 is corrupted. Immediate checks raise from step 1; deferred ones zero the bucket at
    step 1 and raise its error from the next call (``late``); the call after that refuses."""
    state = TwoWayCompressionState(spec, "vanilla", min_compress_bytes=0)
    state._defer = defer
    b = FakeBucket(BUCKET, NUMEL, last=True)
    honest = run_buckets(state, [b], rank, range(1))[0][0]  # step 0 is honest
    armed = [rank == BAD]
    name, orig, call = corrupting(direction, how, spec, armed)
    setattr(dist, name, call)
    try:
        b.buf.copy_(grad(rank, BUCKET, 1, NUMEL))
        kind, msg = outcome(lambda: two_way_compression_hook(state, b).wait())
        zeroed = bool((b.buf == 0).all())
        armed[0] = False
        late = kind == "none"
        if late:
            b.buf.copy_(grad(rank, BUCKET, 2, NUMEL))
            kind, msg = outcome(lambda: two_way_compression_hook(state, b).wait())
        again = outcome(lambda: two_way_compression_hook(state, b).wait())
    finally:
        setattr(dist, name, orig)
    dist.barrier()  # every collective was matched: the group still works
    return {"kind": kind, "msg": msg, "zeroed": zeroed, "again": again, "late": late,
            "honest_ok": bool(torch.isfinite(honest).all() and honest.abs().sum() > 0)}


def pending_case(rank: int) -> tuple[str, str]:
    """Deferred checks: a corrupted last step surfaces from state_dict (check_pending)."""
    state = TwoWayCompressionState(SPEC, "vanilla", min_compress_bytes=0)
    state._defer = True
    b = FakeBucket(BUCKET, NUMEL, last=True)
    run_buckets(state, [b], rank, range(1))
    armed = [rank == BAD]
    name, orig, call = corrupting("push", "step", SPEC, armed)
    setattr(dist, name, call)
    try:
        run_buckets(state, [b], rank, range(1, 2))
    finally:
        setattr(dist, name, orig)
    dist.barrier()
    return outcome(state.state_dict)


def ddp_case(rank: int, defer: bool) -> tuple[str, str, int]:
    """Real DDP: rank BAD sends a push with a wrong step at the third iteration."""
    model = nn.parallel.DistributedDataParallel(make_model())
    state = TwoWayCompressionState(SPEC, "vanilla", min_compress_bytes=0)
    state._defer = defer
    model.register_comm_hook(state, two_way_compression_hook)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    armed = [False]
    name, orig, call = corrupting("push", "step", SPEC, armed)
    setattr(dist, name, call)
    try:
        for it in range(4):
            armed[0] = rank == BAD and it == 2
            err = outcome(lambda: model(x).square().mean().backward())
            if err[0] != "none":
                break
    finally:
        setattr(dist, name, orig)
    return (*err, it)  # the first failure (at iteration 2, deferred 3, on both ranks)


def hostile_worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=10))
    res = {(case, defer): hostile_case(rank, *case, defer) for case in HOSTILE
           for defer in (False, True)}
    res["ddp"] = {defer: ddp_case(rank, defer) for defer in (False, True)}
    res["pending"] = pending_case(rank)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    shutdown()


# -- the tests ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, out, what: str, limit: float) -> list[dict]:
    # spawn, not fork: a rank forked from the pytest process inherits the C++ thread pools
    # earlier tests started there, and once aborted at exit ("Resource deadlock avoided")
    ctx = mp.start_processes(fn, args=(_free_port(), str(out)), nprocs=WORLD, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + limit
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"{what} did not finish within {limit:.0f} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return _spawn(worker, tmp_path_factory.mktemp("ddp_hook"), "DDP hook workers", 120)


@pytest.mark.cluster
def test_none_spec_matches_plain_ddp_bit_exactly(results):
    for r, res in enumerate(results):
        assert res["none_equal"], f"rank {r}: max |diff| {res['none_maxdiff']}"


@pytest.mark.cluster
def test_compressed_replicas_identical_and_loss_decreases(results):
    p0, p1 = results[0]["params"], results[1]["params"]
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    for res in results:
        losses = res["losses"]
        assert sum(losses[-5:]) / 5 < 0.5 * losses[0], losses
        assert res["stats"]["compressed_buckets"] > 0
        assert res["buckets"] >= 2  # several buckets: the overlap path was used


@pytest.mark.cluster
def test_hook_matches_codec_reference(results):
    for res in results:
        bad = {k: v for k, v in res["ref_diff"].items() if v != 0.0}
        assert not bad, bad
        assert all(res["deferred_equal"].values()), res["deferred_equal"]
    for spec, _ in REF_SPECS:
        for a, b in zip(results[0]["ref_out"][spec], results[1]["ref_out"][spec]):
            assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.cluster
def test_pickled_state_resumes_identically(results):
    for res in results:
        assert all(res["resume_equal"].values()), res["resume_equal"]
        assert all(res["resume_nonzero"].values())


@pytest.mark.cluster
def test_resume_into_ddps_initial_buckets_waits_for_the_saved_layout(results):
    for res in results:
        assert res["relayout_first_exact"] and res["relayout_allreduced"] == 1
        assert res["relayout_equal"], "residuals not restored into the rebuilt bucket"


@pytest.mark.cluster
def test_bucket_size_change_recreates_codecs(results):
    for res in results:
        assert all(res["resize_equal"].values()), res["resize_equal"]


WHAT = {"key": "key {k1}, expected {k}", "step": "step 6, expected 1", "codec": "codec id",
        "nan": "non-finite"}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> list[dict]:
    return _spawn(hostile_worker, tmp_path_factory.mktemp("ddp_hostile"), "hostile ranks", 90)


@pytest.mark.cluster
@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("case", HOSTILE, ids=["-".join(c) for c in HOSTILE])
def test_corrupt_payload_is_rejected_naming_sender_and_bucket(hostile, case, defer):
    direction, how, _ = case
    shard = 0 if direction == "push" else BAD
    key = BUCKET * WORLD + shard
    what = WHAT[how].format(k=key, k1=key + 1)
    for rank, res in enumerate(hostile):
        r = res[(case, defer)]
        assert r["honest_ok"], f"rank {rank}: the honest step before the corruption failed"
        assert r["kind"] == "PayloadError", f"rank {rank}: {r['kind']}: {r['msg']}"
        assert r["late"] == defer, f"rank {rank}: raised late={r['late']}, deferred={defer}"
        assert f"bucket {BUCKET} shard {shard} (key {key}, step 1)" in r["msg"], r["msg"]
        if direction == "reply" or rank == shard:  # it decoded rank BAD's payload itself
            sender = f"rank {BAD} (owner of shard {BAD})" if direction == "reply" \
                else f"rank {BAD}"
            assert f"from {sender} rejected" in r["msg"] and what in r["msg"], r["msg"]
        else:  # the owner of shard 0 rejected the push and told the other ranks
            assert f"rank {shard}, the owner of this shard, rejected the push from rank {BAD}" \
                in r["msg"], r["msg"]
        assert r["zeroed"], f"rank {rank}: the bucket buffer was not zeroed"
        kind, msg = r["again"]
        assert kind == "GradpressError" and "an earlier bucket failed" in msg, (kind, msg)


@pytest.mark.cluster
def test_corrupt_push_fails_ddp_backward_on_every_rank(hostile):
    for rank, res in enumerate(hostile):
        for defer, at in ((False, 2), (True, 3)):  # deferred: one iteration late
            kind, msg, it = res["ddp"][defer]
            # (a future's error reaches backward as a RuntimeError quoting it)
            assert kind != "none", f"rank {rank}, deferred={defer}: backward did not fail"
            assert f"rank {BAD}" in msg and "bucket 0" in msg, (kind, msg)
            assert it == at, f"rank {rank}, deferred={defer}: failed at iteration {it}"


@pytest.mark.cluster
def test_deferred_failure_of_the_last_step_surfaces_from_state_dict(hostile):
    for rank, res in enumerate(hostile):
        kind, msg = res["pending"]
        assert kind == "PayloadError" and f"rank {BAD}" in msg, (rank, kind, msg)


# -- single-process checks -----------------------------------------------------------------------
def test_state_pickles_without_process_group():
    state = TwoWayCompressionState("topk:k=0.01", "vanilla", min_compress_bytes=4096,
                                   dense_steps=5, seed=3, overlap=False, lr=0.1)
    state.process_group = object()  # not picklable in general; must be dropped
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None
    assert (copy.compression, copy.ef, copy.min_compress_bytes, copy.dense_steps, copy.seed,
            copy.overlap, copy.lr) == (parse_spec("topk:k=0.01"), parse_ef("vanilla"), 4096, 5,
                                       3, False, 0.1)
    assert copy.state_dict() == state.state_dict()


TOPK = "topk:k=0.01,values=fp16"


@pytest.mark.parametrize("compression", [
    TOPK,
    {"compressor": "topk", "k": 0.01, "values": "fp16"},
    parse_spec(TOPK),
], ids=["string", "dict", "CodecSpec"])
def test_compression_is_a_string_a_dict_or_a_codec_spec_alike(compression):
    """The three forms of ``compression=`` give the same state, the same codec bytes (so the
    same wire fingerprint) and the same checkpointed state."""
    state = TwoWayCompressionState(compression, "vanilla", min_compress_bytes=0, seed=3)
    ref = TwoWayCompressionState(TOPK, "vanilla", min_compress_bytes=0, seed=3)
    assert state.compression.name == "topk" and state.ef == parse_ef("vanilla")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    mine, theirs = state._build(1000), ref._build(1000)
    for step in range(3):  # the residual carries over: equal bytes at every step
        assert torch.equal(mine.compress(x, key=5, step=step), theirs.compress(x, key=5, step=step))
    assert mine.state_dict().keys() == theirs.state_dict().keys()
    copy = pickle.loads(pickle.dumps(state))
    assert copy.compression == state.compression and copy.ef == state.ef
    assert torch.equal(copy._build(1000).compress(x, key=5, step=0),
                       ref._build(1000).compress(x, key=5, step=0))


def test_error_feedback_inside_compression_must_agree_with_ef():
    spec = {"compressor": "onebit", "ef": "corrected"}
    assert TwoWayCompressionState(spec, None).ef == parse_ef("corrected")
    assert TwoWayCompressionState(spec, "corrected").ef == parse_ef("corrected")
    assert "ef" not in TwoWayCompressionState(spec, None).compression.wrappers
    with pytest.raises(ValueError, match="ef given twice"):
        TwoWayCompressionState(spec)  # ef="vanilla" (the default) against the spec's corrected
    assert not TwoWayCompressionState("onebit", None).ef.enabled  # no ef anywhere: off


def test_state_dict_roundtrip_keeps_pending_buckets():
    state = TwoWayCompressionState("onebit")
    saved = {"version": 1, "iter": 7, "steps": {0: 7},
             "buckets": {0: {"numel": 10, "world_size": 2, "rank": 0, "worker": [{}, {}],
                             "server": {}}}}
    state.load_state_dict(saved)
    assert state.state_dict() == saved and state.iter == 7


@pytest.mark.parametrize("kwargs, match", [
    ({"compression": "nosuch"}, "nosuch"),
    ({"compression": {"k": 0.1}}, "compressor"),
    ({"ef": "bogus"}, "bogus"),
    ({"min_compress_bytes": -1}, "min_compress_bytes"),
    ({"dense_steps": 1.5}, "dense_steps"),
    ({"lr": -0.1}, "lr"),
])
def test_invalid_hyperparameters_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TwoWayCompressionState(**kwargs)


def test_hyperparameters_are_read_only_and_state_keys_checked():
    state = TwoWayCompressionState("onebit")
    with pytest.raises(AttributeError):
        state.compression = "topk"
    with pytest.raises(TypeError, match="compression"):
        TwoWayCompressionState(compression=3)
    with pytest.raises(TypeError, match="compression"):
        TwoWayCompressionState(compression=None)
    with pytest.raises(ValueError, match="expected keys"):
        state.load_state_dict({"iter": 0})


# -- deferred checks against the immediate ones, one process (world 3, rank 0) -----------------
def _exchange(numel: int, deferred: bool, dtype=torch.float32):
    from gradpress.ddp.buckets import BucketCodecs, BucketExchange
    layout = (3, 0, numel, dtype, "cpu", (((numel,), 0),))
    c = BucketCodecs(layout, numel, 3, 0, lambda n: build(SPEC, n, ef="vanilla"),
                     torch.device("cpu"))
    return BucketExchange(5, torch.full((numel,), 7.0, dtype=dtype), c, 2, None, None,
                          deferred=deferred)


def _fill(c, buf: torch.Tensor, shard_of, bad: dict) -> None:
    """Slot i of ``buf``: a payload of shard ``shard_of(i)`` (key 5 * 3 + shard, step 2),
    corrupted as ``bad[i]`` says: NaN scale, wrong step, or an abort record naming rank 2."""
    for i in range(3):
        s = shard_of(i)
        lo, hi = c.bounds[s]
        x = torch.randn(hi - lo, generator=torch.Generator().manual_seed(10 * i + s))
        p = c.payload(buf, i, s)
        build(SPEC, hi - lo).compress(x, key=5 * 3 + s, step=2, out=p)
        how = bad.get(i)
        if how == "nan":
            p[-4:].copy_(torch.tensor([float("nan")]).view(torch.uint8))
        elif how == "step":
            p[16] += 5
        elif how == "abort":
            p[:8].copy_(torch.tensor([71, 88, 0, 0, 2, 0, 0, 0], dtype=torch.uint8))


def _run(fn, ex):
    from gradpress.ps.errors import PayloadError
    try:
        return fn(ex), None
    except PayloadError as e:
        return None, str(e)


PUSH_CASES = [{}, {1: "nan"}, {2: "step"}, {1: "nan", 2: "step"}, {0: "nan", 2: "nan"}]


@pytest.mark.parametrize("bad", PUSH_CASES, ids=str)
def test_deferred_reduce_sends_what_the_immediate_checks_send(bad):
    """The owner's abort record names the same sender (a bad header before a non-finite sum,
    else the first non-finite partial sum); a clean reduce sends the same aggregate bytes."""
    from gradpress.ddp.buckets import reduce_shard
    from gradpress.ddp.checks import raise_failed, reduce_shard_deferred
    agg, errors = {}, {}
    for deferred in (False, True):
        ex = _exchange(100, deferred)
        _fill(ex.codecs, ex.codecs.recv, lambda i: 0, bad)
        fn = reduce_shard_deferred if deferred else reduce_shard
        _, errors[deferred] = _run(functools.partial(lambda f, e: f(e, None), fn), ex)
        agg[deferred] = ex.codecs.agg.clone()
        if deferred and bad:  # the host re-check raises the immediate path's error
            assert errors[True] is None
            _, errors[True] = _run(raise_failed, ex)
    if bad:
        assert torch.equal(agg[True][:8], agg[False][:8]) and bytes(agg[True][:2]) == b"GX"
        assert errors[True] == errors[False] and "push from rank" in errors[False]
    else:
        assert torch.equal(agg[True], agg[False]) and errors == {False: None, True: None}


REPLY_CASES = [{}, {1: "nan"}, {2: "step"}, {0: "abort"}, {1: "step", 2: "nan"}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bad", REPLY_CASES, ids=str)
def test_deferred_finish_matches_the_immediate_checks(bad, dtype):
    """Same bucket bytes when clean; a failed bucket is zeroed with a False flag, and the host
    re-check raises the immediate path's PayloadError text."""
    from gradpress.ddp.buckets import finish
    from gradpress.ddp.checks import finish_deferred, raise_failed
    out, errors = {}, {}
    for deferred in (False, True):
        ex = _exchange(100, deferred, dtype)
        _fill(ex.codecs, ex.codecs.recv, lambda i: 0, {})  # clean pushes: the re-check passes
        _fill(ex.codecs, ex.codecs.gathered, lambda i: i, bad)
        flag, errors[deferred] = _run(finish_deferred if deferred else finish, ex)
        if deferred:
            assert errors[True] is None and bool(flag[0]) == (not bad) and not bool(flag[1])
            if bad:
                _, errors[True] = _run(raise_failed, ex)
        out[deferred] = ex.buffer.clone()
    assert torch.equal(out[True], out[False]) and out[True].dtype == dtype
    assert errors[True] == errors[False]
    assert bool((out[True] == 0).all()) == bool(bad)


def test_device_check_records_its_event_on_the_flags_device(monkeypatch):
    """``DeviceCheck`` records its event on the current stream of the flag's device, not on
    that of the thread's current device (``torch.cuda.Event.record()`` without a stream takes
    ``torch.cuda.current_stream()``, torch/cuda/streams.py): on a communication thread whose
    current device is 0, a bucket on cuda:1 would get an event that covers none of its copy.
    CUDA is faked: a flag object on "cuda:1", and recorders for the stream, event and copy."""
    import gradpress.ddp.checks as B
    recorded, copied = [], []

    class Ok:
        device = torch.device("cuda", 1)
        shape = (2,)

    class Flag:
        def copy_(self, src, non_blocking=False):
            copied.append((src, non_blocking))

    class Event:
        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.setattr(B.torch, "empty", lambda *a, **k: Flag())
    monkeypatch.setattr(B.torch.cuda, "Event", Event)
    monkeypatch.setattr(B.torch.cuda, "current_stream",
                        lambda device=None: ("current stream of", device))
    ok = Ok()
    B.DeviceCheck(None, ok)  # type: ignore[arg-type]
    assert copied == [(ok, True)]
    assert recorded == [("current stream of", torch.device("cuda", 1))]


@pytest.mark.parametrize("bad", [{1: "marked"}, {0: "step", 1: "marked"},
                                 {1: "marked", 2: "step"}, {0: "nan", 2: "marked"}], ids=str)
def test_push_marked_rejected_by_its_sender_is_rejected_naming_it(bad):
    """A sender whose device-payload compress rejected its input (``last_finite`` False: no
    raise, the payload still goes out) marks the header's flags (``mark_rejected``); the owner
    rejects that push, deferred or not, naming the same sender with the same error, even when
    the payload decodes to finite values (randomk, topk with fp16 values)."""
    from gradpress.ddp.buckets import reduce_shard
    from gradpress.ddp.checks import (
        mark_rejected,
        raise_failed,
        reduce_shard_deferred,
    )
    agg, errors = {}, {}
    for deferred in (False, True):
        ex = _exchange(100, deferred)
        _fill(ex.codecs, ex.codecs.recv, lambda i: 0, {i: b for i, b in bad.items()
                                                       if b != "marked"})
        for i in (i for i, b in bad.items() if b == "marked"):
            mark_rejected(ex.codecs.payload(ex.codecs.recv, i, 0), torch.tensor(False))
        fn = reduce_shard_deferred if deferred else reduce_shard
        _, errors[deferred] = _run(functools.partial(lambda f, e: f(e, None), fn), ex)
        agg[deferred] = ex.codecs.agg.clone()
        if deferred:
            assert errors[True] is None
            _, errors[True] = _run(raise_failed, ex)
    first = min(i for i, b in bad.items() if b != "nan")  # header checks before the sum's
    assert bytes(agg[True][:2]) == b"GX" and int(agg[True][4]) == first
    assert torch.equal(agg[True][:8], agg[False][:8])
    assert errors[True] == errors[False] and f"push from rank {first}" in errors[False]
    if bad[first] == "marked":
        assert "non-finite" in errors[False]


def test_mark_rejected_sets_the_flags_only_for_a_false_flag():
    from gradpress.ddp.checks import mark_rejected
    p = torch.zeros(48, dtype=torch.uint8)
    mark_rejected(p, torch.tensor(True))
    assert not p.any()
    mark_rejected(p, torch.tensor(False))
    assert p.nonzero().flatten().tolist() == [36]

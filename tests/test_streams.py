"""The CUDA path's stream and host-buffer rules (issue #43), with CPU twins where one exists.

* ``torch.set_default_device``: every host buffer gradpress means (pinned staging, wire and
  control buffers, the hook's header and flag buffers, the nan flag) is made on ``"cpu"``
  explicitly. The CPU twins run the PS path (a real cluster) and the DDP hook with the default
  device set to ``"meta"``, where any buffer made without a device cannot be read on the host
  and fails at once; the CUDA tests set ``"cuda"``, as a user's script would.
* ``decode_chunk`` rejects a reply after its decode kernels were queued on the copy stream:
  ``out`` must still be ``record_stream``-ed there, or a caller that drops the failed handle
  gets ``out``'s block back while the copy stream still writes it (CUDA; a CPU twin with
  stand-in streams).
* ``Handle.wait`` on two streams: the second waiter waits for the first one's conversion (CUDA).
* Fusion with backward on a side stream and the step on the default stream: the push waits for
  every member's copy (CUDA, a real cluster; a CPU twin: "meta" tensors as CUDA ones, stand-in
  streams).
* The dense phase of ``uncompressed_params="auto"`` reads nothing on the host per parameter:
  its meter works on ``"meta"`` tensors (CPU twin), and a dense step makes no host
  synchronisation beyond the pipeline's documented ones (CUDA, a real cluster).
"""

from __future__ import annotations

import contextlib
import gc
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradpress.compress import build
from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook
from helpers import check_replicas, finish, launch_script

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SLEEP = 200_000_000  # torch.cuda._sleep cycles: ~0.1 s, far longer than the host's next steps

WORKER = textwrap.dedent('''
    import json, os, sys, warnings
    import torch
    import gradpress as gp
    from gradpress.api import _rt

    out_dir, part = sys.argv[1], sys.argv[2]
    MODE = os.environ["GRADPRESS_COMPRESS_ON"]
    cuda = torch.cuda.is_available() and part != "meta"
    if cuda:
        torch.cuda.set_device(0)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if part in ("meta", "default_cuda"):  # before init, as a user's script would
        torch.set_default_device("meta" if part == "meta" else dev)
    gp.init()
    r, W = gp.rank(), gp.size()
    results = {}

    def make(rank, i, shape=(999,)):
        g = torch.Generator(device="cpu").manual_seed(1009 * i + rank)
        return torch.randn(shape, generator=g, device="cpu")

    def model(tag):
        torch.manual_seed(0)
        return {f"{tag}.w{i}": torch.nn.Parameter(torch.zeros(n, device=dev))
                for i, n in enumerate([3, 5, 7, 4000])}

    def train(tag, steps, bad_step=None, **kw):
        params = model(tag)
        opt = gp.DistributedOptimizer(torch.optim.SGD(params.values(), lr=0.1),
                                      params.items(), **kw)
        ws = list(params.values())
        for s in range(steps):
            opt.zero_grad()
            loss = sum((w * make(r, 7 * s + i, w.shape).to(dev)).sum()
                       for i, w in enumerate(ws[:3]) if i != 2)  # w2 gets no gradient
            loss = loss + (ws[3] * make(r, 99, ws[3].shape).to(dev)).sum()
            if s == bad_step and r == 1:
                loss = loss * float("inf")
            loss.backward()
            opt.step()
            results[f"{tag}/skipped{s}"] = torch.tensor(opt.step_skipped, device="cpu")
        return [w.detach().cpu() for w in ws]

    def defaults():
        """push_pull of every codec and a training loop (fusion, dense phase, nan skip)."""
        for spec, ef in [("none", None), ("fp16", None), ("onebit", "vanilla"),
                         ("topk:k=0.05", "vanilla"), ("randomk:k=0.05", None),
                         ("dithering:s=7", None)]:
            for step in range(2):
                x = make(r, step).to(dev)
                y = gp.push_pull(x, f"d/{spec}", compression=spec, ef=ef, min_compress_bytes=0)
                assert y.device == dev and bool(torch.isfinite(y).all()), spec
                if spec == "none":
                    ref = sum(make(w, step) for w in range(W)) / W
                    assert torch.equal(y.cpu(), ref), step
                results[f"d/{spec}/{step}"] = y.cpu()
        for i, w in enumerate(train("t", 4, bad_step=2, compression="onebit", nan_policy="skip",
                                    dense_steps=2)):
            results[f"t/w{i}"] = w
        assert bool(results["t/skipped2"]) and not bool(results["t/skipped3"])

    def fusion():
        """Backward inside torch.cuda.stream(side), behind a sleep; step() outside it."""
        side = torch.cuda.Stream(dev)
        params = model("f")
        opt = gp.DistributedOptimizer(torch.optim.SGD(params.values(), lr=1.0), params.items(),
                                      compression="onebit", min_compress_bytes=1 << 20)
        ws = list(params.values())
        for s in range(2):
            opt.zero_grad()
            xs = [make(r, 7 * s + i, w.shape).to(dev) for i, w in enumerate(ws)]
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                torch.cuda._sleep(SLEEP_CYCLES)  # the members' copies queue behind this
                sum((w * x).sum() for i, (w, x) in enumerate(zip(ws, xs)) if i != 2).backward()
            opt.synchronize()  # on the default stream: w2's zeros complete the fused key
            torch.cuda.synchronize()
            for i, w in enumerate(ws):
                want = torch.zeros(w.shape) if i == 2 else \\
                    sum(make(q, 7 * s + i, w.shape) for q in range(W)) / W
                assert torch.equal(w.grad.cpu(), want), (s, i, w.grad[:4], want[:4])
                results[f"f/{s}/{i}"] = w.grad.cpu()
            with opt.skip_synchronize():
                opt.step()

    def dense_syncs():
        """Host synchronisations of one dense-phase step with uncompressed_params="auto"."""
        params = model("s")
        opt = gp.DistributedOptimizer(torch.optim.SGD(params.values(), lr=0.1), params.items(),
                                      compression="onebit", dense_steps=4,
                                      uncompressed_params="auto")
        ws = list(params.values())
        xs = [make(r, i, w.shape).to(dev) for i, w in enumerate(ws)]
        found = {}
        for s in range(3):
            opt.zero_grad()
            loss = sum((w * x).sum() for w, x in zip(ws, xs))
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    loss.backward()
                    opt.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            found[s] = [str(w.message) for w in warned if "synchroniz" in str(w.message)]
        chunks = sum(len(p.chunks) for p in _rt().worker.plans().values())
        with open(os.path.join(out_dir, f"syncs{r}.json"), "w") as f:
            json.dump({"mode": MODE, "chunks": chunks, "syncs": found}, f)
        allowed = 0 if MODE == "host" else chunks  # host: none; device: one per chunk, out
        assert len(found[2]) <= allowed, (MODE, chunks, found[2][:3])
        results["params"] = ws[3].detach().cpu()

    {"meta": defaults, "default_cuda": defaults, "fusion": fusion,
     "dense_syncs": dense_syncs}[part]()
    torch.save(results, os.path.join(out_dir, f"worker{r}.pt"))
    gp.shutdown()
''').replace("SLEEP_CYCLES", str(SLEEP))


def _job(tmp_path: Path, part: str, mode: str = "host") -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    finish([launch_script(["--workers", "2", "--servers", "1"], script, tmp_path, part,
                          GRADPRESS_COMPRESS_ON=mode)])
    check_replicas(tmp_path, 2)


# -- torch.set_default_device -------------------------------------------------------------------
@pytest.mark.cluster
@pytest.mark.parametrize("mode", ["host", "device"])
def test_ps_path_under_a_meta_default_device(tmp_path: Path, mode: str) -> None:
    _job(tmp_path, "meta", mode)


@pytest.mark.cluster
@needs_cuda
@pytest.mark.parametrize("mode", ["host", "device"])
def test_cuda_ps_path_under_a_cuda_default_device(tmp_path: Path, mode: str) -> None:
    _job(tmp_path, "default_cuda", mode)


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


def hook_under_default(device: torch.device, default: str, defer: bool, tmp_path: Path,
                       backend: str) -> None:
    """Every codec through the hook, both policies' paths (an inf bucket under "skip")."""
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    torch.set_default_device(default)
    try:
        for spec in ["onebit", "topk:k=0.1", "randomk:k=0.1", "dithering:s=7", "fp16"]:
            ef = "sparse" if spec.startswith("randomk") else "vanilla"
            state = TwoWayCompressionState(spec, ef, min_compress_bytes=0, nan_policy="skip")
            state._defer = defer
            bucket = Bucket(torch.randn(1000, device=device))
            for it in range(3):
                bucket.buf.normal_()
                if it == 1:
                    bucket.buf[3] = float("inf")
                out = two_way_compression_hook(state, bucket).wait()
                assert out.device == device and bool(torch.isinf(out).all()) == (it == 1), spec
            state.check_pending()
            assert state.compression_stats()["skipped_buckets"] == 1, spec
    finally:
        torch.set_default_device(None)
        dist.destroy_process_group()


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_ddp_hook_under_a_meta_default_device(tmp_path: Path, defer: bool) -> None:
    hook_under_default(torch.device("cpu"), "meta", defer, tmp_path, "gloo")


@needs_cuda
@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_cuda_ddp_hook_under_a_cuda_default_device(tmp_path: Path, defer: bool) -> None:
    torch.cuda.set_device(0)
    hook_under_default(torch.device("cuda", 0), "cuda", defer, tmp_path, "nccl")


# -- decode_chunk's error path ------------------------------------------------------------------
@needs_cuda
def test_cuda_decode_chunk_records_out_on_the_copy_stream_when_it_rejects():
    """A device-mode reply with an inf: decode_reply queues the decode on the copy stream (held
    back by a sleep), then rejects the payload from its bytes. ``out`` dropped at once must not
    be handed out again before the copy stream wrote it: a tensor allocated right after keeps
    the value it was filled with."""
    from gradpress.ps.calls import ChunkJob, ChunkState, PinnedKeeper, decode_chunk
    from gradpress.ps.errors import PayloadError
    n, dev = 1 << 20, torch.device("cuda", 0)
    dec = build("none", n, backend="torch")
    bad = torch.ones(n)
    bad[5] = float("inf")
    payload = build("none", n, nan_policy="allow").compress(bad, key=0, step=0)

    class Desc:
        label = "test"

    chunk = ChunkState(0, Desc(), 0, "server 0", dec, dec, dec.payload_bytes)  # type: ignore
    stream = torch.cuda.Stream(dev)
    out = torch.empty(n, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP)
    job = ChunkJob(chunk, out, out, None, None, stream)  # type: ignore[arg-type]
    job.recv = payload
    with pytest.raises(PayloadError, match="non-finite"):
        decode_chunk(job, True, PinnedKeeper())
    del job, out
    gc.collect()
    fresh = torch.full((n,), 7.0, device=dev)  # the same size, on the default stream
    torch.cuda.synchronize()
    assert bool((fresh == 7.0).all()), "the copy stream wrote into a reused block"


# -- Handle.wait on two streams -----------------------------------------------------------------
@needs_cuda
def test_cuda_second_wait_on_another_stream_waits_for_the_first_conversion():
    """An fp16 result: the first wait, on s1 behind a sleep, queues the conversion there; the
    second, on s2, must not read the converted tensor before that conversion ran."""
    from gradpress.ps.calls import Handle
    n, dev = 1 << 20, torch.device("cuda", 0)
    copy, s1, s2 = (torch.cuda.Stream(dev) for _ in range(3))
    out = torch.empty(n, device=dev)
    with torch.cuda.stream(copy):
        out.fill_(3.0)
        done = copy.record_event()
    h = Handle("t", out, torch.Size([n]), torch.float16, dev, 1)
    h._chunk_done(done)
    with torch.cuda.stream(s1):
        torch.full((n,), float("nan"), device=dev, dtype=torch.float16)  # freed: reused below
        torch.cuda._sleep(SLEEP)
        first = h.wait()
    with torch.cuda.stream(s2):
        second = h.wait()
        seen = second.clone()
    torch.cuda.synchronize()
    assert second is first and bool((first == 3.0).all())
    assert bool((seen == 3.0).all()), "the second waiter read before the conversion ran"


# -- fusion across streams ----------------------------------------------------------------------
@pytest.mark.cluster
@needs_cuda
def test_cuda_fusion_waits_for_members_copied_on_a_side_stream(tmp_path: Path) -> None:
    _job(tmp_path, "fusion")


# -- the dense phase of uncompressed_params="auto" ------------------------------------------------
def test_agreement_meter_reads_nothing_on_the_host_while_measuring():
    """On "meta" tensors any host read raises: step 1 of the meter makes none."""
    from gradpress.torch.agreement import AgreementMeter
    m = AgreementMeter(["a", "b"])
    for _ in range(3):
        for name in ("a", "b"):
            m.add_local(name, torch.ones(1000, device="meta"))
            m.add_average(name, torch.ones(1000, device="meta", dtype=torch.bfloat16))
        m.end_step()
    assert m.steps == 3 and m._sums["a"].device.type == "meta"


def test_agreement_meter_on_the_cpu_decides_as_before():
    """The device sums give the float64 ratio of the host computation (to float32 rounding)."""
    from gradpress.torch.agreement import AgreementMeter
    m = AgreementMeter(["a"])
    g = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    avg = 0.5 * g + 0.1
    for _ in range(2):
        m.add_local("a", g)
        m.add_average("a", avg)
        m.end_step()
    want = 2 * float(avg.double().pow(2).sum() / g.double().pow(2).sum())
    assert m.state_dict()["sums"]["a"] == pytest.approx(want, rel=1e-6)
    assert m.decide(lambda v: v * 2, 2).values["a"] == pytest.approx(2 * want / 2 - 1, rel=1e-5)


@pytest.mark.cluster
@needs_cuda
@pytest.mark.parametrize("mode", ["host", "device"])
def test_cuda_dense_phase_step_adds_no_synchronisation(tmp_path: Path, mode: str) -> None:
    _job(tmp_path, "dense_syncs", mode)


# -- CPU twins of the stream bookkeeping: stand-in streams and events ------------------------------
class _Event(str):
    """A stand-in CUDA event, named after the stream and position it was recorded at."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """A stand-in CUDA stream: logs the events it waited on and recorded (named after it)."""

    def __init__(self, name: str, index: int = 0) -> None:
        self.name, self.device = name, torch.device("cuda", index)
        self.log: list[tuple[str, object]] = []

    def wait_event(self, event: object) -> None:
        self.log.append(("waits", event))

    def record_event(self, event: object = None) -> _Event:
        made = _Event(f"{self.name}:{len(self.log)}")
        self.log.append(("records", made))
        return made


class _Current(threading.local):
    """Each thread's current stand-in stream (``current[0]``; ``first`` until one is set), as
    CUDA keeps a current stream per thread."""

    def __init__(self, first: _Stream) -> None:
        self.stream = first

    def __getitem__(self, _: int) -> _Stream:
        return self.stream

    def __setitem__(self, _: int, stream: _Stream) -> None:
        self.stream = stream


def _stand_ins(monkeypatch: pytest.MonkeyPatch, first: _Stream) -> tuple[_Current, list]:
    """The current stream (``current[0] = s`` switches this thread's) and a log of
    record_stream calls."""
    from gradpress.ps import calls

    current, recorded = _Current(first), []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: recorded.append((self.data_ptr(), s.name)))

    @contextlib.contextmanager
    def on_stream(stream: _Stream | None) -> Iterator[None]:
        before = current[0]
        current[0] = stream or before
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(calls, "on_stream", on_stream)
    return current, recorded


def test_decode_chunk_records_out_on_its_stream_when_it_rejects(monkeypatch) -> None:
    """CPU twin of finding 5: the reply's decode is queued on the copy stream, then rejected
    from its bytes; ``out`` is ``record_stream``-ed there all the same, and no event is made
    (the handle fails instead)."""
    from gradpress.ps.calls import ChunkJob, ChunkState, PinnedKeeper, decode_chunk
    from gradpress.ps.errors import PayloadError
    copy = _Stream("copy")
    _, recorded = _stand_ins(monkeypatch, _Stream("caller"))
    n = 1000
    dec = build("none", n, backend="torch")
    bad = torch.ones(n)
    bad[5] = float("inf")
    payload = build("none", n, nan_policy="allow").compress(bad, key=0, step=0)

    class Desc:
        label = "test"

    chunk = ChunkState(0, Desc(), 0, "server 0", dec, dec, dec.payload_bytes)  # type: ignore
    out = torch.zeros(n)
    job = ChunkJob(chunk, out, out, None, None, copy, "ready")  # type: ignore[arg-type]
    job.recv = payload
    with pytest.raises(PayloadError, match="non-finite"):
        decode_chunk(job, True, PinnedKeeper())
    assert float(out[0]) == 1.0, "the decode ran before the rejection (as queued kernels do)"
    assert recorded == [(out.data_ptr(), "copy")], "out not recorded on the copy stream"
    assert copy.log == []


def test_fusion_push_waits_for_every_members_copy_whatever_its_stream(monkeypatch) -> None:
    """CPU twin of finding 2: "meta" tensors stand in for CUDA ones. Two members arrive on a
    side stream (backward inside ``torch.cuda.stream(side)``), the third, a parameter without
    a gradient, on the main stream (its zeros come from ``step()``). Each copy waits for the
    bucket's zero fill and records an event; the push, on the main stream, is submitted only
    after that stream waited for all three copies."""
    from gradpress.ps.calls import Handle
    from gradpress.ps.fusion import Fuser, fused_keys
    side, main = _Stream("side"), _Stream("main")
    current, recorded = _stand_ins(monkeypatch, side)
    monkeypatch.setattr(torch.Tensor, "is_cuda",
                        property(lambda self: self.device.type in ("cuda", "meta")))
    pushed: list[tuple[str, list]] = []

    def push(buf: torch.Tensor, name: str) -> Handle:
        pushed.append((current[0].name, list(current[0].log)))  # what submit's event covers
        h = Handle(name, buf, buf.shape, buf.dtype, buf.device, 1)
        h._chunk_done()
        return h

    fuser = Fuser(fused_keys([("a", 2), ("b", 3), ("c", 1)], 1000), push, timeout=5.0)
    fuser.add("a", torch.ones(2, device="meta"))
    fuser.add("b", torch.ones(3, device="meta"))
    assert pushed == []
    current[0] = main
    fuser.add("c", torch.zeros(1, device="meta"))
    assert side.log == [("records", "side:0"),                       # the zero fill
                        ("waits", "side:0"), ("records", "side:2"),  # a's copy
                        ("waits", "side:0"), ("records", "side:4")]  # b's copy
    copies = [("waits", "side:2"), ("waits", "side:4"), ("waits", "main:1")]
    assert pushed == [("main", [("waits", "side:0"), ("records", "main:1"), *copies])], pushed
    assert {s for _, s in recorded} == {"side", "main"}, "the bucket is recorded on both"


def test_copy_streams_one_per_pool_thread_out_one_per_device_back() -> None:
    """Finding 7: host mode gives each thread its own stream of a device for the way out and
    every thread the device's one stream for the way back; device mode one stream per device
    (the codecs' device state lives there)."""
    from gradpress.ps.streams import CopyStreams
    made: list[_Stream] = []

    def new(device: torch.device) -> _Stream:
        made.append(_Stream(f"s{len(made)}", device.index))
        return made[-1]

    host, d0, d1 = CopyStreams(False, new), torch.device("cuda", 0), torch.device("cuda", 1)
    got: dict[str, tuple] = {}
    both = threading.Barrier(2, timeout=10)  # alive together, as pool threads are: two idents

    def pick(t: str) -> None:
        got[t] = (host.way_out(d0), host.way_out(d0), host.way_back(d0))
        both.wait()

    ts = [threading.Thread(target=pick, args=(t,)) for t in ("t1", "t2")]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    (a, a2, back_a), (b, b2, back_b) = got["t1"], got["t2"]
    assert a is a2 and b is b2 and a is not b, "one way-out stream per thread"
    assert back_a is back_b and back_a not in (a, b), "one way-back stream per device"
    assert host.way_out(d1).device.index == 1 and host.way_back(d1) is not back_a
    assert len(host.all()) == 5  # t1's, t2's and the way back on 0; this thread's, back on 1
    device = CopyStreams(True, new)
    assert device.way_out(d0) is device.way_back(d0) is device.way_out(d0)
    assert len(device.all()) == 1


def test_two_pool_threads_hand_their_chunks_back_by_events(monkeypatch) -> None:
    """Finding 7's twin: two chunks compressed by two threads on their own streams, decoded by
    the receiver on the way-back stream, waited on the caller's stream. Each way-out stream
    holds its own chunk's wait and copy only; the way back waits for each chunk's submit
    event before writing its result; the caller's stream waits for the way back's events;
    every tensor is recorded on the stream that used it."""
    from types import SimpleNamespace

    from gradpress.ps import calls
    from gradpress.ps.streams import CopyStreams
    caller = _Stream("caller")
    current, recorded = _stand_ins(monkeypatch, caller)
    monkeypatch.setattr(calls, "blocking_event", lambda: None)
    made: list[_Stream] = []
    streams = CopyStreams(False, lambda d: made.append(_Stream(f"s{len(made)}")) or made[-1])
    n = 8
    codec = build("none", n)
    xs = [torch.full((n,), float(i + 1)) for i in range(2)]
    out = torch.zeros(2 * n)
    handle = calls.Handle("g", out, torch.Size([2 * n]), torch.float32, torch.device("cpu"), 2)
    back = streams.way_back(torch.device("cuda", 0))
    jobs = [calls.ChunkJob(SimpleNamespace(enc=codec, dec=codec, key=i, server_name="server 0",
                                           label=f"k{i}"),  # type: ignore[arg-type]
                           xs[i], out[i * n:(i + 1) * n], handle, None, None, f"ready{i}",
                           back=back, send=torch.empty(codec.payload_bytes, dtype=torch.uint8))
            for i in range(2)]

    both = threading.Barrier(2, timeout=10)  # alive together, as pool threads are

    def push(job: calls.ChunkJob) -> None:  # as WorkerEngine._push does, on a pool thread
        job.stream = streams.way_out(torch.device("cuda", 0))
        calls.compress_chunk(job, False)
        both.wait()

    ts = [threading.Thread(target=push, args=(j,)) for j in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    outs = [j.stream for j in jobs]
    assert outs[0] is not outs[1] and back not in outs
    for i, s in enumerate(outs):
        assert s.log == [("waits", f"ready{i}"), ("records", f"{s.name}:1")], s.log
    keeper = calls.PinnedKeeper()
    for j in jobs[::-1]:  # replies land in any order; the receiver decodes them
        j.recv = j.send.clone()  # "none": one worker's reply is its own push
        handle._chunk_done(calls.decode_chunk(j, False, keeper))
    assert back.log == [("waits", "ready1"), ("records", f"{back.name}:1"),
                        ("waits", "ready0"), ("records", f"{back.name}:3")]
    assert torch.equal(handle.wait(), torch.cat(xs))
    assert caller.log[:2] == [("waits", f"{back.name}:1"), ("waits", f"{back.name}:3")]
    assert sorted(recorded) == sorted([(xs[0].data_ptr(), outs[0].name),
                                       (xs[1].data_ptr(), outs[1].name),
                                       (out[n:].data_ptr(), back.name),
                                       (out[:n].data_ptr(), back.name)])

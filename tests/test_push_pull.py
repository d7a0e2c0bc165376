"""push_pull end to end: real processes on loopback, started by ``gradpress launch``.

References (computed inside each worker, for every worker's input, in rank order):

* ``none``: ``sum(x_w for w in range(W)) / W`` in float32 (Python ``sum`` starts at 0, as the
  server's accumulator does), compared bit for bit; ``average=False`` drops the division.
* ``onebit`` with error feedback on workers and server, per chunk ``c`` (key
  ``chunk_key(name, c)``) and step ``t``, with codecs built by ``gradpress.compress.build``:
  ``p_w = enc_w.compress(x_w[c], key, t, lr)``; ``reply = reduce_pushes(p_0..p_W-1)`` (the
  servers' own function: decode-accumulate in rank order, ``/ W``, recompress with the server
  residual); ``dec.decompress(reply)``. Every worker's result must equal it bit for bit, and the
  replicas must be identical. ``tests/test_ef.py`` checks ``reduce_pushes`` itself against the
  plain summation.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import check_replicas, finish, free_port, launch_script

WORKER = textwrap.dedent('''
    import os, sys, threading
    import torch
    import gradpress as gp
    from gradpress.compress import build, parse_ef
    from gradpress.ps.partition import chunk_key, chunk_layout
    from gradpress.ps.reduce import reduce_pushes

    out_dir, modes = sys.argv[1], sys.argv[2].split(",")
    PART = int(os.environ["GRADPRESS_PARTITION_BYTES"])
    SHAPES = [(0,), (), (1,), (7,), (3, 5), (2, 3, 4), (999,), (1000,), (2503,), (33, 61)]
    gp.init()
    r, W = gp.rank(), gp.size()
    assert W == int(os.environ["GRADPRESS_NUM_WORKERS"])

    def make(rank, i, step, shape, dtype=torch.float32):
        g = torch.Generator().manual_seed(10007 * step + 101 * i + rank)
        return torch.randn(shape, generator=g).to(dtype)

    def bits(t):
        return t.reshape(-1).to(torch.float32).view(torch.int32)

    results = {}

    def check_none(step):
        cases = [(f"t{i}", s, torch.float32, True) for i, s in enumerate(SHAPES)]
        cases += [("sum", (2503,), torch.float32, False), ("f64", (17,), torch.float64, True)]
        hs = [gp.push_pull_async(make(r, i, step, s, dt), name, average=avg)
              for i, (name, s, dt, avg) in enumerate(cases)]
        for i, (h, (name, s, dt, avg)) in enumerate(zip(hs, cases)):
            y = h.wait()
            ref = sum(make(w, i, step, s, dt).to(torch.float32) for w in range(W))
            ref = (ref / W if avg else ref).to(dt)
            assert y.shape == ref.shape and y.dtype == dt, (name, y.shape, y.dtype)
            assert torch.equal(bits(y), bits(ref)), (name, step, (y - ref).abs().max())
            results[f"none/{name}/{step}"] = y
        check_out(step)

    def check_out(step):  # out= : in place (out is the input) and into a separate buffer
        for i, s in enumerate(SHAPES[2:], start=2):
            ref = sum(make(w, i, step, s) for w in range(W)) / W
            x = make(r, i, step, s)
            y = gp.push_pull(x, f"inplace{i}", out=x)
            assert y.data_ptr() == x.data_ptr() and torch.equal(bits(x), bits(ref)), (i, step)
            buf = torch.full((ref.numel(),), float("nan"))
            y = gp.push_pull_async(make(r, i, step, s), f"outbuf{i}", out=buf).wait()
            assert y.data_ptr() == buf.data_ptr() and y.shape == buf.shape, (i, y.shape)
            assert torch.equal(bits(buf), bits(ref)), (i, step)

    ONEBIT = [("ob_a", (2503,), "vanilla", None), ("ob_b", (3, 100), "vanilla", None),
              ("ob_c", (1200,), "corrected", 0.1),
              ("ob_d", (1500,), "vanilla:decay=0.5,server_decay=1,anneal=1", 0.4)]
    sim = {}

    def reference_onebit(name, shape, ef, lr, i, step):
        numel = int(torch.Size(shape).numel())
        out = torch.empty(numel)
        for c in chunk_layout(numel, PART):
            key = chunk_key(name, c.index)
            if (name, c.index) not in sim:
                sim[(name, c.index)] = ([build("onebit", c.numel, ef=ef) for _ in range(W)],
                                        build("onebit", c.numel, ef=parse_ef(ef).for_server()),
                                        build("onebit", c.numel))
            encs, server, dec = sim[(name, c.index)]
            pushes = [(f"worker {w}", encs[w].compress(
                make(w, i, step, shape).reshape(-1)[c.offset:c.offset + c.numel], key=key,
                step=step, lr=lr)) for w in range(W)]
            reply = reduce_pushes(pushes, dec, server, torch.empty(c.numel), key=key, step=step,
                                  lr=lr, divisor=W, label=name)
            out[c.offset:c.offset + c.numel] = dec.decompress(reply)
        return out.view(shape)

    def check_onebit(step):
        for i, (name, shape, ef, lr) in enumerate(ONEBIT):
            # rising for corrected EF; falling for anneal=1, whose workers' decay then rises
            lr = None if lr is None else lr / (step + 1) if "anneal" in ef else lr * (step + 1)
            y = gp.push_pull(make(r, i, step, shape), name, compression="onebit", ef=ef, lr=lr,
                             min_compress_bytes=0)
            ref = reference_onebit(name, shape, ef, lr, i, step)
            assert torch.equal(bits(y), bits(ref)), (name, step, (y - ref).abs().max())
            results[f"onebit/{name}/{step}"] = y

    for bad, exc in ((torch.arange(3), TypeError), ([1.0], TypeError)):
        try:
            gp.push_pull(bad, "bad")
            raise AssertionError(f"push_pull accepted {bad!r}")
        except exc as e:
            assert "'bad'" in str(e), e
    try:
        gp.push_pull(torch.ones(8), "anneal_nolr", compression="onebit",
                     ef="vanilla:decay=0.5,anneal=1")
        raise AssertionError("push_pull accepted anneal=1 without an lr")
    except ValueError as e:
        assert "'anneal_nolr'" in str(e) and "learning rate" in str(e), e
    x = torch.ones(8)
    for out, exc, word in ((torch.ones(8, dtype=torch.float64), TypeError, "float32"),
                           (torch.ones(4, 4).t(), TypeError, "contiguous"),
                           (torch.ones(7), ValueError, "7 elements"),
                           (torch.empty(8, device="meta"), TypeError, "on cpu (the tensor")):
        try:
            gp.push_pull(x, "badout", out=out)
            raise AssertionError(f"push_pull accepted out={out!r}")
        except exc as e:
            assert "'badout'" in str(e) and word in str(e), e
    big = torch.ones(16)
    try:
        gp.push_pull(big[:8], "overlap", out=big[4:12])
        raise AssertionError("push_pull accepted an out overlapping the input")
    except ValueError as e:
        assert "overlaps" in str(e), e
    try:
        gp.push_pull(torch.ones(2), "")
        raise AssertionError("push_pull accepted an empty name")
    except ValueError as e:
        assert "name" in str(e), e

    for step in range(2):
        if "none" in modes:
            check_none(step)
        if "onebit" in modes:
            check_onebit(step)
    st = gp.stats()
    assert st["dense_fp32_bytes"] > 0 and st["steps"] > 0, st
    pushes = os.environ.get("GRADPRESS_HIERARCHICAL") != "1" or r == 0  # node leader pushes
    assert (st["bytes_pushed"] > 0) == pushes, st
    torch.save(results, os.path.join(out_dir, f"worker{r}.pt"))
    gp.shutdown()
    assert not gp.is_initialized()
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    assert not left, f"threads left after shutdown: {left}"
''')

ERRORS = textwrap.dedent('''
    import os, sys, time
    import torch
    import gradpress as gp

    out_dir = sys.argv[1]
    declared = os.path.join(out_dir, "declared0")
    gp.init()
    r = gp.rank()
    try:
        if r == 0:  # declares "m" (push_pull_async agrees on the keys before it returns) ...
            h = gp.push_pull_async(torch.ones(10), "m", compression="none",
                                   min_compress_bytes=0)
            open(declared, "w").close()
            h.wait()  # ... and waits for a reply that never comes
        else:  # ... then worker 1 declares it otherwise
            deadline = time.monotonic() + 60
            while not os.path.exists(declared) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert os.path.exists(declared), "worker 0 did not declare 'm' within 60 s"
            gp.push_pull(torch.ones(10), "m", compression="fp16", min_compress_bytes=0)
        msg = "no error"
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
    open(os.path.join(out_dir, f"error{r}.txt.tmp"), "w").write(msg)
    os.rename(os.path.join(out_dir, f"error{r}.txt.tmp"), os.path.join(out_dir, f"error{r}.txt"))
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out_dir, "error0.txt")) and time.monotonic() < deadline:
        time.sleep(0.05)  # worker 1 stays until worker 0 timed out
    os._exit(0)  # the job is broken on purpose: leave without the stop protocol
''')


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


@pytest.mark.cluster
def test_two_workers_one_server_none_and_onebit(tmp_path: Path, script: Path) -> None:
    trace = tmp_path / "trace" / "t.json"
    finish([launch_script(["--workers", "2", "--servers", "1"], script, tmp_path, "none,onebit",
                          GRADPRESS_TRACE=str(trace))])
    check_replicas(tmp_path, 2)
    for name in ("t.worker0.json", "t.worker1.json", "t.server0.json"):
        events = json.loads((trace.parent / name).read_text())["traceEvents"]
        stages = {e["name"] for e in events if e["ph"] == "X"}
        assert stages & {"compress", "server.compress"}, (name, stages)


@pytest.mark.cluster
def test_two_nodes_two_servers_through_multi_node_flags(tmp_path: Path, script: Path) -> None:
    port = str(free_port())
    procs = [launch_script(["--nnodes", "2", "--node-rank", str(n), "--master-addr",
                            "127.0.0.1", "--master-port", port, "--workers-per-node", "1",
                            "--servers-per-node", "1"], script, tmp_path, "none")
             for n in range(2)]
    finish(procs)
    check_replicas(tmp_path, 2)


@pytest.mark.cluster
@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
def test_colocated(tmp_path: Path, script: Path, hierarchical: bool) -> None:
    # hierarchical, W=2: the leader pushes x0 + x1 (exact in either order), so `none` is still
    # bit-exact; the onebit reference above models flat aggregation only
    args = ["--workers", "2", "--colocate"] + (["--hierarchical"] if hierarchical else [])
    finish([launch_script(args, script, tmp_path, "none" if hierarchical else "none,onebit")])
    check_replicas(tmp_path, 2)


@pytest.mark.cluster
def test_spec_mismatch_and_timeout_errors_name_key_peer_and_stage(tmp_path: Path) -> None:
    script = tmp_path / "errors.py"
    script.write_text(ERRORS)
    finish([launch_script(["--workers", "2", "--colocate"], script, tmp_path, "",
                          GRADPRESS_TIMEOUT="2")])
    first, second = ((tmp_path / f"error{r}.txt").read_text() for r in range(2))
    assert first.startswith("CommTimeoutError") and "'m' chunk 0" in first, first
    assert "timed out after 2 s" in first, first
    assert "stage: pull" in first and "server" in first and "(rank " in first, first
    assert second.startswith("ConfigMismatchError") and "'m'" in second, second
    assert "fp16" in second and "none" in second, second


# -- the CUDA stream logic of ps/calls.py, checked on CPU with stand-ins --------------------------
class _FakeStream:
    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)

    def record_event(self) -> str:
        return f"made on {id(self)}"


def test_on_stream_puts_the_pool_thread_on_the_streams_device(monkeypatch) -> None:
    # torch.cuda.stream(s) alone, entered from a thread on device 0 for a stream on device 1,
    # switches device inside and restores device 0 on the way out (StreamContext): on_stream
    # must move the thread to the stream's device first and leave it there
    from gradpress.ps import calls

    calls_seen: list[tuple] = []
    current = [0]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    def set_device(i: int) -> None:
        calls_seen.append(("set_device", i))
        current[0] = i

    class Ctx:
        def __init__(self, s: _FakeStream) -> None:
            self.s = s

        def __enter__(self) -> None:
            calls_seen.append(("enter", self.s.device.index, current[0]))

        def __exit__(self, *exc: object) -> None:
            calls_seen.append(("exit", self.s.device.index, current[0]))

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "stream", Ctx)
    with calls.on_stream(_FakeStream(1)):
        pass
    assert calls_seen == [("set_device", 1), ("enter", 1, 1), ("exit", 1, 1)]
    assert current[0] == 1, "the thread stays on the stream's device"
    calls_seen.clear()
    with calls.on_stream(_FakeStream(1)):  # already there: no device switch at all
        pass
    assert calls_seen == [("enter", 1, 1), ("exit", 1, 1)]
    calls_seen.clear()
    with calls.on_stream(None):
        pass
    assert calls_seen == []


def test_handle_makes_the_callers_stream_wait_on_the_chunks_events(monkeypatch) -> None:
    from gradpress.ps.calls import Handle

    stream = _FakeStream(0)
    asked: list[object] = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: asked.append(device) or stream)
    out = torch.arange(6, dtype=torch.float32)
    h = Handle("g", out, torch.Size([2, 3]), torch.float32, torch.device("cpu"), 3)
    h._chunk_done("ev0")
    h._chunk_done(None)  # a chunk without device copies
    assert not h.done() and stream.waited == []
    h._chunk_done("ev2")
    y = h.wait()
    assert stream.waited == ["ev0", "ev2"], "the caller's stream waits; the host does not"
    assert asked == [torch.device("cpu")]  # the result's device
    assert y.shape == (2, 3) and y.data_ptr() == out.data_ptr()
    plain = Handle("p", out, torch.Size([6]), torch.float32, torch.device("cpu"), 1)
    plain._chunk_done()
    plain.wait()
    assert asked == [torch.device("cpu")], "no events: no stream is asked for"


def test_second_wait_on_another_stream_waits_for_the_first_waits_conversion(monkeypatch) -> None:
    """CPU twin of issue 43's finding 3 (fake streams and events): the first wait converts
    the result on its stream and records an event there; a wait on another stream waits for
    the chunks and for that event, and gets the same tensor."""
    from gradpress.ps.calls import Handle

    a, b = _FakeStream(0), _FakeStream(0)
    current = [a]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    h = Handle("g", torch.arange(6, dtype=torch.float32), torch.Size([6]), torch.float16,
               torch.device("cpu"), 1)
    h._chunk_done("ev0")
    first = h.wait()
    current[0] = b
    second = h.wait()
    assert second is first and first.dtype == torch.float16
    assert a.waited == ["ev0"] and b.waited == ["ev0", f"made on {id(a)}"]


def test_handle_copies_a_staged_result_into_dest_at_wait() -> None:
    from gradpress.ps.calls import Handle

    staged = torch.arange(6, dtype=torch.float32)
    dest = torch.full((3, 2), float("nan"))
    h = Handle("g", staged, dest.shape, dest.dtype, dest.device, 1, dest=dest)
    h._chunk_done()
    assert torch.isnan(dest).all(), "nothing written before wait"
    y = h.wait()
    assert y.data_ptr() == dest.data_ptr() and y.shape == (3, 2)
    assert torch.equal(dest.reshape(-1), staged)
    staged.zero_()
    assert h.wait() is y and torch.equal(dest.reshape(-1), torch.arange(6.0)), "copied once"


def test_pinned_keeper_holds_buffers_until_their_events_complete() -> None:
    from gradpress.ps.calls import PinnedKeeper

    class Ev:
        def __init__(self) -> None:
            self.complete, self.synced = False, False

        def query(self) -> bool:
            return self.complete

        def synchronize(self) -> None:
            self.synced = True

    keeper = PinnedKeeper()
    a, b, c = Ev(), Ev(), Ev()
    keeper.keep(a, torch.zeros(1))
    keeper.keep(b, torch.zeros(1))
    assert len(keeper) == 2
    a.complete = True
    keeper.keep(c, torch.zeros(1))
    assert len(keeper) == 2, "a's buffer dropped once its copy completed; b and c held"
    keeper.drain()
    assert len(keeper) == 0 and b.synced and c.synced and not a.synced
    d = Ev()
    keeper.keep(d, torch.zeros(1))
    keeper.drain(wait=False)  # a failed engine: drop without waiting on the device
    assert len(keeper) == 0 and not d.synced


def test_hierarchical_staging_follows_check_out() -> None:
    from gradpress.ps.hierarchy import _stage

    x = torch.arange(8, dtype=torch.float32)
    flat, dest, copied = _stage(x, x, "g")  # in place on the CPU: the tensor itself is reduced
    assert flat.data_ptr() == x.data_ptr() and dest is None and copied is None
    buf = torch.full((2, 4), float("nan"))
    flat, dest, copied = _stage(x, buf, "g")  # a separate CPU out: filled now, reduced in place
    assert flat.data_ptr() == buf.data_ptr() and dest is None and torch.equal(flat, x)
    flat, dest, copied = _stage(x, None, "g")  # no out: a copy, never the input
    assert flat.data_ptr() != x.data_ptr() and torch.equal(flat, x)
    assert dest is None and copied is None
    h16 = x.to(torch.float16)
    flat, dest, copied = _stage(h16, None, "g")
    assert flat.dtype == torch.float32 and torch.equal(flat, x) and copied is None
    # out on another device than the tensor: rejected as the flat pipeline rejects it
    with pytest.raises(TypeError, match=r"'g'.*float32 tensor on cpu.*on meta"):
        _stage(x, torch.empty(8, device="meta"), "g")
    big = torch.ones(16)
    with pytest.raises(ValueError, match="overlaps"):
        _stage(big[:8], big[4:12], "g")


@pytest.mark.parametrize("device_mode", [False, True], ids=["host", "device"])
def test_cuda_chunk_branches_order_their_stream_work(monkeypatch, device_mode: bool) -> None:
    # compress_chunk / decode_chunk's CUDA branches on CPU tensors, with a stand-in stream:
    # the copy stream waits on the submit event before touching x, every device tensor it uses
    # gets record_stream, the host waits on one event per chunk on the way out (host mode; in
    # device mode the codec's own copy does) and on none on the way back
    import contextlib
    from types import SimpleNamespace

    from gradpress.compress import build
    from gradpress.ps import calls

    log: list = []

    class Ev:
        def __init__(self, n: int) -> None:
            self.n = n

        def synchronize(self) -> None:
            log.append(("host waits", self.n))

        def query(self) -> bool:
            return False

    class Stream(_FakeStream):
        def wait_event(self, event: object) -> None:
            log.append(("stream waits", event))

        def record_event(self, event: object = None) -> Ev:
            log.append("event" if event is None else "blocking event")
            return Ev(len(log))

    @contextlib.contextmanager
    def on_stream(stream: object):
        log.append("enter")
        yield
        log.append("exit")

    monkeypatch.setattr(calls, "on_stream", on_stream)
    monkeypatch.setattr(calls, "blocking_event", lambda: "blocking")
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, s: log.append(("record_stream", self.data_ptr())))
    n = 10
    codec = build("none", n)
    chunk = SimpleNamespace(enc=codec, dec=codec, key=7, server_name="server 0", label="k")
    x, out = torch.arange(n, dtype=torch.float32), torch.zeros(n)
    send = torch.empty(codec.payload_bytes, dtype=torch.uint8)
    job = calls.ChunkJob(chunk, x, out, None, None, Stream(0), "ready", step=3, send=send)
    calls.compress_chunk(job, device_mode)
    pushed = ["enter", ("stream waits", "ready"), ("record_stream", x.data_ptr())]
    assert log == (pushed + ["exit"] if device_mode else pushed + ["blocking event", "exit",
                                                                   ("host waits", 4)]), log
    log.clear()
    job.recv = send.clone()  # "none": the reply of one worker is its own push
    keeper = calls.PinnedKeeper()
    done = calls.decode_chunk(job, device_mode, keeper)
    assert log == ["enter", ("record_stream", out.data_ptr()), "event", "exit"], log
    assert isinstance(done, Ev) and done.n == 3, "the result's event goes to the handle"
    assert torch.equal(out, x)
    assert len(keeper) == (0 if device_mode else 1), "host mode holds the pinned buffer"


def test_call_options_are_parsed_once_per_distinct_options(monkeypatch) -> None:
    """The optimizer passes the same options for every tensor of every step: they are parsed
    and validated once (dict specs, unhashable, every time), and a cached entry still rejects
    what it rejected the first time."""
    from types import SimpleNamespace

    from gradpress.ps import keyplan as P
    from gradpress.ps.config import PSConfig

    eng = P.Planner(SimpleNamespace(layout=SimpleNamespace(num_servers=1)), PSConfig())
    seen: list[object] = []
    real = P.resolve_codec
    monkeypatch.setattr(P, "resolve_codec", lambda c, e, cfg: seen.append(c) or real(c, e, cfg))
    for _ in range(3):
        eng.check_call("t", "onebit", "vanilla")
    assert seen == ["onebit"]
    for _ in range(2):
        eng.check_call("t", {"compressor": "onebit"}, None)
    assert len(seen) == 3
    for _ in range(2):
        with pytest.raises(ValueError, match="needs the step's learning rate"):
            eng.check_call("t", "onebit", "corrected")
        with pytest.raises(ValueError, match="nosuch"):
            eng.check_call("t", "nosuch", None)
    assert eng.resolve("onebit", "vanilla") is eng.resolve("onebit", "vanilla")


def test_a_host_reply_is_judged_finite_from_its_bytes(monkeypatch) -> None:
    """decode_reply reads a host payload's scale, not the decoded result (no extra pass), and
    still rejects a reply whose scale is not finite, naming the sender."""
    from gradpress.compress import build
    from gradpress.ps import protocol
    from gradpress.ps.errors import PayloadError

    codec = build("onebit", 100)
    payload = codec.compress(torch.randn(100), key=7, step=3)
    monkeypatch.setattr(protocol, "is_finite", lambda t: pytest.fail("decoded result scanned"))
    out = torch.empty(100)
    protocol.decode_reply(codec, payload, out, key=7, step=3, sender="server 0", label="k")
    assert torch.isfinite(out).all()
    bad = payload.clone()
    bad[-4:] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # scale = NaN
    with pytest.raises(PayloadError, match="server 0 rejected: it decodes to non-finite"):
        protocol.decode_reply(codec, bad, out, key=7, step=3, sender="server 0", label="k")


def test_layout_names_each_rank_once() -> None:
    from gradpress.ps.cluster import Layout

    lay = Layout(num_workers=2, num_servers=1, colocate=False)
    assert lay.describe(0) == "worker 0 (rank 0)" and lay.describe(2) == "server 0 (rank 2)"
    assert lay.describe(2) is lay.describe(2)
    assert lay == Layout(num_workers=2, num_servers=1, colocate=False)

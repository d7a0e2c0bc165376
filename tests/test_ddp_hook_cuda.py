"""The DDP hook on CUDA with NCCL (issue #30, findings 1 and 8), and its CPU twin on gloo.

NCCL refuses two ranks of one communicator on the same device ("Duplicate GPU detected"), and
gloo's collectives are the CPU path already covered by ``test_ddp_hook.py``; so the GPU tests run
a world of one process on NCCL. Every step of the hook still runs there (compress, all_to_all,
the owner's reduce and recompress, all-gather, decode into the bucket), on NCCL's streams and its
CUDA-aware work futures, which is what the two findings are about:

* the result DDP reads equals the codec chain computed directly, bit for bit, for bf16, fp16
  and fp32 buckets, with the deferred (default on CUDA) and the immediate checks; the gradient
  is read on the default stream right after ``backward`` with no synchronisation, and on CUDA
  a ``torch.cuda._sleep`` queued before each decode (issue #43) holds the decode back, so a
  future without devices (finding 1) would hand DDP a bucket whose decode has not run yet;
* a corrupted reply (NaN scale) is zeroed at once and handed back without an error; the next
  iteration's first hook call raises its PayloadError (the deferred checks' flag, read through
  pinned memory and an event);
* the hook adds no synchronisation per bucket: with ``torch.cuda.set_sync_debug_mode`` a
  backward pass with the hook warns no more often than one with PyTorch's ``allreduce_hook``,
  and the codec calls the hook makes (compress twice, decode-add, decode into device
  payloads) warn not at all when made directly (issue #43: no budget for codec syncs).

The GPU tests are written from PyTorch's sources and have not run on a GPU yet. The CPU twins
run the chain comparison (deferred and immediate checks) and the corrupted reply on gloo.
"""

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from gradpress.compress import build
from gradpress.compress.header import HEADER_BYTES, Header
from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook

SPEC = "onebit"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@contextlib.contextmanager
def world_of_one(backend: str, tmp_path):
    assert not dist.is_initialized(), "a process group was left initialised by an earlier test"
    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def ddp(model: nn.Module, device: torch.device, **kwargs) -> nn.parallel.DistributedDataParallel:
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, **kwargs)


def delay_decode(monkeypatch) -> None:
    """Queue ``torch.cuda._sleep`` on the stream step 6 decodes on, before the decode: a
    future that DDP's stream did not wait for would hand it the bucket before the decode."""
    import gradpress.ddp.pipeline as pipeline

    def delayed(fn):
        def run(job):
            torch.cuda._sleep(200_000_000)
            return fn(job)
        return run

    for name in ("finish", "finish_deferred"):
        monkeypatch.setattr(pipeline, name, delayed(getattr(pipeline, name)))


def chain_matches(device: torch.device, dtype: torch.dtype, defer: bool | None,
                  shape: tuple[int, int], monkeypatch, steps: int = 3) -> None:
    """One weight, so one bucket (index 0; key 0 in a world of one). The hook's result equals
    worker compress -> owner decode-add -> owner recompress -> decode, with fresh codecs."""
    torch.manual_seed(0)
    model = nn.Linear(shape[1], shape[0], bias=False).to(device, dtype)
    net = ddp(model, device)
    state = TwoWayCompressionState(SPEC, "vanilla", min_compress_bytes=0)
    state._defer = defer
    seen: list[torch.Tensor] = []

    def hook(st: TwoWayCompressionState,
             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        seen.append(bucket.buffer().clone())  # the gradient the hook compresses
        return two_way_compression_hook(st, bucket)

    net.register_comm_hook(state, hook)
    if device.type == "cuda":
        delay_decode(monkeypatch)
    x = torch.randn(32, shape[1], generator=torch.Generator().manual_seed(1)).to(device, dtype)
    got = []
    for _ in range(steps):
        net.zero_grad()
        net(x).float().square().mean().backward()
        got.append(model.weight.grad.reshape(-1).clone())  # default stream, no sync before
    state.check_pending()
    assert len(seen) == steps and state.compression_stats()["compressed_buckets"] == steps
    n = model.weight.numel()
    worker, server = build(SPEC, n, ef="vanilla"), build(SPEC, n, ef="vanilla")
    for t, (g, result) in enumerate(zip(seen, got)):
        acc = torch.zeros(n, device=device)
        server.decompress_add(worker.compress(g, key=0, step=t), acc)
        want = worker.decompress(server.compress(acc, key=0, step=t)).to(dtype)
        assert result.dtype == dtype and torch.equal(result, want), f"step {t}"
        assert result.abs().sum() > 0


@pytest.mark.parametrize("defer", [None, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_world_of_one_gloo_cpu_matches_codec_chain(tmp_path, dtype, defer, monkeypatch):
    with world_of_one("gloo", tmp_path):
        chain_matches(torch.device("cpu"), dtype, defer, (64, 96), monkeypatch)


@needs_cuda
@pytest.mark.parametrize("defer", [None, False], ids=["deferred", "immediate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_nccl_ddp_hook_matches_codec_chain(tmp_path, dtype, defer, monkeypatch):
    torch.cuda.set_device(0)
    with world_of_one("nccl", tmp_path):
        chain_matches(torch.device("cuda", 0), dtype, defer, (2048, 2048), monkeypatch)


# -- a corrupted reply: zeroed at once, raised one iteration late ---------------------------------
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


def corrupt_reply_fails_late(device: torch.device, defer: bool | None) -> None:
    """Step 1's reply (the all-gathered aggregate) gets a NaN scale: the deferred checks hand
    back zeros without an error; the next call raises the PayloadError, the one after refuses."""
    from gradpress.ps.errors import GradpressError, PayloadError
    n = 1000
    state = TwoWayCompressionState(SPEC, "vanilla", min_compress_bytes=0)
    state._defer = defer
    bucket = Bucket(torch.randn(n, device=device, dtype=torch.bfloat16))
    assert two_way_compression_hook(state, bucket).wait().abs().sum() > 0  # step 0: honest
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    orig, scale_at = getattr(dist, name), build(SPEC, n).payload_bytes - 4

    def corrupting(out, inp, *args, **kwargs):
        inp[scale_at:scale_at + 4].copy_(torch.tensor([float("nan")]).view(torch.uint8))
        return orig(out, inp, *args, **kwargs)

    setattr(dist, name, corrupting)
    try:
        bucket.buf.normal_()
        result = two_way_compression_hook(state, bucket).wait()  # step 1: corrupted
    finally:
        setattr(dist, name, orig)
    assert result is bucket.buf and bool((result == 0).all()), "the bucket was not zeroed"
    bucket.buf.normal_()
    with pytest.raises(PayloadError, match=r"bucket 0 shard 0 \(key 0, step 1\).*rank 0 \(owner "
                                           r"of shard 0\) rejected.*non-finite"):
        two_way_compression_hook(state, bucket)  # step 2: the error of step 1, before anything
    with pytest.raises(GradpressError, match="an earlier bucket failed"):
        two_way_compression_hook(state, bucket)


def test_world_of_one_gloo_cpu_deferred_failure_raises_next_iteration(tmp_path):
    with world_of_one("gloo", tmp_path):
        corrupt_reply_fails_late(torch.device("cpu"), True)


@needs_cuda
def test_cuda_nccl_deferred_failure_raises_next_iteration(tmp_path):
    torch.cuda.set_device(0)
    with world_of_one("nccl", tmp_path):
        corrupt_reply_fails_late(torch.device("cuda", 0), None)


def rejected_input_fails(device: torch.device, defer: bool | None) -> None:
    """A worker codec whose compress into a device payload rejected its input (``last_finite``
    False; faked here on the CPU, where a compress raises instead) marks its push: the owner
    rejects it naming the sender, and the bucket is zeroed (at once, or one iteration late with
    the deferred checks); randomk, whose payload decodes finite whatever the input was."""
    from gradpress.ps.errors import PayloadError
    spec, n = "randomk:k=0.01", 1000
    state = TwoWayCompressionState(spec, "sparse", min_compress_bytes=0)
    state._defer = defer
    deferred = defer if defer is not None else device.type == "cuda"
    bucket = Bucket(torch.randn(n, device=device))
    assert two_way_compression_hook(state, bucket).wait().abs().sum() > 0  # step 0: honest
    worker = state._buckets[0].workers[0]
    compress = worker.compress

    def rejecting(*args, **kwargs):
        out = compress(*args, **kwargs)
        worker.last_finite = torch.zeros((), dtype=torch.bool, device=device)
        return out

    worker.compress = rejecting
    match = r"bucket 0 shard 0 \(key 0, step 1\).*push from rank 0 rejected.*non-finite"
    with pytest.raises(PayloadError, match=match) if not deferred else contextlib.nullcontext():
        result = two_way_compression_hook(state, bucket).wait()  # step 1
    if deferred:
        assert result is bucket.buf and bool((result == 0).all()), "the bucket was not zeroed"
        with pytest.raises(PayloadError, match="rank 0.*rejected"):
            two_way_compression_hook(state, bucket)  # step 2: the error of step 1
    assert bool((bucket.buf == 0).all())


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
def test_world_of_one_gloo_cpu_rejected_input_is_rejected_by_the_owner(tmp_path, defer):
    with world_of_one("gloo", tmp_path):
        rejected_input_fails(torch.device("cpu"), defer)


@needs_cuda
def test_cuda_nccl_rejected_input_is_rejected_by_the_owner(tmp_path):
    torch.cuda.set_device(0)
    with world_of_one("nccl", tmp_path):
        rejected_input_fails(torch.device("cuda", 0), None)


# -- synchronisations per bucket ------------------------------------------------------------------
def count_syncs(fn) -> int:
    """Warnings of ``set_sync_debug_mode("warn")`` during ``fn()``: one per synchronizing call
    (c10/cuda/CUDAFunctions.h: memcpy_and_sync, stream_synchronize; "always" counts repeats
    from one call site). cudaEventSynchronize is not one of them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def backward_syncs(hook, state, device: torch.device) -> tuple[int, int]:
    """Syncs and hook calls (buckets) of the 4th backward pass of a 4-layer bf16 model (after
    DDP's bucket rebuild, and once the hook's buffers exist)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(4)])
    net = ddp(model.to(device, torch.bfloat16), device, bucket_cap_mb=0.5)
    calls = [0]

    def counted(st: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        calls[0] += 1
        return hook(st, bucket)

    net.register_comm_hook(state, counted)
    x = torch.randn(64, 512, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        net.zero_grad()
        net(x).float().square().mean().backward()
    net.zero_grad()
    loss = net(x).float().square().mean()
    torch.cuda.synchronize()
    calls[0] = 0
    syncs = count_syncs(loss.backward)
    torch.cuda.synchronize()
    return syncs, calls[0]


def codec_syncs(device: torch.device, n: int) -> int:
    """Syncs of the codec calls the deferred hook makes per bucket in a world of one."""
    worker, server = build(SPEC, n, ef="vanilla"), build(SPEC, n, ef="vanilla")
    g = torch.randn(n, device=device, dtype=torch.bfloat16)
    push, reply = (torch.empty(worker.payload_bytes, dtype=torch.uint8, device=device)
                   for _ in range(2))
    acc, out = torch.zeros(n, device=device), torch.empty(n, device=device)

    def calls(step: int) -> None:
        head = Header(worker.codec_id, 0, n, step, None, worker.fingerprint)
        worker.compress(g, key=0, step=step, out=push)
        server._decode_add(push[HEADER_BYTES:], acc, 1.0, head)
        server.compress(acc, key=0, step=step, out=reply)
        worker._decode(reply[HEADER_BYTES:], out, head)

    calls(0)  # warm-up: scratch buffers
    torch.cuda.synchronize()
    return count_syncs(lambda: calls(1))


@needs_cuda
def test_cuda_nccl_ddp_hook_adds_no_sync_per_bucket(tmp_path):
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    with world_of_one("nccl", tmp_path):
        baseline, _ = backward_syncs(allreduce_hook, None, device)

        def syncing_hook(state: None,
                         bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            # control: proves that syncs made in a hook (autograd's thread) are counted
            torch.cuda.current_stream().synchronize()
            return allreduce_hook(state, bucket)

        control, buckets = backward_syncs(syncing_hook, None, device)
        state = TwoWayCompressionState(SPEC, "vanilla", min_compress_bytes=0)
        ours, hooked = backward_syncs(two_way_compression_hook, state, device)
        state.check_pending()
        per_bucket = codec_syncs(device, 512 * 512)
    print(f"syncs in one backward: allreduce_hook {baseline}, control {control} ({buckets} "
          f"buckets), gradpress {ours} ({hooked} buckets); codec calls per bucket {per_bucket}")
    assert buckets >= 2 and hooked == buckets
    assert control >= baseline + buckets, "syncs made in the hook are not counted"
    assert per_bucket == 0, f"the codec calls of one bucket make {per_bucket} syncs, expected 0"
    assert ours <= baseline, f"the hook adds {ours - baseline} syncs to a backward pass"

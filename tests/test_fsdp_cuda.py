"""gradpress.fsdp on CUDA with NCCL, and its CPU twins on gloo (the deferred checks forced on).

FSDP2 never calls the reduce-scatter comm in a world of one (``foreach_reduce`` in
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py copies the input to the output when the
group has one rank), and NCCL refuses two ranks of one communicator on one device; so on one GPU
these tests call :class:`~gradpress.fsdp.CompressedReduceScatter` as ``foreach_reduce`` does:
the reduce-scatter stream waits for the current stream, and inside
``torch.cuda.stream(reduce_scatter_stream)`` the output is made by ``comm.allocate`` and the comm
is called with the flat input, the group and the op. A world of one on NCCL still runs every
step: compress, ``all_to_all_single``, the owner's device-side checks and decode-add, the op.

* the output equals the codec chain computed directly (worker compress with error feedback,
  decode-add, the op), bit for bit, for fp32 and bf16 (FSDP2's reduce dtype) and AVG, SUM,
  PREMUL_SUM (``set_gradient_divide_factor``'s op);
* everything runs on the stream it is called on: with that stream held by
  ``torch.cuda._sleep``, a read of the output from another stream still sees what was there
  before the call; and a call makes no host synchronisation (``set_sync_debug_mode``);
* a corrupted payload (NaN scale) zeroes the output at once without an error; the next
  backward pass's first call raises the PayloadError naming the sender (or ``check_pending``).

The GPU tests are written from PyTorch's sources and have not run on a GPU yet. The CPU twins
run the chain comparison and the corrupted payload with the deferred checks forced on, and the
chain with ``"meta"`` as the default device (every host buffer is made on the CPU explicitly).
"""

import contextlib
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from gradpress.compress import build
from gradpress.fsdp import CompressedReduceScatter, FSDPCompressionState
from gradpress.ps.errors import PayloadError

SPEC = "onebit"
INDEX = 3  # the module's position under the root: its shard's key is INDEX * world + shard
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


def make_op(name: str):
    return {"avg": dist.ReduceOp.AVG, "sum": dist.ReduceOp.SUM,
            "premul": dist._make_nccl_premul_sum(0.25)}[name]


def apply_op(acc: torch.Tensor, name: str) -> torch.Tensor:
    return {"avg": acc / 1, "sum": acc, "premul": acc * 0.25}[name]


class Caller:
    """Calls the comm as FSDP2's ``foreach_reduce`` does, on a reduce-scatter stream of its own
    (CUDA) or inline (CPU)."""

    def __init__(self, device: torch.device, defer: bool | None, n: int) -> None:
        self.device, self.n = device, n
        self.state = FSDPCompressionState(SPEC, "vanilla", min_compress_bytes=0)
        self.state._defer = defer
        self.comm = CompressedReduceScatter(self.state, "layer", INDEX)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stream_ctx(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else \
            contextlib.nullcontext()

    def __call__(self, g: torch.Tensor, op, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with self.stream_ctx():
            if out is None:
                out = self.comm.allocate((self.n,), dtype=g.dtype, device=self.device)
            self.comm(out, g, dist.group.WORLD, op)
        return out

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def chain_matches(device: torch.device, dtype: torch.dtype, op_name: str, defer: bool | None,
                  n: int, steps: int = 3) -> None:
    call = Caller(device, defer, n)
    worker, decoder = build(SPEC, n, ef="vanilla"), build(SPEC, n)
    gen = torch.Generator().manual_seed(0)
    for t in range(steps):
        g = torch.randn(n, generator=gen, device="cpu").to(device, dtype)
        out = call(g, make_op(op_name))
        call.sync()
        acc = torch.zeros(n, device=device)
        decoder.decompress_add(worker.compress(g, key=INDEX, step=t), acc)
        want = apply_op(acc, op_name).to(dtype)
        assert out.dtype == dtype and torch.equal(out, want), f"step {t}"
        assert out.abs().sum() > 0
    call.state.check_pending()
    assert call.state.stats()["compressed_calls"] == steps


@pytest.mark.parametrize("op_name", ["avg", "sum", "premul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_world_of_one_gloo_cpu_deferred_matches_codec_chain(tmp_path, dtype, op_name):
    with world_of_one("gloo", tmp_path):
        chain_matches(torch.device("cpu"), dtype, op_name, True, 1000)


def test_world_of_one_gloo_cpu_deferred_makes_no_buffer_on_the_default_device(tmp_path):
    """A user's ``torch.set_default_device("cuda")`` must not move a host buffer: with "meta"
    (unreadable on the host) as the default, the deferred path still gives the chain's bits."""
    with world_of_one("gloo", tmp_path):
        torch.set_default_device("meta")
        try:
            chain_matches(torch.device("cpu"), torch.float32, "avg", True, 1000)
        finally:
            torch.set_default_device(None)


@needs_cuda
@pytest.mark.parametrize("op_name", ["avg", "sum", "premul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_nccl_fsdp_comm_matches_codec_chain(tmp_path, dtype, op_name):
    torch.cuda.set_device(0)
    with world_of_one("nccl", tmp_path):
        chain_matches(torch.device("cuda", 0), dtype, op_name, None, 1 << 20)


# -- a corrupted payload: zeroed at once, raised one backward pass late --------------------------
def corrupt_payload_fails_late(device: torch.device, defer: bool | None, monkeypatch,
                               n: int = 1000) -> None:
    call = Caller(device, defer, n)
    g = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
    assert call(g, dist.ReduceOp.AVG).abs().sum() > 0  # step 0: honest
    orig, scale_at = dist.all_to_all_single, build(SPEC, n).payload_bytes - 4

    def corrupting(out, inp, *args, **kwargs):
        r = orig(out, inp, *args, **kwargs)
        out[scale_at:scale_at + 4].copy_(torch.tensor([float("nan")]).view(torch.uint8))
        return r

    monkeypatch.setattr(dist, "all_to_all_single", corrupting)
    out = call(g, dist.ReduceOp.AVG)  # step 1: corrupted, no error yet
    monkeypatch.setattr(dist, "all_to_all_single", orig)
    call.sync()
    assert bool((out == 0).all()), "the output of the corrupted call was not zeroed"
    with pytest.raises(PayloadError, match=r"module 'layer' shard 0 \(key 3, step 1\): push from "
                                           r"rank 0 rejected: .*non-finite"):
        call(g, dist.ReduceOp.AVG)  # step 2 reads step 1's flag before sending anything


def test_world_of_one_gloo_cpu_deferred_failure_raises_next_call(tmp_path, monkeypatch):
    with world_of_one("gloo", tmp_path):
        corrupt_payload_fails_late(torch.device("cpu"), True, monkeypatch)


@needs_cuda
def test_cuda_nccl_fsdp_deferred_failure_raises_next_call(tmp_path, monkeypatch):
    torch.cuda.set_device(0)
    with world_of_one("nccl", tmp_path):
        corrupt_payload_fails_late(torch.device("cuda", 0), None, monkeypatch)


def test_world_of_one_gloo_cpu_check_pending_raises_the_last_failure(tmp_path, monkeypatch):
    with world_of_one("gloo", tmp_path):
        call = Caller(torch.device("cpu"), True, 1000)
        g = torch.randn(1000)
        orig = dist.all_to_all_single

        def corrupting(out, inp, *args, **kwargs):
            r = orig(out, inp, *args, **kwargs)
            out[4:8].fill_(0xFF)  # the key field
            return r

        monkeypatch.setattr(dist, "all_to_all_single", corrupting)
        assert bool((call(g, dist.ReduceOp.AVG) == 0).all())
        monkeypatch.setattr(dist, "all_to_all_single", orig)
        with pytest.raises(PayloadError, match=r"push from rank 0 rejected: .*key"):
            call.state.state_dict()  # reads the pending checks first


# -- the stream FSDP2 hands in, and synchronisations per call ---------------------------------
def count_syncs(fn) -> int:
    """Warnings of ``set_sync_debug_mode("warn")`` during ``fn()`` (as tests/test_ddp_hook_cuda.py
    counts them; cudaEventSynchronize is not one of them)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@needs_cuda
def test_cuda_nccl_fsdp_comm_runs_on_its_stream_without_syncs(tmp_path):
    torch.cuda.set_device(0)
    device, n = torch.device("cuda", 0), 1 << 22
    with world_of_one("nccl", tmp_path):
        call = Caller(device, None, n)
        g = torch.randn(n, device=device, dtype=torch.bfloat16)
        outs = [call(g, dist.ReduceOp.AVG) for _ in range(2)]  # NCCL's communicator, buffers
        torch.cuda.synchronize()
        outs.append(torch.empty(n, device=device, dtype=torch.bfloat16))
        syncs = count_syncs(lambda: call(g, dist.ReduceOp.AVG, outs[-1]))
        torch.cuda.synchronize()
        # the held call: everything it enqueues waits behind a sleep on its stream
        held = torch.full((n,), float("nan"), device=device, dtype=torch.bfloat16)
        torch.cuda.synchronize()
        with call.stream_ctx():
            torch.cuda._sleep(2_000_000_000)  # about a second
        t0 = time.perf_counter()
        call(g, dist.ReduceOp.AVG, held)
        enqueue_s = time.perf_counter() - t0
        probe = torch.cuda.Stream(device)  # does not wait for the held stream
        seen = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        with torch.cuda.stream(probe):
            seen.copy_(held, non_blocking=True)
        probe.synchronize()
        still_held = not call.stream.query()
        torch.cuda.synchronize()
        outs.append(held)
        call.state.check_pending()
    print(f"syncs in one call: {syncs}; the held call returned in {enqueue_s:.3f} s")
    assert syncs == 0, f"a compressed reduce-scatter makes {syncs} host synchronisations"
    assert still_held, "the sleep ended before the probe read the output: raise the sleep"
    assert bool(seen.isnan().all()), "the output was written outside the stream it was called on"
    worker, decoder = build(SPEC, n, ef="vanilla"), build(SPEC, n)
    for t, out in enumerate(outs):
        acc = torch.zeros(n, device=device)
        decoder.decompress_add(worker.compress(g, key=INDEX, step=t), acc)
        assert torch.equal(out, acc.to(torch.bfloat16)), f"call {t}"

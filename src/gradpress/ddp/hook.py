"""A DDP communication hook that averages gradients with two-way compression, in allreduce form.

For users who keep :class:`torch.nn.parallel.DistributedDataParallel`: the BytePS-Compress
scheme (Zhong, Xie, Zheng, Lin 2021, "Compressed Communication for Distributed Training: Adaptive
Methods and System") without separate server processes. Every rank serves one shard of each
gradient bucket, as a reduce-scatter/all-gather allreduce does, and the pushes and the replies are
both compressed with error feedback::

    from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook
    state = TwoWayCompressionState(compression="onebit", ef="vanilla", min_compress_bytes=1 << 20)
    ddp_model.register_comm_hook(state, two_way_compression_hook)

Modelled on PyTorch's ``ddp_comm_hooks/powerSGD_hook.py``: a state object holding the
hyperparameters and the per-bucket state, and a pure hook function.
"""

from typing import Any

import torch
import torch.distributed as dist

from .state import TwoWayCompressionState

__all__ = ["TwoWayCompressionState", "two_way_compression_hook"]


def _allreduce_average(buf: torch.Tensor, group: Any) -> torch.futures.Future:
    """Uncompressed path: divide by the world size, then allreduce-sum (as DDP's default)."""
    buf.div_(group.size())
    work = dist.all_reduce(buf, group=group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


def two_way_compression_hook(
    state: TwoWayCompressionState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    r"""Average a DDP gradient bucket with two-way compressed communication.

    Rank r acts as the server of shard r of every bucket (BytePS-Compress's worker/server roles
    folded into the ranks, in the shape of a reduce-scatter + all-gather allreduce):

    1. Views the bucket buffer as one flat tensor and splits it into ``world_size`` shards whose
       sizes depend only on the bucket's element count, so every rank agrees.
    2. Compresses every shard with this rank's worker codec for (bucket index, shard), whose
       error-feedback residual absorbs the compression error; key = index * world + shard, step =
       this bucket's call count (randomk draws identical indices on every rank from them).
    3. Exchanges payloads with ``all_to_all_single`` on uint8 (gloo and NCCL both support it):
       owner r receives every rank's payload for shard r. Payloads have a size fixed by the codec
       and shard, padded to one slot size.
    4. The owner validates each payload (header: codec id, numel, fingerprint, size, key, step),
       decode-accumulates them in rank order (deterministic), divides by ``world_size``, adds
       its server residual and recompresses (server-side error feedback; a non-finite average
       is rejected naming the first sender that makes it so).
    5. All-gathers the compressed aggregates (fixed slot size).
    6. Every rank validates every aggregate (header, then finite values) and decodes it into the
       bucket buffer; the bytes are identical on every rank, so the replicas stay bit-identical.

    A payload that fails a check raises :class:`~gradpress.ps.errors.PayloadError` naming the
    sending rank, the bucket, the shard and what was wrong (see :mod:`gradpress.ddp.buckets`):
    from the hook or from the bucket's future, on the owner that rejected a push and, through an
    abort record it all-gathers in step 5, on every other rank. The bucket buffer is then zeroed
    and the state refuses further buckets (:class:`~gradpress.ps.errors.GradpressError`).

    CUDA buckets are checked on the device, with no host synchronisation per bucket (so
    backward keeps overlapping the exchange): a failed bucket is zeroed there and handed to DDP
    as zeros, and its PayloadError (the same text) is raised on every rank by the first hook
    call of the next iteration, before its collectives: one optimizer step late; call
    ``state.check_pending()`` after the last backward pass (``state_dict`` does) to see an error
    of the last iteration. The bucket's future is CUDA-aware, so DDP's stream waits for the
    decode kernels before it reads the result.

    With ``state.nan_policy="skip"`` a non-finite gradient is no error: the sender marks its
    push, the owner of that shard sends a skip record instead of its aggregate, and every rank
    hands DDP the bucket filled with inf, so a ``torch.amp.GradScaler`` skips the step and
    lowers its scale (:mod:`gradpress.ddp.buckets`); the next iteration goes on as usual.

    Buckets below ``state.min_compress_bytes`` and iterations before
    ``state.dense_steps`` use a plain averaging allreduce (a non-finite gradient reaches
    every rank through it as it does with DDP's own allreduce).

    Overlap (``state.overlap=True``): steps 1-3 run when DDP hands over the bucket; steps 4-5 run
    at the next hook call (or at once for the last bucket of the iteration), and step 6 when the
    all-gather completes, on the communication thread. So the payload exchange overlaps the rest
    of backward, while every collective is still issued from the hook, in bucket order, which
    keeps the collectives in the same order on all ranks. The compression itself runs on the
    backward thread. With ``overlap=False`` every bucket is finished inside its own hook call:
    simpler, and communication then stalls backward.

    Args:
        state: :class:`TwoWayCompressionState` with the hyperparameters and residuals.
        bucket: the DDP gradient bucket (its ``index()`` identifies it; a change of its layout,
            e.g. DDP's bucket rebuild after the first iteration, re-creates its codecs).

    Returns:
        A future completed with the averaged bucket buffer (updated in place).

    Example::
        >>> state = TwoWayCompressionState(compression="onebit", ef="vanilla")
        >>> ddp_model.register_comm_hook(state, two_way_compression_hook)
    """
    group = state._group()
    buf = bucket.buffer()
    if not buf.is_floating_point():
        raise TypeError(f"two_way_compression_hook: bucket {bucket.index()} buffer has dtype "
                        f"{buf.dtype}, expected a floating dtype")
    state._check_usable(bucket.index())
    try:
        state._resolve_checks()  # deferred checks of earlier buckets (may raise their error)
        state._drain()  # steps 4-5 of the previous bucket, before any new collective
        if state.iter >= state.dense_steps and not state._awaits_saved_layout(bucket) \
                and buf.numel() * 4 >= max(state.min_compress_bytes, 1):
            fut = state._launch(bucket, group)
            if bucket.is_last() or not state.overlap:
                state._drain()
        else:
            state._stats["allreduced_buckets"] += 1
            state._stats["allreduce_bytes"] += buf.numel() * buf.element_size()
            fut = _allreduce_average(buf, group)
    except BaseException as e:
        state._fail(e)
        raise
    if bucket.is_last():
        state.iter += 1
    return fut

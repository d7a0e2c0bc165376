"""FSDP2's reduce-scatter, compressed: :class:`CompressedReduceScatter`, a subclass of FSDP2's
``ReduceScatter`` (``torch.distributed.fsdp._fully_shard._fsdp_api``, a private module of
torch, imported defensively: :func:`require_fsdp_api` names the torch version where it is
missing).

FSDP2's ``foreach_reduce`` copies a module's unsharded gradients into one flat buffer (shard s is
the s-th of ``world`` equal slices, FSDP2 pads to a multiple), allocates it and the output shard
with :meth:`CompressedReduceScatter.allocate`, and calls the comm on its reduce-scatter stream
with the buffer, the output shard, the group and the op: ``ReduceOp.AVG`` by default,
``ReduceOp.SUM`` (after its own pre-division, for fp16 and other narrow reduce dtypes) or a
``PREMUL_SUM`` op carrying ``1/factor`` from ``set_gradient_divide_factor``. It reads the output
when the call returns (CPU) or on the stream after it (CUDA).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..compress.header import HEADER_BYTES, Header, pack_header
from ..ps.errors import PayloadError
from ..ps.protocol import add_push, check_sum, is_finite
from .checks import PendingReduce, ReduceCheck, reduce_own_deferred

if TYPE_CHECKING:
    from .state import FSDPCompressionState, ModuleCodecs

__all__ = ["CompressedReduceScatter", "require_fsdp_api", "FSDP_API_ERROR"]

log = logging.getLogger(__name__)

_FLAGS = 36  # the header's flags field (gradpress.compress.header): 1 marks a rejected input

try:  # a private module of torch: present in torch 2.13, absent in older releases
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _Base
    FSDP_API_ERROR: str | None = None
except ImportError as _e:  # pragma: no cover - depends on the installed torch
    _Base = object  # type: ignore[assignment,misc]
    FSDP_API_ERROR = (f"gradpress.fsdp needs FSDP2's custom reduce-scatter "
                      f"(torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter and "
                      f"FSDPModule.set_custom_reduce_scatter, as in torch 2.13); torch "
                      f"{torch.__version__} does not have them ({_e})")


def require_fsdp_api() -> None:
    """Raise ImportError naming the torch version when FSDP2's custom comm API is missing."""
    from torch.distributed.fsdp import FSDPModule
    if FSDP_API_ERROR is not None:
        raise ImportError(FSDP_API_ERROR)
    if not hasattr(FSDPModule, "set_custom_reduce_scatter"):
        raise ImportError(f"gradpress.fsdp needs FSDPModule.set_custom_reduce_scatter (torch "
                          f"2.13 has it); torch {torch.__version__} does not")


def reduce_factor(op: Any, world: int) -> tuple[str, float] | None:
    """How the rank-order sum of the ranks' shards becomes FSDP2's result for ``op``:
    ``("div", world)`` for AVG (as gloo divides), None for SUM, ``("mul", factor)`` for
    PREMUL_SUM (its own factor); ValueError for other ops."""
    kind = getattr(op, "op", op)  # a PREMUL_SUM op is a ReduceOp with .op and .factor
    if kind == dist.ReduceOp.AVG:
        return ("div", float(world))
    if kind == dist.ReduceOp.SUM:
        return None
    if kind == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if not isinstance(factor, float):
            raise ValueError(f"gradpress.fsdp: a PREMUL_SUM op without a float factor "
                             f"({op!r}); expected one made by FSDP2's set_gradient_divide_factor")
        return ("mul", factor)
    raise ValueError(f"gradpress.fsdp: reduce op {op!r} is not supported; expected AVG, SUM or "
                     f"PREMUL_SUM (the ops FSDP2 reduce-scatters gradients with)")


class CompressedReduceScatter(_Base):
    """The reduce-scatter of one ``FSDPModule`` (``name``: its qualified name under the root,
    ``index``: its position there, which keys its payloads), compressed with ``state``'s codec
    and the workers' error feedback. Installed by :func:`gradpress.fsdp.compress`."""

    def __init__(self, state: FSDPCompressionState, name: str, index: int) -> None:
        require_fsdp_api()
        self.state, self.name, self.index = state, name, index

    def __repr__(self) -> str:
        return f"CompressedReduceScatter(module={self.name!r}, state={self.state!r})"

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A new tensor per call, as FSDP2's default comm (FSDP2 keeps the input alive until
        the reduce-scatter stream has passed it; nothing here keeps a reference)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        r"""Reduce-scatter ``input_tensor`` into ``output_tensor`` with compressed payloads.

        1. Splits the flat input into ``world`` equal shards (shard s is owned by rank s).
        2. Compresses shard s with this rank's worker codec of (module, s), whose residual takes
           the compression error (key = index * world + s, step = this module's call count); an
           input the codec rejects (NaN/inf) is sent as a marked payload so every owner fails
           too, instead of waiting.
        3. Exchanges the fixed-size payloads with ``all_to_all_single``: rank r receives every
           rank's payload of shard r.
        4. Validates every received payload (header: codec, numel, fingerprint, size, key,
           step; the sender's mark) and decode-adds them into an fp32 sum in rank order.
        5. Applies ``op`` (AVG: / world; SUM: as is; PREMUL_SUM: * its factor), checks the
           result is finite (else names the first sender that makes it so) and writes it to
           ``output_tensor`` (cast to its dtype, e.g. bf16).

        On CUDA (step 0) the device-side checks of the calls of earlier backward passes are
        read first, and steps 4-5 run without a host read (:mod:`gradpress.fsdp.checks`): a
        failed payload zeroes the output, and its PayloadError is raised one backward pass
        later (or by ``state.check_pending()``). Everything runs on the current stream (FSDP2's
        reduce-scatter stream); NCCL's collective is ordered on it without a host wait.

        Modules below ``state.min_compress_bytes`` and the first ``state.dense_steps`` calls use
        ``dist.reduce_scatter_single`` with ``op`` (FSDP2's own collective). Runs synchronously
        (FSDP2 calls it with ``async_op=False``); with ``async_op=True`` it returns a completed
        work. Raises :class:`~gradpress.ps.errors.PayloadError` naming the sender for a bad
        payload, ValueError for an op it cannot honour.
        """
        world, rank = group.size(), dist.get_rank(group)
        numel = input_tensor.numel()
        if output_tensor.numel() * world != numel:
            raise ValueError(f"gradpress.fsdp: module {self.name!r}: output of "
                             f"{output_tensor.numel()} elements for an input of {numel} at "
                             f"world size {world}; expected {numel // world}")
        factor = reduce_factor(op, world)
        st = self.state
        if not st.uses_compression(self.name, numel):
            st._stats["plain_calls"] += 1
            st._stats["plain_bytes"] += (world - 1) * output_tensor.numel() * 4
            return dist.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op,
                                              async_op=async_op)
        codecs = st.codecs_for(self.name, numel, world, rank, input_tensor.device)
        step = codecs.step
        st.resolve_checks(step)  # 0. the device-side checks of earlier backward passes
        codecs.step = step + 1
        flat = input_tensor.reshape(-1)
        rejected = self._compress_shards(codecs, flat, step)
        dist.all_to_all_single(codecs.recv, codecs.send, group=group)  # 3.
        if rejected is not None:
            raise rejected
        deferred = st._defer if st._defer is not None else input_tensor.device.type == "cuda"
        ok = reduce_own_deferred(codecs, self.key(rank, world), step, factor, output_tensor) \
            if deferred else None
        if ok is None:
            self._reduce_own(codecs, step, factor, output_tensor)
        else:
            st._checks.append(ReduceCheck(PendingReduce(self, codecs, step, factor), ok))
        st._stats["compressed_calls"] += 1
        st._stats["payload_bytes"] += (world - 1) * codecs.slot
        st._stats["dense_bytes"] += (world - 1) * codecs.shard * 4
        return _completed_work() if async_op else None

    def key(self, shard: int, world: int) -> int:
        key = self.index * world + shard
        if key >= 2**32:
            raise ValueError(f"gradpress.fsdp: module {self.name!r} shard {shard}: key {key} "
                             f"does not fit the 32-bit header key field")
        return key

    def _compress_shards(self, codecs: ModuleCodecs, flat: torch.Tensor,
                         step: int) -> ValueError | None:
        """Steps 1-2 into ``codecs.send``. When the codec rejects a shard (non-finite input),
        every slot is marked, so that every owner fails naming this rank, and the codec's error
        is returned, to raise after the exchange (the residuals are then not to be trusted)."""
        error = None
        n = codecs.shard
        for s, worker in enumerate(codecs.workers):  # 1.+2. shard s -> its codec -> slot s
            out = codecs.payload(codecs.send, s)
            try:
                worker.compress(flat[s * n:(s + 1) * n], key=self.key(s, codecs.world),
                                step=step, lr=self.state.lr, out=out)
            except ValueError as e:  # non-finite input: tell the owners instead of hanging them
                error = error or e
                continue
            finite = worker.last_finite
            if finite is not None:  # a device payload: the verdict stays on the device
                out[_FLAGS:_FLAGS + 1].copy_(torch.logical_not(finite).reshape(1))
        if error is not None:
            for s, worker in enumerate(codecs.workers):
                out = codecs.payload(codecs.send, s)
                pack_header(out[:HEADER_BYTES], Header(worker.codec_id, self.key(s, codecs.world),
                                                       n, step, None, worker.fingerprint))
                out[_FLAGS:_FLAGS + 1].fill_(1)
        return error

    def _reduce_own(self, codecs: ModuleCodecs, step: int, factor: tuple[str, float] | None,
                    output: torch.Tensor) -> None:
        """Steps 4-5 for the shard this rank owns."""
        key = self.key(codecs.rank, codecs.world)
        label = (f"gradpress.fsdp rank {codecs.rank}, module {self.name!r} shard "
                 f"{codecs.rank} (key {key}, step {step})")
        acc = codecs.acc
        acc.zero_()
        senders = [f"rank {src}" for src in range(codecs.world)]
        payloads = [codecs.payload(codecs.recv, src) for src in range(codecs.world)]
        for who, p in zip(senders, payloads):  # 4. validate, decode-add in rank order
            if int(p[_FLAGS]) != 0:
                raise PayloadError(f"{label}: push from {who} rejected: the sender's input has "
                                   f"non-finite values (NaN/inf)", key=key, peer=who,
                                   stage="push")
            add_push(codecs.decoder, p, acc, key=key, step=step, sender=who, label=label)
        if factor is not None:  # 5. the op, the finiteness check, the cast into the output
            (acc.div_ if factor[0] == "div" else acc.mul_)(factor[1])
        if not is_finite(acc):
            check_sum(acc, codecs.decoder, payloads, senders, key=key, label=label)
        output.reshape(-1).copy_(acc)


def _completed_work() -> Any:
    """A finished ``dist.Work`` for ``async_op=True`` callers (the exchange ran already)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(None)
    make = getattr(torch._C._distributed_c10d, "_create_work_from_future", None)
    return make(fut) if make is not None else None

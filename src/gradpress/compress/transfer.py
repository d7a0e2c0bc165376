"""The copies between host and device memory that the codecs make, each in one place.

Device mode keeps the compute stream free of host synchronisations: every codec call makes at
most one, in :func:`to_host` (the copy of an encoded body and its finiteness flag back to a host
payload). Host-to-device copies never synchronise:

* :func:`host_to` copies from pinned memory with ``non_blocking=True``; ATen's copy kernel then
  records an event with the caching host allocator so that the pinned block is not reused before
  the copy ran (``torch/include/ATen/cuda/CachingHostAllocator.h``: "THCCachingHostAllocator_
  recordEvent must be called anytime a pointer from this allocator is used in a cudaMemcpyAsync
  ... This is currently invoked by at::native::copy_kernel_cuda").
* pageable memory is first copied (on the host) into a pinned block of that allocator. A
  ``non_blocking`` copy straight from pageable memory would not be counted by
  ``torch.cuda.set_sync_debug_mode`` (ATen warns only in ``memcpy_and_sync`` and
  ``stream_synchronize``, ``torch/include/c10/cuda/CUDAFunctions.h``), but CUDA documents that
  "if pageable memory must first be staged to pinned memory, the driver may synchronize with the
  stream" (CUDA runtime API, "API synchronization behavior"): a hidden synchronisation. A
  blocking copy (``non_blocking=False``) goes through ``memcpy_and_sync``: a counted one.

The CUDA branches are reasoned from these sources and not yet run on a GPU here; on the CPU the
same functions are plain copies, so the CPU suite runs every caller's code path.
"""

from __future__ import annotations

import torch

__all__ = ["to_host", "host_to", "bytes_to"]


def to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` (any device) into the host tensor ``dst`` and wait for it: the one host
    synchronisation of a device-mode compress (a blocking ``copy_``, whose
    ``cudaStreamSynchronize`` on the current stream is what sync debug mode counts)."""
    dst.copy_(src)


def host_to(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the host tensor ``src`` into ``dst`` without a host synchronisation.

    For a CUDA ``dst`` the copy is queued on the current stream; a pinned ``src`` must not be
    written until that stream has passed this point (a pageable one is copied into a pinned
    block first and may be reused at once)."""
    if dst.device.type != "cuda":
        dst.copy_(src)
        return
    if not src.is_pinned():
        staged = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
        staged.copy_(src)
        src = staged  # the allocator keeps the block until the copy's event has passed
    dst.copy_(src, non_blocking=True)


def bytes_to(dst: torch.Tensor, raw: bytes) -> None:
    """Write ``raw`` into the uint8 tensor ``dst`` (same size, any device), without a host
    synchronisation (:func:`host_to`)."""
    if dst.device.type == "cpu":
        dst.numpy()[:] = memoryview(raw)
        return
    host_to(dst, torch.frombuffer(bytearray(raw), dtype=torch.uint8))

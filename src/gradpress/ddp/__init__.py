"""gradpress's DDP communication hook: two-way compressed gradient averaging for
:class:`torch.nn.parallel.DistributedDataParallel`, with no server processes::

    from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook
    ddp_model.register_comm_hook(TwoWayCompressionState(compression="onebit"),
                                 two_way_compression_hook)

* ``hook.py``: :func:`two_way_compression_hook`;
* ``state.py``: :class:`TwoWayCompressionState` (hyperparameters, residuals, checkpointable
  state), on ``pipeline.py``'s :class:`~gradpress.ddp.pipeline.BucketPipeline` (the per-bucket
  exchange, steps 1-6);
* ``buckets.py``: per-bucket codecs, wire buffers and the validated receive paths;
* ``checks.py``: the device-side checks of CUDA buckets, read one iteration late.
"""

from .hook import TwoWayCompressionState, two_way_compression_hook

__all__ = ["TwoWayCompressionState", "two_way_compression_hook"]

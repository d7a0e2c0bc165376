"""gradpress's DDP communication hook: two-way compressed gradient averaging for
:class:`torch.nn.parallel.DistributedDataParallel`, with no server processes::

    from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook
    ddp_model.register_comm_hook(TwoWayCompressionState(compression="onebit"),
                                 two_way_compression_hook)

* ``hook.py``: :class:`TwoWayCompressionState` (hyperparameters, residuals, checkpointable
  state) and :func:`two_way_compression_hook` (the per-bucket exchange);
* ``buckets.py``: per-bucket codecs, wire buffers and the validated receive paths;
* ``checks.py``: the device-side checks of CUDA buckets, read one iteration late.
"""

from .hook import TwoWayCompressionState, two_way_compression_hook

__all__ = ["TwoWayCompressionState", "two_way_compression_hook"]

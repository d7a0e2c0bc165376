"""``gradpress simulate``: a pipeline model of one BytePS-Compress training iteration at paper
scale (ResNet50, VGG16, BERT-base on multi-node V100 clusters).

* :mod:`.models`: exact parameter tensors and per-op forward MACs, generated from the
  architectures (ResNet50 25,557,032 parameters; VGG16 138,357,544; BERT-base pre-training
  110,106,428).
* :mod:`.pipeline`: the discrete-event model (backward, intra-node reduce, compression on CPU
  thread pools, push/pull over full-duplex links, server decompress-sum-recompress).
* :mod:`.rates`: codec CPU throughput (a default table or measured on this machine).
* :mod:`.cli`: ``add_arguments`` and ``run`` of the ``simulate`` subcommand.
"""

from .models import MODELS, Model, Op, Tensor, get_model
from .pipeline import Comparison, SimConfig, SimResult, compare, plan_chunks, simulate
from .rates import CodecRates, default_rates, measure_rates

__all__ = ["MODELS", "Model", "Op", "Tensor", "get_model", "Comparison", "SimConfig", "SimResult",
           "compare", "plan_chunks", "simulate", "CodecRates", "default_rates", "measure_rates"]

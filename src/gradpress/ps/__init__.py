"""The parameter-server runtime. The public entry points are in :mod:`gradpress.api`
(``gradpress.init``, ``gradpress.push_pull``, ...) and :mod:`gradpress.launch`
(``gradpress launch``). The modules, in the order a ``push_pull`` meets them:

* :mod:`.calls`: the call's arguments checked, its plan and chunks, the handle it returns;
* :mod:`.keyplan`: a tensor name's key plan: chunks, keys, servers and codecs, agreed by all
  workers (not the optimizer's :mod:`gradpress.torch.plan`);
* :mod:`.partition`: tensors cut into chunks (keys) and spread over the servers;
* :mod:`.worker`: the worker pipeline (compress, push, pull, decompress);
* :mod:`.transport`: point-to-point messages, payload buffers and the in-flight budget;
* :mod:`.protocol`: control messages, key descriptors, state requests, and the checks of
  everything a process receives;
* :mod:`.server`: the server engine; :mod:`.reduce`: :func:`~.reduce.reduce_pushes`, the server
  arithmetic (also the DDP hook's);
* :mod:`.codec_state`: worker and server codec state, saved and restored exactly (the engines'
  part of :mod:`gradpress.checkpoint`);
* :mod:`.hierarchy`: the optional reduce/broadcast within a node;
* :mod:`.cluster`, :mod:`.auth`, :mod:`.config`, :mod:`.watchdog`, :mod:`.trace`,
  :mod:`.errors`: joining the job, its options, failure detection, traces and exceptions.
"""

from .config import ClusterConfig, PSConfig
from .errors import (
    AuthError,
    CommTimeoutError,
    ConfigMismatchError,
    GradpressError,
    KeyCollisionError,
    NotInitializedError,
    PayloadError,
    PeerError,
)

__all__ = ["PSConfig", "ClusterConfig", "GradpressError", "CommTimeoutError", "PeerError",
           "PayloadError", "AuthError", "ConfigMismatchError", "KeyCollisionError",
           "NotInitializedError"]

"""The defaults that ship, in one place.

Every entry point takes its defaults from here: ``gp.CLAN``, ``gp.OneBitLANS``,
``gp.DistributedOptimizer``, ``gradpress train`` (all of them through one builder,
:func:`gradpress.torch.builder.build_optimizer`), the Lightning strategy, the Hugging Face
callback and the DDP hook. Each value carries its one-line reason; ``docs/guide.md#the-defaults``
lists them for users.
"""

from __future__ import annotations

__all__ = [
    "COMPRESSION", "WRAPPER_COMPRESSION", "EF", "MOMENTUM_EF", "DENSE_STEPS", "WRAPPER_DENSE_STEPS",
    "MIN_COMPRESS_BYTES", "UNCOMPRESSED_PARAMS", "WEIGHT_DECAY", "BETAS", "EPS", "SGD_MOMENTUM",
    "HOOK_MIN_COMPRESS_BYTES", "NAN_POLICY", "NAN_POLICIES", "dense_steps_for", "ef_for",
]

#: One bit per element instead of fp32's 32, with error feedback, which keeps the accuracy on
#: the bundled tasks (``docs/results.md``).
COMPRESSION = "onebit"
#: Every residual is kept until sent, on workers and servers alike, as in the paper.
EF = "vanilla"
#: For the methods that send their momentum: it already carries the past, so the workers'
#: residuals decay by 0.8 a step; the servers' are kept until sent.
MOMENTUM_EF = "vanilla:decay=0.8,server_decay=1.0"
#: ``gp.DistributedOptimizer``: wrapping an optimizer changes nothing until a codec is named,
#: as Horovod's.
WRAPPER_COMPRESSION = "none"
#: The adaptive methods' uncompressed opening steps: their second moment settles on dense
#: gradients before compression starts.
DENSE_STEPS = 100
#: An optimizer of the user's, wrapped as it is, compresses from the first step.
WRAPPER_DENSE_STEPS = 0
#: Measured, not a byte count tuned on one model: the largest tensors holding
#: :data:`~gradpress.torch.agreement.COMPRESSED_SHARE` of the model's bytes, and every tensor of
#: 1 MiB or more, are compressed (:func:`gradpress.torch.agreement.auto_min_compress_bytes`).
MIN_COMPRESS_BYTES = "auto"
#: Measured in the dense phase: a tensor whose gradients agree little across workers (mostly
#: noise) travels exact (:mod:`gradpress.torch.agreement`).
UNCOMPRESSED_PARAMS = "auto"
#: Decoupled, on tensors of two or more dimensions only, as in BERT's recipe.
WEIGHT_DECAY = 0.01
#: Adam's and LANS's moment decays.
BETAS = (0.9, 0.999)
#: Added to ``sqrt(v)``: LANS's value.
EPS = 1e-6
#: dist-EF-SGDM's momentum, applied on the workers before compression.
SGD_MOMENTUM = 0.9
#: The DDP hook sees buckets, not tensors: buckets under 1 MiB (biases, norms, a small model's
#: tail) are averaged exact with one allreduce.
HOOK_MIN_COMPRESS_BYTES = 1 << 20
#: What a non-finite gradient does, in ``gp.DistributedOptimizer`` and the DDP hook alike:
#: ``"raise"`` (an error: a NaN is a bug until shown otherwise) or ``"skip"`` (every worker skips
#: the step and the gradients read inf, so a ``torch.amp.GradScaler`` lowers its scale: fp16).
NAN_POLICY = "raise"
NAN_POLICIES = ("raise", "skip")

#: The methods with an adaptive second moment that open with :data:`DENSE_STEPS`.
_DENSE_METHODS = ("clan", "onebit-lans", "onebit-adam")
#: The methods that send their momentum and take :data:`MOMENTUM_EF`.
_MOMENTUM_METHODS = ("onebit-lans",)


def dense_steps_for(method: str) -> int:
    """The default ``dense_steps`` of ``method`` (a ``gradpress train --optimizer`` name)."""
    return DENSE_STEPS if method in _DENSE_METHODS else WRAPPER_DENSE_STEPS


def ef_for(method: str) -> str:
    """The default error feedback of ``method`` (a ``gradpress train --optimizer`` name)."""
    return MOMENTUM_EF if method in _MOMENTUM_METHODS else EF

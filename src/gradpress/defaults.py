"""The defaults that ship, in one place.

Every entry point takes its defaults from here: ``gp.CLAN``, ``gp.OneBitLANS``,
``gp.DistributedOptimizer``, ``gradpress train`` (all of them through one builder,
:func:`gradpress.torch.builder.build_optimizer`), the Lightning strategy, the Hugging Face
callback and the DDP hook. Each value carries its one-line reason; ``docs/guide.md#the-defaults``
lists them for users.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "COMPRESSION", "ONEBIT_COMPRESSION", "WRAPPER_COMPRESSION", "EF", "MOMENTUM_EF",
    "DENSE_STEPS", "WRAPPER_DENSE_STEPS", "MIN_COMPRESS_BYTES", "UNCOMPRESSED_PARAMS",
    "WEIGHT_DECAY", "BETAS", "EPS", "SGD_MOMENTUM", "HOOK_MIN_COMPRESS_BYTES", "NAN_POLICY",
    "NAN_POLICIES", "dense_steps_for", "ef_for", "BLOCK_SCALED", "ONEBIT_METHODS",
    "compression_for",
]

#: 4-bit codes with a bfloat16 scale per 128 elements (4.125 bits an element), two-way
#: with error feedback: the user's optimizer keeps its accuracy on every bundled task
#: (``docs/guide.md#the-frontier``); ``none`` is bit-identical to the optimizer alone.
COMPRESSION = "int4"
#: The one-bit methods (``gp.CLAN``, ``gp.OneBitLANS``): one bit per element instead of 32,
#: with error feedback; where they lose is in ``docs/optimizers.md``.
ONEBIT_COMPRESSION = "onebit"
#: Every residual is kept until sent, on workers and servers alike, as in the paper.
EF = "vanilla"
#: For the methods that send their momentum: it already carries the past, so the workers'
#: residuals decay by 0.8 a step; the servers' are kept until sent.
MOMENTUM_EF = "vanilla:decay=0.8,server_decay=1.0"
#: ``gp.DistributedOptimizer``: the safe default, :data:`COMPRESSION`.
WRAPPER_COMPRESSION = COMPRESSION
#: The adaptive methods' uncompressed opening steps: their second moment settles on dense
#: gradients before compression starts.
DENSE_STEPS = 100
#: An optimizer of the user's, wrapped as it is, compresses from the first step.
WRAPPER_DENSE_STEPS = 0
#: ``gp.DiLoCo``: inner steps per outer step (bytes per step fall as 1/H; DiLoCo's own
#: choice, and where the accuracy target of ``docs/guide.md`` is measured).
DILOCO_SYNC_EVERY = 50
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


#: The methods whose compression defaults to :data:`ONEBIT_COMPRESSION` (the paper's and the
#: 1-bit optimizers); every other optimizer takes :data:`COMPRESSION`.
ONEBIT_METHODS = ("clan", "onebit-lans", "onebit-adam")


def compression_for(method: str) -> str:
    """The default codec of ``method`` (a ``gradpress train --optimizer`` name)."""
    return ONEBIT_COMPRESSION if method in ONEBIT_METHODS else COMPRESSION


def dense_steps_for(method: str, compression: Any = None) -> int:
    """The default ``dense_steps`` of ``method`` (a ``gradpress train --optimizer`` name) with
    ``compression`` (a spec; None: not known): none for a block-scaled codec (``int4``...),
    whose gradients the optimizer takes as they are from the first step."""
    if method not in _DENSE_METHODS:
        return WRAPPER_DENSE_STEPS
    return WRAPPER_DENSE_STEPS if method == "clan" and _block_scaled(compression) \
        else DENSE_STEPS


def _block_scaled(compression: Any) -> bool:
    from .compress.spec import parse_spec

    return compression is not None and parse_spec(compression).name in BLOCK_SCALED


#: The block-scaled codecs (:mod:`gradpress.compress.blockint`): a scale per block, so small
#: tensors compress as well as large ones and zero stays exact.
BLOCK_SCALED = ("int2", "int3", "int4", "int8")


def ef_for(method: str) -> str:
    """The default error feedback of ``method`` (a ``gradpress train --optimizer`` name)."""
    return MOMENTUM_EF if method in _MOMENTUM_METHODS else EF

"""The adaptive methods in one call: ``gp.CLAN`` (the paper's) and ``gp.OneBitLANS``.

Both build LANS-style layer-wise adaptive optimizers whose communication is compressed two
ways (workers compress, servers average and compress again), with error feedback on both
sides, and return a :func:`~gradpress.torch.optimizer.DistributedOptimizer`. They differ in
what travels after the dense phase: CLAN sends the gradient, OneBitLANS each worker's
momentum. See ``docs/guide.md`` for which to choose and ``docs/reference/api.md`` for every
parameter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .. import defaults
from ..compress.spec import Compression, EFSpec
from .builder import OptimizerConfig, build_optimizer

__all__ = ["CLAN", "OneBitLANS"]

EFLike = str | EFSpec
NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]


def CLAN(named_parameters: NamedParameters,  # noqa: N802  (named like the method)
         lr: float = 1e-3, *, compression: Compression = defaults.ONEBIT_COMPRESSION,
         ef: EFLike = defaults.EF, dense_steps: int = defaults.DENSE_STEPS,
         weight_decay: float = defaults.WEIGHT_DECAY,
         betas: tuple[float, float] = defaults.BETAS, eps: float = defaults.EPS,
         min_compress_bytes: int | str | None = defaults.MIN_COMPRESS_BYTES,
         uncompressed_params: Iterable[str] | str = defaults.UNCOMPRESSED_PARAMS
         ) -> torch.optim.Optimizer:
    """CLAN (Zhong, Xie, Zheng, Lin 2021, "Compressed Communication for Distributed Training:
    Adaptive Methods and System"): LANS driven by the two-way compressed gradient.

    Algorithm, per step:

    1. For the first ``dense_steps`` steps every gradient is averaged uncompressed.
    2. Then each worker compresses its gradient (chunks of it) with ``compression``, adding its
       error-feedback residual first and keeping what the codec dropped as the next residual.
    3. The servers decompress, average, add their own residual and compress the average again;
       every worker receives the same bytes and decompresses the same averaged gradient.
    4. Every worker takes the LANS step (Zheng et al. 2020) on it with the per-layer gradient
       normalisation turned off (:func:`gradpress.optim.clan_core`): normalising would rescale the
       residual that error feedback carries over. Weight decay is decoupled and applied to
       matrices and kernels only (:func:`gradpress.optim.weight_decay_groups`).

    The same optimizer as ``gradpress train --optimizer clan`` (both call
    :func:`gradpress.torch.builder.build_optimizer`). Gradient accumulation and AMP's skipped
    steps: wrap :func:`gradpress.optim.clan_core` in :func:`gradpress.DistributedOptimizer`
    yourself.

    Args:
        named_parameters: ``model.named_parameters()``. The names key the tensors on every
            worker, so give the same model on all of them; parameters with
            ``requires_grad=False`` are left out.
        lr: the peak learning rate, a relative step per layer (the trust ratio scales it by
            each layer's weight norm), so it does not transfer from Adam. Rule of thumb: start
            from uncompressed LANS's rate and tune per codec; the paper used 0.0014865 (one-bit)
            and 0.001051 (top-k, ``k=0.001``) for BERT-base at batch 2k, with a warm-up and decay.
        compression: the codec spec. Default ``"onebit"`` (one bit an element); the paper's other
            setting is ``"topk:k=0.001,values=fp16"``. Rule of thumb: one-bit unless the wire is
            very slow; see ``docs/guide.md``.
        ef: error feedback on workers and servers. Default ``"vanilla"``: every residual is
            kept until sent, as in the paper. ``"corrected"`` rescales the residuals when the lr
            changes (steep schedules); ``"vanilla:decay=B"`` lets them decay.
        dense_steps: uncompressed opening steps. Default 100: the second moment settles on
            dense gradients before compression starts. Rule of thumb: 0 for small CNNs (no gap
            to close), a fixed 100-200 for transformers; they cost dense traffic, negligible in
            a long run.
        weight_decay: decoupled weight decay on tensors of two or more dimensions (biases and
            normalisation weights get none, as in BERT's recipe). Default 0.01; keep some on
            long runs.
        betas: LANS's ``(b1, b2)``. Default ``(0.9, 0.999)``; ``b1`` also weighs the momentum
            direction against the instant gradient. Lower ``b2`` (0.99) if the loss spikes.
        eps: added to ``sqrt(v)``. Default 1e-6 (the paper's); raise it if fp16 gradients
            underflow.
        min_compress_bytes: tensors smaller than this (fp32 bytes) travel uncompressed and
            exact. Default ``"auto"``: the largest tensors holding
            :data:`~gradpress.torch.agreement.COMPRESSED_SHARE` of the model's bytes are
            compressed, and every tensor of 1 MiB or more
            (:func:`~gradpress.torch.agreement.auto_min_compress_bytes`), so a small model is
            compressed too; biases and norms, a small share, stay exact.
        uncompressed_params: which tensors travel exact (fp32), whatever their size. Default
            ``"auto"``: measured during the dense phase, identically on every worker; a tensor
            whose gradients agree little across workers (mostly noise, like a learned position
            embedding's) travels exact (:mod:`gradpress.torch.agreement`; ``opt.plan()`` shows
            the measure). Or names / ``fnmatch`` patterns, each matching a name, to choose by
            hand (``()``: none). Rule of thumb: keep the default.

    Returns:
        A :class:`gradpress.optim.LANS` (from :func:`gradpress.optim.clan_core`) turned into a
        distributed optimizer.

    Raises:
        ValueError: a hyperparameter or a codec spec is invalid, or a pattern matches no name.
        TypeError: ``uncompressed_params`` is a single string.
    """
    return build_optimizer(named_parameters, OptimizerConfig(
        method="clan", lr=lr, compression=compression, ef=ef, dense_steps=dense_steps,
        weight_decay=weight_decay, betas=betas, eps=eps, min_compress_bytes=min_compress_bytes,
        uncompressed_params=uncompressed_params))


def OneBitLANS(named_parameters: NamedParameters,  # noqa: N802  (named like the method)
               lr: float = 1e-3, *, compression: Compression = defaults.ONEBIT_COMPRESSION,
               ef: EFLike = defaults.MOMENTUM_EF, dense_steps: int = defaults.DENSE_STEPS,
               weight_decay: float = defaults.WEIGHT_DECAY,
               betas: tuple[float, float] = defaults.BETAS, eps: float = defaults.EPS,
               min_compress_bytes: int | str | None = defaults.MIN_COMPRESS_BYTES,
               uncompressed_params: Iterable[str] | str = defaults.UNCOMPRESSED_PARAMS
               ) -> torch.optim.Optimizer:
    """1-bit LANS: LANS whose workers communicate their momentum, compressed two ways, after a
    dense phase, as 1-bit Adam (Tang et al. 2021) and 1-bit LAMB (Li et al. 2021) do.

    Algorithm, per step:

    1. For the first ``dense_steps`` steps the gradients are averaged uncompressed (bf16,
       half of fp32's bytes, for the tensors that will be compressed; fp32 when
       ``compression="none"``) and LANS (with its per-layer gradient normalisation) steps on
       them.
    2. Then each worker keeps its own first and second moments ``m``, ``v`` from its own
       normalised gradient and sends ``m/(sqrt(v)+eps)``, compressed with ``compression`` and
       error feedback; the servers average and compress again (with their own residuals).
    3. Every worker receives the same averaged ``m/(sqrt(v)+eps)`` and takes LAMB's layer-wise
       step along it (the trust ratio ``||x||/||r||``), so the replicas stay identical. When
       every momentum travels exact (``compression="none"``; ``opt.plan()`` says which do),
       the step is LANS's: it also takes the averaged gradient, recovered from two
       consecutive momenta.

    Compressing the momentum instead of the gradient keeps a transformer's compressed run close
    to uncompressed LANS where CLAN falls behind (``docs/guide.md``). The same optimizer as
    ``gradpress train --optimizer onebit-lans`` (both call
    :func:`gradpress.torch.builder.build_optimizer`); the single-process core is
    :class:`gradpress.optim.OneBitLANSCore`.

    Args:
        named_parameters: ``model.named_parameters()``. The names key the tensors on every
            worker, so give the same model on all of them; parameters with
            ``requires_grad=False`` are left out.
        lr: the peak learning rate, a relative step per layer as for LANS. Rule of thumb:
            uncompressed LANS's rate and schedule.
        compression: the codec spec of the momentum. Default ``"onebit"`` (one bit an element).
            Rule of thumb: one-bit for transformers; top-k keeps up only on short runs.
        ef: error feedback on workers and servers. Default
            ``"vanilla:decay=0.8,server_decay=1.0"``: a worker's residual decays by 0.8 a step
            (the momentum already carries the past), the servers' are kept until sent. Rule of
            thumb: 0.7-0.8 for the workers; append ``",anneal=1"`` for long runs, so the decay
            rises towards 1 as the lr falls.
        dense_steps: uncompressed opening steps, >= 1. Default 100: the second moment settles
            before compression starts. Rule of thumb for a transformer: a fixed number of steps
            (100-200) that ends before the model starts to use its context, not a fraction of
            the run.
        weight_decay: decoupled weight decay on tensors of two or more dimensions (biases and
            normalisation weights get none). Default 0.01; keep some on long runs, where it
            keeps the compressed run stable while the lr is high.
        betas: ``(b1, b2)``. Default ``(0.9, 0.999)``; a high ``b1`` averages the momentum's
            compression error out, so do not lower it much.
        eps: added to ``sqrt(v)``. Default 1e-6 (LANS's).
        min_compress_bytes: tensors smaller than this (fp32 bytes) travel uncompressed and
            exact. Default ``"auto"``: the largest tensors holding
            :data:`~gradpress.torch.agreement.COMPRESSED_SHARE` of the model's bytes are
            compressed, and every tensor of 1 MiB or more
            (:func:`~gradpress.torch.agreement.auto_min_compress_bytes`). The small momenta
            (and dense-phase gradients) share fused keys (:mod:`gradpress.torch.fusion`).
        uncompressed_params: which tensors' momenta travel exact (fp32). Default ``"auto"``:
            measured during the dense phase, identically on every worker; a tensor whose
            gradients agree little across workers (mostly noise, like a learned position
            embedding's) travels exact (:mod:`gradpress.torch.agreement`; ``opt.plan()`` shows
            the measure). Or names / ``fnmatch`` patterns to choose by hand (``()``: none).
            Rule of thumb: keep the default.

    Returns:
        A :class:`gradpress.optim.OneBitLANSCore` turned into a distributed optimizer (it averages
        the dense phase's gradients and communicates the momenta itself afterwards).

    Raises:
        ValueError: a hyperparameter or a codec spec is invalid, or a pattern matches no name.
        TypeError: ``uncompressed_params`` is a single string.
    """
    return build_optimizer(named_parameters, OptimizerConfig(
        method="onebit-lans", lr=lr, compression=compression, ef=ef, dense_steps=dense_steps,
        weight_decay=weight_decay, betas=betas, eps=eps, min_compress_bytes=min_compress_bytes,
        uncompressed_params=uncompressed_params))

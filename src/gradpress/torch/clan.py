"""The adaptive methods in one call: ``gp.CLAN`` (the paper's) and ``gp.OneBitLANS``.

Both build LANS-style layer-wise adaptive optimizers whose communication is compressed two
ways (workers compress, servers average and compress again), with error feedback on both
sides, and return a :func:`~gradpress.torch.optimizer.DistributedOptimizer`. They differ in
what travels after the dense phase: CLAN sends the gradient, OneBitLANS each worker's
momentum. See ``docs/guide.md`` for which to choose and ``docs/reference/api.md`` for every
parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..compress.spec import CodecSpec, EFSpec, parse_spec
from ..optim import OneBitLANS as _OneBitLANSCore
from ..optim import clan as clan_optimizer
from ..optim import weight_decay_groups
from ..optim.health import HealthWatch
from ..optim.idle_rows import has_idle_rows
from .agreement import auto_min_compress_bytes
from .fusion import momentum_fuser
from .optimizer import ALWAYS_EXACT, DistributedOptimizer, match_names
from .plan import MomentumTraffic, dense_codec, set_momentum_traffic, travels_exact

__all__ = ["CLAN", "OneBitLANS"]

#: ``gp.CLAN``'s dense steps: enough for the second moment to settle before compression.
DEFAULT_DENSE_STEPS = 100
#: ``gp.OneBitLANS``'s error feedback: the workers' residuals decay by 0.8 a step, the servers'
#: are kept until sent.
DEFAULT_MOMENTUM_EF = "vanilla:decay=0.8,server_decay=1.0"

Compression = str | Mapping[str, Any] | CodecSpec
EFLike = str | EFSpec
NamedParameters = Iterable[tuple[str, torch.nn.Parameter]]


def CLAN(named_parameters: NamedParameters,  # noqa: N802  (named like the method)
         lr: float = 1e-3, *, compression: Compression = "onebit", ef: EFLike = "vanilla",
         dense_steps: int = DEFAULT_DENSE_STEPS, weight_decay: float = 0.01,
         betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
         min_compress_bytes: int | str | None = "auto",
         uncompressed_params: Iterable[str] | str = "auto") -> torch.optim.Optimizer:
    """CLAN (Zhong, Xie, Zheng, Lin 2021, "Compressed Communication for Distributed Training:
    Adaptive Methods and System"): LANS driven by the two-way compressed gradient.

    Algorithm, per step:

    1. For the first ``dense_steps`` steps every gradient is averaged uncompressed.
    2. Then each worker compresses its gradient (chunks of it) with ``compression``, adding its
       error-feedback residual first and keeping what the codec dropped as the next residual.
    3. The servers decompress, average, add their own residual and compress the average again;
       every worker receives the same bytes and decompresses the same averaged gradient.
    4. Every worker takes the LANS step (Zheng et al. 2020) on it with the per-layer gradient
       normalisation turned off (:func:`gradpress.optim.clan`): normalising would rescale the
       residual that error feedback carries over. Weight decay is decoupled and applied to
       matrices and kernels only (:func:`gradpress.optim.weight_decay_groups`).

    The same as ``gradpress train --optimizer clan --uncompressed-params auto`` (the CLI's
    default keeps exact only the tensors it names). Gradient accumulation and AMP's skipped
    steps: wrap :func:`gradpress.optim.clan` in :func:`gradpress.DistributedOptimizer` yourself.

    Args:
        named_parameters: ``model.named_parameters()``. The names key the tensors on every
            worker, so give the same model on all of them; parameters with
            ``requires_grad=False`` are left out.
        lr: the peak learning rate, a relative step per layer (the trust ratio scales it by
            each layer's weight norm), so it does not transfer from Adam. Rule of thumb: start
            from uncompressed LANS's rate and tune per codec; the paper used 0.0014865 (one-bit)
            and 0.001051 (top-k 0.1%) for BERT-base at batch 2k, with a warm-up and decay.
        compression: the codec spec. Default ``"onebit"`` (32x against fp32); the paper's other
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
            exact. Default ``"auto"``: the largest tensors holding 95% of the model's bytes are
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
        A :class:`gradpress.optim.LANS` turned into a distributed optimizer.

    Raises:
        ValueError: a hyperparameter or a codec spec is invalid, or a pattern matches no name.
        TypeError: ``uncompressed_params`` is a single string.
    """
    _check_dense_steps(dense_steps, 0)
    _spec(compression, ef)  # checked now, not at the first push
    named, groups = _groups(named_parameters, weight_decay)
    dense = _exact_names(named, uncompressed_params)
    opt = clan_optimizer(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    return DistributedOptimizer(opt, named_parameters=named, compression=compression, ef=ef,
                                min_compress_bytes=min_compress_bytes, dense_steps=dense_steps,
                                uncompressed_params="auto" if dense is None else sorted(dense))


def OneBitLANS(named_parameters: NamedParameters,  # noqa: N802  (named like the method)
               lr: float = 1e-3, *, compression: Compression = "onebit",
               ef: EFLike = DEFAULT_MOMENTUM_EF, dense_steps: int = DEFAULT_DENSE_STEPS,
               weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.999),
               eps: float = 1e-6, min_compress_bytes: int | str | None = "auto",
               uncompressed_params: Iterable[str] | str = "auto") -> torch.optim.Optimizer:
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
    to uncompressed LANS where CLAN falls behind (``docs/guide.md``). The same as
    ``gradpress train --optimizer onebit-lans --uncompressed-params auto`` (the CLI's default
    keeps exact only the tensors it names); the single-process core is
    :class:`gradpress.optim.OneBitLANS`.

    Args:
        named_parameters: ``model.named_parameters()``. The names key the tensors on every
            worker, so give the same model on all of them; parameters with
            ``requires_grad=False`` are left out.
        lr: the peak learning rate, a relative step per layer as for LANS. Rule of thumb:
            uncompressed LANS's rate and schedule.
        compression: the codec spec of the momentum. Default ``"onebit"`` (32x against fp32).
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
            exact. Default ``"auto"``: the largest tensors holding 95% of the model's bytes are
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
        A :class:`gradpress.optim.OneBitLANS` turned into a distributed optimizer (it averages
        the dense phase's gradients and communicates the momenta itself afterwards).

    Raises:
        ValueError: a hyperparameter or a codec spec is invalid, or a pattern matches no name.
        TypeError: ``uncompressed_params`` is a single string.
    """
    from ..api import _rt, push_pull_async
    from ..compress.registry import ef_needs_lr

    _check_dense_steps(dense_steps, 1)
    named, param_groups = _groups(named_parameters, weight_decay)
    dense = _exact_names(named, uncompressed_params)
    if min_compress_bytes == "auto":
        min_compress_bytes = auto_min_compress_bytes(4 * p.numel() for _, p in named)
    spec = _spec(compression, ef)  # checked now, not when the dense phase ends
    needs_lr = ef_needs_lr(ef)
    prefix = named[0][0] if named else "clan"  # distinct per model: names key the tensors
    groups: list[dict[str, Any]] = []           # the optimizer's, once built
    wrapper: list[Any] = []                     # the DistributedOptimizer, once built
    # keys are positions in the optimizer's flat parameter order (the groups hold named's order)
    exact: set[str] = set()
    decided = [dense is not None]               # "auto": not until the dense phase has ended
    fusion: list[Any] = []                      # the momenta's Fuser, at the first push

    def decide() -> None:
        if not decided[0]:  # the first compressed step: take the measured decision
            chosen = wrapper[0].decide_exact().exact
            exact.update(str(i) for i, (n, _) in enumerate(named) if n in chosen)
            decided[0] = True

    def blend(i: int) -> bool:  # step 3: LANS's step proper when every momentum is exact
        decide()
        return all(travels_exact(p.numel(), spec=spec, exact=str(j) in exact,
                                 min_compress_bytes=min_compress_bytes)
                   for j, (_, p) in enumerate(named))

    def communicate(key: str, m: torch.Tensor) -> Any:
        decide()
        if not fusion:  # small momenta share fused keys (gradpress.torch.fusion)
            fusion.append(momentum_fuser(groups, prefix=f"{prefix}.clan_m.", spec=spec,
                                         min_compress_bytes=min_compress_bytes))
        name = f"{prefix}.clan_m.{key}"
        if fusion[0].fuses(name):
            return fusion[0].add(name, m)
        if key.endswith(".rows"):  # which rows of an embedding-like tensor have a gradient
            return push_pull_async(m, name=name, average=True, compression="none",
                                   min_compress_bytes=ALWAYS_EXACT)
        if key.endswith(".probe"):  # the health watch's exact average, as the dense phase's
            return push_pull_async(m, name=name, average=True, compression=warm or "none",
                                   min_compress_bytes=0)
        # a drifted tensor travels exact for a while, then compressed under fresh keys (new
        # residuals) named by its generation
        i = int(key)
        gen, recovering = opt.generation(i), opt.recovering(i)
        if gen > drifts.get(i, 0):  # the watch saw a drift at the last step: count it once
            _rt().worker.account(drift_recoveries=gen - drifts.get(i, 0))
            drifts[i] = gen
        name += f".x{gen}" if recovering else f".g{gen}" if gen else ""
        # corrected error feedback rescales the residuals by the change of the current lr;
        # anneal=1 moves the workers' decay towards 1 as it falls
        step_lr = groups[0]["lr"] if needs_lr else None
        limit = ALWAYS_EXACT if key in exact or recovering else min_compress_bytes
        return push_pull_async(m, name=name, average=True, compression=spec, lr=step_lr,
                               min_compress_bytes=limit)

    def compressed(i: int) -> bool:  # step 2b: hold the idle rows of compressed momenta
        decide()
        p = named[i][1]
        return not travels_exact(p.numel(), spec=spec, exact=str(i) in exact,
                                 min_compress_bytes=min_compress_bytes)

    drifts: dict[int, int] = {}                 # flat index -> drifts counted in gp.stats()
    warm = dense_codec(spec)
    opt = _OneBitLANSCore(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                          dense_steps=dense_steps, communicate=communicate, blend=blend,
                          hold_idle_rows=compressed, watch=HealthWatch())
    opt.param_names = {i: n for i, (n, _) in enumerate(named)}
    groups.extend(opt.param_groups)
    exact.update(str(i) for i, (n, _) in enumerate(named) if dense and n in dense)
    set_momentum_traffic(opt, MomentumTraffic(prefix=f"{prefix}.clan_m.", compression=spec,
                                              min_compress_bytes=min_compress_bytes,
                                              exact_keys=frozenset(exact),
                                              dense_compression=warm))
    # The wrapper averages dense gradients during the dense phase (bf16 unless nothing is
    # compressed) and stops once the optimizer's compression_active turns true (it
    # communicates momenta from then on).
    wrapper.append(DistributedOptimizer(
        opt, named_parameters=named, compression=warm or "none", ef="none",
        min_compress_bytes=min_compress_bytes,
        uncompressed_params="auto" if dense is None else sorted(dense)))
    meter = getattr(wrapper[0], "_gp_meter", None)
    if meter is not None:  # the core holds the idle rows of these: compress them (agreement)
        meter.held = lambda: [n for n, p in named if has_idle_rows(opt.state[p])]
    return wrapper[0]


def _exact_names(named: list[tuple[str, torch.nn.Parameter]],
                 patterns: Iterable[str] | str) -> frozenset[str] | None:
    """The names that ``uncompressed_params`` keeps exact; None for ``"auto"`` (measured)."""
    if isinstance(patterns, str) and patterns == "auto":
        return None
    return match_names([n for n, _ in named], patterns, "uncompressed_params")


def _spec(compression: Compression, ef: EFLike) -> CodecSpec:
    """The codec spec with ``ef`` as its error feedback, built once to check it (ValueError)."""
    from ..compress import build

    cs = parse_spec(compression)
    spec = CodecSpec(cs.name, dict(cs.params), {**cs.wrappers, "ef": ef})
    build(spec, 4096)
    return spec


def _check_dense_steps(dense_steps: Any, lo: int) -> None:
    if isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < lo:
        raise ValueError(f"dense_steps must be an int >= {lo}, got {dense_steps!r}")


def _groups(named_parameters: NamedParameters, weight_decay: float
            ) -> tuple[list[tuple[str, torch.nn.Parameter]], list[dict[str, Any]]]:
    """The weight-decay param groups and the named parameters in the groups' flat order
    (frozen parameters left out): the flat positions key the momenta."""
    named = list(named_parameters)
    groups = weight_decay_groups([p for _, p in named], weight_decay)
    name_of = {id(p): n for n, p in named}
    return [(name_of[id(p)], p) for g in groups for p in g["params"]], groups

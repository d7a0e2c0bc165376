"""CLAN in one call: the headline method of gradpress (Zhong, Xie, Zheng, Lin 2021).

CLAN is LANS (Zheng et al. 2020) driven by two-way compressed communication with error feedback
on workers and servers. ``gp.CLAN`` builds it in one of two ways (``communicate``):

``"momentum"`` (the default since the 3-seed runs of ``docs/convergence.md``, section 2.6):
1-bit LANS, :class:`gradpress.optim.OneBitLANS`.

1. for ``warmup_steps`` steps the gradients are averaged uncompressed and LANS (with its
   gradient normalisation) steps on them;
2. then each worker keeps its own second moment from its own gradient (``variance``) and
   its momentum, divided by its ``sqrt(v)+eps``, is compressed, averaged by the servers and
   compressed again;
3. every worker takes the layer-wise step (LAMB's, or LANS's blend with ``blend=True``) along
   the averaged momentum.

``"gradient"`` (the paper's CLAN): each worker compresses its gradient chunks, the servers
average and compress again, and every worker takes the LANS step without gradient normalisation
(:func:`gradpress.optim.clan`) on the decoded gradient, after ``warmup_steps`` uncompressed steps.

Evidence (``docs/convergence.md``, section 2): stdlib-mlm, a 2-layer transformer; one-bit;
gap in validation loss to uncompressed LANS at the same lr 0.01 in %, paired by seed, mean ± std
over 3 seeds (the argument docstrings give the figures behind each default):

===================================================  ============  ============  ============
setting                                              800 steps     1600 steps    3200 steps
===================================================  ============  ============  ============
``communicate="gradient"``, 100 warm-up steps (2.4)  +8.57 ± 3.47  -             -
defaults, every matrix compressed (2.11, 2.12)       +5.49 ± 2.70  +2.90 ± 4.31  +0.38 ± 2.21
``uncompressed_params=["pos.weight"]``, 20% dense    +1.30 ± 0.84  +0.78 ± 1.37  +5.14 ± 0.87
``uncompressed_params=["pos.weight"]``, 160 dense    +1.30 ± 0.84  -2.13 ± 0.85  +0.75 ± 1.88
the same with ``weight_decay=0.01`` (2.14)           +1.25 ± 0.75  -2.26 ± 0.80  -0.97 ± 4.97
and ``ef`` with ``anneal=1`` (2.15)                  +0.71 ± 0.62  -2.48 ± 1.39  -1.85 ± 4.13
===================================================  ============  ============  ============

(All rows but the last two ran with weight decay 0, against LANS with 0; the last two with 0.01,
this function's default, against LANS with 0.01. The last row's ``ef`` is
``"vanilla:decay=0.8,server_decay=1,anneal=1"``. At 6400 steps the last two: +3.56 ± 4.64% and
-1.49 ± 3.87%, section 2.15.)

``"momentum"`` against ``"gradient"`` (section 2.6: 100 dense steps, plain error feedback, and
for the momentum the frozen second moment and blend of that time), at 200 / 400 / 800 steps:
one-bit +0.25 / +0.67 / +6.39% against +1.34 (50 warm-up) / +2.12 / +8.57%; top-k 0.1% fp16
+0.78 / +2.25 / +8.25% against +0.01 / +2.35 / +9.00% (gradient at its own lr 0.02). So
``"momentum"`` is the default: better for one-bit at every length and for top-k from 400 steps
on.

The rows with ``warmup_steps=160`` (section 2.13) are within 3% on every seed at every length:
for a transformer, keep a learned position embedding exact and make the dense phase a fixed
number of steps that ends before the model starts to use its context, not a fraction of the run.
Past 3200 steps it needs weight decay: a 6400-step run of it (seed 1) without decay diverged
from step ~1950, where the longer schedule keeps the lr near its peak, while uncompressed LANS
did not; with ``weight_decay=0.01`` (the default here) the same run ended 0.84% ahead of LANS
with the same decay, but seeds 0 and 2 ended 8.40% and 3.13% behind (seed 0 was inside 3% to
step 2912, then its gap grew as the lr fell). Letting the workers' residual decay rise to 1 as
the lr falls (``ef="vanilla:decay=0.8,server_decay=1,anneal=1"``, section 2.15) closed that:
every seed within 3% at 6400 steps (-0.53, -5.75, +1.82%) and at 800, 1600 and 3200 steps too.
Top-k 0.1% does not keep up past 800 steps either way (seed 1 at 1600 steps: momentum +54-60%;
gradient +79.9%, never leaving the early plateau): in 1280 compressed steps an element is
delivered about once, and at 6400 steps the gap is larger, not smaller (+70%, section 2.17).
Prefer one-bit for transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..compress.spec import CodecSpec, parse_spec
from ..optim import OneBitLANS, weight_decay_groups
from ..optim import clan as clan_optimizer
from .optimizer import ALWAYS_EXACT, DistributedOptimizer, match_names

__all__ = ["CLAN"]

#: What ``gp.CLAN`` compresses after its warm-up.
COMMUNICATES = ("gradient", "momentum")

#: Uncompressed warm-up steps chosen by the 3-seed runs in docs/convergence.md (50 was enough
#: for onebit at 200 steps; top-k 0.1% and 400-step runs needed 100).
DEFAULT_WARMUP_STEPS = 100
#: ``ef=None`` with ``communicate="momentum"``: the workers' residuals decay by this each step,
#: the servers' are kept until sent (``docs/convergence.md`` 2.11).
DEFAULT_MOMENTUM_EF = "vanilla:decay=0.8,server_decay=1.0"


def CLAN(named_parameters: Iterable[tuple[str, torch.nn.Parameter]],  # noqa: N802
         lr: float = 1e-3, *, compression: str | Mapping[str, Any] | CodecSpec = "onebit",
         ef: str | None = None, warmup_steps: int = DEFAULT_WARMUP_STEPS,
         weight_decay: float = 0.01, betas: tuple[float, float] = (0.9, 0.999),
         eps: float = 1e-6, freeze_variance: bool = False,
         min_compress_bytes: int | None = 1 << 20,
         backward_passes_per_step: int = 1, nan_policy: str = "raise",
         communicate: str = "momentum",
         uncompressed_params: Iterable[str] = (),
         refresh_every: int | None = None,
         variance: str | None = None,
         blend: bool | None = None) -> torch.optim.Optimizer:
    """Build the CLAN optimizer: ``gradpress.optim.clan`` wrapped in a ``DistributedOptimizer``.

    Args:
        named_parameters: ``model.named_parameters()`` (names key the tensors on all workers;
            parameters with ``requires_grad=False`` are left out).
        lr: learning rate. The paper's BERT-base values (batch 2k): 0.0014865 with onebit,
            0.001051 with topk 0.1%. Tune it per codec: on stdlib-mlm (200 steps) onebit did
            best at 0.01 and topk 0.1% at 0.02 (0.005 and 0.04 were far worse), while
            uncompressed LANS did best at 0.02 (``docs/convergence.md``).
        compression: codec spec; ``"onebit"`` (32x) or ``"topk:k=0.001,values=fp16"`` (333x
            against fp16 in the paper's int32-index layout; about 440x on 4 MiB chunks with
            gradpress's default bit-packed indices) are the paper's settings.
        ef: error feedback on workers and servers. None (default): with
            ``communicate="momentum"``, ``"vanilla:decay=0.8,server_decay=1"``: the workers'
            residuals decay by 0.8 a step, the servers' are kept until sent
            (``docs/convergence.md`` 2.10-2.11: on stdlib-mlm at 1600 steps, every matrix
            compressed, +15.37 ± 1.08% from uncompressed LANS with ``"vanilla"``, +6.80 ±
            1.10% with the workers' decay 0.9, 3 seeds each; with ``pos.weight`` exact, decay
            0.8 against 0.9: +0.78 ± 1.37% against +3.91 ± 0.97%). Tuning: 0.7-0.8 was best
            on one seed at 800 and 1600 steps; 0.5 was better at 1600 but worse at 800 steps
            on every seed, 0.9 and above worse at 1600, 0 (no feedback) far worse. For a long
            compression stage try 0.7 (3 seeds, ``pos.weight`` exact, section 2.12: +3.81 ±
            1.42% against 0.8's +5.14 ± 0.87% at 3200 steps, the same at 1600, one point
            worse at 800); a lower decay is further behind mid-run and catches up late. For
            long runs append ``",anneal=1"``: the workers' decay rises from 0.8 towards 1 as
            the lr falls (``B_t = 1 - (1 - B) * lr / lr_max``), and on stdlib-mlm
            (``pos.weight`` exact, 160 dense steps, weight decay 0.01) every seed was within
            3% of LANS at 6400 steps, -1.49 ± 3.87% against +3.56 ± 4.64% with 0.8 fixed
            (section 2.15); with every matrix compressed and 100 dense steps it was not
            better (1600 steps: +4.64 ± 1.22% against +4.02 ± 4.06%, section 2.16), so it is
            not the default. With ``"gradient"``, ``"vanilla"``. Others: ``"vanilla"`` (no decay),
            ``"vanilla:decay=B"`` (on both sides), ``"corrected"`` (scales the residual by
            lr_prev/lr_now, useful with steep lr schedules) and, with
            ``communicate="momentum"``, ``"ef21"``: the workers send differences to a
            shared estimate of the averaged momentum and the codec keeps no residuals
            (``OneBitLANS(ef21=True)``).
        warmup_steps: uncompressed steps before compression starts (default 100). Tuning:
            a fixed number of steps that ends before a transformer starts to use its
            context, not a fraction of the run: on stdlib-mlm with ``pos.weight`` exact, 160
            kept one-bit within 3% of LANS on every seed at 800, 1600 and 3200 steps, 100 was
            too few at 800 (+2.56 ± 1.27%) and 20% of a 3200-step run too many (+5.14 ±
            0.87%; ``docs/convergence.md`` 2.13). With ``"momentum"`` it must be >= 1 (a
            frozen second moment, ``variance="frozen"``, freezes there; 1-bit Adam uses
            15-25% of the run); ``communicate="gradient", warmup_steps=0`` compresses from the first
            step (small CNNs show no gap). They cost dense traffic: negligible in a long run,
            half of a 200-step one.
        weight_decay: decoupled weight decay on weight matrices and kernels (tensors of two
            or more dimensions); biases and normalisation weights get none, as in BERT's
            recipe and ``gradpress train`` (:func:`gradpress.optim.weight_decay_groups`).
            Tuning: keep some on long runs. On stdlib-mlm a 6400-step one-bit run without
            it diverged once the lr stayed near its peak; with 0.01 no run diverged, and the
            three seeds ended +8.40, -0.84 and +3.13% against uncompressed LANS
            (``docs/convergence.md`` 2.13-2.14); with ``ef`` annealed as well (above) -0.53,
            -5.75 and +1.82% (2.15).
        betas, eps: LANS hyperparameters (``docs/optimizers.md``).
        freeze_variance: freeze LANS's second moment when compression starts (after
            ``warmup_steps``, which must then be >= 1), as 1-bit Adam does; see
            ``docs/convergence.md`` for what it did on stdlib-mlm.
        min_compress_bytes: tensors smaller than this travel uncompressed and exact.
        backward_passes_per_step, nan_policy: as in :func:`DistributedOptimizer`.
        communicate: ``"momentum"`` (default; 1-bit LANS,
            :class:`gradpress.optim.OneBitLANS`: LANS proper on the dense gradient for
            ``warmup_steps`` steps, then each worker's momentum, divided by
            ``sqrt(v)+eps``, compressed two-way with error feedback; ``v`` as ``variance``
            says, ``freeze_variance`` is ignored) or ``"gradient"`` (the paper's CLAN: the two-way
            compressed gradient drives LANS without gradient normalisation). The evidence for
            the default is in the module docstring.
        uncompressed_params: names or ``fnmatch`` patterns of parameters that always travel
            uncompressed (fp32, exact), as in :func:`DistributedOptimizer`; with
            ``"momentum"`` their momenta do. Keep a learned position embedding here
            (``docs/convergence.md``, sections 2.7 and 2.13: one-bit at 800 steps with 160
            dense steps, +4.94 ± 2.56% behind LANS with every matrix compressed, +1.30 ±
            0.84% with it exact).
        refresh_every: ``"momentum"`` only: every this many steps after the warm-up, one
            dense step refreshes the frozen second moment (``OneBitLANS(refresh_every=)``);
            None (default): never.
        variance: ``"momentum"`` only: the second moment after the warm-up, ``"local"``
            (each worker keeps updating its own from its local gradient and sends its
            momentum divided by it, ``OneBitLANS(variance=)``; no extra bytes) or
            ``"frozen"`` (1-bit Adam's). None (default): ``"local"``, or ``"frozen"`` with
            ``ef="ef21"`` or ``refresh_every``, which need a frozen one. The local one
            removed the frozen one's cost on stdlib-mlm and cut one-bit's 1600-step gap from
            +20.8% to +14.7% (3 seeds, ``docs/convergence.md`` 2.8).
        blend: ``"momentum"`` only: after the warm-up, keep LANS's blend of the momentum with
            the gradient recovered from two consecutive averaged momenta (True) or step along
            the averaged momentum alone (False, LAMB's step, as 1-bit LAMB;
            ``OneBitLANS(blend=)``). None (default): False. The recovered gradient carries
            the codec's error of one step amplified by ``1/(1-b1)``; dropping it took one-bit's
            gap on stdlib-mlm (``pos.weight`` exact, decaying residuals) from +7.97 to +6.33%
            at 1600 steps and from +3.11 to +1.79% at 800; with nothing else changed +15.37
            against +15.82% at 1600 (3 seeds each, ``docs/convergence.md`` 2.9).
            With ``"gradient"`` LANS always blends; only None is accepted.
    """
    if not isinstance(freeze_variance, bool):
        raise TypeError(f"freeze_variance must be a bool, got {freeze_variance!r}")
    if communicate not in COMMUNICATES:
        raise ValueError(f"communicate must be one of {', '.join(COMMUNICATES)}, got "
                         f"{communicate!r}")
    if blend is not None and not isinstance(blend, bool):
        raise TypeError(f"blend must be None or a bool, got {blend!r}")
    if ef is None:
        ef = _default_ef(communicate)
    if variance is None:
        frozen = ef == "ef21" or refresh_every is not None or communicate != "momentum"
        variance = "frozen" if frozen else "local"
    for given, what, why in (  # options that only the momentum variant has
            (ef == "ef21", "ef='ef21'", "the optimizer keeps the shared estimate"),
            (variance != "frozen", f"variance={variance!r}",
             "the optimizer keeps the second moment there"),
            (blend is not None, f"blend={blend!r}",
             "with 'gradient' LANS always blends; leave blend=None"),
            (refresh_every is not None, "refresh_every", "the second moment is frozen there")):
        if given and communicate != "momentum":
            raise ValueError(f"{what} needs communicate='momentum' ({why}), got "
                             f"communicate={communicate!r}")
    freezes = freeze_variance or communicate == "momentum"
    if freezes and not (isinstance(warmup_steps, int) and warmup_steps >= 1):
        raise ValueError(f"freeze_variance=True or communicate='momentum' (the default) needs "
                         f"warmup_steps >= 1 (the second moment is frozen when compression "
                         f"starts), got warmup_steps={warmup_steps!r}; communicate='gradient' "
                         f"compresses from the first step")
    named = list(named_parameters)
    groups = weight_decay_groups([p for _, p in named], weight_decay)
    # keys are flat positions: the names in the groups' order (frozen parameters left out)
    name_of = {id(p): n for n, p in named}
    named = [(name_of[id(p)], p) for g in groups for p in g["params"]]
    dense = match_names([n for n, _ in named], uncompressed_params, "uncompressed_params")
    if communicate == "momentum":
        return _momentum_clan(named, groups, lr, compression, ef, warmup_steps, weight_decay,
                              betas, eps, min_compress_bytes, backward_passes_per_step,
                              nan_policy, dense, refresh_every, variance, bool(blend))
    opt = clan_optimizer(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         freeze_step=warmup_steps if freeze_variance else None)
    return DistributedOptimizer(opt, named_parameters=named, compression=compression, ef=ef,
                                min_compress_bytes=min_compress_bytes,
                                backward_passes_per_step=backward_passes_per_step,
                                nan_policy=nan_policy, warmup_steps=warmup_steps,
                                uncompressed_params=sorted(dense))


def _default_ef(communicate: str) -> str:
    """``ef=None``: :data:`DEFAULT_MOMENTUM_EF` with ``"momentum"``, ``"vanilla"`` otherwise."""
    return DEFAULT_MOMENTUM_EF if communicate == "momentum" else "vanilla"


def _momentum_clan(named: list[tuple[str, torch.nn.Parameter]],
                   param_groups: list[dict[str, Any]], lr: float,
                   compression: str | Mapping[str, Any] | CodecSpec, ef: str, warmup_steps: int,
                   weight_decay: float, betas: tuple[float, float], eps: float,
                   min_compress_bytes: int | None, backward_passes_per_step: int,
                   nan_policy: str, dense: frozenset[str],
                   refresh_every: int | None, variance: str,
                   blend: bool) -> torch.optim.Optimizer:
    """``communicate="momentum"``: OneBitLANS whose compression stage push_pulls momenta."""
    from ..api import push_pull_async
    from ..compress import build
    from ..compress.registry import ef_needs_lr

    cs = parse_spec(compression)  # checked now, not when the warm-up ends
    ef21 = ef == "ef21"           # the estimate is the feedback: no residuals in the codec
    spec = CodecSpec(cs.name, dict(cs.params), {**cs.wrappers, "ef": None if ef21 else ef})
    build(spec, 4096)
    needs_lr = not ef21 and ef_needs_lr(ef)
    prefix = named[0][0] if named else "clan"  # distinct per model: names key the tensors
    groups: list[dict[str, Any]] = []           # the optimizer's, once built
    # keys are positions in the optimizer's flat parameter order (the groups hold named's order)
    exact = {str(i) for i, (n, _) in enumerate(named) if n in dense}

    def communicate(key: str, m: torch.Tensor) -> Any:
        # corrected error feedback rescales the residuals by the change of the current lr;
        # anneal=1 moves the workers' decay towards 1 as it falls
        step_lr = groups[0]["lr"] if needs_lr else None
        limit = ALWAYS_EXACT if key in exact else min_compress_bytes
        return push_pull_async(m, name=f"{prefix}.clan_m.{key}", average=True,
                               compression=spec, lr=step_lr, min_compress_bytes=limit)

    opt = OneBitLANS(param_groups, lr=lr, betas=betas, eps=eps,
                     weight_decay=weight_decay, freeze_step=warmup_steps,
                     communicate=communicate, ef21=ef21, refresh_every=refresh_every,
                     variance=variance, blend=blend)
    groups.extend(opt.param_groups)
    # The wrapper averages dense gradients during the warm-up and stops once the optimizer's
    # compression_active turns true (it communicates momenta from then on).
    return DistributedOptimizer(opt, named_parameters=named, compression="none",
                                backward_passes_per_step=backward_passes_per_step,
                                nan_policy=nan_policy)

"""A bundled task through ``gradpress train``'s script mode: the public factories, or the
optimizers' experiment switches.

Two uses, both on a bundled task (model, data, evaluation and training loop from
``gradpress.tasks`` and ``gradpress.train.worker``, as ``gradpress train --task`` runs them):

1. ``--method onebit-lans`` (default) or ``--method clan``: the optimizer a user builds,
   ``gp.OneBitLANS`` or ``gp.CLAN``, with this script's codec and, where given, error
   feedback, dense steps, exact tensors and ``min_compress_bytes`` (the factory's own defaults
   where not; ``gradpress train``'s ``--compression`` then only labels the report and warms
   the links up)::

       gradpress train --compression onebit --lr 0.01 --steps 800 --warmup-steps 30 --seed 0 \\
           --no-progress --out runs/clan-script/pos-d160_st800_s0 \\
           -- python benchmarks/clan_script.py --dense-steps 160 --uncompressed-params pos.weight

2. ``--method train``: exactly ``gradpress train --task TASK`` with every option of the
   ``gradpress train`` command line, plus the optimizer-class switches that only the
   convergence study uses (``benchmarks/convergence.py`` runs its variants this way)::

       gradpress train --optimizer onebit-lans --compression onebit --lr 0.01 --steps 800 \\
           -- python benchmarks/clan_script.py --method train --variance frozen --blend

``--lr``, ``--steps``, ``--warmup-steps`` (the lr schedule's), ``--weight-decay`` (default: the
task's) and ``--seed`` come from ``gradpress train`` in both.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

import gradpress as gp
from gradpress.tasks import get_task
from gradpress.train import Session, TrainConfig
from gradpress.train.session import CONFIG_ENV
from gradpress.train.worker import run_task, train_steps

#: ``--method`` -> the public factory it builds.
FACTORIES = {"onebit-lans": "OneBitLANS", "clan": "CLAN"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="stdlib-mlm", help="bundled task (default: stdlib-mlm)")
    p.add_argument("--method", default="onebit-lans", choices=[*FACTORIES, "train"],
                   help="gp.OneBitLANS, gp.CLAN, or gradpress train's optimizer with the "
                        "switches below (default: onebit-lans)")
    f = p.add_argument_group("the factories (--method onebit-lans or clan)")
    f.add_argument("--compression", default="onebit", help="the factory's codec spec")
    f.add_argument("--ef", default=None, help="the factory's error feedback (default: its own)")
    f.add_argument("--dense-steps", type=int, default=None,
                   help="the factory's dense steps (default: its own, 100)")
    f.add_argument("--uncompressed-params", nargs="*", default="auto",
                   help="parameter names kept exact (e.g. pos.weight; none given: none); "
                        "default: the factory's own, measured in the dense phase")
    f.add_argument("--save-model", type=Path, metavar="FILE",
                   help="rank 0 saves {'model': state_dict, 'probe_log': the health watch's "
                        "probes per tensor} here at the end (benchmarks/row_drift.py)")
    f.add_argument("--min-compress-bytes", type=int, default=None,
                   help="smaller tensors travel exact (default: the factory's own, \"auto\": "
                        "the largest tensors holding 95%% of the bytes are compressed; "
                        "16384 is gradpress train's default)")
    f.add_argument("--reset-every", type=int, metavar="N",
                   help="study (issue 38): every N compressed steps each compressed momentum "
                        "travels exact once and its residuals start afresh (the health watch "
                        "made to act at every probe; default: the watch's own rule)")
    f.add_argument("--ef-auto", action="store_true",
                   help="study (issue 38): each worker residual's decay from the codec's "
                        "measured contraction (benchmarks/study_ef.py)")
    f.add_argument("--decay-on-drift", metavar="EF",
                   help="study (issue 38): residuals kept whole (give --ef vanilla:...) until "
                        "the health watch sees a drift, then every compressed momentum travels "
                        "with this ef (benchmarks/study_ef.py)")
    s = p.add_argument_group("experiment switches of the optimizer classes (--method train)")
    s.add_argument("--variance", choices=("frozen", "local"),
                   help="onebit-lans: the second moment after the dense phase")
    s.add_argument("--blend", action=argparse.BooleanOptionalAction, default=None,
                   help="onebit-lans: LANS's blend after the dense phase")
    s.add_argument("--no-precondition", action="store_true",
                   help="onebit-lans: send the momentum, not divided by sqrt(v)")
    s.add_argument("--sends", choices=("momentum", "gradient"),
                   help="onebit-lans: what travels after the dense phase")
    s.add_argument("--refresh-every", type=int, metavar="N",
                   help="onebit-lans: one dense step every N that refreshes a frozen v")
    s.add_argument("--ef21", action="store_true",
                   help="onebit-lans: differences to a shared estimate (give --ef none to "
                        "gradpress train)")
    s.add_argument("--freeze-variance-after", type=int, metavar="N",
                   help="clan/lans: freeze the second moment after N steps")
    return p.parse_args(argv)


def optimizer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The optimizer-class keywords of the experiment switches that were given (the classes
    of ``benchmarks/study_optim.py`` take them)."""
    opts: dict[str, Any] = {
        "variance": args.variance, "blend": args.blend, "sends": args.sends,
        "refresh_every": args.refresh_every,
        "freeze_variance_after": args.freeze_variance_after}
    opts = {k: v for k, v in opts.items() if v is not None}
    if args.no_precondition:
        opts["precondition"] = False
    if args.ef21:
        opts["ef21"] = True
    return opts


def factory_options(args: argparse.Namespace) -> dict[str, Any]:
    """The factory's keywords of the options given (its own defaults for the others)."""
    opts = {"ef": args.ef, "dense_steps": args.dense_steps,
            "min_compress_bytes": args.min_compress_bytes}
    return {"uncompressed_params": args.uncompressed_params,
            **{k: v for k, v in opts.items() if v is not None}}


def run_factory(args: argparse.Namespace) -> None:
    """Use 1: the public factory in a user's training script."""
    s = Session.from_env()
    task = get_task(args.task)
    # 1. the task's model, the same start on every worker
    model = task.build_model(s.cfg.seed)
    model.train()
    wd = task.defaults.weight_decay if s.cfg.weight_decay is None else s.cfg.weight_decay
    factory = getattr(gp, FACTORIES[args.method])
    if args.reset_every is not None:
        _reset_every(args.reset_every)
    if args.ef_auto:
        from study_ef import install_auto_decay

        install_auto_decay()
    if args.decay_on_drift:
        from study_ef import install_decay_on_drift

        install_decay_on_drift(args.decay_on_drift)
    opt = factory(model.named_parameters(), lr=s.hparams["lr"], compression=args.compression,
                  weight_decay=wd, **factory_options(args))
    gp.broadcast_parameters({f"init.{k}": v for k, v in model.state_dict().items()})
    s.start()
    # 2-3. the bundled task's own loop (the one `gradpress train --task` runs): steps with the
    # session's schedule, evaluation on rank 0 once per epoch and at the end
    bs = s.cfg.batch_size or task.defaults.batch_size
    train_steps(task, model, opt, s, bs, task.steps_per_epoch(gp.size(), bs))
    s.finish(model, task=args.task)
    if args.save_model is not None and gp.rank() == 0:
        args.save_model.parent.mkdir(parents=True, exist_ok=True)
        probes = {name: opt.state[p]["probe_log"] for name, p in model.named_parameters()
                  if "probe_log" in opt.state.get(p, {})}
        torch.save({"model": model.state_dict(), "probe_log": probes}, args.save_model)
        # the probes alone, small enough to keep with the run's record
        args.save_model.with_name("probes.json").write_text(json.dumps(probes) + "\n")


def _reset_every(n: int) -> None:
    """``--reset-every N``: the factory's health watch probes every N steps and acts at every
    probe (a cosine is never above 1), for one exact step (the builder reads
    ``gradpress.optim.health.HealthWatch`` when it builds the optimizer)."""
    import dataclasses

    import gradpress.optim.health as health

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class ResetWatch(health.HealthWatch):
        every: int = n
        threshold: float | None = 1.0
        recover_steps: int = 1

    health.HealthWatch = ResetWatch  # type: ignore[misc]


def run_train(args: argparse.Namespace) -> None:
    """Use 2: ``gradpress train --task`` with the optimizer's experiment switches, which the
    study's classes take (``benchmarks/study_optim.py``)."""
    from study_optim import make_core

    path = Path(os.environ[CONFIG_ENV])
    cfg = TrainConfig.from_dict(json.loads(path.read_text())["runs"][0])
    opts = optimizer_options(args)
    core = make_core(cfg.optimizer, opts)
    run_task(cfg.replace(task=args.task, script=()),
             optimizer_options={**opts, **({"core": core} if core else {})})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.method != "train" and optimizer_options(args):
        raise SystemExit("clan_script.py: the experiment switches need --method train")
    gp.init()
    if args.method == "train":
        run_train(args)
    else:
        run_factory(args)
    gp.shutdown()


if __name__ == "__main__":
    main()

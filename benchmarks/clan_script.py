"""The bundled transformer task through the public API: ``gp.CLAN`` in a user script.

``benchmarks/convergence.py`` measures 1-bit LANS through ``gradpress train --optimizer
onebit-lans``. This script trains the same task (stdlib-mlm: model, data, evaluation from
``gradpress.tasks``) with the optimizer a user would build, ``gp.CLAN``, under ``gradpress
train``'s script mode, so the recommendation of ``docs/convergence.md`` section 2.13 can be
checked as it is written there::

    gradpress train --compression onebit --lr 0.01 --steps 800 --warmup-steps 30 --seed 0 \\
        --no-progress --out runs/clan-script/pos-w160_st800_s0 \\
        -- python benchmarks/clan_script.py --warmup-steps 160 --uncompressed-params pos.weight

Compare its ``val_loss`` with the driver's run of the same seed and length
(``onebit-lans_onebit_pos-lv-decay08-noblend-srv1-freeze160``). ``--lr``, ``--steps``,
``--warmup-steps`` (the lr schedule's), ``--weight-decay`` (default: the task's) and
``--seed`` come from ``gradpress train`` (its ``--compression`` only labels the report and
warms the links up); the script's own options give ``gp.CLAN``'s codec, error feedback, dense
phase and exact tensors.
"""

from __future__ import annotations

import argparse

import gradpress as gp
from gradpress.tasks import get_task
from gradpress.train import Session
from gradpress.train.worker import train_steps


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="stdlib-mlm", help="bundled task (default: stdlib-mlm)")
    p.add_argument("--compression", default="onebit", help="gp.CLAN's codec spec")
    p.add_argument("--ef", default=None,
                   help="gp.CLAN's error feedback (default: its own, "
                        "vanilla:decay=0.8,server_decay=1)")
    p.add_argument("--warmup-steps", type=int, default=100, help="gp.CLAN's dense steps")
    p.add_argument("--uncompressed-params", nargs="*", default=[],
                   help="parameter names kept exact (e.g. pos.weight)")
    p.add_argument("--min-compress-bytes", type=int, default=16 << 10,
                   help="smaller tensors travel exact (default 16 KiB, as gradpress train; "
                        "gp.CLAN's own default of 1 MiB would leave this small model dense)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    gp.init()
    s = Session.from_env()
    task = get_task(args.task)
    # 1. the task's model, the same start on every worker
    model = task.build_model(s.cfg.seed)
    model.train()
    wd = task.defaults.weight_decay if s.cfg.weight_decay is None else s.cfg.weight_decay
    opt = gp.CLAN(model.named_parameters(), lr=s.hparams["lr"], compression=args.compression,
                  ef=args.ef, weight_decay=wd, warmup_steps=args.warmup_steps,
                  uncompressed_params=args.uncompressed_params,
                  min_compress_bytes=args.min_compress_bytes)
    gp.broadcast_parameters({f"init.{k}": v for k, v in model.state_dict().items()})
    s.start()
    # 2-3. the bundled task's own loop (the one `gradpress train --task` runs): steps with the
    # session's schedule, evaluation on rank 0 once per epoch and at the end
    bs = task.defaults.batch_size
    train_steps(task, model, opt, s, bs, task.steps_per_epoch(gp.size(), bs))
    s.finish(model, task=args.task)
    gp.shutdown()


if __name__ == "__main__":
    main()

"""The ``gradpress`` command line: one small function pair per subcommand.

Each subcommand has an ``_add_<name>(subparsers)`` that defines its arguments and a
``_run_<name>(args) -> int`` that runs it; :data:`SUBCOMMANDS` lists them. Add a subcommand by
writing both functions and adding one entry.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .train.netem import NetemError

if TYPE_CHECKING:
    from .launch import LaunchConfig

__all__ = ["main", "build_parser", "SUBCOMMANDS"]


# -- launch ---------------------------------------------------------------------------------
def _add_launch(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "launch", help="start workers and servers of a job on this node",
        description="Start the worker processes (running CMD) and the server processes of a "
                    "gradpress job on this node, and stop all of them if one fails.",
        epilog="examples:\n  gradpress launch --workers 2 --servers 1 -- python train.py\n"
               "  gradpress launch --nnodes 2 --node-rank 0 --master-addr HOST "
               "--master-port 29500 \\\n      --workers-per-node 8 --servers-per-node 1 -- "
               "python train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, help="total workers (all nodes)")
    p.add_argument("--servers", type=int, help="total servers (all nodes); default: one per "
                   "node, or one per worker with --colocate")
    p.add_argument("--colocate", action="store_true",
                   help="run the server engines inside the worker processes")
    p.add_argument("--hierarchical", action="store_true",
                   help="reduce within each node; only one worker per node pushes and pulls "
                        "(sets GRADPRESS_HIERARCHICAL=1)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="address of node 0, which hosts the TCP store (default 127.0.0.1)")
    p.add_argument("--master-port", type=int, default=0,
                   help="port of the TCP store (default: a free port; required with --nnodes)")
    p.add_argument("--workers-per-node", type=int, help="workers on each node")
    p.add_argument("--servers-per-node", type=int, help="servers on each node")
    p.add_argument("--grace", type=float, default=5.0,
                   help="seconds between SIGTERM and SIGKILL when stopping (default 5)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the store, servers and other nodes (default 300)")
    p.add_argument("--resume", metavar="DIR",
                   help="resume from the checkpoint in DIR: sets GRADPRESS_RESUME=DIR for every "
                        "process; servers load their state from it at start, the training "
                        "script calls gradpress.checkpoint.load (docs/design.md)")
    p.add_argument("--checkpoints", metavar="DIR",
                   help="where the script saves its checkpoints, one subdirectory each (sets "
                        "GRADPRESS_CHECKPOINTS=DIR; gradpress.checkpoint.checkpoints_dir())")
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="when a process dies, restart the job from the newest valid checkpoint "
                        "under --checkpoints (GRADPRESS_RESUME), at most N times (default 0; "
                        "one node: on several nodes, recovery is torchrun's elastic agent, "
                        "docs/integrations.md)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ... run by each worker")
    return p


def _resume_env(directory: str | None, workers: int, servers: int) -> dict[str, str]:
    """``GRADPRESS_RESUME`` for ``--resume DIR``; another number of workers or servers is
    announced (the workers' ``checkpoint.load`` applies its resize rule)."""
    if directory is None:
        return {}
    path = os.path.abspath(directory)
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume {directory}: cannot read {meta_path} ({e}); is it a "
                         f"complete gradpress checkpoint?") from None
    saved = (meta.get("num_workers"), meta.get("num_servers"))
    if saved != (workers, servers):  # the workers' checkpoint.load applies its resize rule
        print(f"gradpress launch: --resume {directory}: the checkpoint was saved by a job with "
              f"{saved[0]} workers and {saved[1]} servers, this launch has {workers} workers "
              f"and {servers} servers (gradpress.checkpoint.load's resize rule applies)",
              file=sys.stderr, flush=True)
    return {"GRADPRESS_RESUME": path}


def _per_node(total: int | None, per_node: int | None, nnodes: int, what: str,
              default: int | None) -> int:
    """Resolve a per-node count from ``--X`` (total) and ``--X-per-node``."""
    if per_node is not None:
        if total is not None and total != per_node * nnodes:
            raise ValueError(f"--{what}s {total} disagrees with --{what}s-per-node {per_node} "
                             f"x --nnodes {nnodes}")
        return per_node
    if total is not None:
        if total < 1 or total % nnodes:
            raise ValueError(f"--{what}s {total} must be a positive multiple of --nnodes "
                             f"{nnodes}")
        return total // nnodes
    if default is None:
        raise ValueError(f"give --{what}s (total) or --{what}s-per-node")
    return default


def _run_launch(args: argparse.Namespace) -> int:
    from .launch import LaunchConfig, layout_advice

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("no worker command: put it after '--', e.g. "
                         "gradpress launch --workers 2 --servers 1 -- python train.py")
    if args.nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {args.nnodes}")
    wpn = _per_node(args.workers, args.workers_per_node, args.nnodes, "worker", None)
    spn = _per_node(args.servers, args.servers_per_node, args.nnodes, "server",
                    wpn if args.colocate else 1)
    _check_restarts(args)
    if (advice := layout_advice(wpn, spn, args.colocate)) is not None:
        print(f"gradpress launch: note: {advice}", file=sys.stderr, flush=True)
    cfg = LaunchConfig(command=tuple(command), workers_per_node=wpn, servers_per_node=spn,
                       colocate=args.colocate, nnodes=args.nnodes, node_rank=args.node_rank,
                       master_addr=args.master_addr, master_port=args.master_port,
                       grace_s=args.grace, timeout=args.timeout,
                       env={**({"GRADPRESS_HIERARCHICAL": "1"} if args.hierarchical else {}),
                            **({"GRADPRESS_CHECKPOINTS": os.path.abspath(args.checkpoints)}
                               if args.checkpoints else {}),
                            **_resume_env(args.resume, wpn * args.nnodes, spn * args.nnodes)})
    return _launch_with_restarts(cfg, args.max_restarts)


def _check_restarts(args: argparse.Namespace) -> None:
    n = args.max_restarts
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"--max-restarts must be an int >= 0, got {n!r}")
    if n and args.nnodes > 1:
        raise ValueError(f"--max-restarts is for one node (the launchers of several nodes do "
                         f"not restart together), got --nnodes {args.nnodes}")


def _launch_with_restarts(cfg: LaunchConfig, max_restarts: int) -> int:
    """``launch(cfg)`` under :func:`gradpress.launch.restart_loop`: a failed job is launched
    again with ``GRADPRESS_RESUME`` set to the newest valid checkpoint under
    ``GRADPRESS_CHECKPOINTS`` (none: the job's own ``--resume``, or the start)."""
    import dataclasses

    from .launch import launch, restart_loop

    def run(resume: str | None) -> int:
        env = {k: v for k, v in cfg.env.items() if k != "GRADPRESS_RESUME"}
        return launch(dataclasses.replace(
            cfg, env={**env, **({"GRADPRESS_RESUME": resume} if resume else {})}))

    def announce(code: int, count: int, resume: str | None) -> None:
        print(f"gradpress launch: the job failed (exit status {code}); restart {count} of "
              f"{max_restarts} from {resume or 'the start'}", file=sys.stderr, flush=True)

    code, _ = restart_loop(run, checkpoints=cfg.env.get("GRADPRESS_CHECKPOINTS"),
                           resume=cfg.env.get("GRADPRESS_RESUME"), max_restarts=max_restarts,
                           announce=announce)
    return code


# -- simulate -------------------------------------------------------------------------------
def _add_simulate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .sim.cli import add_arguments

    p = sub.add_parser(
        "simulate", help="predict iteration time at paper scale (pipeline model)",
        description="Predict one training iteration of BytePS-Compress for ResNet50, VGG16 or "
                    "BERT-base on a GPU cluster, with and without compression.")
    add_arguments(p)
    return p


def _run_simulate(args: argparse.Namespace) -> int:
    from .sim.cli import run

    return run(args)


# -- train, demo ----------------------------------------------------------------------------
def _add_train(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .train.cli import add_train_arguments

    p = sub.add_parser(
        "train", help="train a bundled task (or your script) on a local cluster",
        description="Start a local cluster, train with compressed communication, and write "
                    "metrics.jsonl, report.json and plots to the run directory "
                    "(docs/reference/cli.md).",
        epilog="examples:\n  gradpress train --task digits-cnn --compression onebit "
               "--optimizer clan --lr 0.004\n  gradpress train --compression onebit --lr 0.004 "
               "--steps 500 -- python my_train.py",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_train_arguments(p)


def _run_train(args: argparse.Namespace) -> int:
    from .train.cli import run_train

    return run_train(args)


def _add_demo(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from .train.cli import add_demo_arguments

    p = sub.add_parser(
        "demo", help="the digits CNN uncompressed, int4, CLAN onebit and DiLoCo side by side",
        description="Train digits-cnn uncompressed, with the default int4, with CLAN onebit "
                    "and with DiLoCo in one local cluster; print a table with each run's time "
                    "to the uncompressed run's final accuracy and write plots. With --bandwidth "
                    "RATE (as root) the cluster runs behind a link of RATE "
                    "(docs/reference/cli.md).")
    return add_demo_arguments(p)


def _run_demo(args: argparse.Namespace) -> int:
    from .train.cli import run_demo

    return run_demo(args)


#: name -> (add arguments, run); ``main`` dispatches on the name.
SUBCOMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], argparse.ArgumentParser],
                             Callable[[argparse.Namespace], int]]] = {
    "launch": (_add_launch, _run_launch),
    "simulate": (_add_simulate, _run_simulate),
    "train": (_add_train, _run_train),
    "demo": (_add_demo, _run_demo),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="gradpress", description="Data-parallel training with two-way compressed "
                                      "communication (BytePS-Compress).")
    sub = parser.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", required=True)
    for name, (add, _run) in SUBCOMMANDS.items():
        add(sub).set_defaults(_run=SUBCOMMANDS[name][1])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradpress`` command; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except (ValueError, NetemError) as e:  # bad input, or a network namespace not possible
        parser.exit(2, f"gradpress {args.subcommand}: error: {e}\n")
    return 2  # unreachable: parser.exit raises SystemExit


if __name__ == "__main__":
    sys.exit(main())

"""The ``gradpress`` command line: one small function pair per subcommand.

Each subcommand has an ``_add_<name>(subparsers)`` that defines its arguments and a
``_run_<name>(args) -> int`` that runs it; :data:`SUBCOMMANDS` lists them. Add a subcommand by
writing both functions and adding one entry.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

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
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ... run by each worker")
    return p


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
    from .launch import LaunchConfig, launch

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
    cfg = LaunchConfig(command=tuple(command), workers_per_node=wpn, servers_per_node=spn,
                       colocate=args.colocate, nnodes=args.nnodes, node_rank=args.node_rank,
                       master_addr=args.master_addr, master_port=args.master_port,
                       grace_s=args.grace, timeout=args.timeout,
                       env={"GRADPRESS_HIERARCHICAL": "1"} if args.hierarchical else {})
    return launch(cfg)


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


#: name -> (add arguments, run); ``main`` dispatches on the name.
SUBCOMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], argparse.ArgumentParser],
                             Callable[[argparse.Namespace], int]]] = {
    "launch": (_add_launch, _run_launch),
    "simulate": (_add_simulate, _run_simulate),
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
    except ValueError as e:
        parser.exit(2, f"gradpress {args.subcommand}: error: {e}\n")
    return 2  # unreachable: parser.exit raises SystemExit


if __name__ == "__main__":
    sys.exit(main())

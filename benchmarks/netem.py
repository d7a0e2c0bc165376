"""Network emulation on one machine: command line and throughput check.

The library (rate-limited namespaces, emulated clusters, cleanup) is :mod:`gradpress.train.netem`;
this module re-exports it, so ``import netem`` from ``benchmarks/`` keeps working, and adds:

* :func:`measure_throughput`: bytes per second of one TCP stream through an emulated link;
* the command line (``python benchmarks/netem.py -h``): ``check``, ``ns create|destroy``,
  ``cluster create|destroy``, ``list``, ``cleanup`` (namespaces of processes that died), ``run``
  (a command inside a fresh rate-limited namespace) and ``bench`` (measured TCP throughput).

Library use (always cleaned up, also on an exception, Ctrl-C or SIGTERM)::

    with rate_limited_namespace("1gbit") as ns:
        subprocess.run(ns.cmd(["python", "job.py"]), check=True)
    with emulated_cluster(3, "1gbit") as cl:
        print(cl.addresses)               # ('10.99.0.1', '10.99.0.2', '10.99.0.3')

Needs root (or CAP_NET_ADMIN) and iproute2's ``ip netns``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence

from gradpress.train.netem import (  # re-exported for the benchmarks and their tests
    _LIVE,
    NAME_PREFIX,
    EmulatedCluster,
    Namespace,
    NetemError,
    _run,
    check_environment,
    cleanup_stale,
    create_cluster,
    create_namespace,
    destroy_cluster,
    destroy_namespace,
    emulated_cluster,
    list_namespaces,
    new_run_id,
    parse_rate,
    rate_limited_namespace,
)

__all__ = ["NAME_PREFIX", "NetemError", "Namespace", "EmulatedCluster", "check_environment",
           "parse_rate", "new_run_id", "create_namespace", "destroy_namespace", "create_cluster",
           "destroy_cluster", "rate_limited_namespace", "emulated_cluster", "list_namespaces",
           "cleanup_stale", "measure_throughput", "main"]


# -- throughput check ---------------------------------------------------------------------------
_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n = 0
while (b := c.recv(1 << 20)): n += len(b)
print(n, flush=True)
"""
_CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); buf = b"x" * (1 << 20)
t = time.perf_counter()
for _ in range(int(sys.argv[3])): c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); print(time.perf_counter() - t)
"""


def measure_throughput(server: Namespace, client: Namespace, address: str = "127.0.0.1",
                       mib: int = 64) -> float:
    """Bytes per second of one TCP stream from ``client`` to ``address`` in ``server``."""
    srv = subprocess.Popen(server.cmd([sys.executable, "-c", _SERVER, address]),
                           stdout=subprocess.PIPE, text=True)
    try:
        port = srv.stdout.readline().strip()  # type: ignore[union-attr]
        if not port:
            raise NetemError(f"throughput server in {server.name} did not start")
        res = _run(client.cmd([sys.executable, "-c", _CLIENT, address, port, str(mib)]),
                   f"throughput client in {client.name}")
        seconds = float(res.stdout.strip())
        srv.wait(30)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    return mib * (1 << 20) / seconds


# -- command line -------------------------------------------------------------------------------
def _cmd_ns(args: argparse.Namespace) -> int:
    if args.action == "create":
        ns = create_namespace(args.name or f"{new_run_id()}-ns", args.rate)
        _LIVE.discard(ns.name)  # kept on purpose: the user destroys it
        print(ns.name)
    else:
        for name in args.names:
            destroy_namespace(name)
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    if args.action == "create":
        cl = create_cluster(args.hosts, args.rate, subnet=args.subnet)
        for ns in cl.namespaces:
            _LIVE.discard(ns.name)
        print(f"run id {cl.run_id} (destroy: netem.py cluster destroy {cl.run_id})")
        print(f"hub {cl.hub.name}")
        for ns, addr in zip(cl.hosts, cl.addresses):
            print(f"host {ns.name} {cl.device} {addr}")
    else:
        for name in list_namespaces(prefix=f"{args.run_id}-"):
            destroy_namespace(name)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ValueError("run: give the command after '--'")
    with rate_limited_namespace(args.rate, tag="run") as ns:
        return subprocess.run(ns.cmd(command)).returncode


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.hosts:
        with emulated_cluster(args.hosts, args.rate) as cl:
            bps = measure_throughput(cl.hosts[0], cl.hosts[-1], cl.addresses[0], args.mib)
    else:
        with rate_limited_namespace(args.rate, tag="bench") as ns:
            bps = measure_throughput(ns, ns, "127.0.0.1", args.mib)
    print(f"{args.mib} MiB in one TCP stream: {bps / 1e6:.1f} MB/s = {bps * 8 / 1e9:.3f} Gbit/s "
          f"(rate {args.rate})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Parser of ``python benchmarks/netem.py``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="check root, ip netns and tc")
    sub.add_parser("list", help="list namespaces created by this module")
    sub.add_parser("cleanup", help="delete namespaces whose creating process died (this "
                   "includes those made by `ns create` / `cluster create`)")
    ns = sub.add_parser("ns", help="one namespace with a rate-limited loopback")
    ns.add_argument("action", choices=("create", "destroy"))
    ns.add_argument("names", nargs="*", help="namespaces to destroy")
    ns.add_argument("--rate", default="1gbit", help="tbf rate of lo (default 1gbit)")
    ns.add_argument("--name", help="namespace name (default: a fresh unique one)")
    cl = sub.add_parser("cluster", help="hosts joined by rate-limited veth pairs to a bridge")
    cl.add_argument("action", choices=("create", "destroy"))
    cl.add_argument("run_id", nargs="?", help="run id to destroy")
    cl.add_argument("--hosts", type=int, default=2)
    cl.add_argument("--rate", default="1gbit")
    cl.add_argument("--subnet", default="10.99.0", help="10.99.<x> (default 10.99.0)")
    run = sub.add_parser("run", help="run a command inside a fresh rate-limited namespace")
    run.add_argument("--rate", default="1gbit")
    run.add_argument("command", nargs=argparse.REMAINDER)
    bench = sub.add_parser("bench", help="measure TCP throughput through the emulated link")
    bench.add_argument("--rate", default="1gbit")
    bench.add_argument("--hosts", type=int, default=0, help="use a cluster of this many hosts")
    bench.add_argument("--mib", type=int, default=64)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        check_environment()
        if args.cmd == "check":
            print("ok: root, ip netns and tc available")
        elif args.cmd == "list":
            print("\n".join(list_namespaces()))
        elif args.cmd == "cleanup":
            print("\n".join(f"removed {n}" for n in cleanup_stale()) or "nothing stale")
        elif args.cmd == "cluster" and args.action == "destroy" and not args.run_id:
            raise ValueError("cluster destroy: give the run id printed by cluster create")
        else:
            return {"ns": _cmd_ns, "cluster": _cmd_cluster, "run": _cmd_run,
                    "bench": _cmd_bench}[args.cmd](args)
    except (NetemError, ValueError, TypeError) as e:
        print(f"netem: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

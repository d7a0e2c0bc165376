"""Network emulation on one machine with Linux network namespaces and ``tc``.

Two set-ups, both reachable only from inside namespaces this module creates:

* a **rate-limited namespace**: a fresh namespace whose loopback has a token-bucket filter
  (``tbf``) at a given rate; everything inside talks over 127.0.0.1 through that one link
  (``gradpress demo --bandwidth RATE`` runs its whole cluster in one);
* an **emulated cluster**: one namespace per host, each joined by a veth pair to a bridge in a
  hub namespace, with a ``tbf`` on the egress of both ends of every veth (so each host has its own
  full-duplex link of the given rate). Hosts get addresses ``10.99.<x>.<i+1>/24``; the range exists
  only inside these namespaces, nothing is routed anywhere else.

Library use (always cleaned up, also on an exception, Ctrl-C or SIGTERM)::

    with rate_limited_namespace("1gbit") as ns:
        subprocess.run(ns.cmd(["python", "job.py"]), check=True)
    with emulated_cluster(3, "1gbit") as cl:
        print(cl.addresses)               # ('10.99.0.1', '10.99.0.2', '10.99.0.3')
        subprocess.run(cl.hosts[0].cmd(["ping", "-c1", cl.addresses[1]]))

The command line (``check``, ``ns``, ``cluster``, ``list``, ``cleanup``, ``run``, ``bench``) and
the throughput check live in ``benchmarks/netem.py``, which re-exports this module.

Names start with ``gpnet<pid>x<random>`` so that concurrent runs never clash, and this module
refuses to delete any namespace whose name does not carry that prefix. Needs root (or
CAP_NET_ADMIN) and iproute2's ``ip netns``.
"""

from __future__ import annotations

import atexit
import os
import re
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["NAME_PREFIX", "NetemError", "Namespace", "EmulatedCluster", "check_environment",
           "parse_rate", "rate_bits_per_second", "new_run_id", "create_namespace",
           "destroy_namespace", "create_cluster", "destroy_cluster", "rate_limited_namespace",
           "emulated_cluster", "list_namespaces", "cleanup_stale"]

#: Every namespace this module creates starts with this prefix (then the creator's pid).
NAME_PREFIX = "gpnet"
_RATE_RE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$",
                      re.IGNORECASE)
_SIZE_RE = re.compile(r"^\d+(\.\d+)?(b|k|kb|kbit|m|mb|mbit)?$", re.IGNORECASE)
_TIME_RE = re.compile(r"^\d+(\.\d+)?(s|ms|us)$", re.IGNORECASE)
_SUBNET_RE = re.compile(r"^10\.99\.(\d{1,3})$")
_OURS_RE = re.compile(rf"^{NAME_PREFIX}(\d+)x[0-9a-f]+(-[A-Za-z0-9_.]+)?$")
_LIVE: set[str] = set()  # namespaces created by this process and not yet destroyed


class NetemError(RuntimeError):
    """A namespace or qdisc operation failed (the message names the command and the cause)."""


# -- small helpers ------------------------------------------------------------------------------
def _run(argv: Sequence[str], what: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``argv``; raise :class:`NetemError` naming ``what`` and the command on failure."""
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetemError(f"{what}: `{' '.join(argv)}` could not run: {e}") from e
    if check and res.returncode != 0:
        raise NetemError(f"{what}: `{' '.join(argv)}` failed with exit code {res.returncode}: "
                         f"{(res.stderr or res.stdout).strip()}")
    return res


def check_environment() -> None:
    """Raise :class:`NetemError` unless we are root and ``ip netns`` and ``tc`` work."""
    if os.geteuid() != 0:
        raise NetemError(f"network emulation needs root (CAP_NET_ADMIN) to create namespaces "
                         f"and qdiscs; this process runs as uid {os.geteuid()}")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetemError(f"network emulation needs the `{tool}` command (iproute2); it is "
                             f"not on PATH ({os.environ.get('PATH', '')})")
    res = _run(["ip", "netns", "list"], "checking `ip netns`", check=False)
    if res.returncode != 0:
        raise NetemError(f"`ip netns` is unavailable here (exit code {res.returncode}): "
                         f"{res.stderr.strip()}")


def parse_rate(rate: str | int | float) -> str:
    """A tc rate string: ``"1gbit"``, ``"100mbit"``, ... or a number of bits per second."""
    if isinstance(rate, bool) or not isinstance(rate, (str, int, float)):
        raise TypeError(f"rate must be a tc rate string (e.g. '1gbit') or bits/s, got "
                        f"{type(rate).__name__}")
    if isinstance(rate, (int, float)):
        if not rate > 0 or rate != rate:
            raise ValueError(f"rate must be > 0 bits/s, got {rate!r}")
        return f"{int(rate)}bit"
    text = rate.strip().lower()
    number = re.match(r"[\d.]+", text)
    if not _RATE_RE.match(text) or number is None or float(number.group()) <= 0:
        raise ValueError(f"rate {rate!r} is not a positive tc rate; expected e.g. '1gbit', "
                         f"'100mbit', '500kbit'")
    return text


#: tc's rate units in bits per second (decimal; ``bps`` is bytes per second, as in tc).
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12}


def rate_bits_per_second(rate: str | int | float) -> float:
    """Bits per second of a rate accepted by :func:`parse_rate` (``"100mbit"`` -> ``1e8``)."""
    text = parse_rate(rate)
    number = re.match(r"[\d.]+", text).group()  # type: ignore[union-attr]  # parse_rate checked
    return float(number) * _RATE_UNITS[text[len(number):]]


def _check_tbf_args(burst: str, latency: str) -> None:
    if not isinstance(burst, str) or not _SIZE_RE.match(burst):
        raise ValueError(f"burst {burst!r} is not a tc size; expected e.g. '128kb'")
    if not isinstance(latency, str) or not _TIME_RE.match(latency):
        raise ValueError(f"latency {latency!r} is not a tc time; expected e.g. '100ms'")


def new_run_id() -> str:
    """A fresh name prefix ``gpnet<pid>x<hex>``: unique per process and call."""
    return f"{NAME_PREFIX}{os.getpid()}x{secrets.token_hex(3)}"


def _check_ours(name: str) -> None:
    if not isinstance(name, str) or not _OURS_RE.match(name):
        raise ValueError(f"refusing to touch namespace {name!r}: only namespaces created by "
                         f"gradpress.train.netem (named {NAME_PREFIX}<pid>x<hex>[-tag]) are "
                         f"managed here")


# -- namespaces ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Namespace:
    """A network namespace created by this module."""

    name: str

    def cmd(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside this namespace (``ip netns exec NAME ...``)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def ip(self, *args: str, what: str = "ip") -> str:
        """Run ``ip -n NAME args...``; returns stdout."""
        return _run(["ip", "-n", self.name, *args], f"{what} in namespace {self.name}").stdout


def _add_tbf(ns: Namespace, dev: str, rate: str, burst: str, latency: str) -> None:
    _run(ns.cmd(["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst",
                 burst, "latency", latency]), f"rate-limiting {dev} in {ns.name} to {rate}")


def create_namespace(name: str, rate: str | int | float | None = None, *, burst: str = "128kb",
                     latency: str = "100ms") -> Namespace:
    """Create namespace ``name`` with its loopback up, rate-limited by a tbf when ``rate``."""
    _check_ours(name)
    tc_rate = None if rate is None else parse_rate(rate)
    _check_tbf_args(burst, latency)
    _run(["ip", "netns", "add", name], f"creating namespace {name}")
    _LIVE.add(name)
    ns = Namespace(name)
    try:
        ns.ip("link", "set", "lo", "up", what="bringing up lo")
        if tc_rate is not None:
            _add_tbf(ns, "lo", tc_rate, burst, latency)
    except BaseException:
        destroy_namespace(name)
        raise
    return ns


def destroy_namespace(name: str) -> None:
    """Kill the processes left inside namespace ``name`` (started by us) and delete it.

    A namespace that does not exist (any more) is not an error.
    """
    _check_ours(name)
    if name not in list_namespaces(prefix=name):
        _LIVE.discard(name)
        return
    pids = _run(["ip", "netns", "pids", name], f"listing processes in {name}", check=False)
    for pid in pids.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run(["ip", "netns", "del", name], f"deleting namespace {name}")
    _LIVE.discard(name)


def list_namespaces(prefix: str = NAME_PREFIX) -> list[str]:
    """Names of existing namespaces starting with ``prefix``."""
    out = _run(["ip", "netns", "list"], "listing namespaces").stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(prefix))


def cleanup_stale() -> list[str]:
    """Delete our namespaces whose creating process is gone; returns their names."""
    removed = []
    for name in list_namespaces():
        m = _OURS_RE.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # creator alive: not stale
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        destroy_namespace(name)
        removed.append(name)
    return removed


# -- emulated cluster ---------------------------------------------------------------------------
@dataclass(frozen=True)
class EmulatedCluster:
    """Hosts (one namespace each) joined through veth pairs to a bridge in ``hub``."""

    run_id: str
    hub: Namespace
    hosts: tuple[Namespace, ...]
    addresses: tuple[str, ...]
    rate: str | None
    #: Name of each host's interface towards the bridge (use it as GLOO_SOCKET_IFNAME).
    device: str = "eth0"

    @property
    def namespaces(self) -> tuple[Namespace, ...]:
        return (*self.hosts, self.hub)


def create_cluster(hosts: int, rate: str | int | float | None = None, *, subnet: str = "10.99.0",
                   burst: str = "128kb", latency: str = "100ms",
                   run_id: str | None = None) -> EmulatedCluster:
    """Create ``hosts`` host namespaces joined by rate-limited veth pairs to a bridge.

    Steps: 1. hub namespace with a bridge ``br0``; 2. per host: a namespace, a veth pair
    created in the hub (``v<i>`` on the bridge, ``eth0`` moved into the host), address
    ``<subnet>.<i+1>/24``; 3. a tbf at ``rate`` on the egress of both veth ends.
    """
    if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= 250:
        raise ValueError(f"hosts must be an int in 1..250, got {hosts!r}")
    m = _SUBNET_RE.match(subnet) if isinstance(subnet, str) else None
    if m is None or int(m.group(1)) > 255:
        raise ValueError(f"subnet {subnet!r} must be '10.99.<0-255>' (a private range that "
                         f"exists only inside these namespaces)")
    tc_rate = None if rate is None else parse_rate(rate)
    _check_tbf_args(burst, latency)
    rid = run_id or new_run_id()
    created: list[str] = []
    try:
        hub = create_namespace(f"{rid}-hub")
        created.append(hub.name)
        hub.ip("link", "add", "br0", "type", "bridge", what="creating the bridge")
        hub.ip("link", "set", "br0", "up", what="bringing up the bridge")
        nss, addrs = [], []
        for i in range(hosts):
            ns = create_namespace(f"{rid}-h{i}")
            created.append(ns.name)
            addr = f"{subnet}.{i + 1}"
            _join_host(hub, ns, i, addr, tc_rate, burst, latency)
            nss.append(ns)
            addrs.append(addr)
    except BaseException:
        for name in reversed(created):
            destroy_namespace(name)
        raise
    return EmulatedCluster(rid, hub, tuple(nss), tuple(addrs), tc_rate)


def _join_host(hub: Namespace, ns: Namespace, i: int, addr: str, rate: str | None, burst: str,
               latency: str) -> None:
    what = f"connecting host {i} ({ns.name})"
    hub.ip("link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns.name,
           what=what)
    hub.ip("link", "set", f"v{i}", "master", "br0", what=what)
    hub.ip("link", "set", f"v{i}", "up", what=what)
    ns.ip("addr", "add", f"{addr}/24", "dev", "eth0", what=what)
    ns.ip("link", "set", "eth0", "up", what=what)
    if rate is not None:
        _add_tbf(ns, "eth0", rate, burst, latency)      # host -> bridge
        _add_tbf(hub, f"v{i}", rate, burst, latency)    # bridge -> host


def destroy_cluster(cluster: EmulatedCluster) -> None:
    """Delete every namespace of ``cluster`` (hosts first, then the hub)."""
    errors = []
    for ns in cluster.namespaces:
        try:
            destroy_namespace(ns.name)
        except NetemError as e:
            errors.append(str(e))
    if errors:
        raise NetemError("; ".join(errors))


# -- context managers ---------------------------------------------------------------------------
@contextmanager
def _signals_unwind() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into SystemExit while inside (main thread only), so that the
    ``finally`` clauses that delete namespaces run; SIGINT already raises KeyboardInterrupt."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, _raise) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def rate_limited_namespace(rate: str | int | float | None = "1gbit", *, burst: str = "128kb",
                           latency: str = "100ms", tag: str = "ns") -> Iterator[Namespace]:
    """A fresh namespace with a tbf-limited loopback; deleted on exit, whatever happens."""
    check_environment()
    with _signals_unwind():
        ns = create_namespace(f"{new_run_id()}-{tag}", rate, burst=burst, latency=latency)
        try:
            yield ns
        finally:
            destroy_namespace(ns.name)


@contextmanager
def emulated_cluster(hosts: int, rate: str | int | float | None = "1gbit", *,
                     subnet: str = "10.99.0", burst: str = "128kb",
                     latency: str = "100ms") -> Iterator[EmulatedCluster]:
    """An emulated cluster (see :func:`create_cluster`); deleted on exit, whatever happens."""
    check_environment()
    with _signals_unwind():
        cl = create_cluster(hosts, rate, subnet=subnet, burst=burst, latency=latency)
        try:
            yield cl
        finally:
            destroy_cluster(cl)


@atexit.register
def _destroy_leftovers() -> None:
    for name in sorted(_LIVE):
        try:
            destroy_namespace(name)
        except (NetemError, ValueError):
            pass

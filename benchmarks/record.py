"""Run a command and keep its record: what ran, at which commit, on which machine.

Usage::

    python benchmarks/record.py NAME [--keep GLOB ...] -- CMD ...

Steps:

1. ``benchmarks/results/records/NAME/`` is emptied and created; every ``{out}`` in CMD is
   replaced by that directory (relative to the repository root, where CMD runs).
2. Before CMD starts, gradpress must import from this checkout's ``src/``; the record notes
   the commit (``git rev-parse HEAD``), the tracked files
   that differ from it outside ``benchmarks/results/`` (``dirty``: a record measured on a
   modified tree says so), the machine (CPU model, cores, memory, OS, Python, torch, GPU) and
   the load average.
3. CMD runs with no time limit of its own (its output goes to the terminal); the record adds
   the exit code, the wall time and the load average after it, and is written to
   ``NAME/record.json``. With ``--keep``, files of NAME/ matching none of the globs are
   deleted afterwards (plots, checkpoints), so that only the figures stay in the repository.

``python benchmarks/results_md.py`` renders the README's figure blocks and docs/results.md from
these records (and the tables in ``benchmarks/results/*.json``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "results" / "records"


def git(*args: str) -> str:
    """The stripped stdout of ``git ARGS`` in the repository ('' when git fails)."""
    r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                       timeout=60)
    return r.stdout.strip() if r.returncode == 0 else ""


def dirty_paths() -> list[str]:
    """Tracked files that differ from HEAD, outside benchmarks/results/."""
    paths = git("diff", "--name-only", "HEAD").splitlines()
    return [p for p in paths if not p.startswith("benchmarks/results/")]


def machine() -> dict[str, Any]:
    """The machine a command runs on: what bears on its timings."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem_kib = next(int(line.split()[1]) for line in
                       Path("/proc/meminfo").read_text().splitlines()
                       if line.startswith("MemTotal:"))
        memory = f"{mem_kib / 2**20:.0f} GiB"
    except (OSError, StopIteration):
        memory = "unknown"
    out = {"cpu": cpu, "cores": os.cpu_count(), "memory": memory,
           "os": platform.platform(), "python": platform.python_version()}
    try:
        import torch
        out["torch"] = torch.__version__
        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        out["torch"] = None
    return out


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def prune(directory: Path, keep: list[str]) -> None:
    """Delete the files of ``directory`` (recursively) that match none of ``keep``."""
    for path in sorted(directory.rglob("*"), reverse=True):
        if path.is_file() and path.name != "record.json" \
                and not any(path.match(g) for g in keep):
            path.unlink()
        elif path.is_dir() and not any(path.iterdir()):
            path.rmdir()


def imported_gradpress() -> Path:
    """Where ``import gradpress`` finds the package in a child process (this environment)."""
    r = subprocess.run([sys.executable, "-c", "import gradpress; print(gradpress.__file__)"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise ValueError(f"record.py: gradpress does not import: {r.stderr.strip()[-500:]}")
    return Path(r.stdout.strip()).resolve().parent


def run(name: str, command: list[str], keep: list[str] | None = None,
        records: Path = RECORDS) -> dict[str, Any]:
    """Steps 1-3: run ``command`` (``{out}`` replaced) and write ``records/name/record.json``.

    ValueError when gradpress would be imported from elsewhere than this checkout's ``src/``
    (the record's commit would not be the code that ran): set ``PYTHONPATH=src``."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"record name {name!r}: expected one plain directory name")
    if not command:
        raise ValueError("no command given (put it after --)")
    package = imported_gradpress()
    if package != (ROOT / "src" / "gradpress").resolve():
        raise ValueError(f"record.py: gradpress imports from {package}, not from this "
                         f"checkout's {ROOT / 'src'}; run with PYTHONPATH={ROOT / 'src'}")
    out = records / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    rel = os.path.relpath(out, ROOT)
    cmd = [a.replace("{out}", rel) for a in command]
    rec: dict[str, Any] = {
        "name": name, "command": shlex.join(cmd), "commit": git("rev-parse", "HEAD"),
        "dirty": dirty_paths(), "machine": machine(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_before": load_average()}
    t0 = time.perf_counter()
    code = subprocess.run(cmd, cwd=ROOT).returncode
    rec.update(wall_s=round(time.perf_counter() - t0, 1), exit_code=code,
               load_after=load_average())
    if keep:
        prune(out, keep)
    (out / "record.json").write_text(json.dumps(rec, indent=1) + "\n")
    return rec


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("record.py: error: put the command after --", file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name", help="the record's directory under benchmarks/results/records/")
    p.add_argument("--keep", nargs="+", metavar="GLOB",
                   help="afterwards keep only the files matching these globs")
    args = p.parse_args(argv[:cut])
    rec = run(args.name, argv[cut + 1:], args.keep)
    print(f"record.py: {args.name}: exit {rec['exit_code']}, {rec['wall_s']} s; wrote "
          f"{os.path.relpath(RECORDS / args.name / 'record.json', ROOT)}", file=sys.stderr)
    return int(rec["exit_code"] != 0)


if __name__ == "__main__":
    sys.exit(main())

"""A GPU check anyone can run: CUDA tests, codec throughput and push_pull on one GPU machine.

Usage::

    python benchmarks/gpu_check.py                     # on a GPU machine: under 8 minutes
    python benchmarks/gpu_check.py --quick             # smaller problems
    python benchmarks/gpu_check.py --allow-cpu --quick # no GPU: the non-CUDA parts on the CPU

Writes ``gpu_check.json`` and ``gpu_check.md`` into ``--out`` (default
``benchmarks/results/gpu_check/``); exits 1 when a check failed, 2 on bad arguments (also on a
machine without a visible CUDA device, unless ``--allow-cpu``). The machine (GPU, memory, CUDA,
torch, CPUs) heads both. Sections, in this order, each with its own time limit (together 450 s),
each recorded as pass, fail (also on an exception or a timeout; the others still run) or skip:

* ``codecs``: encode/decode GB/s of the device path (torch kernels) against the host path
  (pinned copies + numba), with and without error feedback, and a payload comparison of the
  two; see ``gpu_check_codecs.py``. Runs first: it compiles the numba kernels into numba's
  cache, which the later jobs' processes then load instead of compiling each on its own.
* ``cuda_tests``: ``pytest -q -k cuda`` over the files of ``tests/`` that define a test named
  ``*cuda*`` (the suite's CUDA tests are named so and skip themselves without a GPU; name new
  ones so too, and no other test): passed/failed/skipped counts and the output's tail. On a
  GPU, a test skipped for want of CUDA is a failure; in CPU mode the section is a skip (the
  CPU twins in those files run and must pass).
* ``push_pull``: 2 workers on the same device + 1 server, ``compress_on`` host and device, with
  exactness checks and seconds per step; see ``gpu_check_push_pull.py``.
* ``overlap`` (CUDA only): 2 workers on the device + 1 server, host mode, two compress
  threads: a backward-like loop of matmuls alone, the push_pull of its gradients alone, and
  both interleaved; prints the share of the shorter one hidden (the overlap ratio, one run);
  see ``gpu_check_overlap.py``.

Problem sizes: :data:`SIZES`, by device kind and ``--quick``. ``--device`` picks the GPU of the
codecs and push_pull sections; the CUDA tests use the default device (choose it with
``CUDA_VISIBLE_DEVICES``).

``--allow-cpu`` runs all of this on the CPU when no CUDA device is there (then the device path
is the torch kernels on the CPU, the CUDA tests skip): it tests the script, not a GPU. The check
tests the checkout it belongs to: ``src/`` comes first on the path, also in every subprocess.

Adding a check (e.g. stream correctness): write ``def check_x(ctx: Context, limit_s: float) ->
Result`` and append a :class:`Section` to :data:`SECTIONS`; ``needs_cuda=True`` records it as
skipped in CPU mode. Run slow or crash-prone work through :func:`run_command`, whose timeout
kills the whole process group.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "src"), str(HERE)]

import torch  # noqa: E402

import gpu_check_codecs  # noqa: E402
import gpu_check_overlap  # noqa: E402
import gpu_check_push_pull  # noqa: E402
from gpu_check_report import Result, build_report, machine_info, write_report  # noqa: E402

MiB = 2**20


@dataclass(frozen=True)
class Sizes:
    """Problem sizes of one run (chosen by device kind and --quick)."""

    codec_mib: float
    codec_reps: int
    codec_specs: tuple[str, ...]
    pp_tensors: int
    pp_mib: float
    pp_steps: int
    pp_codecs: tuple[str, ...]
    pp_odd_numel: int = 1_500_001  # 2 chunks of the default 4 MiB partition, the last partial


ALL_SPECS = ("none", "fp16", "bf16", "onebit", "topk:k=0.001,values=fp16", "randomk:k=0.01",
             "dithering:s=7")
QUICK_SPECS = ("fp16", "onebit", "topk:k=0.001,values=fp16")
PP_CODECS = ("none", "onebit", "topk:k=0.001,values=fp16")
SIZES = {("cuda", False): Sizes(64, 10, ALL_SPECS, 8, 4, 5, PP_CODECS),
         ("cuda", True): Sizes(16, 5, QUICK_SPECS, 4, 4, 2, PP_CODECS),
         ("cpu", False): Sizes(8, 3, QUICK_SPECS, 4, 1, 2, PP_CODECS),
         ("cpu", True): Sizes(1, 2, ("fp16", "onebit"), 2, 0.25, 1, ("none", "onebit"), 2503)}


@dataclass
class Context:
    """What every check gets: where to run, how big, where to write."""

    device: torch.device
    sizes: Sizes
    work_dir: Path
    cuda_tests: list[str]
    env: dict[str, str]

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    run: Callable[[Context, float], Result]
    limit_s: float
    needs_cuda: bool = False


# -- subprocesses ---------------------------------------------------------------------------
@dataclass
class Outcome:
    rc: int | None
    output: str
    timed_out: bool
    seconds: float


def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group started for ``proc`` (its own session), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Outcome:
    """Run ``cmd`` in its own session from the repository root, stdout and stderr together;
    after ``timeout_s`` the whole group is stopped and ``timed_out`` is set."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return Outcome(proc.returncode, out, False, time.perf_counter() - t0)
    except subprocess.TimeoutExpired:
        _kill_group(proc, grace_s=8.0)  # gradpress launch stops its processes within 5 s
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a process outside the group holds the pipe open
            out = "(no output: a process outside the group kept the pipe open)"
        return Outcome(proc.returncode, out, True, time.perf_counter() - t0)
    finally:
        if proc.poll() is None:  # KeyboardInterrupt or another error: leave nothing behind
            _kill_group(proc, grace_s=2.0)


def tail(text: str, chars: int = 3000) -> str:
    return text if len(text) <= chars else "..." + text[-chars:]


def failed_run(name: str, title: str, what: str, out: Outcome, limit_s: float) -> Result:
    why = f"timed out after {limit_s:.0f} s" if out.timed_out else f"exited {out.rc}"
    return Result(name, title, "fail", f"{what} {why}", error=tail(out.output))


# -- section: CUDA tests --------------------------------------------------------------------
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b")


def pytest_counts(output: str) -> dict[str, int]:
    """Counts of pytest's final summary line (``2 passed, 1 skipped in 3.1s``)."""
    counts = {k: 0 for k in ("passed", "failed", "skipped", "errors", "deselected")}
    lines = [ln for ln in output.splitlines() if re.search(r" in [\d.]+s", ln)]
    for n, what in _COUNT.findall(lines[-1] if lines else ""):
        key = "errors" if what.startswith("error") else what
        counts[key] = counts.get(key, 0) + int(n)
    return counts


def cuda_tests_verdict(counts: dict[str, int], cuda: bool, output: str = "") -> tuple[str, str]:
    """(status, summary) of the CUDA tests' counts. ``-k cuda`` also selects the CPU twins of
    the files named ``*cuda*``: in CPU mode the section is a skip whatever they did unless one
    failed; on a GPU, a test skipped for want of CUDA (its reason names CUDA) is a failure."""
    text = ", ".join(f"{v} {k}" for k, v in counts.items() if v and k != "deselected")
    if counts["failed"] or counts["errors"]:
        return "fail", text
    if not (counts["passed"] or counts["skipped"]):
        return "fail", "no test matched -k cuda"
    if not cuda:
        return "skip", f"{text} (no CUDA device: the CUDA tests skip, CPU twins may pass)"
    no_cuda = len(_SKIPPED_NO_CUDA.findall(output))
    if no_cuda or not counts["passed"]:
        return "fail", f"{text}: {no_cuda or 'every'} CUDA test(s) skipped on a CUDA machine"
    return "pass", text


_SKIPPED_NO_CUDA = re.compile(r"^SKIPPED \[\d+\] .*\bCUDA\b", re.MULTILINE)


_CUDA_TEST = re.compile(r"^\s*(?:async\s+)?def (test_\w*cuda\w*)\(", re.MULTILINE | re.IGNORECASE)


def cuda_test_files(tests: Path) -> list[str]:
    """The test files under ``tests`` that define a test named ``*cuda*`` (relative to the
    repository root): collecting only them keeps a module that fails to import elsewhere in
    the suite (a missing optional package) from failing this section."""
    found = [p for p in sorted(tests.rglob("test_*.py")) if _CUDA_TEST.search(p.read_text())]
    return [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in found]


def check_cuda_tests(ctx: Context, limit_s: float) -> Result:
    name, title = "cuda_tests", "CUDA tests (pytest -k cuda)"
    paths = ctx.cuda_tests or cuda_test_files(ROOT / "tests")
    if not paths:
        return Result(name, title, "fail", f"no test named *cuda* under {ROOT / 'tests'}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", "-k", "cuda",
           *paths]
    out = run_command(cmd, limit_s, ctx.env)
    if out.timed_out:
        return failed_run(name, title, "pytest", out, limit_s)
    counts = pytest_counts(out.output)
    status, summary = cuda_tests_verdict(counts, ctx.cuda, out.output)
    if status != "fail" and out.rc not in (0, 5):
        status, summary = "fail", f"{summary}; pytest exited {out.rc}"
    cols = ["passed", "failed", "errors", "skipped", "exit code"]
    row = [str(counts[k]) for k in cols[:4]] + [str(out.rc)]
    return Result(name, title, status, summary, columns=cols, rows=[row],
                  details={"command": cmd, "counts": counts, "output_tail": tail(out.output)},
                  error=tail(out.output) if status == "fail" else "")


# -- section: codec throughput --------------------------------------------------------------
def check_codecs(ctx: Context, limit_s: float) -> Result:
    name, title = "codecs", "Codec throughput: device path against host path"
    s, path = ctx.sizes, ctx.work_dir / "codecs.json"
    cmd = [sys.executable, str(HERE / "gpu_check_codecs.py"), "--device", str(ctx.device),
           "--mib", str(s.codec_mib), "--reps", str(s.codec_reps), "--json", str(path)]
    for spec in s.codec_specs:
        cmd += ["--spec", spec]
    out = run_command(cmd, limit_s, ctx.env)
    if out.timed_out or out.rc != 0:
        return failed_run(name, title, "gpu_check_codecs.py", out, limit_s)
    data = json.loads(path.read_text())
    cols, rows, fails = gpu_check_codecs.table(data)
    refs = ", ".join(f"{k} {v:.2f}" for k, v in data["refs"].items())
    dcp = "device memcpy" if "device memcpy" in data["refs"] else "host memcpy"
    notes = [f"{s.codec_mib:g} MiB float32 chunk on {data['device']}, best of {s.codec_reps} "
             f"interleaved rounds; GB/s = input fp32 bytes / time; rt = encode + decode.",
             f"References in the same run (GB/s): {refs}. rt/cp = round trip / that path's copy "
             f"({dcp} for dev, host memcpy for host)."]
    status = "fail" if fails else "pass"
    summary = f"{len(rows)} rows; {fails} failed (errors, or cast codecs' payloads differing)"
    return Result(name, title, status, summary, columns=cols, rows=rows, notes=notes,
                  details=data)


# -- section: push_pull ---------------------------------------------------------------------
def launch_push_pull(ctx: Context, mode: str, limit_s: float) -> tuple[list[dict], str]:
    """One 2-worker + 1-server job with ``compress_on=mode``: (the workers' results, error)."""
    s, job = ctx.sizes, ctx.work_dir / f"push_pull-{mode}"
    job.mkdir(parents=True, exist_ok=True)
    cfg = {"device": str(ctx.device), "codecs": list(s.pp_codecs), "tensors": s.pp_tensors,
           "numel": int(s.pp_mib * MiB) // 4, "odd_numel": s.pp_odd_numel,
           "steps": s.pp_steps, "out_dir": str(job)}
    (job / "cfg.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "1",
           "--timeout", "60", "--", sys.executable, str(HERE / "gpu_check_push_pull.py"),
           "--worker", str(job / "cfg.json")]
    env = {**ctx.env, "GRADPRESS_COMPRESS_ON": mode, "GRADPRESS_TIMEOUT": "60"}
    out = run_command(cmd, limit_s, env)
    if out.timed_out or out.rc != 0:
        why = f"timed out after {limit_s:.0f} s" if out.timed_out else f"exited {out.rc}"
        return [], f"compress_on={mode}: gradpress launch {why}\n{tail(out.output)}"
    return [json.loads((job / f"rank{r}.json").read_text()) for r in range(2)], ""


def check_push_pull(ctx: Context, limit_s: float) -> Result:
    name, title = "push_pull", "push_pull: 2 workers on one device + 1 server"
    s = ctx.sizes
    by_mode, errors = {}, []
    for mode in ("host", "device"):
        ranks, err = launch_push_pull(ctx, mode, limit_s / 2)
        if err:
            errors.append(err)
        else:
            by_mode[mode] = ranks
    numel = s.pp_tensors * (int(s.pp_mib * MiB) // 4) + s.pp_odd_numel
    cols, rows, fails = gpu_check_push_pull.table(by_mode, 4 * numel)
    notes = [f"Per worker: {s.pp_tensors} x {s.pp_mib:g} MiB + 1 x {s.pp_odd_numel} float32 "
             f"on {ctx.device} ({4 * numel / MiB:.1f} MiB); 1 warm-up + {s.pp_steps} timed "
             f"steps per codec, ef=vanilla for the lossy codecs, min_compress_bytes=0. A step: "
             f"barrier, push_pull_async of every tensor, wait for all; the slower worker counts."]
    status = "fail" if fails or errors else "pass"
    summary = f"{len(by_mode)} of 2 jobs ran; {fails} failed checks"
    return Result(name, title, status, summary, columns=cols, rows=rows, notes=notes,
                  details={"workers": by_mode}, error="\n\n".join(errors))


# -- section: overlap ------------------------------------------------------------------------
def check_overlap(ctx: Context, limit_s: float) -> Result:
    name, title = "overlap", "Overlap of push_pull with a backward-like loop (host mode)"
    job = ctx.work_dir / "overlap"
    job.mkdir(parents=True, exist_ok=True)
    quick = ctx.sizes.pp_steps < 5
    cfg = {"device": str(ctx.device), "layers": 8, "numel": MiB // 4 * (1 if quick else 4),
           "matmul_n": 2048, "layer_ms": 4.0, "steps": 3 if quick else 5, "out_dir": str(job)}
    (job / "cfg.json").write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "1",
           "--timeout", "60", "--", sys.executable, str(HERE / "gpu_check_overlap.py"),
           "--worker", str(job / "cfg.json")]
    env = {**ctx.env, "GRADPRESS_COMPRESS_ON": "host", "GRADPRESS_COMPRESS_THREADS": "2",
           "GRADPRESS_TIMEOUT": "60"}
    out = run_command(cmd, limit_s, env)
    if out.timed_out or out.rc != 0:
        return failed_run(name, title, "gradpress launch", out, limit_s)
    ranks = [json.loads((job / f"rank{r}.json").read_text()) for r in range(2)]
    cols, rows, ratio, finite = gpu_check_overlap.table(ranks)
    print(f"overlap ratio (slower worker, one run): {ratio:.2f}", flush=True)
    notes = [f"Per worker: {cfg['layers']} layers of ~{cfg['layer_ms']:g} ms of "
             f"{cfg['matmul_n']}^2 matmuls, a {4 * cfg['numel'] / MiB:g} MiB gradient each, "
             f"onebit + vanilla EF; medians of {cfg['steps']} steps after a warm-up. Ratio: "
             f"(compute + comm - both) / min(compute, comm); 1 = fully hidden, 0 = serial."]
    return Result(name, title, "pass" if finite else "fail",
                  f"overlap ratio {ratio:.2f} (slower worker, one run)"
                  + ("" if finite else "; non-finite results"),
                  columns=cols, rows=rows, notes=notes, details={"workers": ranks, "cfg": cfg})


#: in this order (the codecs compile and cache the numba kernels the later jobs load); the
#: limits add up to 450 s (most CUDA tests start a job of 2 workers and a server each)
SECTIONS: list[Section] = [
    Section("codecs", "Codec throughput: device path against host path", check_codecs, 60.0),
    Section("cuda_tests", "CUDA tests (pytest -k cuda)", check_cuda_tests, 260.0),
    Section("push_pull", "push_pull: 2 workers on one device + 1 server", check_push_pull, 70.0),
    Section("overlap", "Overlap of push_pull with a backward-like loop (host mode)",
            check_overlap, 60.0, needs_cuda=True),
]


def run_section(section: Section, ctx: Context, scale: float = 1.0) -> Result:
    """Run one section; an exception becomes a failed record, never the end of the run."""
    t0 = time.perf_counter()
    if section.needs_cuda and not ctx.cuda:
        res = Result(section.name, section.title, "skip", "needs a CUDA device")
    else:
        try:
            res = section.run(ctx, section.limit_s * scale)
        except Exception as e:  # noqa: BLE001 - recorded, and the other sections still run
            res = Result(section.name, section.title, "fail", f"{type(e).__name__}: {e}",
                         error=tail(traceback.format_exc()))
    res.seconds = time.perf_counter() - t0
    return res


def run_sections(sections: list[Section], ctx: Context, scale: float = 1.0) -> list[Result]:
    results = []
    for sec in sections:
        print(f"[gpu_check] {sec.name}: running (limit {sec.limit_s * scale:.0f} s)", flush=True)
        res = run_section(sec, ctx, scale)
        print(f"[gpu_check] {sec.name}: {res.status.upper()} in {res.seconds:.1f} s: "
              f"{res.summary}", flush=True)
        results.append(res)
    return results


def resolve_device(requested: str, allow_cpu: bool) -> tuple[torch.device, str]:
    """The device to run on and a note; ValueError when it cannot be used."""
    try:
        dev = torch.device(requested)
    except RuntimeError as e:
        raise ValueError(f"--device {requested!r} is not a torch device ({e})") from None
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n and (dev.index or 0) < n:
            return torch.device("cuda", dev.index or 0), ""
        if not allow_cpu:
            raise ValueError(f"--device {requested}: {n} CUDA devices visible (torch "
                             f"{torch.__version__}, CUDA {torch.version.cuda}); expected a "
                             f"CUDA device, or --allow-cpu to run the non-CUDA parts on the CPU")
        return torch.device("cpu"), f"{requested} not available: CPU mode"
    if dev.type == "cpu" and allow_cpu:
        return dev, "CPU mode"
    raise ValueError(f"--device {requested}: expected cuda[:N] (cpu only with --allow-cpu)")


def select(names: str) -> list[Section]:
    known = {s.name: s for s in SECTIONS}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    bad = [n for n in wanted if n not in known]
    if bad or not wanted:
        raise ValueError(f"--sections {names!r}: expected a comma-separated subset of "
                         f"{', '.join(known)}")
    return [known[n] for n in wanted]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results" / "gpu_check",
                   help="directory of gpu_check.json and gpu_check.md (default %(default)s)")
    p.add_argument("--quick", action="store_true", help="smaller problems, fewer repetitions")
    p.add_argument("--device", default="cuda:0",
                   help="CUDA device of the codecs and push_pull sections (default cuda:0; the "
                        "CUDA tests use the default device)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="without a CUDA device, run the non-CUDA parts on the CPU (tests the "
                        "script, measures no GPU)")
    p.add_argument("--sections", default=",".join(s.name for s in SECTIONS),
                   help="comma-separated subset of the sections (default: all)")
    p.add_argument("--cuda-tests", action="append", metavar="PATH",
                   help="test file or directory of the CUDA tests; repeatable (default: the "
                        "files under tests/ that define a test named *cuda*)")
    p.add_argument("--timeout-scale", type=float, default=1.0,
                   help="multiply every section's time limit (default 1)")
    args = p.parse_args(argv)
    if not args.timeout_scale > 0:
        p.error(f"--timeout-scale must be > 0, got {args.timeout_scale}")
    try:
        args.device, args.device_note = resolve_device(args.device, args.allow_cpu)
        args.sections = select(args.sections)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when no section failed, 1 otherwise (2: bad arguments)."""
    args = parse_args(argv)
    t0, mode = time.perf_counter(), args.device.type
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    command = " ".join([Path(sys.executable).name, *sys.argv]) if argv is None \
        else " ".join(["python", "benchmarks/gpu_check.py", *argv])
    print(f"[gpu_check] device {args.device} {args.device_note}".rstrip(), flush=True)
    machine = machine_info(args.device)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if mode == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="gp-gpucheck-") as tmp:
        ctx = Context(args.device, SIZES[(mode, args.quick)], Path(tmp),
                      args.cuda_tests or [], env)
        results = run_sections(args.sections, ctx, args.timeout_scale)
    report = build_report(machine, results, mode, command, created, time.perf_counter() - t0)
    js, md = write_report(args.out, report)
    print(f"[gpu_check] {'PASS' if report['ok'] else 'FAIL'}; wrote {js} and {md}", flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

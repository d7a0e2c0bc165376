"""Helpers shared by several test modules: test modules import them from here, never from one
another.

* processes: a free port, waiting for files, the processes of a job found through ``/proc`` by
  the marker environment variable ``GP_TEST_MARKER`` (which ``gradpress launch`` passes to every
  child), and a reader that waits for a line on a child's output;
* jobs: ``gradpress launch`` of a push_pull script (tests/test_push_pull.py and its device
  twin), ``torchrun`` of an example script (tests/test_torchrun.py, the Hugging Face example);
* optimizers: parameters, gradient sequences and the independent float64 LANS/LAMB reference
  (tests/test_optim.py and tests/test_optim_fused.py).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import torch

ROOT = Path(__file__).resolve().parents[1]


# -- processes --------------------------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_files(paths: list[Path], timeout: float = 60.0) -> None:
    """Wait until every path in ``paths`` exists; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"timed out waiting for {paths}"
        time.sleep(0.05)


def _environ(pid: str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
    return None if state == "Z" else env.split(b"\0")


def marked(marker: str) -> list[int]:
    """PIDs of live (not zombie) processes whose environment holds ``GP_TEST_MARKER=marker``."""
    tag = f"GP_TEST_MARKER={marker}".encode()
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and tag in (_environ(e) or ())]


def pid_of(marker: str, role: str, rank: int | None = None) -> int | None:
    """The PID of the marked job's process with ``GRADPRESS_ROLE=role`` (and ``RANK=rank``)."""
    want = [f"GP_TEST_MARKER={marker}".encode(), f"GRADPRESS_ROLE={role}".encode()]
    if rank is not None:
        want.append(f"RANK={rank}".encode())
    for entry in os.listdir("/proc"):
        env = _environ(entry) if entry.isdigit() else None
        if env is not None and all(w in env for w in want):
            return int(entry)
    return None


def assert_no_leftovers(marker: str, timeout: float = 10.0, log: str = "") -> None:
    """Every marked process is gone within ``timeout`` seconds (they may still be exiting)."""
    deadline = time.monotonic() + timeout
    while marked(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked(marker) == [], f"processes left behind: {marked(marker)}\n{log}"


class LineWatch:
    """Reads a child's text stream on a thread, keeping every line; :meth:`wait_for` blocks
    until a line holding a given text has been read (an event, not a guess of how long)."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        """Return once a line containing ``text`` was read; AssertionError if the stream ends
        or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(text in line for line in self.lines):
                left = deadline - time.monotonic()
                assert not self._closed and left > 0, \
                    f"no line with {text!r} within {timeout} s:\n{self.text()[-3000:]}"
                self._cond.wait(left)

    def text(self) -> str:
        """Everything read so far."""
        with self._cond:
            return "".join(self.lines)

    def close(self, timeout: float = 60.0) -> str:
        """Wait for the end of the stream (the child exited); return the whole text."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"stream still open after {timeout} s"
        return "".join(self.lines)


# -- jobs: gradpress launch of a push_pull script ----------------------------------------------
def launch_script(args: list[str], script: Path, out: Path, modes: str,
                  **env_vars: str) -> subprocess.Popen:
    """``gradpress launch ARGS -- python SCRIPT OUT MODES`` with small partitions and threads."""
    env = dict(os.environ, GRADPRESS_PARTITION_BYTES="4000", GRADPRESS_TIMEOUT="60",
               GRADPRESS_COMPRESS_THREADS="2", GRADPRESS_ENGINE_THREADS="2",
               OMP_NUM_THREADS="1")
    env.update(env_vars)
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--timeout", "60", *args, "--",
           sys.executable, str(script), str(out), modes]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def worker_results(tmp_path: Path, script_text: str, *args: str, workers: int = 2,
                   timeout: float = 240) -> list[dict]:
    """``gradpress launch`` of ``script_text`` on ``workers`` workers and 1 server, with
    ``tmp_path`` and ``args`` as its arguments; each worker ``r`` saves its results to
    ``tmp_path/worker{r}.pt``, returned in rank order (the launch must succeed)."""
    script = tmp_path / "worker.py"
    script.write_text(script_text)
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", str(workers),
           "--servers", "1", "--", sys.executable, str(script), str(tmp_path), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return [torch.load(tmp_path / f"worker{w}.pt") for w in range(workers)]


def finish(procs: list[subprocess.Popen]) -> None:
    """Wait for every launcher (150 s each); each must exit 0 (its log in the message)."""
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=150)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0])
    for p, log in zip(procs, logs):
        assert p.returncode == 0, f"launcher exited {p.returncode}:\n{log}"


def check_replicas(out: Path, workers: int) -> None:
    """The results the workers saved (``worker<r>.pt``) are identical and not empty."""
    res = [torch.load(out / f"worker{w}.pt") for w in range(workers)]
    assert res[0], "workers saved no results"
    for other in res[1:]:
        assert other.keys() == res[0].keys()
        for k in res[0]:
            assert torch.equal(other[k], res[0][k]), f"replicas differ on {k}"


# -- jobs: torchrun of an example script -------------------------------------------------------
def run_env(**extra: str) -> dict[str, str]:
    """The test's environment, one thread per process, the worktree's sources first."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADPRESS_")}
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else src
    return env | {"OMP_NUM_THREADS": "1", "GRADPRESS_TIMEOUT": "60"} | extra


def torchrun(nproc: int, script: Path, args: list[str], env: dict[str, str],
             timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node NPROC SCRIPT ARGS`` on 127.0.0.1; it must exit 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return p


def results(out: Path, workers: int) -> list[dict]:
    """The ``rank<r>.json`` files an example script wrote, one per worker, in rank order."""
    files = sorted(out.glob("rank*.json"))
    assert [f.name for f in files] == [f"rank{r}.json" for r in range(workers)], files
    return [json.loads(f.read_text()) for f in files]


def check_training(runs: list[dict], max_ratio: float, loss_ratio: float = 0.8) -> None:
    """Replicas bit-identical, loss down (the last 10 steps' mean below ``loss_ratio`` times
    the first 10 steps'), bytes below ``max_ratio`` times fp32's."""
    assert len({r["param_hash"] for r in runs}) == 1, [r["param_hash"] for r in runs]
    for r in runs:
        losses = r["losses"]
        first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
        assert last < loss_ratio * first, (first, last)
        s = r["stats"]
        assert 0 < s["bytes_pushed"] < max_ratio * s["dense_fp32_bytes"], s


# -- optimizers: parameters, gradients and the float64 reference -------------------------------
SHAPES = [(5, 3), (7,), (4, 2, 2), (3,)]


# -- fixtures: parameters and gradient sequences ------------------------------------------------

def make_params(dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.Tensor]:
    """Several tensors; the last one starts at zero (weight norm 0 -> trust ratio 1)."""
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    ps[-1].zero_()
    return [p.to(dtype).requires_grad_() for p in ps]


def make_grads(steps: int = 6, seed: int = 1) -> list[list[torch.Tensor | None]]:
    """Per step, one gradient per tensor; includes an all-zero gradient and a missing one."""
    g = torch.Generator().manual_seed(seed)
    seq = []
    for k in range(steps):
        grads: list[torch.Tensor | None] = [
            torch.randn(s, generator=g, dtype=torch.float64) * (0.1 + i)
            for i, s in enumerate(SHAPES)
        ]
        if k == 1:
            grads[0] = torch.zeros(SHAPES[0], dtype=torch.float64)   # gradient norm 0
        if k == 2:
            grads[1] = None                                          # no gradient this step
        seq.append(grads)
    return seq


def run(opt: torch.optim.Optimizer, params: list[torch.Tensor],
        seq: list[list[torch.Tensor | None]]) -> None:
    for grads in seq:
        for p, gr in zip(params, grads):
            p.grad = None if gr is None else gr.to(p.dtype).clone()
        opt.step()


# -- independent float64 references -----------------------------------------------------------

def _ratio(x: torch.Tensor, u: torch.Tensor) -> float:
    xn, un = float(x.norm()), float(u.norm())
    return xn / un if xn > 0 and un > 0 else 1.0


def ref_layerwise(params, seq, lr, betas, eps, wds, kind, normalize=False, freeze_step=None):
    """LANS (kind="lans") or LAMB (kind="lamb") written per tensor, straight from the papers;
    with ``freeze_step``, v and its bias correction stop at that step (1-bit LAMB style)."""
    b1, b2 = betas
    xs = [p.detach().double().clone() for p in params]
    ms = [torch.zeros_like(x) for x in xs]
    vs = [torch.zeros_like(x) for x in xs]
    ts = [0] * len(xs)
    for grads in seq:
        for i, g in enumerate(grads):
            if g is None:
                continue
            x, wd = xs[i], wds[i]
            ts[i] += 1
            t = ts[i]
            if normalize and float(g.norm()) > 0:
                g = g / g.norm()
            ms[i] = b1 * ms[i] + (1 - b1) * g
            tv = t if freeze_step is None else min(t, freeze_step)
            if t == tv:
                vs[i] = b2 * vs[i] + (1 - b2) * g * g
            mh, vh = ms[i] / (1 - b1 ** t), vs[i] / (1 - b2 ** tv)
            r = mh / (vh.sqrt() + eps) + wd * x
            if kind == "lamb":
                xs[i] = x - lr * _ratio(x, r) * r
            else:
                c = g / (vh.sqrt() + eps) + wd * x
                xs[i] = x - lr * b1 * _ratio(x, r) * r - lr * (1 - b1) * _ratio(x, c) * c
    return xs


def assert_close_list(got, want, rtol, atol):
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.detach().double(), b, rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"tensor {i}: {m}")

"""Fixtures shared by several test modules, and the rule of the ``cluster`` marker.

``@pytest.mark.cluster`` marks the tests that start real processes (``gradpress launch``,
``torchrun``, a child Python, ``mp.spawn``, network namespaces), so ``pytest -m "not cluster"``
is the fast loop. Any other test that starts a Python process or a ``multiprocessing`` process
fails, naming the marker it lacks; helpers in ``tests/helpers.py``.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from elastic_runs import elastic
from helpers import results


@pytest.fixture
def one_thread():
    """Train on one thread: the suite shares 2 cores, where 2-thread kernels thrash."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """examples/torchrun_elastic.py under torchrun, two workers, no failure: the checkpoints
    and the results (tests/elastic_runs.py)."""
    root = tmp_path_factory.mktemp("uninterrupted")
    elastic(2, root / "ckpt", root / "out")
    return root / "ckpt", results(root / "out", 2)


def _is_python(args: object, executable: object) -> bool:
    """Whether a Popen of ``args`` (``executable``) starts Python (or torchrun)."""
    if executable:
        program = os.fsdecode(executable)  # type: ignore[arg-type]
    elif isinstance(args, (str, bytes, os.PathLike)):
        program = (os.fsdecode(args).split() or [""])[0]
    else:
        program = os.fsdecode(next(iter(args), ""))  # type: ignore[call-overload]
    name = os.path.basename(program)
    return program == sys.executable or name.startswith(("python", "torchrun"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Around an unmarked test's setup (module fixtures included), call and teardown: starting
    a Python or multiprocessing process fails the test."""
    if item.get_closest_marker("cluster") is not None:
        yield
        return

    def refuse(what: str) -> AssertionError:
        return AssertionError(f"{item.nodeid} starts {what}: mark it @pytest.mark.cluster "
                              f"(tests that start real processes are left out of the fast "
                              f'loop, pytest -m "not cluster")')

    real_execute = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    real_start = multiprocessing.process.BaseProcess.start

    def execute_child(self, args, executable, *rest, **kw):  # type: ignore[no-untyped-def]
        if _is_python(args, executable):
            raise refuse(f"a Python process ({args!r})")
        return real_execute(self, args, executable, *rest, **kw)

    def start(self):  # type: ignore[no-untyped-def]
        raise refuse("a multiprocessing process")

    subprocess.Popen._execute_child = execute_child  # type: ignore[attr-defined]
    multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen._execute_child = real_execute  # type: ignore[attr-defined]
        multiprocessing.process.BaseProcess.start = real_start  # type: ignore[method-assign]

"""``gradpress launch``: environment of the children, failure handling, no orphans, CLI errors.

Most worker commands here are plain Python without torch, so the tests stay fast; processes
are found by a marker environment variable that the launcher passes to every child.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from gradpress.cli import main
from gradpress.launch import layout_advice
from gradpress.ps.cluster import Layout
from gradpress.ps.config import ClusterConfig, PSConfig
from helpers import assert_no_leftovers, wait_files


def _launch(args: list[str], code: str, tmp_path: Path, marker: str,
            extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    script = tmp_path / "cmd.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ, GP_TEST_MARKER=marker, **(extra_env or {}))
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--grace", "1", *args, "--",
           sys.executable, str(script), str(tmp_path)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


ENV_DUMP = """
    import json, os, sys
    keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "GRADPRESS_ROLE", "GRADPRESS_NUM_WORKERS", "GRADPRESS_NUM_SERVERS",
            "GRADPRESS_COLOCATE", "GRADPRESS_NNODES", "GRADPRESS_STORE_HOSTED"]
    env = {k: os.environ.get(k) for k in keys}
    with open(os.path.join(sys.argv[1], f"env{env['RANK']}.json"), "w") as f:
        json.dump(env, f)
"""


@pytest.mark.cluster
def test_workers_get_the_job_environment(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    p = _launch(["--workers", "3", "--colocate"], ENV_DUMP, tmp_path, marker)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    for r, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["GRADPRESS_NUM_WORKERS"] == "3"
        assert env["GRADPRESS_NUM_SERVERS"] == "3" and env["GRADPRESS_COLOCATE"] == "1"
        assert env["GRADPRESS_ROLE"] == "worker" and env["GRADPRESS_STORE_HOSTED"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    assert len({e["MASTER_PORT"] for e in envs}) == 1
    assert_no_leftovers(marker, 5)


FAIL_ONE = """
    import os, subprocess, sys, time
    rank, started = int(os.environ["RANK"]), os.path.join(sys.argv[1], "started")
    if rank == 1:  # fails once worker 0's grandchild is up, so the launcher must stop that too
        deadline = time.monotonic() + 60
        while not os.path.exists(started) and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(3 if os.path.exists(started) else 4)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open(started + ".tmp", "w").write(str(child.pid))
    os.rename(started + ".tmp", started)
    time.sleep(120)  # until the launcher stops it
"""


@pytest.mark.cluster
def test_failed_worker_stops_everything_and_is_named(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    p = _launch(["--workers", "2", "--servers", "1", "--timeout", "30"], FAIL_ONE, tmp_path,
                marker)
    out, err = p.communicate(timeout=90)
    assert p.returncode == 3, err
    assert "worker 1 (rank 1" in err and "exited with code 3" in err, err
    # code 3, not 4: worker 0's grandchild was up before worker 1 failed
    assert_no_leftovers(marker, 5)  # worker 0, its grandchild and the server are gone


@pytest.mark.cluster
def test_failed_server_is_named(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    # the server reads GRADPRESS_TIMEOUT and fails; the workers just wait to be stopped
    p = _launch(["--workers", "2", "--servers", "1", "--timeout", "30"],
                "import time; time.sleep(120)", tmp_path, marker,
                {"GRADPRESS_TIMEOUT": "not-a-number"})
    out, err = p.communicate(timeout=90)
    assert p.returncode == 1, err
    assert "server 0 (rank 2" in err and "GRADPRESS_TIMEOUT" in err, err
    assert_no_leftovers(marker, 5)


@pytest.mark.cluster
def test_sigterm_to_the_launcher_stops_everything(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    code = """
        import os, sys, time
        open(os.path.join(sys.argv[1], f"up{os.environ['RANK']}"), "w").close()
        time.sleep(120)
    """
    p = _launch(["--workers", "2", "--colocate"], code, tmp_path, marker)
    wait_files([tmp_path / "up0", tmp_path / "up1"])
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM" in err
    assert_no_leftovers(marker, 5)


@pytest.mark.parametrize("argv,message", [
    (["launch", "--workers", "2"], "no worker command"),
    (["launch", "--servers", "1", "--", "true"], "--workers"),
    (["launch", "--workers", "3", "--nnodes", "2", "--master-port", "1", "--", "true"],
     "multiple of --nnodes"),
    (["launch", "--workers", "2", "--workers-per-node", "2", "--nnodes", "2", "--", "true"],
     "disagrees"),
    (["launch", "--workers", "2", "--servers", "3", "--colocate", "--", "true"],
     "servers_per_node"),
    (["launch", "--workers", "2", "--nnodes", "2", "--", "true"], "--master-port"),
])
def test_cli_usage_errors(argv: list[str], message: str,
                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


TORCHRUN = """
    import os, sys, torch
    import gradpress as gp
    gp.init(timeout=60)  # the server rank serves here, then exits with status 0
    assert os.environ["RANK"] != "2", "a server rank returned from init"
    y = gp.push_pull(torch.full((5,), float(gp.rank())), "x")
    assert gp.size() == 2 and torch.equal(y, torch.full((5,), 0.5)), y
    gp.shutdown()
    open(os.path.join(sys.argv[1], f"done{os.environ['RANK']}"), "w").close()
"""


@pytest.mark.cluster
def test_usable_under_torchrun_with_a_server_rank(tmp_path: Path) -> None:
    script = tmp_path / "cmd.py"
    script.write_text(textwrap.dedent(TORCHRUN))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, GRADPRESS_NUM_SERVERS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                        "--master-addr", "127.0.0.1", "--master-port", str(port), str(script),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "done0").exists() and (tmp_path / "done1").exists()


def test_cluster_config_from_torchrun_style_environment() -> None:
    base = {"WORLD_SIZE": "4", "RANK": "3", "MASTER_PORT": "1234", "LOCAL_RANK": "3",
            "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    colo = ClusterConfig.from_env(base)
    assert (colo.colocate, colo.num_workers, colo.num_servers, colo.role) == (True, 4, 4, "worker")
    assert colo.store_hosted and colo.world_size == 4
    sep = ClusterConfig.from_env(base | {"GRADPRESS_NUM_SERVERS": "1"})
    assert (sep.colocate, sep.num_workers, sep.num_servers, sep.role) == (False, 3, 1, "server")
    single = ClusterConfig.from_env({})
    assert (single.num_workers, single.num_servers, single.colocate, single.rank) == (1, 1, True, 0)
    with pytest.raises(ValueError, match="num_servers"):
        ClusterConfig(role="worker", rank=0, num_workers=2, num_servers=3, colocate=True)


def test_ps_config_environment_fills_defaults_only() -> None:
    env = {"GRADPRESS_TIMEOUT": "12.5", "GRADPRESS_TRACE": "/tmp/t.json",
           "GRADPRESS_HIERARCHICAL": "yes", "GRADPRESS_TORCH_THREADS": ""}
    cfg = PSConfig.from_env(env, timeout=3.0)
    assert cfg.timeout == 3.0 and cfg.trace == "/tmp/t.json" and cfg.hierarchical
    assert cfg.torch_threads is None and cfg.partition_bytes == 4 << 20
    with pytest.raises(ValueError, match="GRADPRESS_PARTITION_BYTES"):
        PSConfig.from_env({"GRADPRESS_PARTITION_BYTES": "4MB"})
    with pytest.raises(ValueError, match="timeout"):
        PSConfig(timeout=-1)
    with pytest.raises(TypeError, match="unknown option"):
        PSConfig.from_env({}, partition=5)


def test_rank_layout() -> None:
    sep = Layout(num_workers=4, num_servers=2, colocate=False, nnodes=2)
    assert [sep.server_rank(s) for s in range(2)] == [4, 5] and sep.world_size == 6
    assert sep.describe(5) == "server 1 (rank 5)" and sep.describe(1) == "worker 1 (rank 1)"
    colo = Layout(num_workers=4, num_servers=2, colocate=True, nnodes=2)
    assert [colo.server_rank(s) for s in range(2)] == [0, 2]
    assert colo.describe(2) == "worker 2 + server 1 (rank 2)"
    flat = Layout(num_workers=4, num_servers=1, colocate=False, nnodes=2)
    assert flat.pushers == [0, 1, 2, 3] and flat.server_rank(0) == 4
    with pytest.raises(ValueError, match="evenly"):
        Layout(num_workers=3, num_servers=1, colocate=False, nnodes=2)
    assert Layout(4, 2, False, 2, hierarchical=True).pushers == [0, 2]


@pytest.mark.parametrize("workers,servers,colocate,cores,advised", [
    (1, 1, False, 2, "--colocate"),        # the measured case: 1 worker + 1 server, 2 cores
    (2, 1, False, 2, "--colocate"),
    (2, 3, False, 4, "--servers-per-node 2"),  # more servers than workers cannot colocate as is
    (1, 1, False, 3, None),                 # a spare core for the server process
    (4, 2, False, 16, None),
    (2, 2, True, 2, None),                  # already colocated
])
def test_layout_advice(workers: int, servers: int, colocate: bool, cores: int,
                       advised: str | None) -> None:
    advice = layout_advice(workers, servers, colocate, cores)
    if advised is None:
        assert advice is None
    else:
        assert advice is not None and advised in advice and f"{cores} core" in advice


def test_launch_prints_the_layout_advice(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    import gradpress.cli as cli

    started = []
    monkeypatch.setattr(cli, "_launch_with_restarts", lambda cfg, n: started.append(cfg) or 0)
    cores = len(os.sched_getaffinity(0))
    assert main(["launch", "--workers", str(cores), "--servers", "1", "--", "true"]) == 0
    err = capsys.readouterr().err
    assert "--colocate" in err and "Where the servers run" in err
    assert main(["launch", "--workers", str(cores), "--colocate", "--", "true"]) == 0
    assert "Where the servers run" not in capsys.readouterr().err
    assert [c.colocate for c in started] == [False, True]  # advice only: the layout asked for

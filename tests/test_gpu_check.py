"""benchmarks/gpu_check.py on the CPU: the CPU mode end to end, failing sections, the report.

The CUDA parts (pinned copies, device kernels, the CUDA tests passing) need a GPU machine; here
the script runs with ``--allow-cpu``, where the device path is the torch kernels on the CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import gpu_check as gc  # noqa: E402
import gpu_check_codecs as gcc  # noqa: E402
import gpu_check_push_pull as gpp  # noqa: E402
from gpu_check_report import Result, build_report, render_markdown  # noqa: E402


@pytest.mark.cluster
def test_cpu_mode_end_to_end(tmp_path: Path) -> None:
    """--allow-cpu --quick writes JSON and markdown with every section, and passes."""
    cmd = [sys.executable, str(BENCH / "gpu_check.py"), "--allow-cpu", "--quick", "--device",
           "cpu", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {s["name"]: s["status"] for s in report["sections"]}
    assert status == {"codecs": "pass", "cuda_tests": "skip", "push_pull": "pass",
                      "overlap": "skip"}, report
    assert report["ok"] and report["mode"] == "cpu" and report["machine"]["cpu_count"] >= 1
    secs = {s["name"]: s for s in report["sections"]}
    counts = secs["cuda_tests"]["details"]["counts"]
    assert counts["skipped"] >= 2 and counts["failed"] == counts["errors"] == 0, counts
    codecs = secs["codecs"]
    assert {(r[0], r[1]) for r in codecs["rows"]} == {(s, ef) for s in ("fp16", "onebit")
                                                      for ef in ("none", "vanilla")}
    modes = {(r[0], r[1]): r[-1] for r in secs["push_pull"]["rows"]}
    for mode in ("host", "device"):
        assert modes[(mode, "none")] == modes[(mode, "onebit")] == "PASS"
    md = (tmp_path / "gpu_check.md").read_text()
    assert md == render_markdown(report)
    for s in report["sections"]:
        assert f"## {s['title']}" in md


def _boom(ctx: gc.Context, limit_s: float) -> Result:
    raise RuntimeError("planted failure")


def _fine(ctx: gc.Context, limit_s: float) -> Result:
    return Result("ok", "A passing check", "pass", "fine", columns=["limit"],
                  rows=[[f"{limit_s:g}"]])


def test_failing_section_is_recorded_and_exit_is_nonzero(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gc, "SECTIONS", [gc.Section("boom", "A failing check", _boom, 5.0),
                                         gc.Section("ok", "A passing check", _fine, 7.0)])
    rc = gc.main(["--allow-cpu", "--out", str(tmp_path), "--timeout-scale", "2"])
    assert rc == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    boom, ok = report["sections"]
    assert boom["status"] == "fail" and "RuntimeError: planted failure" in boom["summary"]
    assert "_boom" in boom["error"]  # the traceback
    assert ok["status"] == "pass" and ok["rows"] == [["14"]]  # the later section still ran
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("# gradpress GPU check") and "FAIL (boom)" in md


def test_gpu_only_sections_skip_in_cpu_mode(tmp_path: Path) -> None:
    ctx = gc.Context(torch.device("cpu"), gc.SIZES[("cpu", True)], tmp_path, [], {})
    res = gc.run_section(gc.Section("streams", "Streams", _boom, 1.0, needs_cuda=True), ctx)
    assert res.status == "skip" and "CUDA" in res.summary


def test_overlap_ratio_and_table() -> None:
    import gpu_check_overlap as ov
    fast = {"compute": 1.0, "comm": 0.5, "both": 1.0}  # comm hidden entirely
    slow = {"compute": 1.0, "comm": 0.5, "both": 1.5}  # serial
    assert ov.ratio(fast) == 1.0 and ov.ratio(slow) == 0.0
    ranks = [{"rank": 0, "reps": 3, "finite": True, "median_s": fast},
             {"rank": 1, "reps": 3, "finite": True, "median_s": slow}]
    cols, rows, ratio, finite = ov.table(ranks)
    assert ratio == 0.0 and finite and len(rows) == 2 and len(rows[0]) == len(cols)
    assert rows[0][cols.index("overlap ratio")] == "1.00"


def test_gpu_test_files(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("import torch\n\ndef test_on_cuda_streams():\n    pass\n")
    (tmp_path / "test_b.py").write_text("def test_other():\n    pass\n\ndef use_cuda():\n"
                                        "    pass\n")
    assert gc.cuda_test_files(tmp_path) == [str(tmp_path / "test_a.py")]
    real = gc.cuda_test_files(gc.ROOT / "tests")
    assert "tests/test_push_pull_device.py" in real and "tests/test_gpu_check.py" not in real
    assert {"tests/test_ddp_amp.py", "tests/test_streams.py"} <= set(real)  # issue 43's
    assert "tests/test_fsdp_cuda.py" in real  # issue 41's: gradpress.fsdp on NCCL


@pytest.mark.cluster
def test_run_command_timeout_kills_the_group() -> None:
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \
           "'import time; time.sleep(60)']); print('started', flush=True); time.sleep(60)"
    t0 = time.perf_counter()
    out = gc.run_command([sys.executable, "-c", code], timeout_s=2.0)
    assert out.timed_out and out.rc != 0 and "started" in out.output
    assert time.perf_counter() - t0 < 20  # the grandchild did not keep the pipe open
    res = gc.failed_run("x", "X", "job", out, 2.0)
    assert res.status == "fail" and res.summary == "job timed out after 2 s"


@pytest.mark.parametrize("line, expected", [
    ("2 skipped, 1615 deselected in 3.10s", {"skipped": 2, "deselected": 1615}),
    ("1 failed, 1 passed, 1 error in 12.00s", {"failed": 1, "passed": 1, "errors": 1}),
    ("=== 2 passed in 65.12s (0:01:05) ===", {"passed": 2}),
    ("no tests ran in 0.50s", {}),
])
def test_pytest_counts(line: str, expected: dict[str, int]) -> None:
    counts = gc.pytest_counts(f"....\nSKIPPED [1] x.py:3: 4 passed in the header\n{line}\n")
    assert {k: v for k, v in counts.items() if v} == expected


@pytest.mark.parametrize("counts, cuda, status", [
    ({"passed": 2}, True, "pass"), ({"skipped": 2}, True, "fail"),
    ({"skipped": 2}, False, "skip"), ({"passed": 1, "failed": 1}, False, "fail"),
    ({"passed": 3, "skipped": 2}, False, "skip"),
    ({"errors": 1}, True, "fail"), ({}, False, "fail")])
def test_gpu_tests_verdict(counts: dict[str, int], cuda: bool, status: str) -> None:
    full = {k: counts.get(k, 0) for k in ("passed", "failed", "skipped", "errors",
                                          "deselected")}
    assert gc.cuda_tests_verdict(full, cuda)[0] == status


def test_gpu_tests_verdict_fails_a_skip_for_want_of_the_device() -> None:
    counts = {"passed": 5, "failed": 0, "skipped": 1, "errors": 0, "deselected": 0}
    out = "SKIPPED [1] tests/test_x.py:3: needs 2 GPUs\n5 passed, 1 skipped in 1.0s\n"
    assert gc.cuda_tests_verdict(counts, True, out)[0] == "pass"
    out = "SKIPPED [1] tests/test_x.py:3: needs CUDA\n5 passed, 1 skipped in 1.0s\n"
    assert gc.cuda_tests_verdict(counts, True, out)[0] == "fail"


def test_resolve_device(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device cuda:0: 0 CUDA devices.*--allow-cpu"):
        gc.resolve_device("cuda:0", False)
    assert gc.resolve_device("cuda:0", True)[0] == torch.device("cpu")
    with pytest.raises(ValueError, match="cpu only with --allow-cpu"):
        gc.resolve_device("cpu", False)
    with pytest.raises(ValueError, match="'nonsense' is not a torch device"):
        gc.resolve_device("nonsense", True)
    with pytest.raises(ValueError, match="subset of"):
        gc.select("codecs,nothing")


def _report(mode: str = "cpu") -> dict:
    ok = Result("a", "Section A", "pass", "all | good", 1.25, ["x", "y|z"], [["1", "a|b"]],
                ["a note"])
    bad = Result("b", "Section B", "fail", "broke", 2.0, error="Traceback\n```x```\nboom")
    return build_report({"gpu": "Test GPU", "cpu_count": 2}, [ok, bad], mode, "python x.py",
                        "2026-12-01T00:00:00+00:00", 3.4)


def test_render_markdown_is_a_pure_function_of_the_report() -> None:
    report = _report()
    md = render_markdown(report)
    assert md == render_markdown(json.loads(json.dumps(report)))  # from the JSON alone
    lines = md.splitlines()
    assert lines[0] == "# gradpress GPU check: Test GPU"
    assert lines[2].startswith("FAIL (b). Mode: cpu;") and "3 s in all" in lines[2]
    assert "| gpu | Test GPU |" in lines and "| cpu_count | 2 |" in lines
    assert "| a | PASS | 1.2 | all \\| good |" in lines  # pipes in cells escaped
    assert "| x | y\\|z |" in lines and "| 1 | a\\|b |" in lines and "* a note" in lines
    assert "**FAIL** in 2.0 s: broke" in lines
    block = md[md.index("```\nTraceback"):]
    assert "'''x'''" in block and block.count("```") == 2  # fences inside are neutralized
    assert "CPU mode" in md and "CPU mode" not in render_markdown(_report("cuda"))
    assert render_markdown(_report("cuda")).splitlines()[2].startswith("FAIL (b). Mode: cuda")


def test_result_validation() -> None:
    with pytest.raises(ValueError, match="status must be one of pass, fail, skip, got 'ok'"):
        Result("a", "A", "ok", "")
    with pytest.raises(ValueError, match=r"every row must have 2 cells.*\[1\]"):
        Result("a", "A", "pass", "", columns=["x", "y"], rows=[["1"]])


def _ranks(digests: list[list[str]], problems: list[str] | None = None) -> list[dict]:
    return [{"rank": r, "codecs": {"none": {"seconds": [0.2, 0.1], "digests": d,
                                            "problems": problems if r == 1 and problems else []}}}
            for r, d in enumerate(digests)]


def test_push_pull_table() -> None:
    good = _ranks([["a", "b", "c"], ["a", "b", "c"]])
    cols, rows, fails = gpp.table({"host": good, "device": good}, 10**8)
    assert fails == 0 and len(rows) == 3 and all(len(r) == len(cols) for r in rows)
    assert rows[0][:5] == ["host", "none", "0.1500", "0.1000", "0.67"]
    assert rows[2][0] == "host vs device" and "identical" in rows[2][5]
    split = _ranks([["a", "b", "c"], ["a", "x", "c"]], problems=["step 2: tensor 0: differs"])
    cols, rows, fails = gpp.table({"host": split}, 10**8)
    assert fails == 1 and rows[0][-1] == "FAIL"
    assert "rank 1 step 2: tensor 0: differs" in rows[0][5] and "steps [1]" in rows[0][5]


def test_codecs_table() -> None:
    row = {"bits": 16.0, "device_enc": 4.0, "device_dec": 4.0, "host_enc": 1.0,
           "host_dec": 1.0, "device_rt": 2.0, "host_rt": 0.5}
    data = {"refs": {"host memcpy": 10.0, "device memcpy": 100.0},
            "same_payload": {"fp16": False, "onebit": False},
            "rows": [{"spec": "fp16", "ef": "none", **row}, {"spec": "onebit", "ef": "none", **row},
                     {"spec": "topk", "ef": "vanilla", "error": "RuntimeError: no kernel"}]}
    cols, rows, fails = gcc.table(data)
    assert fails == 2 and all(len(r) == len(cols) for r in rows)
    assert rows[0][-5:] == ["4.00x", "0.020", "0.050", "no", "FAIL"]  # cast codec: exact
    assert rows[1][-1] == "(reported)"  # onebit may round differently on a GPU
    assert rows[2][-2:] == ["RuntimeError: no kernel", "FAIL"]

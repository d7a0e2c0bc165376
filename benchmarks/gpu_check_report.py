"""The records and the report of ``gpu_check.py``: :class:`Result`, the machine description,
the JSON file and the markdown page (:func:`render_markdown`, a pure function of the JSON)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

STATUSES = ("pass", "fail", "skip")
ROOT = Path(__file__).resolve().parent.parent
JSON_NAME, MD_NAME = "gpu_check.json", "gpu_check.md"


@dataclass
class Result:
    """The record of one section: what the JSON holds and the markdown shows."""

    name: str
    title: str
    status: str  # one of STATUSES
    summary: str
    seconds: float = 0.0
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Result {self.name!r}: status must be one of "
                             f"{', '.join(STATUSES)}, got {self.status!r}")
        widths = {len(r) for r in self.rows}
        if widths - {len(self.columns)}:
            raise ValueError(f"Result {self.name!r}: every row must have "
                             f"{len(self.columns)} cells (the columns), got {sorted(widths)}")


# -- machine --------------------------------------------------------------------------------
def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a description, not a check
        return f"unavailable ({type(e).__name__}: {e})"


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                    platform.processor())


def _memory_gib() -> float:
    with open("/proc/meminfo") as f:
        kib = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
    return round(kib / 2**20, 1)


def _first_line(cmd: list[str]) -> str:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=20)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{cmd[0]} exited {out.returncode}: {out.stderr.strip()[:200]}")
    return lines[0]


def _gpu(device: torch.device) -> dict[str, Any]:
    p = torch.cuda.get_device_properties(device)
    driver = _try(lambda: _first_line(["nvidia-smi", "--query-gpu=driver_version",
                                       "--format=csv,noheader"]))
    return {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1),
            "compute_capability": f"{p.major}.{p.minor}",
            "gpu_count": torch.cuda.device_count(), "cuda_runtime": torch.version.cuda,
            "driver": driver}


def machine_info(device: torch.device) -> dict[str, Any]:
    """GPU, CUDA, torch and CPU description of this machine (errors as text, never raised)."""
    import numba

    import gradpress

    info: dict[str, Any] = {"device": str(device)}
    gpu = _try(lambda: _gpu(device)) if device.type == "cuda" else {"gpu": "none (CPU mode)"}
    info.update(gpu if isinstance(gpu, dict) else {"gpu": gpu})
    info.update({"cpu": _try(_cpu_model), "cpu_count": os.cpu_count(),
                 "memory_gib": _try(_memory_gib),
                 "load_average_1m": _try(lambda: round(os.getloadavg()[0], 2)),
                 "os": platform.platform(), "python": platform.python_version(),
                 "torch": torch.__version__, "numba": numba.__version__,
                 "gradpress": str(Path(gradpress.__file__).parent),
                 "commit": _try(lambda: _first_line(["git", "rev-parse", "--short", "HEAD"])),
                 "hostname": platform.node()})
    return info


# -- report ---------------------------------------------------------------------------------
def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def md_table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    """Lines of a markdown table (pipes in cells escaped, newlines flattened)."""
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]


def _section_md(sec: dict[str, Any]) -> list[str]:
    lines = ["", f"## {sec['title']}", "",
             f"**{sec['status'].upper()}** in {sec['seconds']:.1f} s: {sec['summary']}"]
    if sec["columns"]:
        lines += [""] + md_table(sec["columns"], sec["rows"])
    if sec["notes"]:
        lines += [""] + [f"* {n}" for n in sec["notes"]]
    if sec["error"]:
        lines += ["", "```", sec["error"].replace("```", "'''"), "```"]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The markdown page of a report (the dict :func:`write_report` stores as JSON)."""
    secs = report["sections"]
    failed = [s["name"] for s in secs if s["status"] == "fail"]
    verdict = f"FAIL ({', '.join(failed)})" if failed else "PASS"
    machine = report["machine"]
    lines = [f"# gradpress GPU check: {machine.get('gpu', '?')}", "",
             f"{verdict}. Mode: {report['mode']}; {report['created']}; "
             f"{report['wall_s']:.0f} s in all.", "", f"    {report['command']}", ""]
    if report["mode"] != "cuda":
        lines += ["CPU mode: no CUDA device was used, so the figures below are not GPU "
                  "figures; this run tests the script.", ""]
    lines += ["## Machine", ""] + md_table(["item", "value"], list(machine.items()))
    lines += ["", "## Summary", ""] + md_table(
        ["section", "status", "seconds", "summary"],
        [[s["name"], s["status"].upper(), f"{s['seconds']:.1f}", s["summary"]] for s in secs])
    for sec in secs:
        lines += _section_md(sec)
    return "\n".join(lines) + "\n"


def build_report(machine: dict[str, Any], results: list[Result], mode: str, command: str,
                 created: str, wall_s: float) -> dict[str, Any]:
    """The JSON-able report; ``ok`` is False when a section failed."""
    secs = [asdict(r) for r in results]
    return {"schema": 1, "created": created, "command": command, "mode": mode,
            "wall_s": wall_s, "ok": all(r.status != "fail" for r in results),
            "machine": machine, "sections": secs}


def write_report(out_dir: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    """Write the JSON and the markdown into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / JSON_NAME, out_dir / MD_NAME
    js.write_text(json.dumps(report, indent=1, default=str) + "\n")
    md.write_text(render_markdown(report))
    return js, md

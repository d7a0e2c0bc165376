"""Every figure in the README comes from a record: the figure blocks are rendered from
benchmarks/results/ (``python benchmarks/results_md.py``) and equal what the records give, no
figure stands outside them, the records hold command, commit and machine, failed and unrun
targets read as such, and the first screen is the two commands and what the project is. In
docs/, every figure links its record (or results.md) or is marked a citation, and the simulator
tables of paper-comparison.md equal the kept outputs of their commands."""

from __future__ import annotations

import copy
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT / "benchmarks"))

import readme_figures  # noqa: E402
import record  # noqa: E402
import results_md  # noqa: E402

#: A results figure in prose: a percentage, a ratio, a rate, a mean with its spread, a time.
FIGURE = re.compile(r"(?<![\w.])[+-]?\d+(\.\d+)? ?%|(?<![\w.])\d+(\.\d+)?x\b|±"
                    r"|\d+(\.\d+)? ?(?:[KMGT]i?B|[kKMGT]bit|[kKMGT]b)/s\b|\b\d+\.\d+ s\b")


def prose(text: str) -> str:
    """``text`` without figure blocks, indented code (commands) and inline code; fenced
    blocks stay (a pasted table or plan is a figure)."""
    text = re.sub(r"<!-- figures:(\w+) -->.*?<!-- /figures:\1 -->", "", text, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return re.sub(r"`[^`\n]*`", "", text)


def figures_outside_blocks(text: str) -> list[str]:
    """The lines of ``text``'s prose that carry a figure."""
    return [line for line in prose(text).splitlines() if FIGURE.search(line)]


@pytest.fixture(scope="module")
def sections() -> list[dict[str, Any]]:
    return results_md.load_results()


TOUR = ROOT / "docs" / "tour.md"


def test_figure_blocks_equal_their_records(sections: list[dict[str, Any]]) -> None:
    for page, text in readme_figures.render_pages(sections).items():
        assert page.read_text() == text, \
            f"{page.name}'s figure blocks differ from their records: run python " \
            f"benchmarks/results_md.py"


def test_pages_have_their_figure_blocks() -> None:
    assert readme_figures.block_names(README.read_text()) == ["results", "limits"]
    assert readme_figures.block_names(TOUR.read_text()) == ["plan", "demo", "targets"]


def test_no_figure_outside_the_blocks() -> None:
    for page in (README, TOUR):
        hits = figures_outside_blocks(page.read_text())
        assert not hits, f"figures in {page.name} with no record (put them in a figure " \
            f"block):\n" + "\n".join(hits)


def test_readme_is_a_product_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines (at most 120)"
    block = README.read_text().split("<!-- figures:results -->")[1].split("<!-- /")[0]
    rows = [r for r in block.splitlines() if r.startswith("| ") and not r.startswith("| work")]
    assert 1 <= len(rows) <= 6, rows
    for r in rows:  # every row names its machine and commit and links its table
        where = r.split(" | ")[1]
        assert "core" in where and "commit `" in where and "](docs/results.md#" in r, r
    assert "## Known limits" in README.read_text()


def test_a_changed_or_added_figure_is_caught(sections: list[dict[str, Any]]) -> None:
    text = README.read_text()
    block = re.search(r"<!-- figures:results -->.*?<!-- /figures:results -->", text, re.S)
    assert block and "25.1x" in block.group(0)
    changed = text.replace(block.group(0), block.group(0).replace("25.1x", "26.1x"))
    assert readme_figures.render_readme(changed, sections) == text  # the record wins
    added = text.replace("## Example", "CLAN one-bit trains 8.4x faster.\n\n## Example")
    assert figures_outside_blocks(added) == ["CLAN one-bit trains 8.4x faster."]
    for figure in ("+2.6%", "3 ± 1", "1.2 GB/s", "100 Mbit/s", "5.8 s"):
        assert figures_outside_blocks(f"measured {figure} here"), figure
    for setting in ("`--lr 0.01`", "    gradpress demo --bandwidth 100mbit  # 100 Mbit/s"):
        assert not figures_outside_blocks(setting), setting


def test_readme_first_screen() -> None:
    lines = README.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("## "))
    assert first <= 30, f"README.md: {first} lines before the first section (at most 30)"
    commands = [line for line in lines[:first] if line.startswith("    ")]
    assert len(commands) == 2 and all(c.startswith("    pip install ") for c in commands)
    screen = "\n".join(lines[:first])
    assert "%" not in screen, "a percentage before the README's first section"
    assert not figures_outside_blocks(screen)


@pytest.mark.parametrize("name", ["plan-stdlib-mlm", "demo-100mbit"])
def test_readme_records_hold_command_commit_machine(name: str) -> None:
    rec, report = readme_figures.read_record(name)
    assert re.fullmatch(r"[0-9a-f]{40}", rec["commit"])
    assert {"cpu", "cores", "memory", "os", "torch"} <= set(rec["machine"])
    assert rec["exit_code"] == 0 and report["status"] == "completed"
    out = str(readme_figures.RECORDS.relative_to(ROOT) / name)
    assert rec["command"] == shlex.join(
        [a.replace("{out}", out) for a in readme_figures.COMMANDS[name]]), \
        f"{name}: kept record made by another command than --rerun {name} runs"


def test_every_results_table_holds_commit_and_machine(tmp_path: Path) -> None:
    for s in results_md.load_results():
        for t in s["tables"]:
            assert results_md.COMMIT.match(t["commit"]) and t["machine"], t["id"]
    data = json.loads((results_md.RESULTS / "wire.json").read_text())
    del data["tables"][0]["machine"]
    (tmp_path / "wire.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing 'machine'"):
        results_md.load_results(tmp_path)


def test_references_resolve_and_fail_loudly(sections: list[dict[str, Any]]) -> None:
    page = (ROOT / "docs" / "results.md").read_text()
    assert [m.group(0) for m in results_md._REF.finditer(page)] == ["{{TABLE|ROW|COLUMN}}"]
    gap = readme_figures.cell(sections, "targets", "gap (mean ± std)", target="onebit-mlm-800")
    assert gap in page.split("### stdlib-mlm: OneBitLANS and CLAN at their defaults")[1]
    bad = copy.deepcopy(sections)
    bad[0]["tables"][0]["notes"] = "{{targets|no-such-target|result}}"
    with pytest.raises(ValueError, match="no-such-target"):
        results_md.resolve(bad)


def test_failed_and_unrun_targets_read_as_such(sections: list[dict[str, Any]]) -> None:
    s = copy.deepcopy(sections)
    t = next(t for x in s for t in x["tables"] if t["id"] == "targets")
    cols = t["columns"]
    base = list(t["rows"][0])
    unrun, failed = list(base), list(base)
    unrun[0], unrun[cols.index("runs")], unrun[cols.index("result")] = "u", "0/6", "not run"
    unrun[cols.index("gap per seed")] = "-"
    failed[0], failed[cols.index("result")] = "f", "not met (seed 1 at +3.51%)"
    t["rows"] = [unrun, failed]
    block = readme_figures.targets_block(s)
    assert "| u | " in block and block.split("| u | ")[1].split("\n")[0].endswith(
        "**not run** |")
    assert "**not met (seed 1 at +3.51%)** |" in block
    limits = readme_figures.limits_block(s).splitlines()  # both in the README's limits
    assert len(limits) == 2 and limits[0].startswith("- `gp.OneBitLANS` target u (")
    assert "**not run**" in limits[0] and "**not met (seed 1 at +3.51%)**" in limits[1]
    assert readme_figures.target_result("4/6", "incomplete") == "incomplete (4/6 runs)"
    assert readme_figures.target_result("0/6", "incomplete") == "**not run**"


@pytest.mark.cluster
def test_record_keeps_command_commit_machine(tmp_path: Path) -> None:
    code = "import pathlib, sys; pathlib.Path(sys.argv[1], 'report.json').write_text('{}'); " \
        "pathlib.Path(sys.argv[1], 'plot.png').write_text('x')"
    rec = record.run("t", [sys.executable, "-c", code, "{out}"], keep=["*.json"],
                     records=tmp_path)
    assert rec["exit_code"] == 0 and rec["wall_s"] >= 0
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, timeout=60).stdout.strip()
    assert rec["commit"] == head and rec["machine"]["cores"]
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == ["record.json", "report.json"]
    kept = json.loads((tmp_path / "t" / "record.json").read_text())
    out = kept["command"].split()[-1]  # {out}: the record's directory, from the repository
    assert (ROOT / out).samefile(tmp_path / "t")
    with pytest.raises(ValueError, match="plain directory name"):
        record.run("../x", ["true"], records=tmp_path)


@pytest.mark.cluster
def test_record_refuses_code_from_another_checkout(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert record.imported_gradpress() == (ROOT / "src" / "gradpress").resolve()
    monkeypatch.setattr(record, "imported_gradpress", lambda: tmp_path / "gradpress")
    with pytest.raises(ValueError, match="PYTHONPATH"):
        record.run("t", ["true"], records=tmp_path)
    assert not (tmp_path / "t").exists()


def test_guide_plan_example_is_what_the_code_prints() -> None:
    """docs/guide.md's plan example (computed, not measured) is what its snippet prints."""
    import contextlib
    import io

    import torch

    page = (ROOT / "docs" / "guide.md").read_text()
    m = re.search(r"```python\n(.*?print\(opt\.plan\(\)\.format\(\)\)\n)```\n\n```text\n"
                  r"(.*?)```", page, re.S)
    assert m, "docs/guide.md: no python block printing opt.plan().format() followed by its text"
    out = io.StringIO()
    torch.manual_seed(0)
    with contextlib.redirect_stdout(out):
        exec(compile("import torch\nimport gradpress as gp\n" + m.group(1), "guide", "exec"),
             {})
    assert out.getvalue() == m.group(2), "docs/guide.md's plan example differs from the code's"



#: A link to a record: a file or folder of benchmarks/results/, or docs/results.md (rendered
#: from them).
RECORD_LINK = re.compile(r"\]\((?:\.\./)*(?:benchmarks/results/|results\.md)[^)]*\)")
#: A figure that is someone else's published measurement, marked as such on its block.
CITATION = re.compile(r"the paper reports|\breports that\b|\bpublished:|\*\*estimate\*\*", re.I)
#: Figures in docs/ that are settings, arithmetic or a test's bound, not measurements:
#: (page, text on the line).
NOT_MEASURED = [
    ("design.md", "k=0.1%, fp16, 4 MiB chunk: 0.036"),  # bits per element of the format
    ("design.md", "k=1%: 0.32"),
    ("guide.md", "the largest tensors holding 95% of the bytes"),  # the "auto" rule
    ("guide.md", "1 of 4 compressed, 24.0x vs fp32"),  # test_guide_plan_example_is_what_...
    ("guide.md", "a one-bit run is below 32x"),
    ("integrations.md", "under 5% of fp32's bytes"),  # the bound the test asserts
    ("optimizers.md", "as in the dense phase: 0.5% of fp32's bytes"),  # bf16 every 100 steps
    ("paper-comparison.md", "(default 100 GB/s NCCL bus"),
    ("paper-comparison.md", "(default 10 GB/s"),
    ("paper-comparison.md", "8 V100s per node at 25 Gb/s"),
    ("paper-comparison.md", "## 2. Predictions beside the paper (25 Gbit/s"),
    ("performance.md", "step time behind a 1 Gbit/s link per codec"),
    ("performance.md", '"2 hosts at 1 Gbit/s" in these pages'),
    ("reference/cli.md", "bandwidth (100GB/s)"),
    ("reference/cli.md", "bandwidth (10GB/s)"),
]


def blocks(text: str) -> list[list[str]]:
    """``text``'s prose cut into blocks (paragraphs, tables, lists) at blank lines."""
    out: list[list[str]] = [[]]
    for line in prose(text).splitlines():
        if line.strip():
            out[-1].append(line)
        elif out[-1]:
            out.append([])
    return [b for b in out if b]


def unbacked_figures(page: str, text: str) -> list[str]:
    """The lines of a docs page that carry a figure with no record behind it: a line is backed
    when its block (paragraph, table, list) links a record or marks a citation, or when it lies
    in a table or fenced block whose caption (the block right before it) does."""
    hits, caption_backed = [], False
    for block in blocks(text):
        joined = "\n".join(block)
        backed = bool(RECORD_LINK.search(joined) or CITATION.search(joined))
        if block[0].startswith(("|", "`")) and caption_backed:  # prose() leaves "`text"
            backed = True
        for line in block:
            if FIGURE.search(line) and not backed and \
                    not any(p == page and s in line for p, s in NOT_MEASURED):
                hits.append(f"{page}: {line.strip()[:160]}")
        caption_backed = backed
    return hits


def docs_pages() -> list[Path]:
    """docs/*.md and docs/reference/*.md but results.md, which is rendered from the records."""
    return [p for p in sorted((ROOT / "docs").rglob("*.md")) if p.name != "results.md"]


def test_every_figure_in_docs_has_a_record_or_is_a_citation() -> None:
    hits = [h for p in docs_pages()
            for h in unbacked_figures(p.relative_to(ROOT / "docs").as_posix(), p.read_text())]
    assert not hits, "figures in docs/ with no link to benchmarks/results/ or results.md " \
        "(nor a citation):\n" + "\n".join(hits)


def test_an_unbacked_docs_figure_is_caught() -> None:
    link = "[chaos](../benchmarks/results/chaos/)"
    assert unbacked_figures("x.md", "Recovery took 5.3 s.\n") == ["x.md: Recovery took 5.3 s."]
    assert not unbacked_figures("x.md", f"Recovery took 5.3 s\n({link}).\n")
    assert unbacked_figures("x.md", f"{link}\n\nRecovery took 5.3 s.\n")  # another paragraph
    table = "| a | b |\n|---|---|\n| x | 38.0% |\n"
    assert unbacked_figures("x.md", "Caption:\n\n" + table) == ["x.md: | x | 38.0% |"]
    assert not unbacked_figures("x.md", f"Caption ({link}):\n\n" + table)
    assert not unbacked_figures("x.md", "The paper reports 5.0% at 25 Gb/s.\n")
    assert not unbacked_figures("x.md", "    gradpress simulate --bandwidth 10gbit  # 25x\n")
    for p in docs_pages():  # the allow-list names only lines that exist
        for page, s in NOT_MEASURED:
            if p.relative_to(ROOT / "docs").as_posix() == page:
                assert s in prose(p.read_text()), (page, s)


def simulate_outputs() -> dict[str, str]:
    """The kept ``gradpress simulate`` outputs: the arguments of each command -> its output,
    from the paper-sim-* records' commands (``run FILE ARGS`` for each)."""
    out = {}
    for rec_path in sorted(readme_figures.RECORDS.glob("paper-sim-*/record.json")):
        rec = json.loads(rec_path.read_text())
        assert rec["exit_code"] == 0 and re.fullmatch(r"[0-9a-f]{40}", rec["commit"])
        script = shlex.split(rec["command"])[-1]
        for m in re.finditer(r"run (\S+) ([^;]+)", script.split("; ", 1)[1]):
            for model in ("resnet50", "vgg16", "bert-base"):  # the shell's loops
                path = m.group(1).replace("$m", model)
                if (ROOT / path).exists():
                    out[m.group(2).strip().replace("$m", model)] = (ROOT / path).read_text()
    return out


def test_paper_comparison_tables_equal_the_simulate_records() -> None:
    """Every `gradpress simulate` row of docs/paper-comparison.md gives the iteration times and
    the reduction that the kept output of the same command holds."""
    outputs, checked = simulate_outputs(), 0
    header: list[str] = []
    for line in (ROOT / "docs" / "paper-comparison.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| command |"):
            header = cells
        m = re.match(r"`gradpress simulate ([^`]*)`", cells[0]) if line.startswith("|") else None
        if not m:
            continue
        text = outputs.get(m.group(1))
        assert text, f"paper-comparison.md: no record of gradpress simulate {m.group(1)}"
        times = re.search(r"iteration time +([\d.]+) ms +([\d.]+) ms", text)
        reduction = re.search(r"training time reduction ([\d.]+)%", text)
        assert times and reduction
        row = dict(zip(header, cells))
        assert row["reduction"].strip("*") == f"{reduction.group(1)}%", (m.group(1), row)
        for column, value in (("baseline", times.group(1)), ("compressed", times.group(2))):
            assert abs(float(row[column]) - float(value)) <= 0.051, (m.group(1), column)
        checked += 1
    assert checked == 23

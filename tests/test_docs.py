"""The documentation matches the code: every CLI option, GRADPRESS_* variable and public name is
documented in docs/reference/, every relative link resolves, and docs/results.md is up to date
with benchmarks/results/*.json."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
REF = ROOT / "docs" / "reference"
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

#: Public names the docs must cover beyond the modules' ``__all__``.
EXTRA_API = {"gradpress": ("OneBitLANS",), "gradpress.compress": ("EFSpec",)}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from gradpress.cli import build_parser

    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert actions, "gradpress.cli.build_parser() has no subcommands"
    return dict(actions[0].choices)


def _cli_section(name: str) -> str:
    text = (REF / "cli.md").read_text()
    m = re.search(rf"^## `gradpress {re.escape(name)}`\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"docs/reference/cli.md has no section '## `gradpress {name}`'"
    return m.group(1)


@pytest.mark.parametrize("name", sorted(_subparsers()))
def test_every_cli_option_is_documented(name: str) -> None:
    section = _cli_section(name)
    options = [s for a in _subparsers()[name]._actions for s in a.option_strings
               if s.startswith("--") and s != "--help"]
    missing = [o for o in options if not re.search(rf"`{re.escape(o)}[` ]", section)]
    assert not missing, (f"options of `gradpress {name}` missing from its section of "
                         f"docs/reference/cli.md: {missing}")


def _env_names() -> set[str]:
    names = set()
    for path in (ROOT / "src").rglob("*.py"):
        names |= set(re.findall(r"GRADPRESS_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text()))
    from gradpress.ps.config import PSConfig  # GRADPRESS_<FIELD> fills every field

    names |= {f"GRADPRESS_{f.name.upper()}" for f in dataclasses.fields(PSConfig)}
    return names


def test_every_environment_variable_is_documented() -> None:
    text = (REF / "environment.md").read_text()
    missing = sorted(n for n in _env_names() if f"`{n}`" not in text)
    assert not missing, f"variables missing from docs/reference/environment.md: {missing}"


def _public_names() -> list[tuple[str, str]]:
    out = []
    for module in ("gradpress", "gradpress.optim", "gradpress.compress"):
        names = [*importlib.import_module(module).__all__, *EXTRA_API.get(module, ())]
        out += [(module, n) for n in names]
    return out


def test_every_public_name_is_documented() -> None:
    text = (REF / "api.md").read_text()
    missing = [f"{m}.{n}" for m, n in _public_names()
               if not re.search(rf"(?<!\w){re.escape(n)}(?!\w)", text)]
    assert not missing, f"public names missing from docs/reference/api.md: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            anchors.add(_slug(m.group(1)))
    return anchors


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link} (no file {target.relative_to(ROOT)})")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            broken.append(f"{link} (no heading #{anchor} in {target.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: broken links: {broken}"


@pytest.mark.cluster
def test_results_page_is_up_to_date() -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "results_md.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr or r.stdout


#: What src/ must not carry: results figures (percentages, ratios, rates written as prose),
#: links into the study log, issue numbers, words about how the code was written. A docstring
#: states the default and a one-line reason and links to a page (docs/guide.md); a setting is
#: given as its value (``k=0.001``), not as a percentage. Format specs (``%s``, ``{x:.1%}``,
#: ``{n:#010x}``) and rate syntax without a space (``25Gb/s``, an option's form) are not figures.
_NOT_IN_SRC = re.compile(
    r"convergence\.md|convergence-log|[Ii]ssue #?\d+|±|\blog (section )?\d+\.\d+"
    r"|(?<![\w.#:%{])[+-]?\d+(\.\d+)? ?%(?![\w(])"            # 8.4%, +3%, 0.1%%
    r"|(?<![\w.#:{])\d+(\.\d+)?x\b"                             # 8.4x, 32x
    r"|\d+(\.\d+)? (?:[KMGT]i?B|[kKMGT]bit|[kKMGT]b)/s\b"        # 1.2 GB/s, 100 Mbit/s
    r"|(?i:design brief|the lead'?s?\b|\bthe brief\b)")


def test_src_holds_no_results_figures_or_study_references() -> None:
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
            for path in sorted((ROOT / "src" / "gradpress").rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if _NOT_IN_SRC.search(line)]
    assert not hits, "results figures or study references in src/:\n" + "\n".join(hits)


@pytest.mark.parametrize("name", ["CLAN", "OneBitLANS", "DistributedOptimizer", "push_pull"])
def test_factory_signatures_match_api_page(name: str) -> None:
    import inspect

    import gradpress as gp

    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    row = next((line for line in page.splitlines() if f"`gp.{name}(" in line), None)
    assert row is not None, f"docs/reference/api.md has no row for gp.{name}"
    doc = row.split(f"`gp.{name}(", 1)[1].split(")`", 1)[0]
    for p in inspect.signature(getattr(gp, name)).parameters.values():
        shown = f"{p.name}={p.default!r}" if p.default is not p.empty else p.name
        assert p.name in doc, f"gp.{name}: parameter {p.name!r} missing from api.md"
        if isinstance(p.default, str):
            assert shown.replace("'", '"') in doc, f"gp.{name}: api.md shows another default " \
                f"for {p.name} (code: {p.default!r})"

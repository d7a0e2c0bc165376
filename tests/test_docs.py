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


#: The public modules (programs import them; docs/reference/api.md has a section each) and
#: the pages besides docs/reference/api.md where their names may be documented.
PUBLIC_MODULES = {
    "gradpress": (),
    "gradpress.compress": (),
    "gradpress.optim": ("optimizers.md",),
    "gradpress.ddp": ("integrations.md",),
    "gradpress.fsdp": ("integrations.md",),
    "gradpress.checkpoint": ("checkpoints.md",),
    "gradpress.elastic": ("checkpoints.md",),
    "gradpress.lightning": ("integrations.md",),
    "gradpress.huggingface": ("integrations.md",),
    "gradpress.train": ("train.md",),
}


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"(?<!\w){re.escape(name)}(?!\w)", text) is not None


@pytest.mark.parametrize("module", sorted(PUBLIC_MODULES))
def test_every_public_module_has_all_and_documents_it(module: str) -> None:
    """Each public module defines ``__all__``, every name in it exists, and every name is
    documented in docs/reference/api.md or the module's own page."""
    mod = importlib.import_module(module)
    assert isinstance(getattr(mod, "__all__", None), list | tuple), \
        f"{module} defines no __all__"
    absent = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not absent, f"{module}.__all__ names what the module does not define: {absent}"
    pages = [REF / "api.md", *(ROOT / "docs" / page for page in PUBLIC_MODULES[module])]
    text = "\n".join(page.read_text() for page in pages)
    names = [*mod.__all__, *EXTRA_API.get(module, ())]
    missing = [n for n in names if not _mentions(text, n)]
    assert not missing, (f"{module}: public names documented neither in docs/reference/api.md "
                         f"nor in {[str(p.relative_to(ROOT)) for p in pages[1:]]}: {missing}")


def test_every_module_section_of_the_api_page_is_a_covered_public_module() -> None:
    """A ``## `gradpress.x``` section of docs/reference/api.md documents a public module: it is
    in PUBLIC_MODULES, so the test above covers its ``__all__``."""
    sections = re.findall(r"^## `(gradpress[\w.]*)`", (REF / "api.md").read_text(), re.M)
    assert sections, "docs/reference/api.md has no module sections"
    assert set(sections) <= set(PUBLIC_MODULES), sorted(set(sections) - set(PUBLIC_MODULES))
    assert set(PUBLIC_MODULES) - {"gradpress"} <= set(sections), \
        sorted(set(PUBLIC_MODULES) - {"gradpress"} - set(sections))


def test_the_exceptions_users_catch_are_importable_from_gradpress() -> None:
    """Every exception class of gradpress's modules (besides private ones and the CLI's
    NetemError) is a name of ``gradpress`` and so, by the test above, documented."""
    import inspect
    import pkgutil

    import gradpress

    found = set()
    for info in pkgutil.walk_packages(gradpress.__path__, "gradpress."):
        if info.name.split(".")[1] in ("huggingface", "lightning", "cli", "__main__"):
            continue  # optional dependencies; the command line
        mod = importlib.import_module(info.name)
        found |= {obj for name, obj in vars(mod).items()
                  if inspect.isclass(obj) and issubclass(obj, Exception)
                  and obj.__module__.startswith("gradpress") and not name.startswith("_")}
    names = {c.__name__ for c in found} - {"NetemError"}
    assert names, "no exception classes found"
    assert names <= set(gradpress.__all__), sorted(names - set(gradpress.__all__))


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


@pytest.mark.parametrize("name", ["CLAN", "OneBitLANS", "DistributedOptimizer", "push_pull",
                                  "DiLoCo"])
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

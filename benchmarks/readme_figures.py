"""The figure blocks of README.md and docs/tour.md, rendered from records
(``python benchmarks/results_md.py``).

A block sits between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->``; everything between
the two markers is rewritten from :data:`BLOCKS` (links are made relative to the page: ``root``
is the way from the page to the repository's root):

* ``results`` (README): the headline rows, each cell taken from a table of
  ``benchmarks/results/*.json`` (the tables of docs/results.md; the transformer and MLP speed
  rows from ``cluster-tfm`` and ``cluster-mlp``, written by ``benchmarks/issue40.py
  --write-results`` from their records), each naming the machine and the commit its table
  records;
* ``limits`` (README): every accuracy target not met, incomplete or not run, one line each;
* ``plan`` (tour): an abridged ``opt.plan().format()`` of the bundled transformer, from the
  ``plan`` of ``records/plan-stdlib-mlm/report.json`` (rebuilt as a
  :class:`gradpress.torch.plan.Plan` and formatted by its own ``format``; its totals must equal
  the report's);
* ``demo`` (tour): the table and the link budget of ``records/demo-100mbit/report.json``
  (``gradpress demo --bandwidth 100mbit``), with the machine of its ``record.json``;
* ``targets`` (tour): every accuracy target with its result: met, not met, incomplete or not
  run.

No figure is computed here: each is a string of a record, or a number of a report formatted
as the run printed it. The records are refreshed by ``python benchmarks/results_md.py --rerun
NAME`` (the command of :data:`COMMANDS` through ``benchmarks/record.py``, then the rendering).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RECORDS = ROOT / "benchmarks" / "results" / "records"
README = ROOT / "README.md"
TOUR = ROOT / "docs" / "tour.md"
#: The blocks of each page, in order.
PAGES = {README: ["results", "limits"], TOUR: ["plan", "demo", "targets"]}

#: The command of each record behind a block (``python benchmarks/results_md.py --rerun NAME``
#: runs it through ``record.py``; ``{out}`` is the record's directory).
COMMANDS = {
    "plan-stdlib-mlm": ["gradpress", "train", "--optimizer", "onebit-lans", "--compression",
                        "onebit", "--lr", "0.01", "--steps", "120", "--seed", "0",
                        "--no-progress", "--out", "{out}", "--", "python",
                        "benchmarks/clan_script.py", "--task", "stdlib-mlm", "--compression",
                        "onebit"],
    "demo-100mbit": ["gradpress", "demo", "--bandwidth", "100mbit", "--no-progress", "--out",
                     "{out}"],
}
#: What a record keeps of its run's directory (reports; not plots, metrics or checkpoints).
KEEP = ["*.json"]


def read_record(name: str, records: Path = RECORDS) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(record.json, report.json)`` of ``records/name``; ValueError naming what is missing."""
    d = records / name
    out = []
    for f in ("record.json", "report.json"):
        if not (d / f).is_file():
            raise ValueError(f"no record {d / f} (make it with: python "
                             f"benchmarks/results_md.py --rerun {name})")
        out.append(json.loads((d / f).read_text()))
    rec, report = out
    for key in ("command", "commit", "machine"):
        if not rec.get(key):
            raise ValueError(f"{d / 'record.json'}: missing {key!r}")
    return rec, report


def machine_text(rec: Mapping[str, Any]) -> str:
    """One line on where a record was measured."""
    m = rec["machine"]
    gpu = m.get("gpu") or "no GPU"
    return (f"one {m['cores']}-core {m['cpu']} machine ({m['memory']}, {gpu}), load average "
            f"{rec['load_before'][0]} before and {rec['load_after'][0]} after the run")


def provenance(rec: Mapping[str, Any], name: str, where: bool = True, root: str = "") -> str:
    """The record's line under a block: command, commit and (``where``) machine."""
    dirty = f", with local changes to {', '.join(rec['dirty'])}" if rec.get("dirty") else ""
    return (f"Record: [benchmarks/results/records/{name}]({root}benchmarks/results/records/{name}/"
            f"record.json), `{rec['command']}` at commit `{rec['commit'][:10]}`{dirty}, "
            f"{rec['started'][:10]}" + (f", on {machine_text(rec)}." if where else "."))


# -- plan -------------------------------------------------------------------------------------

def plan_text(plan: Mapping[str, Any], label: str) -> str:
    """The report's ``plan`` formatted by :meth:`gradpress.torch.plan.Plan.format`."""
    from gradpress.compress import parse_spec
    from gradpress.torch.plan import EXACT, Plan, TensorPlan

    fields = set(TensorPlan.__dataclass_fields__)
    rows = tuple(TensorPlan(**{k: v for k, v in t.items() if k in fields})
                 for t in plan["tensors"])
    dense = plan.get("dense_codec")
    p = Plan(tensors=rows, communicates=plan["communicates"], dense_steps=plan["dense_steps"],
             ef=plan["ef"], partition_bytes=plan["partition_bytes"],
             min_compress_bytes=plan["min_compress_bytes"],
             dense_codec=None if dense in (None, EXACT) else parse_spec(dense))
    for key in ("bytes_per_step", "fp32_bytes", "compressed_tensors", "dense_bytes_per_step"):
        if getattr(p, key) != plan[key]:
            raise ValueError(f"plan rebuilt from the report: {key} {getattr(p, key)} != the "
                             f"report's {plan[key]} (does Plan have fields the report lacks?)")
    return p.format(label)


def abridge(text: str, plan: Mapping[str, Any]) -> str:
    """The heading, the column names, the first three rows, the first noisy row kept exact,
    the first fused row, ``...`` and the total."""
    lines = text.splitlines()
    head, cols, rows, total = lines[0], lines[1], lines[2:-2], lines[-1]
    names = [t["name"] for t in plan["tensors"]]
    pick = list(range(min(3, len(rows))))
    exact = [i for i, t in enumerate(plan["tensors"]) if t["codec"] == "exact"
             and not t.get("fused")]
    fused = [i for i, t in enumerate(plan["tensors"]) if t.get("fused")]
    pick += exact[:1] + fused[:1]
    keep = sorted(dict.fromkeys(pick))
    if len(names) != len(rows):
        raise ValueError(f"the plan's text has {len(rows)} rows for {len(names)} tensors")
    return "\n".join([head, cols, *(rows[i] for i in keep), "...", total])


def plan_block(sections: Sequence[Mapping[str, Any]], records: Path = RECORDS,
               root: str = "") -> str:
    rec, report = read_record("plan-stdlib-mlm", records)
    if not isinstance(report.get("plan"), dict):
        raise ValueError("records/plan-stdlib-mlm/report.json has no plan (the run stopped "
                         "before its compressed phase)")
    text = abridge(plan_text(report["plan"], f"plan of run {report['run']}"), report["plan"])
    return "\n".join(["```text", text, "```", "",
                      provenance(rec, "plan-stdlib-mlm", root=root)])


# -- demo -------------------------------------------------------------------------------------

def demo_block(sections: Sequence[Mapping[str, Any]], records: Path = RECORDS,
               root: str = "") -> str:
    rec, report = read_record("demo-100mbit", records)
    if report.get("status") != "completed":
        raise ValueError(f"records/demo-100mbit: the demo did not complete "
                         f"({report.get('status')})")
    lines = report["summary"].splitlines()
    return "\n".join([
        "```text", report["table"], "", *lines, "```", "",
        f"Where: every process (2 workers, 1 server; the three runs one after the other in "
        f"one cluster) in one network namespace whose loopback is limited to "
        f"{report['bandwidth']}, on "
        f"{machine_text(rec)}. The times are that machine's; the bytes are the same anywhere.",
        "", provenance(rec, "demo-100mbit", where=False, root=root)])


# -- results ----------------------------------------------------------------------------------

def find_table(sections: Sequence[Mapping[str, Any]], table_id: str) -> Mapping[str, Any]:
    for s in sections:
        for t in s["tables"]:
            if t["id"] == table_id:
                return t
    raise ValueError(f"no table {table_id!r} in benchmarks/results/*.json")


def cell(sections: Sequence[Mapping[str, Any]], table_id: str, column: str,
         **match: str) -> str:
    """The cell in ``column`` of the one row of table ``table_id`` whose cells equal
    ``match`` (column name -> text; underscores stand for spaces)."""
    t = find_table(sections, table_id)
    cols = t["columns"]
    want = {k.replace("_", " "): v for k, v in match.items()}
    for k in [*want, column]:
        if k not in cols:
            raise ValueError(f"table {table_id!r} has no column {k!r}; columns: {cols}")
    rows = [r for r in t["rows"] if all(r[cols.index(k)] == v for k, v in want.items())]
    if len(rows) != 1:
        raise ValueError(f"table {table_id!r}: {len(rows)} rows match {want}, expected 1")
    return rows[0][cols.index(column)]


def _link(table: Mapping[str, Any], root: str = "", text: str = "record") -> str:
    slug = re.sub(r"[^\w\- ]", "", table["title"].strip().lower()).replace(" ", "-")
    return f"[{text}]({root}docs/results.md#{slug})"


def where(table: Mapping[str, Any]) -> str:
    """Where a table's figures were measured: its ``machine`` up to the first ``;`` and the
    commit it names."""
    machine = re.split(r", (?:load average|shared|the one)|;", table["machine"])[0]
    return f"{machine.rstrip('. ')}; commit `{table['commit'].split()[0]}`"


def target_result(runs: str, result: str) -> str:
    """A target's result as the summary shows it: ``not run`` when none of its runs exist."""
    if runs.startswith("0/"):
        return "**not run**"
    if result.startswith("not met"):
        return f"**{result}**"
    return f"incomplete ({runs} runs)" if result == "incomplete" else result


#: The PS path's row label in the cluster-tfm / cluster-mlp tables (benchmarks/issue40.py).
PS_COLOC = "gradpress onebit, servers in the workers (--colocate)"


def _versus(speedup: str) -> str:
    """``"1.32x"`` -> ``"1.32x faster than"``; a speed-up below 1 reads as the slow-down it is
    (``"0.98x"`` -> ``"1.02x slower than"``)."""
    x = float(speedup.rstrip("x"))
    return f"{speedup} faster than" if x >= 1 else f"{1 / x:.2f}x slower than"


def _cluster_row(sections: Sequence[Mapping[str, Any]], model: str, what: str,
                 root: str) -> tuple[str, ...]:
    """A speed row of the issue-40 tables: the PS path (colocated) against DDP + fp16 and
    PowerSGD rank 1, and the two-way hook beside it."""
    tid, fp16 = f"cluster-{model}", "speed-up vs DDP + fp16 hook"
    psgd = "speed-up vs DDP + PowerSGD hook (rank 1)"
    hook, table = "DDP + gradpress two-way onebit hook", find_table(sections, tid)
    return (f"{what}, median of 3 runs", where(table),
            "CLAN one-bit, parameter-server path (servers in the workers)",
            f"{_versus(cell(sections, tid, fp16, system=PS_COLOC))} DDP + fp16 hook, "
            f"{_versus(cell(sections, tid, psgd, system=PS_COLOC))} DDP + PowerSGD rank 1 "
            f"(speed-ups of gradpress's DDP hook: {cell(sections, tid, fp16, system=hook)} and "
            f"{cell(sections, tid, psgd, system=hook)})", _link(table, root))


def results_block(sections: Sequence[Mapping[str, Any]], records: Path = RECORDS,
                  root: str = "") -> str:
    def c(table_id: str, column: str, **match: str) -> str:
        return cell(sections, table_id, column, **match)

    digits, vgg, codecs = (find_table(sections, i) for i in ("digits-cnn", "cluster-vgg",
                                                               "codecs"))
    top = "topk:k=0.001,values=fp16 (int32 indices)"
    rows = [
        ("CNN on digits, 3 seeds", where(digits),
         f"CLAN one-bit, {c('digits-cnn', 'model vs fp32', method='CLAN', codec='onebit')} "
         "fewer bytes than fp32",
         f"test accuracy {c('digits-cnn', 'test accuracy % (n=3)', method='CLAN', codec='onebit')}"
         f"%, uncompressed {c('digits-cnn', 'test accuracy % (n=3)', codec='none', lr='0.004', method='CLAN (`--optimizer clan`)')}%",  # noqa: E501
         _link(digits, root)),
        ("CNN on digits, 3 seeds", where(digits),
         f"CLAN top-k 0.1% fp16, {c('digits-cnn', 'model vs fp32', method='CLAN', codec=top)}"
         " fewer bytes",
         f"test accuracy {c('digits-cnn', 'test accuracy % (n=3)', method='CLAN', codec=top)}%",
         _link(digits, root)),
        ("VGG-style net (34M parameters), one training step", where(vgg), "CLAN one-bit",
         f"{c('cluster-vgg', 'speed-up vs DDP fp32', system='gradpress onebit')} faster than "
         f"DDP fp32 (DDP + PowerSGD: "
         f"{c('cluster-vgg', 'speed-up vs DDP fp32', system='DDP + PowerSGD hook (rank 4)')})",
         _link(vgg, root)),
        *(_cluster_row(sections, model, what, root) for model, what in (
            ("tfm", "Transformer encoder (12 layers, d=384, 148 tensors), one training step"),
            ("mlp", "MLP (100 MB of fp32 gradients), one training step"))),
        ("one-bit codec, 64 MB buffer", where(codecs), "one-bit",
         f"compresses at {c('codecs', 'compress GB/s', spec='onebit')} GB/s, "
         f"{c('codecs', 'compress x copy', spec='onebit')}x a memory copy", _link(codecs, root)),
    ]
    out = ["| workload | measured on | compression | result | |", "|---|---|---|---|---|"]
    return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])


def _targets(sections: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], list[dict]]:
    """The targets table and its rows as dicts (column -> cell)."""
    t = find_table(sections, "targets")
    return t, [dict(zip(t["columns"], r, strict=True)) for r in t["rows"]]


def targets_block(sections: Sequence[Mapping[str, Any]], records: Path = RECORDS,
                  root: str = "") -> str:
    table, rows = _targets(sections)
    out = ["The accuracy targets: `gp.OneBitLANS` at its defaults against uncompressed LANS, 3 "
           "seeds each, 2 workers and 1 server (processes on one 2-core machine) unless the "
           f"target says otherwise; the gap is paired by seed ({_link(table, root)}):", "",
           "| target | task | steps | codec | requirement (every seed) | gap per seed | result |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append("| " + " | ".join([
            r["target"], r["task"], r["steps"], r["codec"], r["requirement (every seed)"],
            r["gap per seed"], target_result(r["runs"], r["result"])]) + " |")
    return "\n".join(out)


def limits_block(sections: Sequence[Mapping[str, Any]], records: Path = RECORDS,
                 root: str = "") -> str:
    """One line per accuracy target of the targets table that is not met, incomplete or not
    run."""
    table, rows = _targets(sections)
    out = []
    for r in rows:
        result = target_result(r["runs"], r["result"])
        if result != "met":
            out.append(f"- `gp.OneBitLANS` target {r['target']} ({r['task']}, {r['steps']} "
                       f"steps, {r['codec']}, {r['requirement (every seed)']}): {result} "
                       f"({_link(table, root, 'table')})")
    return "\n".join(out)


BLOCKS: dict[str, Callable[..., str]] = {"plan": plan_block, "demo": demo_block,
                                         "results": results_block, "targets": targets_block,
                                         "limits": limits_block}
_BLOCK = re.compile(r"(<!-- figures:(\w+) -->\n)(.*?)(<!-- /figures:\2 -->)", re.S)


def block_names(text: str) -> list[str]:
    """The names of the figure blocks in ``text``, in order."""
    return [m.group(2) for m in _BLOCK.finditer(text)]


def render_readme(text: str, sections: Sequence[Mapping[str, Any]],
                  records: Path = RECORDS, root: str = "") -> str:
    """``text`` with every figure block rewritten (``root``: the way from the page to the
    repository's root, for links); ValueError for an unknown block name."""
    def sub(m: re.Match[str]) -> str:
        name = m.group(2)
        if name not in BLOCKS:
            raise ValueError(f"unknown figure block {name!r}; known: {', '.join(BLOCKS)}")
        return f"{m.group(1)}{BLOCKS[name](sections, records, root)}\n{m.group(4)}"

    return _BLOCK.sub(sub, text)


def render_pages(sections: Sequence[Mapping[str, Any]],
                 records: Path = RECORDS) -> dict[Path, str]:
    """Every page of :data:`PAGES` with its blocks rendered."""
    return {page: render_readme(page.read_text(), sections, records,
                                "../" * (len(page.relative_to(ROOT).parts) - 1))
            for page in PAGES}

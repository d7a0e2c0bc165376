"""``gradpress simulate``: predict one iteration's time with and without compression.

``gradpress.cli`` calls :func:`add_arguments` on the subcommand's parser and
:func:`run` with the parsed arguments; ``python -m gradpress.sim.cli ...`` runs the same code.
Unit strings: bandwidths like ``25gbit``, ``100mbit``, ``25Gb/s`` (bits per second) or
``10GB/s`` (bytes per second); sizes like ``4MB`` (binary: 4 MiB, as ``PSConfig``), ``512KB``
or a plain byte count.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence

from .models import MODELS, get_model
from .pipeline import BASELINES, FORWARD_MODES, Comparison, SimConfig, compare
from .rates import default_rates, parse_rates

__all__ = ["add_arguments", "run", "main", "parse_bandwidth", "parse_size", "PAPER_DEFAULTS"]

#: model -> (compression spec, baseline wire format) the paper's runs imply (see
#: docs/paper-comparison.md): one-bit with error feedback for the CNNs against fp32, top-k
#: (``k=0.001``) with fp16 values and error feedback for BERT against mixed precision (fp16).
PAPER_DEFAULTS = {
    "resnet50": ("onebit:ef=vanilla", "none"),
    "vgg16": ("onebit:ef=vanilla", "none"),
    "bert-base": ("topk:k=0.001,values=fp16,ef=vanilla", "fp16"),
}

_NUM = r"([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BW_FORMS = ("a number and a unit: 25gbit, 100mbit (tc style: bit kbit mbit gbit tbit), "
             "25Gb/s, 100Mb/s (bits per second: b/s kb/s Mb/s Gb/s Tb/s) or 10GB/s, 500MB/s "
             "(bytes per second: B/s KB/s MB/s GB/s TB/s)")
_SIZE_UNITS = {"": 1, "b": 1, "kb": 1 << 10, "kib": 1 << 10, "mb": 1 << 20, "mib": 1 << 20,
               "gb": 1 << 30, "gib": 1 << 30}


def parse_bandwidth(text: str, what: str = "bandwidth") -> float:
    """Bytes per second of a bandwidth string (see :data:`_BW_FORMS`); ValueError otherwise."""
    m = re.fullmatch(rf"\s*{_NUM}\s*([A-Za-z]*(?:/s)?)\s*", str(text))
    value = None
    if m:
        num, unit = float(m.group(1)), m.group(2)
        low = unit.lower()
        if low.endswith("bit") and low[:-3] in _PREFIX:
            value = num * _PREFIX[low[:-3]] / 8.0
        elif unit.endswith("/s") and len(unit) >= 3 and unit[-3] in "bB" \
                and unit[:-3].lower() in _PREFIX:
            value = num * _PREFIX[unit[:-3].lower()] / (8.0 if unit[-3] == "b" else 1.0)
    if value is None:
        raise ValueError(f"{what} {text!r}: expected {_BW_FORMS}")
    if not value > 0:
        raise ValueError(f"{what} {text!r} must be greater than 0")
    return value


def parse_size(text: str, what: str = "size") -> int:
    """Bytes of a size string: ``4MB`` (= 4 MiB), ``512KB``, ``1GiB`` or a plain integer."""
    m = re.fullmatch(rf"\s*{_NUM}\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{what} {text!r}: expected a byte count or a number with a unit "
                         f"(B, KB, MB, GB; binary, so 4MB = 4194304), e.g. 4MB")
    value = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
    if value != int(value):
        raise ValueError(f"{what} {text!r} is not a whole number of bytes")
    return int(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Define the arguments of ``gradpress simulate`` on ``parser``."""
    parser.description = ("Predict the time of one training iteration of BytePS-Compress "
                          "with and without compression (a pipeline model; see "
                          "gradpress.sim.pipeline and docs/paper-comparison.md).")
    a = parser.add_argument
    a("--model", default="resnet50", help=f"one of {', '.join(MODELS)} (default resnet50)")
    a("--bandwidth", default="25gbit", help="NIC bandwidth per node and direction "
      "(default 25gbit; forms: 25gbit, 25Gb/s, 3.125GB/s)")
    a("--nodes", type=int, default=8, help="worker nodes (default 8)")
    a("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    a("--compression", help="codec spec of the compressed run (default: the paper's, "
      "onebit:ef=vanilla for CNNs, topk:k=0.001,values=fp16,ef=vanilla for bert-base)")
    a("--baseline", help=f"dense wire format, one of {', '.join(BASELINES)} (default: none "
      "(fp32) for CNNs, fp16 (mixed precision) for bert-base)")
    a("--servers-per-node", type=int, default=1, help="servers colocated on each node "
      "(default 1, as BytePS)")
    a("--server-machines", type=int, default=0, help="dedicated server machines instead of "
      "colocated servers (default 0)")
    a("--worker-threads", type=int, default=8, help="compression threads per node (default 8)")
    a("--server-threads", type=int, default=4, help="engine threads per server (default 4)")
    a("--compute-ms", type=float, help="forward+backward ms per iteration (default: batch / "
      "published V100 throughput of the model)")
    a("--batch-per-gpu", type=int, help="samples per GPU (default per model) for the "
      "default compute time")
    a("--backward-fraction", type=float, default=2.0 / 3.0,
      help="share of compute spent in backward (default 2/3)")
    a("--codec-gbps", help="per-thread codec GB/s: 'measure' (run the codec here), X, C,D or "
      "C,D,A (compress, decompress, decompress-add); default: the built-in table")
    a("--partition-bytes", default="4MB", help="chunk size (default 4MB)")
    a("--min-compress-bytes", default="1MB", help="smaller tensors are not compressed "
      "(default 1MB)")
    a("--nvlink-bandwidth", default="100GB/s", help="intra-node reduce/broadcast bandwidth "
      "(default 100GB/s)")
    a("--pcie-bandwidth", default="10GB/s", help="GPU<->host copy bandwidth (default 10GB/s)")
    a("--forward", default="all", help=f"next forward waits for {' or '.join(FORWARD_MODES)} "
      "gradients: 'all' (default) or per 'layer'")
    a("--json", action="store_true", help="print JSON instead of a table")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build the :class:`SimConfig` of parsed arguments; ValueError on any bad value."""
    model = get_model(args.model)
    spec, base = PAPER_DEFAULTS[model.name]
    compute_ms = args.compute_ms
    if args.batch_per_gpu is not None:
        if compute_ms is not None:
            raise ValueError("give --compute-ms or --batch-per-gpu, not both")
        if args.batch_per_gpu < 1:
            raise ValueError(f"--batch-per-gpu must be >= 1, got {args.batch_per_gpu}")
        compute_ms = 1000.0 * args.batch_per_gpu / model.samples_per_s
    compression = args.compression or spec
    codec_rates = parse_rates(args.codec_gbps, compression)
    dense_rates = parse_rates("measure" if args.codec_gbps == "measure" else None, "none")
    return SimConfig(
        model=model, bandwidth=parse_bandwidth(args.bandwidth, "--bandwidth"), nodes=args.nodes,
        gpus_per_node=args.gpus_per_node, compression=compression,
        baseline=args.baseline or base, compute_ms=compute_ms,
        backward_fraction=args.backward_fraction,
        partition_bytes=parse_size(args.partition_bytes, "--partition-bytes"),
        min_compress_bytes=parse_size(args.min_compress_bytes, "--min-compress-bytes"),
        servers_per_node=args.servers_per_node, server_machines=args.server_machines,
        worker_threads=args.worker_threads, server_threads=args.server_threads,
        codec_rates=codec_rates, dense_rates=dense_rates,
        nvlink=parse_bandwidth(args.nvlink_bandwidth, "--nvlink-bandwidth"),
        pcie=parse_bandwidth(args.pcie_bandwidth, "--pcie-bandwidth"), forward=args.forward)


def _describe(cfg: SimConfig) -> dict:
    r = cfg.codec_rates or default_rates(cfg.compression)
    return {"model": cfg.model.name, "params": cfg.model.num_params, "nodes": cfg.nodes,
            "gpus_per_node": cfg.gpus_per_node, "bandwidth_gbit": cfg.bandwidth * 8 / 1e9,
            "compression": cfg.compression, "baseline": cfg.baseline,
            "compute_ms": cfg.compute_s * 1e3, "compute_source": cfg.model.source
            if cfg.compute_ms is None else "--compute-ms",
            "codec_gbps_per_thread": {"compress": r.compress, "decompress": r.decompress,
                                      "decompress_add": r.decompress_add},
            "partition_bytes": cfg.partition_bytes, "min_compress_bytes": cfg.min_compress_bytes,
            "forward": cfg.forward}


_ROWS = (("compute (fwd+bwd)", "compute_ms", "ms"),
         ("communication (busiest link)", "network_ms", "ms"),
         ("exposed communication", "exposed_ms", "ms"),
         ("worker codec CPU (thread-ms/node)", "worker_codec_ms", "ms"),
         ("server codec CPU (thread-ms/host)", "server_codec_ms", "ms"),
         ("bytes pushed per node", "push_bytes", "MB"),
         ("iteration time", "iteration_ms", "ms"))


def format_table(cfg: SimConfig, cmp: Comparison) -> str:
    """The human-readable report of one comparison."""
    d = _describe(cfg)
    lines = [f"{d['model']} ({d['params']:,} parameters), {cfg.nodes} nodes x "
             f"{cfg.gpus_per_node} GPUs, {d['bandwidth_gbit']:g} Gbit/s per node, "
             f"compute {d['compute_ms']:.1f} ms/iteration",
             f"codec {cfg.compression}: {d['codec_gbps_per_thread']['compress']:.2f} / "
             f"{d['codec_gbps_per_thread']['decompress']:.2f} / "
             f"{d['codec_gbps_per_thread']['decompress_add']:.2f} GB/s per thread "
             f"(compress / decompress / decompress-add)", ""]
    w = max(len(r[0]) for r in _ROWS)
    lines.append(f"{'':{w}}  {'baseline (' + cfg.baseline + ')':>18}  {'compressed':>12}")
    for label, field, unit in _ROWS:
        vals = [getattr(r, field) for r in (cmp.baseline, cmp.compressed)]
        if unit == "MB":
            vals = [v / 1e6 for v in vals]
        lines.append(f"{label:{w}}  {vals[0]:>15.2f} {unit}  {vals[1]:>9.2f} {unit}")
    lines += ["", f"speedup {cmp.speedup:.3f}x, training time reduction "
                  f"{cmp.reduction_pct:.1f}%  ({cmp.compressed.compressed_chunks} of "
                  f"{cmp.compressed.chunks} chunks compressed)"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run ``gradpress simulate`` with parsed ``args``; returns the exit status."""
    cfg = config_from_args(args)
    cmp = compare(cfg)
    if args.json:
        print(json.dumps({"config": _describe(cfg), **cmp.to_dict()}, indent=2))
    else:
        print(format_table(cfg, cmp))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradpress.sim.cli``: the same as ``gradpress simulate``."""
    parser = argparse.ArgumentParser(prog="gradpress simulate")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ValueError as e:
        parser.exit(2, f"gradpress simulate: error: {e}\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())

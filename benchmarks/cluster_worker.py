"""Worker side of ``benchmarks/cluster.py``: one training process of one system.

Started with ``python cluster_worker.py CONFIG.json``, either by ``gradpress launch`` (the
gradpress systems: the launcher sets the job environment) or directly by the driver with the
torchrun-style variables ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (the DDP
systems). Steps:

1. build the model (seeded, identical on every rank) and the optimizer of the config;
2. wrap them: DDP (gloo) with one of the comm hooks, or ``gp.DistributedOptimizer``; the
   ``local`` system wraps nothing (each rank trains alone: the compute floor of a step);
3. run ``warmup`` steps, a barrier, then ``steps`` timed steps (forward, backward, optimizer
   step; each rank has its own fixed batch), recording each step's seconds;
4. write seconds, the ``perf_counter`` marks of each timed step (start, end of backward, end
   of the gradient synchronisation, end; see ``benchmarks/profile_trace.py``), the host
   interface's byte counters over the timed steps (``/proc/net/dev`` of this process's
   network namespace), the CPU time over the timed steps (:func:`cpu_counters`: the whole
   machine's, this process's and its main thread's) and, for gradpress, ``gp.stats()`` deltas
   to ``<out_dir>/<name>.rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cluster_models import build_model, loss_of, make_batch

DDP_SYSTEMS = ("ddp-fp32", "ddp-fp16", "ddp-powersgd", "ddp-powersgd1", "gp-ddp-hook",
               "gp-int4-hook")
GP_SYSTEMS = ("gp-none", "gp-onebit", "gp-topk", "gp-onebit-coloc", "gp-int4",
              "gp-int4-coloc")
#: gradpress systems whose servers run as threads inside the workers (``launch --colocate``).
GP_COLOCATED = ("gp-onebit-coloc", "gp-int4-coloc")
GP_SPECS = {"gp-none": ("none", None), "gp-onebit": ("onebit", "vanilla"),
            "gp-topk": ("topk:k=0.001,values=fp16", "vanilla"),
            "gp-onebit-coloc": ("onebit", "vanilla"), "gp-int4": ("int4", "vanilla"),
            "gp-int4-coloc": ("int4", "vanilla")}


def cpu_counters() -> dict[str, float]:
    """CPU seconds so far: the machine's user/system/idle (``/proc/stat``, all cores, every
    process: also the servers, the kernel's network work and other jobs), this process's
    user/system (all its threads) and its main thread's (the training loop)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:8]]  # user nice system idle iowait irq softirq
    t = os.times()
    return {"machine_user": (v[0] + v[1]) / tick, "machine_sys": (v[2] + v[5] + v[6]) / tick,
            "machine_idle": (v[3] + v[4]) / tick, "process_user": t.user,
            "process_sys": t.system, "main_thread": time.thread_time(), "wall": time.time()}


def iface_bytes(device: str) -> int:
    """Received + transmitted bytes of ``device`` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == device:
                fields = rest.split()
                return int(fields[0]) + int(fields[8])
    return 0


def make_optimizer(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """CLAN (LANS without gradient normalisation; the gradpress recipe) or plain SGD."""
    if name == "clan":
        from gradpress.optim import clan_core

        return clan_core(params, lr=1e-3)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    raise ValueError(f"optimizer must be 'clan' or 'sgd', got {name!r}")


def _ddp(cfg: dict, model: torch.nn.Module) -> tuple[torch.nn.Module, Callable[[], None]]:
    """Step 2 for the DDP systems: init gloo, wrap, register the system's comm hook."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    system = cfg["system"]
    # PowerSGD issues its second allreduce from a future callback; with gloo, two buckets'
    # callbacks can issue collectives in different orders on different ranks ("Received data
    # size doesn't match expected size"), so PowerSGD gets a single bucket.
    cap = 4096 if system.startswith("ddp-powersgd") else 25
    ddp = DistributedDataParallel(model, bucket_cap_mb=cap)
    if system == "ddp-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif system.startswith("ddp-powersgd"):  # rank 4, or rank 1 (ddp-powersgd1)
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1 if system.endswith("1") else 4,
            start_powerSGD_iter=2, min_compression_rate=2, use_error_feedback=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif system in ("gp-ddp-hook", "gp-int4-hook"):
        from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook

        codec = "int4" if system == "gp-int4-hook" else "onebit"
        state = TwoWayCompressionState(codec, "vanilla",
                                       min_compress_bytes=_hook_bytes(cfg))
        ddp.register_comm_hook(state, two_way_compression_hook)
    return ddp, dist.barrier


def _hook_bytes(cfg: dict) -> int:
    """The hook's threshold: the benchmark's, or the hook's own default for ``auto``."""
    from gradpress.defaults import HOOK_MIN_COMPRESS_BYTES

    limit = cfg["min_compress_bytes"]
    return HOOK_MIN_COMPRESS_BYTES if limit == "auto" else int(limit)


def _gradpress(cfg: dict, model: torch.nn.Module,
               opt: torch.optim.Optimizer) -> tuple[torch.optim.Optimizer, Callable[[], None]]:
    """Step 2 for the gradpress systems: init, broadcast, wrap the optimizer."""
    import gradpress as gp

    gp.init()
    gp.broadcast_parameters(model.state_dict(), root_rank=0)
    spec, ef = GP_SPECS[cfg["system"]]
    dopt = gp.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=spec, ef=ef,
                                   min_compress_bytes=cfg["min_compress_bytes"])
    return dopt, gp.barrier


def run(cfg: dict) -> dict:
    """Steps 1-4 of the module docstring; returns the result written to disk."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = int(os.environ["RANK"])
    model = build_model(cfg["model"])
    opt = make_optimizer(cfg["optimizer"], list(model.parameters()))
    gp_system = cfg["system"] in GP_SYSTEMS
    if gp_system:
        opt, barrier = _gradpress(cfg, model, opt)
        net = model
    elif cfg["system"] == "local":
        net, barrier = model, lambda: None
    else:
        net, barrier = _ddp(cfg, model)
    data = make_batch(cfg["model"], cfg["batch"], seed=1 + rank)
    seconds, marks, net0, st0, cpu0 = [], [], 0, {}, {}
    for i in range(cfg["warmup"] + cfg["steps"]):
        if i == cfg["warmup"]:  # step 3: timed steps start together
            barrier()
            net0 = iface_bytes(cfg["device"])
            st0 = _gp_stats() if gp_system else {}
            cpu0 = cpu_counters()
        mark = _step(opt, net, cfg["model"], data, gp_system)
        seconds.append(mark[-1] - mark[0])
        marks.append(mark)
    cpu1 = cpu_counters()
    res = {"seconds": seconds[cfg["warmup"]:], "marks": marks[cfg["warmup"]:],
           "iface_bytes": (iface_bytes(cfg["device"]) - net0) / cfg["steps"],
           "cpu": {k: (cpu1[k] - cpu0[k]) / cfg["steps"] for k in cpu1}}
    if gp_system:
        st1 = _gp_stats()
        res["gp_bytes"] = (st1["bytes_pushed"] + st1["bytes_pulled"]
                           - st0["bytes_pushed"] - st0["bytes_pulled"]) / cfg["steps"]
        res["stage_s"] = {k: (st1[k] - st0[k]) / cfg["steps"] for k in st1 if k.endswith("_s")}
    return res


def _step(opt: torch.optim.Optimizer, net: torch.nn.Module, model: str, data: object,
          gp_system: bool) -> list[float]:
    """One training step; its ``perf_counter`` marks: start, end of backward, end of the
    gradient synchronisation (gradpress: ``synchronize()``; else = end of backward), end."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=False)
    loss_of(net, model, data).backward()
    t1 = t2 = time.perf_counter()
    if gp_system:
        opt.synchronize()  # type: ignore[attr-defined]  # what step() would do first
        t2 = time.perf_counter()
        with opt.skip_synchronize():  # type: ignore[attr-defined]
            opt.step()
    else:
        opt.step()
    return [t0, t1, t2, time.perf_counter()]


def _gp_stats() -> dict:
    import gradpress as gp

    return dict(gp.stats())


def main(path: str) -> int:
    """Run the config at ``path`` and write this rank's JSON result next to it."""
    cfg = json.loads(Path(path).read_text())
    res = run(cfg)
    out = Path(cfg["out_dir"]) / f"{cfg['name']}.rank{os.environ['RANK']}.json"
    out.write_text(json.dumps(res))
    if cfg["system"] in GP_SYSTEMS:
        import gradpress as gp

        gp.shutdown()
    elif cfg["system"] != "local":
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: cluster_worker.py CONFIG.json (started by benchmarks/cluster.py)",
              file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1]))

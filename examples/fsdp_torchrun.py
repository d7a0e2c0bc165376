"""FSDP2 with gradpress's compressed reduce-scatter, a plain torchrun script (docs/integrations.md).

    torchrun --nproc-per-node 2 examples/fsdp_torchrun.py              # CPU: gloo; GPUs: NCCL
    torchrun --nproc-per-node 2 examples/fsdp_torchrun.py --ckpt DIR   # save at the end, or
                                                                       # resume from DIR

The lines marked ``# gradpress`` are all FSDP2 code adds. The model is a small MLP learning a
fixed random teacher network's labels (synthetic, no download), each layer sharded with
``fully_shard``. The parameter all-gather is FSDP2's own; every reduce-scatter of gradients is
compressed (one bit per element with ``onebit``) with error feedback on the sending ranks.
With ``--out DIR`` every rank writes ``DIR/rank<r>.json``: its losses, a hash of the full
parameters (identical on every rank) and the compression statistics.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import gradpress.fsdp  # gradpress

TEACHER = torch.randn(128, 10, generator=torch.Generator().manual_seed(0))


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs at ``step`` and the labels a fixed random teacher network gives
    them (drawn from (step, rank) alone, so a resumed run sees the same batches)."""
    x = torch.randn(size, 128, generator=torch.Generator().manual_seed(1 + 1000 * step + rank))
    return x, (torch.tanh(x) @ TEACHER).argmax(dim=1)


def full_hash(model: nn.Module) -> str:
    """sha256 of the full (all-gathered) parameters: the same on every rank."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.full_tensor().detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--compression", default="onebit")
    ap.add_argument("--ckpt", default=None, help="resume from DIR if it holds a checkpoint; "
                                                 "save there at the end")
    ap.add_argument("--out", default=None, help="write rank<r>.json here")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    st = gradpress.fsdp.compress(  # gradpress: every FSDPModule's reduce-scatter, compressed
        model, compression=args.compression, ef="vanilla",
        min_compress_bytes=1 << 16)  # modules of 64 KiB or more (the default is 1 MiB)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gradpress.fsdp.check_optimizer(opt)  # gradpress: refuses layer-wise LANS/LAMB on shards

    start = 0
    if args.ckpt and os.path.exists(os.path.join(args.ckpt, ".metadata")):
        msd, osd = get_state_dict(model, opt)
        extra = {"step": 0}
        dcp.load({"model": msd, "optim": osd, "extra": extra}, checkpoint_id=args.ckpt)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        st.load(args.ckpt)  # gradpress: this rank's residuals (same world size)
        start = int(extra["step"])

    device = torch.device("cuda") if cuda else torch.device("cpu")
    losses = []
    for step in range(start, start + args.steps):
        xb, yb = (t.to(device) for t in batch(step, rank, args.batch_size))
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()  # the reduce-scatters run, compressed, as FSDP2 issues them
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    if args.ckpt:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd, "extra": {"step": start + args.steps}},
                 checkpoint_id=args.ckpt)
        st.save(args.ckpt)  # gradpress: beside DCP's files, one file per rank
    stats, digest = st.stats(), full_hash(model)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "size": world, "losses": losses, "param_hash": digest,
                       "stats": stats}, f)
    if rank == 0:
        print(f"sent {stats['payload_bytes']} bytes, fp32 would be {stats['dense_bytes']}",
              flush=True)
    # Drop FSDP2's modules (their hooks and DTensors reference the process group) before the
    # group: gloo's threads then end here, not at interpreter exit, where they can abort.
    del model, opt, st
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

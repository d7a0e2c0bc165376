"""A plain PyTorch training script with gradpress, started by torchrun (docs/integrations.md).

    torchrun --nproc-per-node 2 examples/torchrun_train.py                          # colocated
    GRADPRESS_NUM_SERVERS=1 torchrun --nproc-per-node 3 examples/torchrun_train.py  # 2 + 1 server
    gradpress launch --workers 2 --servers 1 -- python examples/torchrun_train.py   # the same

The lines marked ``# gradpress`` are all a single-process script needs. The model is a small
MLP learning a fixed random teacher network's labels (synthetic, no download). With ``--out DIR``
every worker writes ``DIR/rank<r>.json``: its losses, a hash of its parameters (identical on
every worker) and ``gp.stats()``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

import gradpress as gp  # gradpress


def data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs and the labels a fixed random teacher network gives them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 128, generator=g)
    teacher = torch.randn(128, 10, generator=g)
    return x, (torch.tanh(x) @ teacher).argmax(dim=1)


def param_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--compression", default="onebit")
    ap.add_argument("--out", default=None, help="write rank<r>.json here")
    args = ap.parse_args()

    gp.init()  # gradpress: a separate server rank serves here and exits
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = gp.DistributedOptimizer(  # gradpress
        opt, named_parameters=model.named_parameters(), compression=args.compression,
        ef="vanilla", min_compress_bytes=1 << 16)  # compress tensors of 64 KiB or more
    gp.broadcast_parameters(model.state_dict(), root_rank=0)  # gradpress: same start

    x, y = data(args.steps * args.batch_size * gp.size())
    losses = []
    for step in range(args.steps):
        i = (step * gp.size() + gp.rank()) * args.batch_size  # gradpress: this worker's shard
        loss = F.cross_entropy(model(x[i:i + args.batch_size]), y[i:i + args.batch_size])
        opt.zero_grad()
        loss.backward()  # gradients are pushed, compressed, while backward runs
        opt.step()  # waits for the averaged gradients, then steps
        losses.append(loss.item())
        if gp.rank() == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    stats = gp.stats()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{gp.rank()}.json"), "w") as f:
            json.dump({"rank": gp.rank(), "size": gp.size(), "losses": losses,
                       "param_hash": param_hash(model), "stats": stats}, f)
    if gp.rank() == 0:
        print(f"pushed {stats['bytes_pushed']:.0f} bytes, fp32 would be "
              f"{stats['dense_fp32_bytes']:.0f}", flush=True)
    gp.shutdown()  # gradpress


if __name__ == "__main__":
    main()

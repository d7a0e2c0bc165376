"""A plain PyTorch script with gradpress that recovers under torchrun's elastic agent
(docs/integrations.md, "Recovery with torchrun"):

    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # several nodes: a new node's agent finds it
    torchrun --nnodes 1:2 --nproc-per-node 4 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --local-addr THIS_NODE_ADDR examples/torchrun_elastic.py \\
        --ckpt /shared/ckpt

Every ``--every`` steps it saves a checkpoint into ``CKPT/step-<N>`` (``gradpress.checkpoint.
save``: parameters, optimizer, every worker's and server's residuals, RNG, and as ``extra`` the
samples drawn so far); at start it resumes from the newest valid one
(``gradpress.checkpoint.latest``), whatever the number of workers now (a resized load folds
the saved workers' residuals, :mod:`gradpress.elastic`). The lr schedule is a function of the
step; the data position is the number of samples drawn, so a job with fewer workers goes on
where the larger one stopped. The task is examples/torchrun_train.py's (an MLP on a fixed random
teacher's labels). With ``--out DIR`` every worker writes ``DIR/rank<r>.json``: its losses
since the start of this attempt, the held-out loss, a hash of its parameters, what a resized
load did and torchrun's restart count (``attempt``). ``GP_KILL_AT=STEP`` (with
``GP_KILL_RANK``, default 1; ``any``: whichever rank this process is, for a variable set on one
node only, since the rendezvous does not promise which node's worker gets which rank) makes
that worker SIGKILL itself before that step in torchrun's first attempt only
(``TORCHELASTIC_RESTART_COUNT=0``): the failure the tests inject; with ``GP_KILL_AGENT=1`` it
SIGKILLs its torchrun agent first (a node lost). ``GP_HOLD_AT=STEP`` instead makes it write
``OUT/held-rank<r>`` and wait there to be killed from outside (the tests kill every process of
its "node", or a node joins and its agent restarts the group), once per ``OUT``: an agent that
restarts its workers for a joining node does not count a restart.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import gradpress as gp
import gradpress.checkpoint as ckpt
from gradpress.elastic import last_resize
from gradpress.train.periodic import params_sha256

BATCH = 32  # per worker


def data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs and the labels a fixed random teacher network gives them."""
    x = torch.randn(n, 128, generator=torch.Generator().manual_seed(seed))
    teacher = torch.randn(128, 10, generator=torch.Generator().manual_seed(1000))
    return x, (torch.tanh(x) @ teacher).argmax(dim=1)


def maybe_die(step: int, out: str | None) -> None:
    """SIGKILL this worker before ``step`` if ``GP_KILL_AT`` says so, or wait there to be killed
    if ``GP_HOLD_AT`` does (first attempt only)."""
    who = os.environ.get("GP_KILL_RANK", "1")
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" \
            or (who != "any" and gp.rank() != int(who)):
        return
    if out and step == int(os.environ.get("GP_HOLD_AT", "-1")) \
            and not any(Path(out).glob("held-rank*")):  # once per OUT
        print(f"worker {gp.rank()}: holding before step {step}", flush=True)
        os.makedirs(out, exist_ok=True)
        Path(out, f"held-rank{gp.rank()}").touch()
        while True:  # until killed
            signal.pause()
    if step == int(os.environ.get("GP_KILL_AT", "-1")):
        print(f"worker {gp.rank()}: SIGKILL before step {step}", flush=True)
        if os.environ.get("GP_KILL_AGENT"):  # the whole "node": its torchrun agent too
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    ap.add_argument("--ckpt", required=True, help="the checkpoints' root directory")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resize", default="fold", help="fold, reset or refuse")
    ap.add_argument("--out", default=None, help="write rank<r>.json here")
    args = ap.parse_args()

    gp.init()
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = gp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        named_parameters=model.named_parameters(), compression="onebit", ef="vanilla",
        min_compress_bytes=1 << 16)
    sched = torch.optim.lr_scheduler.LambdaLR(  # a function of the step: resumes with it
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    start, seen = 0, 0
    found = ckpt.latest(args.ckpt)
    if found is not None:
        start = ckpt.load(found, model, opt, resize=args.resize)
        seen = int((ckpt.extra(found) or {}).get("seen", 0))
        sched.last_epoch = start - 1
        sched.step()
        print(f"worker {gp.rank()}: resumed from {found} at step {start}", flush=True)
    else:
        gp.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = data(args.steps * BATCH * 8, args.seed)  # room for up to 8 workers
    losses = []
    for step in range(start, args.steps):
        maybe_die(step, args.out)
        i = seen + gp.rank() * BATCH
        loss = F.cross_entropy(model(x[i:i + BATCH]), y[i:i + BATCH])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        seen += gp.size() * BATCH
        losses.append(loss.item())
        if (step + 1) % args.every == 0:
            ckpt.save(Path(args.ckpt) / f"step-{step + 1}", model, opt, step + 1,
                      extra={"seen": seen})
    if args.out:
        xt, yt = data(2048, args.seed + 1)
        with torch.no_grad():
            held_out = F.cross_entropy(model(xt), yt).item()
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{gp.rank()}.json"), "w") as f:
            json.dump({"rank": gp.rank(), "size": gp.size(), "start": start, "losses": losses,
                       "held_out_loss": held_out, "resized": last_resize(),
                       "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                       "param_hash": params_sha256(model)}, f)
    gp.shutdown()


if __name__ == "__main__":
    main()

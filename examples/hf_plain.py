"""A Hugging Face ``transformers`` model trained with gradpress in a plain loop.

    torchrun --nproc-per-node 2 examples/hf_plain.py
    gradpress launch --workers 2 --colocate -- python examples/hf_plain.py

A GPT-2 sized down (2 layers, width 64) built from its config, nothing downloaded, learns
next-byte prediction on the source of Python's ``argparse`` module (a real text that ships with
every Python; byte-level: ids 0..255 are bytes, 256 is end-of-text, so no tokenizer is needed).
The optimizer is ``gp.OneBitLANS``, gradpress's recommended optimizer for transformers: it
averages exact gradients for ``--dense-steps`` steps, then communicates each worker's momentum
compressed to one bit per element, both ways. The lines marked ``# gradpress`` are what a
single-process script adds (docs/integrations.md). With ``--out DIR`` every worker writes
``DIR/rank<r>.json``: its losses, a hash of its parameters (identical on every worker) and
``gp.stats()``.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import gradpress as gp  # gradpress

EOT = 256  # end of text; ids 0..255 are the bytes themselves


def corpus(seq_len: int) -> torch.Tensor:
    """The bytes of ``argparse.py`` cut into sequences of ``seq_len`` ids."""
    raw = inspect.getsource(argparse).encode()
    ids = torch.tensor(list(raw), dtype=torch.long)
    n = len(ids) // seq_len
    return ids[:n * seq_len].view(n, seq_len)


def param_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per worker and step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--dense-steps", type=int, default=20)
    ap.add_argument("--out", default=None, help="write rank<r>.json here")
    args = ap.parse_args()

    gp.init()  # gradpress
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=257, n_positions=args.seq_len, n_embd=64, n_layer=2,
                        n_head=2, bos_token_id=EOT, eos_token_id=EOT)
    model = GPT2LMHeadModel(config)
    gp.broadcast_parameters(model.state_dict(), root_rank=0)  # gradpress: same start
    opt = gp.OneBitLANS(model.named_parameters(), lr=args.lr,  # gradpress
                        dense_steps=args.dense_steps)
    if gp.rank() == 0:
        print(opt.plan().format(), flush=True)

    data = corpus(args.seq_len)
    g = torch.Generator().manual_seed(1)  # the same order on every worker
    losses = []
    model.train()
    for step in range(args.steps):
        if step % (len(data) // (args.batch_size * gp.size())) == 0:
            order = torch.randperm(len(data), generator=g)
            pos = 0
        rows = order[pos + gp.rank() * args.batch_size:  # gradpress: this worker's shard
                     pos + (gp.rank() + 1) * args.batch_size]
        pos += args.batch_size * gp.size()
        batch = data[rows]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
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

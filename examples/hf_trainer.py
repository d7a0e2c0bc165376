"""The Hugging Face ``Trainer`` with gradpress's two-way compressed DDP hook (docs/integrations.md).

    torchrun --nproc-per-node 2 examples/hf_trainer.py

The Trainer wraps the model in DDP as usual; ``TwoWayCompressionCallback`` registers gradpress's
hook on that wrapper before the first backward, so every gradient bucket is compressed to one bit
per element (with error feedback) on its way to the rank that averages it, and again on its way
back. No gradpress servers and no ``gp.init()``: the hook uses the Trainer's process group. The
lines marked ``# gradpress`` are all a Trainer script adds.

The model and data are those of ``hf_plain.py``: a GPT-2 sized down, from its config, on the
bytes of ``argparse.py``. With ``--out DIR`` every rank writes ``DIR/rank<r>.json`` (the logged
losses, a hash of its parameters, the hook's counters), and checkpoints go to
``DIR/trainer``, each with the hook's residuals.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import inspect
import json
import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from gradpress.huggingface import TwoWayCompressionCallback  # gradpress

EOT = 256  # end of text; ids 0..255 are the bytes themselves


class ByteDataset(torch.utils.data.Dataset):
    """The bytes of ``argparse.py`` in sequences of ``seq_len`` ids, as causal-LM examples."""

    def __init__(self, seq_len: int) -> None:
        ids = torch.tensor(list(inspect.getsource(argparse).encode()), dtype=torch.long)
        n = len(ids) // seq_len
        self.rows = ids[:n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def param_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps")
    ap.add_argument("--resume", action="store_true", help="resume from the last checkpoint")
    ap.add_argument("--out", default=None, help="write rank<r>.json and checkpoints here")
    args = ap.parse_args()

    out = args.out or tempfile.mkdtemp(prefix="hf_trainer_")
    config = GPT2Config(vocab_size=257, n_positions=args.seq_len, n_embd=64, n_layer=2,
                        n_head=2, bos_token_id=EOT, eos_token_id=EOT)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    targs = TrainingArguments(
        output_dir=os.path.join(out, "trainer"), max_steps=args.steps,
        per_device_train_batch_size=args.batch_size, learning_rate=args.lr,
        lr_scheduler_type="constant", logging_steps=1, report_to="none", seed=0,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        use_cpu=True, ddp_backend="gloo", disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=ByteDataset(args.seq_len))
    hook = TwoWayCompressionCallback(trainer, compression="onebit", ef="vanilla",  # gradpress
                                     min_compress_bytes=1 << 16)  # small model: small buckets
    trainer.add_callback(hook)  # gradpress
    trainer.train(resume_from_checkpoint=True if args.resume else None)

    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    stats = hook.state.compression_stats()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    if args.out:
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "losses": losses, "param_hash": param_hash(trainer.model),
                       "hook_registered": hook.registered, "stats": stats}, f)
    if rank == 0:
        print(f"hook: {stats['compressed_buckets']} buckets compressed, {stats['payload_bytes']} "
              f"payload bytes for {stats['dense_bytes']} fp32 bytes", flush=True)


def end_process_group() -> None:
    """Destroy the process group and wait for gloo's threads to end, before Python exits.

    A gloo thread that drops the last reference to a Python tensor (the Trainer gathers its
    losses into temporary tensors) takes the GIL to free it; if the interpreter is already
    shutting down, CPython ends that thread with ``pthread_exit`` and the process aborts with
    "terminate called without an active exception" (pytorch/pytorch#117762). Dropping the
    group's last reference from Python joins its threads with the GIL released."""
    if not torch.distributed.is_initialized():
        return
    group = torch.distributed.group.WORLD
    torch.distributed.destroy_process_group()
    gc.collect()  # the Trainer's DDP wrapper (its reducer holds the group) is in a cycle
    del group  # the last reference: gloo's threads are joined here


if __name__ == "__main__":
    main()
    end_process_group()

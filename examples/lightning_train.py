"""Train a small regression MLP with PyTorch Lightning, gradients two-way compressed by gradpress.

The recipes of docs/integrations.md (PyTorch Lightning), run as written by tests/test_lightning.py::

    python examples/lightning_train.py --strategy two-way        # DDP + gradpress's comm hook
    python examples/lightning_train.py --strategy ps             # gradpress's parameter servers
    python examples/lightning_train.py --strategy two-way --ckpt-path CKPT   # resume

Lightning starts the second process itself (``devices=2``). With ``--out DIR`` every rank writes
``DIR/rank<r>.json``: a hash of its parameters, its losses and the bytes it sent.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook
from gradpress.lightning import ParameterServerStrategy, TwoWayCompressionStrategy


class Regressor(L.LightningModule):
    """An ordinary LightningModule: nothing in it knows about gradpress."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(32, 1024), nn.Tanh(), nn.Linear(1024, 1024),
                                 nn.Tanh(), nn.Linear(1024, 1))
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)  # Lightning's all_reduce still works
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)}


def data(n: int = 512) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    y = torch.tanh(x[:, :4].sum(1, keepdim=True))
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


def make_strategy(name: str):
    if name == "two-way":
        return TwoWayCompressionStrategy(find_unused_parameters=True)  # onebit + error feedback
    if name == "ps":
        return ParameterServerStrategy(compression="onebit", ef="vanilla")
    if name == "ddp-hook":  # Lightning's own DDPStrategy: on CPU it never calls the hook
        return DDPStrategy(ddp_comm_hook=two_way_compression_hook,
                           ddp_comm_state=TwoWayCompressionState())
    raise SystemExit(f"unknown strategy {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default="two-way", choices=["two-way", "ps", "ddp-hook"])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--root", default="lightning_run", help="logs and checkpoints go here")
    ap.add_argument("--ckpt-path", default=None, help="resume from this checkpoint")
    ap.add_argument("--out", default=None, help="write rank<r>.json here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0)
    model = Regressor()
    strategy = make_strategy(args.strategy)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy,
                        max_epochs=args.epochs, log_every_n_steps=1,
                        logger=CSVLogger(args.root, name="logs"),
                        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.root, "ckpt"),
                                                   save_top_k=-1, every_n_epochs=1)],
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data(), data(128), ckpt_path=args.ckpt_path)
    val = trainer.validate(model, data(128), verbose=False)  # after fit: same processes
    if args.out:
        state = getattr(strategy, "_ddp_comm_state", None)
        stats = strategy.compression_stats if hasattr(strategy, "compression_stats") \
            else state.compression_stats()
        blob = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"params_sha256": hashlib.sha256(blob).hexdigest(), "losses": model.losses,
                       "stats": stats, "global_step": trainer.global_step,
                       "val_loss": val[0]["val_loss"],
                       "lr": trainer.optimizers[0].param_groups[0]["lr"]}, f)


if __name__ == "__main__":
    main()

"""FSDP2 under PyTorch Lightning's ``ModelParallelStrategy``, the reduce-scatters compressed by
gradpress (docs/integrations.md, "FSDP2"; run by tests/test_fsdp.py)::

    python examples/lightning_fsdp.py --out DIR

Lightning starts the second process itself (``devices=2``, CPU and gloo here). The module shards
itself in ``configure_model`` (Lightning's FSDP2 hook) and installs gradpress there, after
``fully_shard``: the line marked ``# gradpress``. Every rank writes ``DIR/rank<r>.json``: its
losses, a hash of the full parameters and the compression statistics.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import gradpress.fsdp


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                                 nn.Linear(256, 1))
        self.losses: list[float] = []
        self.compression: gradpress.fsdp.FSDPCompressionState | None = None

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2], self.net[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)
        self.compression = gradpress.fsdp.compress(  # gradpress
            self.net, compression="onebit", ef="vanilla", min_compress_bytes=1 << 16)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def data(n: int = 512) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    y = torch.tanh(x[:, :4].sum(dim=1, keepdim=True))
    return DataLoader(TensorDataset(x, y), batch_size=16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", default=None, help="write rank<r>.json here")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Regressor()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=args.epochs, logger=False,
                        strategy=ModelParallelStrategy(data_parallel_size=2,
                                                       tensor_parallel_size=1),
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model, data())
    assert model.compression is not None
    h = hashlib.sha256()
    for p in model.net.parameters():
        h.update(p.full_tensor().detach().contiguous().numpy().tobytes())
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"losses": model.losses, "params_sha256": h.hexdigest(),
                       "stats": model.compression.stats()}, f)


if __name__ == "__main__":
    main()

"""Models and batches of ``benchmarks/cluster.py``: small compute, many parameters.

* ``vgg``: a VGG-style net for 32x32 images: four conv blocks (3-32-64-128-256 channels, each
  conv + ReLU, the first three with a 2x2 max-pool) and VGG's classifier of two 4096-wide fully
  connected layers, 34.0M parameters, 33.6M of them in the two big FC layers. The convolutions
  of a 32x32 batch of 8 cost a few MFLOP: the step is communication-heavy (the VGG16 case).
* ``bert``: a BERT-style encoder: a 30522-token embedding (BERT's WordPiece vocabulary), learned
  positions, ``layers`` post-norm transformer encoder layers (GELU) and a masked-language-model
  head tied to the embedding, evaluated only at the masked positions (15%). 11.1M parameters
  at the default width 256 and 4 layers; the embedding (31 MB of fp32 gradient) dominates.
* ``tfm``: a transformer encoder of many tensors (issue 40): a 1024-token embedding, 12
  post-norm encoder layers of width 384 (6 heads, GELU), a linear head predicting each
  position's next token; 22.1M parameters in 148 tensors, none dominant.
* ``mlp``: a 25M-parameter MLP (1024-4096-4096-1024-10, ReLU): 100 MB of fp32 gradient in 8
  tensors, three of them large.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MODELS", "build_model", "make_batch", "loss_of", "count_parameters"]

MODELS = ("vgg", "bert", "tfm", "mlp")
TFM_VOCAB = 1024
VOCAB = 30522
SEQ_LEN = 64
MASK_FRACTION = 0.15


class VGGStyle(nn.Module):
    """Four conv blocks (32 -> 4 pixels) and a 4096-4096 classifier (input: 3 x 32 x 32)."""

    def __init__(self, classes: int = 10, width: int = 4096) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        chans = (3, 32, 64, 128, 256)
        for i, (cin, cout) in enumerate(zip(chans, chans[1:])):
            layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True)]
            layers += [nn.MaxPool2d(2)] if i < 3 else []  # 32 -> 4
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(256 * 4 * 4, width), nn.ReLU(inplace=True),
            nn.Linear(width, width), nn.ReLU(inplace=True), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class BertStyle(nn.Module):
    """Embedding + positions, post-norm encoder layers, tied MLM head at masked positions."""

    def __init__(self, width: int = 256, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, width)
        self.pos = nn.Embedding(SEQ_LEN, width)
        self.norm = nn.LayerNorm(width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, width)
        self.bias = nn.Parameter(torch.zeros(VOCAB))

    def forward(self, ids: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        h = self.encoder(self.norm(self.tok(ids) + self.pos(pos)))
        h = torch.nn.functional.gelu(self.head(h[:, masked]))
        return h @ self.tok.weight.t() + self.bias  # tied decoder, masked positions only


class ManyTensors(nn.Module):
    """Token embedding + positions, 12 post-norm encoder layers, next-token head."""

    def __init__(self, width: int = 384, layers: int = 12, heads: int = 6) -> None:
        super().__init__()
        self.tok = nn.Embedding(TFM_VOCAB, width)
        self.pos = nn.Embedding(SEQ_LEN, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                           activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, TFM_VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        return self.head(self.encoder(self.tok(ids) + self.pos(pos)))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 1024), nn.ReLU(), nn.Linear(1024, 10))


def build_model(name: str) -> nn.Module:
    """The model called ``name`` (one of :data:`MODELS`), seeded so all ranks agree."""
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {name!r}")
    torch.manual_seed(0)
    return {"vgg": VGGStyle, "bert": BertStyle, "tfm": ManyTensors, "mlp": _mlp}[name]()


def make_batch(name: str, batch: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A random batch for model ``name`` (different per ``seed``, i.e. per rank)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    g = torch.Generator().manual_seed(seed)
    if name == "vgg":
        return torch.randn(batch, 3, 32, 32, generator=g), torch.randint(10, (batch,), generator=g)
    if name == "mlp":
        return torch.randn(batch, 1024, generator=g), torch.randint(10, (batch,), generator=g)
    if name == "tfm":
        return (torch.randint(TFM_VOCAB, (batch, SEQ_LEN + 1), generator=g),)
    ids = torch.randint(VOCAB, (batch, SEQ_LEN), generator=g)
    masked = torch.randperm(SEQ_LEN, generator=g)[: max(1, int(MASK_FRACTION * SEQ_LEN))]
    return ids, masked, ids[:, masked]


def loss_of(model: nn.Module, name: str, data: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross-entropy of ``model`` on a batch from :func:`make_batch`."""
    if name in ("vgg", "mlp"):
        x, y = data
        return nn.functional.cross_entropy(model(x), y)
    if name == "tfm":
        (ids,) = data
        logits = model(ids[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, TFM_VOCAB), ids[:, 1:].reshape(-1))
    ids, masked, target = data
    logits = model(ids, masked)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

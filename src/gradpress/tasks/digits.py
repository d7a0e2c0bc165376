"""``digits-cnn``: a small residual CNN on scikit-learn's bundled 8x8 handwritten digits.

Data: ``sklearn.datasets.load_digits`` (1797 images, 10 classes, shipped with scikit-learn, no
network). A fixed stratified 80/20 split (``random_state=0``) gives 1437 training and 360 test
images. Pixels (0..16) are scaled to [0, 1] and standardised with the training set's mean and
standard deviation.

Model: a ResNet-style network (He et al. 2016, "Deep Residual Learning for Image Recognition")
with GroupNorm (Wu & He 2018) instead of BatchNorm. GroupNorm has no running statistics, so the
replicas of a data-parallel run stay identical (BatchNorm's running mean/variance would differ
per worker, since each sees a different shard). Layout::

    stem   conv3x3 1->32, GN, ReLU                     8x8
    stage1 residual block (two conv3x3 32->32)         8x8
    down   conv3x3 32->64 stride 2, GN, ReLU           4x4
    stage2 residual block (two conv3x3 64->64)         4x4
    head   flatten 64*4*4 -> linear 10

The 64->64 convolutions (147 KB each) and the 32->64 convolution (74 KB) are large enough to be
compressed with a 64 KB threshold; the head is 40 KB.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .base import Batch, EvalResult, Task, TaskDefaults, model_device, shard_batches

__all__ = ["DigitsTask", "DigitsResNet", "load_digits_split"]

_SPLIT_SEED = 0
_TEST_FRACTION = 0.2


@functools.lru_cache(maxsize=1)
def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed split ``(x_train, y_train, x_test, y_test)``; x is float32 (N, 1, 8, 8).

    Steps:
      1. Load the 1797 images and scale pixels to [0, 1].
      2. Stratified 80/20 split with a fixed ``random_state``.
      3. Standardise both parts with the training set's mean and standard deviation.
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:  # pragma: no cover - scikit-learn is a demo dependency
        raise ImportError("task 'digits-cnn' needs scikit-learn (pip install "
                          "'gradpress[demo]')") from exc
    # 1. load and scale
    data = load_digits()
    x = (data.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = data.target.astype(np.int64)
    # 2. fixed stratified split
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=_TEST_FRACTION, random_state=_SPLIT_SEED, stratify=y)
    # 3. standardise with training statistics
    mean, std = float(x_tr.mean()), float(x_tr.std())
    x_tr, x_te = (x_tr - mean) / std, (x_te - mean) / std
    tensors = (torch.from_numpy(x_tr), torch.from_numpy(y_tr),
               torch.from_numpy(x_te), torch.from_numpy(y_te))
    for t in tensors:
        t.requires_grad_(False)
    return tensors


def _conv_gn(c_in: int, c_out: int, stride: int = 1, groups: int = 8) -> nn.Sequential:
    """conv3x3 (no bias) followed by GroupNorm."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.GroupNorm(groups, c_out))


class _ResidualBlock(nn.Module):
    """Basic ResNet block: relu(x + GN(conv(relu(GN(conv(x))))))."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.a = _conv_gn(channels, channels)
        self.b = _conv_gn(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b(F.relu(self.a(x))))


class DigitsResNet(nn.Module):
    """Residual CNN for 1x8x8 inputs; returns logits of shape (N, num_classes)."""

    def __init__(self, width: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        if width < 8 or width % 8:
            raise ValueError(f"width must be a positive multiple of 8, got {width}")
        self.stem = _conv_gn(1, width)
        self.stage1 = _ResidualBlock(width)
        self.down = _conv_gn(width, 2 * width, stride=2)
        self.stage2 = _ResidualBlock(2 * width)
        self.head = nn.Linear(2 * width * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or tuple(x.shape[1:]) != (1, 8, 8):
            raise ValueError(f"DigitsResNet expects input of shape (N, 1, 8, 8), "
                             f"got {tuple(x.shape)}")
        x = F.relu(self.stem(x))
        x = self.stage1(x)
        x = F.relu(self.down(x))
        x = self.stage2(x)
        return self.head(x.flatten(1))


class DigitsTask(Task):
    """``digits-cnn``: classify 8x8 digits with :class:`DigitsResNet`.

    Args:
        width: channels of the first stage (the second has twice as many).
        eval_batch_size: batch size of :meth:`evaluate`.
    """

    name = "digits-cnn"
    description = ("scikit-learn digits (1437 train / 360 test 8x8 images), "
                   "residual CNN with GroupNorm, ~121k parameters")
    # Learning rates tuned per optimizer family with a cosine schedule over 8 epochs, one
    # worker (see docs/results.md).
    defaults = TaskDefaults(
        batch_size=32, epochs=8,
        lr={"adam": 1e-3, "sgd": 3e-3, "lans": 2e-3, "lamb": 5e-3},
        momentum=0.9, weight_decay=0.0)

    def __init__(self, width: int = 32, eval_batch_size: int = 512) -> None:
        if eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be >= 1, got {eval_batch_size}")
        self.width = width
        self.eval_batch_size = eval_batch_size
        self.x_train, self.y_train, self.x_test, self.y_test = load_digits_split()

    @property
    def num_train_examples(self) -> int:
        return int(self.y_train.numel())

    def build_model(self, seed: int) -> nn.Module:
        """A :class:`DigitsResNet` initialised under a forked RNG seeded by ``seed``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return DigitsResNet(self.width)

    def train_batches(self, rank: int, world_size: int, batch_size: int, seed: int,
                      epoch: int) -> Iterator[Batch]:
        """Batches ``(x, y)``: x float32 (B, 1, 8, 8), y int64 (B,)."""
        for idx in shard_batches(self.num_train_examples, rank, world_size, batch_size,
                                 seed, epoch):
            yield self.x_train[idx], self.y_train[idx]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean cross-entropy of the logits against the labels."""
        x, y = _unpack(batch)
        device = model_device(model)
        return F.cross_entropy(model(x.to(device)), y.to(device))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> EvalResult:
        """Test accuracy (primary) and mean test cross-entropy over the 360 test images."""
        was_training = model.training
        model.eval()
        device = model_device(model)
        total_loss, correct = 0.0, 0
        try:
            for start in range(0, self.y_test.numel(), self.eval_batch_size):
                x = self.x_test[start:start + self.eval_batch_size].to(device)
                y = self.y_test[start:start + self.eval_batch_size].to(device)
                logits = model(x)
                total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(dim=1) == y).sum())
        finally:
            model.train(was_training)
        n = int(self.y_test.numel())
        return EvalResult({"test_accuracy": correct / n, "test_loss": total_loss / n},
                          primary="test_accuracy", higher_is_better=True, num_examples=n)


def _unpack(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Check that ``batch`` is ``(x, y)`` and return it."""
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(f"digits-cnn batch must be a pair (images, labels), got "
                         f"{type(batch).__name__}")
    return batch[0], batch[1]

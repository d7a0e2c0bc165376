"""``stdlib-mlm``: a small BERT-style masked language model on the Python standard library.

Corpus: the ``*.py`` files directly in ``sysconfig.get_paths()["stdlib"]`` (no sub-packages),
read in sorted order until ``max_bytes`` are collected. It ships with every Python, so no network
and no cache is needed; it is built in memory in well under a second. The exact bytes depend on
the Python version, so numbers differ slightly between interpreters (never between runs).

Steps of data preparation:
  1. Split by file: a file goes to validation when ``crc32(name) % 10 == 0`` (about one in ten),
     which keeps the split stable when files are added to or removed from the stdlib.
  2. Tokenize byte-level: ids 0..255 are bytes, then [PAD]=256, [MASK]=257, [CLS]=258.
  3. Join each part's files with a newline and cut the stream into non-overlapping sequences of
     ``seq_len - 1`` bytes; prepend [CLS]. (All sequences are full, so [PAD] is never used.)
  4. Mask as BERT does (Devlin et al. 2019, "BERT: Pre-training of Deep Bidirectional
     Transformers for Language Understanding", section 3.1): choose ``round(0.15*(seq_len-1))``
     positions per sequence (never [CLS]); replace 8 in 10 of them by [MASK], 1 in 10 by a random
     byte, keep 1 in 10; the loss is the cross-entropy at the chosen positions only.
  5. Validation uses a fixed subset of validation sequences with masks drawn once from a fixed
     seed, so every evaluation sees the same inputs and targets.

Model: token + learned positional embeddings, a pre-LayerNorm ``nn.TransformerEncoder``, BERT's
MLM head (dense, GELU, LayerNorm) and an untied output layer (measured slightly better than tied
here, and every parameter then has a single use). Weights are initialised as BERT does (normal,
std 0.02), each layer separately (``nn.TransformerEncoder`` clones one layer).
"""

from __future__ import annotations

import functools
import math
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._lm import evaluate_tokens, normal_init
from .base import (
    Batch,
    EvalResult,
    Task,
    TaskDefaults,
    derive_seed,
    model_device,
    shard_batches,
)

__all__ = ["StdlibMLMTask", "MLMTransformer", "StdlibCorpus", "load_stdlib_corpus", "bert_mask",
           "PAD", "MASK", "CLS", "VOCAB_SIZE", "IGNORE_INDEX"]

PAD, MASK, CLS = 256, 257, 258
VOCAB_SIZE = 259
#: Label of positions that are not predicted (``F.cross_entropy``'s default ignore_index).
IGNORE_INDEX = -100
_VAL_MODULUS = 10
_VAL_MASK_SEED = 20210101


@dataclass(frozen=True)
class StdlibCorpus:
    """The byte streams of the training and validation files and the files they came from."""

    train: bytes
    validation: bytes
    train_files: tuple[str, ...]
    validation_files: tuple[str, ...]


@functools.lru_cache(maxsize=4)
def load_stdlib_corpus(max_bytes: int = 3 << 20, stdlib_dir: str | None = None) -> StdlibCorpus:
    """Read the stdlib's top-level ``*.py`` files in sorted order (up to ``max_bytes``) and split
    them by file (data preparation step 1)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    names: dict[bool, list[str]] = {True: [], False: []}
    total = 0
    for path in sorted(root.glob("*.py")):
        if total >= max_bytes:
            break
        try:
            data = path.read_bytes()
        except OSError:
            continue
        data = data[:max_bytes - total]
        total += len(data)
        is_val = zlib.crc32(path.name.encode()) % _VAL_MODULUS == 0
        parts[is_val].append(data)
        names[is_val].append(path.name)
    if not parts[True] or not parts[False]:
        raise ValueError(f"stdlib corpus from {root} with max_bytes={max_bytes} has "
                         f"{len(names[False])} training and {len(names[True])} validation "
                         f"files; expected at least one of each")
    return StdlibCorpus(b"\n".join(parts[False]), b"\n".join(parts[True]),
                        tuple(names[False]), tuple(names[True]))


def to_sequences(stream: bytes, seq_len: int) -> torch.Tensor:
    """Data preparation steps 2-3: int64 (N, seq_len) sequences, [CLS] then seq_len-1 bytes."""
    body = seq_len - 1
    n = len(stream) // body
    if n == 0:
        raise ValueError(f"a stream of {len(stream)} bytes holds no sequence of length {seq_len}")
    ids = np.frombuffer(stream, dtype=np.uint8, count=n * body).reshape(n, body)
    out = torch.empty((n, seq_len), dtype=torch.int64)
    out[:, 0] = CLS
    out[:, 1:] = torch.from_numpy(ids.astype(np.int64))
    return out


def bert_mask(ids: torch.Tensor, generator: torch.Generator,
              mask_prob: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """Data preparation step 4: ``(inputs, labels)`` for int64 ``ids`` (B, L) with [CLS] at 0.

    Labels are the original ids at the chosen positions and ``IGNORE_INDEX`` elsewhere.
    """
    if not 0.0 < mask_prob < 1.0:
        raise ValueError(f"mask_prob must be in (0, 1), got {mask_prob}")
    b, length = ids.shape
    m = max(1, round(mask_prob * (length - 1)))
    # 4a. exactly m positions per row among 1..L-1 (the argsort of uniform scores)
    scores = torch.rand((b, length - 1), generator=generator)
    pos = scores.argsort(dim=1)[:, :m] + 1
    chosen = torch.zeros_like(ids, dtype=torch.bool).scatter_(1, pos, True)
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    # 4b. 8 in 10 [MASK], 1 in 10 random byte, 1 in 10 unchanged
    u = torch.rand(ids.shape, generator=generator)
    random_bytes = torch.randint(0, 256, ids.shape, generator=generator)
    inputs = torch.where(chosen & (u < 0.8), torch.full_like(ids, MASK), ids)
    inputs = torch.where(chosen & (u >= 0.8) & (u < 0.9), random_bytes, inputs)
    return inputs, labels


class MLMTransformer(nn.Module):
    """BERT-style encoder with an MLM output layer.

    ``forward(ids)`` returns logits (B, L, vocab); ``forward(ids, select)`` with a boolean
    (B, L) mask returns logits (n_selected, vocab) for the selected positions only (cheaper).
    """

    def __init__(self, vocab_size: int = VOCAB_SIZE, seq_len: int = 128, d_model: int = 128,
                 n_layers: int = 2, n_heads: int = 4, d_ff: int = 256,
                 dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.emb_norm = nn.LayerNorm(d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, norm=nn.LayerNorm(d_model),
                                             enable_nested_tensor=False)
        self.head = nn.Sequential(nn.Linear(d_model, d_model), nn.GELU(), nn.LayerNorm(d_model))
        self.out = nn.Linear(d_model, vocab_size)
        self.apply(normal_init)

    def forward(self, ids: torch.Tensor, select: torch.Tensor | None = None) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] > self.seq_len:
            raise ValueError(f"MLMTransformer expects ids of shape (B, L<={self.seq_len}), "
                             f"got {tuple(ids.shape)}")
        positions = torch.arange(ids.shape[1], device=ids.device)
        h = self.emb_norm(self.tok(ids) + self.pos(positions))
        h = self.encoder(h)
        if select is not None:
            h = h[select]
        return self.out(self.head(h))


class StdlibMLMTask(Task):
    """``stdlib-mlm``: masked byte prediction on Python stdlib source with :class:`MLMTransformer`.

    Args:
        seq_len, d_model, n_layers, n_heads, d_ff, dropout: model and sequence shape.
        max_bytes: size of the corpus read from the stdlib (train + validation).
        num_val_sequences: size of the fixed validation set (evenly spaced over the stream).
        mask_prob: fraction of positions predicted per sequence.
        eval_batch_size: batch size of :meth:`evaluate`.
    """

    name = "stdlib-mlm"
    description = ("byte-level BERT-style masked LM on the Python stdlib's own source "
                   "(~3 MB, split by file), 2-layer d=128 transformer, ~0.37M parameters")
    # Learning rates tuned per optimizer family over 300 steps (30 warm-up, cosine, one
    # worker; see docs/results.md).
    defaults = TaskDefaults(
        batch_size=32, epochs=4, max_steps=300,
        lr={"adam": 2e-3, "sgd": 0.3, "lans": 1e-2, "lamb": 1e-2},
        momentum=0.9, weight_decay=0.0, warmup_steps=30)

    def __init__(self, seq_len: int = 128, d_model: int = 128, n_layers: int = 2,
                 n_heads: int = 4, d_ff: int = 256, dropout: float = 0.0,
                 max_bytes: int = 3 << 20,
                 num_val_sequences: int = 256, mask_prob: float = 0.15,
                 eval_batch_size: int = 128) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        if num_val_sequences < 1 or eval_batch_size < 1:
            raise ValueError(f"num_val_sequences and eval_batch_size must be >= 1, got "
                             f"{num_val_sequences} and {eval_batch_size}")
        self.model_kwargs: dict[str, Any] = dict(
            seq_len=seq_len, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_ff=d_ff,
            dropout=dropout)
        self.mask_prob = mask_prob
        self.eval_batch_size = eval_batch_size
        corpus = load_stdlib_corpus(max_bytes)
        self.train_sequences = to_sequences(corpus.train, seq_len)
        val = to_sequences(corpus.validation, seq_len)
        keep = torch.linspace(0, len(val) - 1, min(num_val_sequences, len(val))).round().long()
        gen = torch.Generator().manual_seed(_VAL_MASK_SEED)
        self.val_inputs, self.val_labels = bert_mask(val[keep], gen, mask_prob)
        self.uniform_loss = math.log(VOCAB_SIZE)
        self.unigram_loss = self._unigram_loss()

    def _unigram_loss(self) -> float:
        """Validation loss of the best context-free model (training byte frequencies)."""
        counts = torch.bincount(self.train_sequences[:, 1:].reshape(-1), minlength=VOCAB_SIZE)
        logp = torch.log((counts.double() + 1.0) / (counts.sum() + VOCAB_SIZE))
        targets = self.val_labels[self.val_labels != IGNORE_INDEX]
        return float(-logp[targets].mean())

    @property
    def num_train_examples(self) -> int:
        return int(self.train_sequences.shape[0])

    def build_model(self, seed: int) -> nn.Module:
        """An :class:`MLMTransformer` initialised under a forked RNG seeded by ``seed``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return MLMTransformer(**self.model_kwargs)

    def train_batches(self, rank: int, world_size: int, batch_size: int, seed: int,
                      epoch: int) -> Iterator[Batch]:
        """Batches ``(inputs, labels)``, int64 (B, seq_len); masks seeded by (seed, epoch, rank)."""
        gen = torch.Generator().manual_seed(derive_seed(seed, epoch, rank, "mask"))
        for idx in shard_batches(self.num_train_examples, rank, world_size, batch_size,
                                 seed, epoch):
            yield bert_mask(self.train_sequences[idx], gen, self.mask_prob)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean cross-entropy over the masked positions of the batch."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"stdlib-mlm batch must be a pair (inputs, labels), got "
                             f"{type(batch).__name__}")
        device = model_device(model)
        inputs, labels = batch[0].to(device), batch[1].to(device)
        select = labels != IGNORE_INDEX
        return F.cross_entropy(model(inputs, select), labels[select])

    def evaluate(self, model: nn.Module) -> EvalResult:
        """Validation loss (primary), masked-token accuracy and perplexity on the fixed set."""
        def masked(start: int, stop: int, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
            inputs = self.val_inputs[start:stop].to(device)
            labels = self.val_labels[start:stop].to(device)
            select = labels != IGNORE_INDEX
            return model(inputs, select), labels[select]

        return evaluate_tokens(model, len(self.val_inputs), self.eval_batch_size, masked)

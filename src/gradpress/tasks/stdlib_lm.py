"""``stdlib-lm``: a small GPT-style causal (next-byte) language model on Python's documentation.

Corpus: ``pydoc_data/topics.py`` under ``sysconfig.get_paths()["stdlib"]``, the English text of
``help("topic")`` that ships with every CPython (about 80 topics, about 0.5 MB of prose). No
network and no cache is needed. The file is Python source whose string literals hold the text, so
it is parsed with :func:`ast.literal_eval` (never imported or executed); training on its raw bytes
would spend a large share of the bytes on the generated quotes and indentation. The exact text
depends on the Python version, so numbers differ slightly between interpreters (never between
runs).

Steps of data preparation:
  1. Split by topic: a topic goes to validation when ``crc32(name) % 10 == 0`` (about a tenth of
     the bytes), which keeps the split stable when topics are added or removed between versions and
     never cuts a topic in two.
  2. Tokenize byte-level: each topic's text is encoded as UTF-8; ids 0..255 are bytes, [BOS]=256.
  3. Join each part's topics in the file's order with a blank line and cut the stream into
     non-overlapping sequences of ``seq_len`` bytes (the incomplete tail is dropped); prepend
     [BOS]. A sequence is ``seq_len + 1`` ids: the inputs are the first ``seq_len``, the targets
     the last ``seq_len``, so every byte is predicted once, the first from [BOS] alone.
  4. The loss is the mean next-byte cross-entropy over all ``seq_len`` positions.
  5. Validation uses a fixed subset of validation sequences, evenly spaced over the stream, so
     every evaluation sees the same inputs and targets.

Model: token + learned positional embeddings, then a pre-LayerNorm ``nn.TransformerEncoder``
run with a causal mask (position ``i`` attends to positions ``<= i``; the decoder-only stack of
GPT, which has no cross-attention, is exactly an encoder stack with that mask), a final
LayerNorm and an untied output layer (every parameter then has a single use, as in
``stdlib-mlm``). Weights are initialised as GPT-2 does (Radford et al. 2019, "Language Models are
Unsupervised Multitask Learners", section 2.3): normal with std 0.02, biases zero, and the two
projections that write into the residual stream of each layer (attention output and second
feed-forward layer) scaled by ``1/sqrt(2 * n_layers)``; each layer separately
(``nn.TransformerEncoder`` clones one layer).
"""

from __future__ import annotations

import ast
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
    model_device,
    shard_batches,
)

__all__ = ["StdlibLMTask", "CausalTransformer", "TopicsCorpus", "load_topics_corpus",
           "to_causal_sequences", "BOS", "VOCAB_SIZE", "TOPICS_FILE"]

BOS = 256
VOCAB_SIZE = 257
#: The corpus file, relative to the stdlib directory.
TOPICS_FILE = Path("pydoc_data") / "topics.py"
_VAL_MODULUS = 10
_TOPIC_SEPARATOR = b"\n\n"


@dataclass(frozen=True)
class TopicsCorpus:
    """The byte streams of the training and validation topics and the topics they came from."""

    train: bytes
    validation: bytes
    train_topics: tuple[str, ...]
    validation_topics: tuple[str, ...]


def _read_topics(path: Path) -> dict[str, str]:
    """The ``topics`` dict literal of ``pydoc_data/topics.py``, parsed without executing it."""
    try:
        source = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"stdlib-lm corpus file {path} does not exist; expected "
                                f"CPython's pydoc_data/topics.py (the text of help('topic')) "
                                f"in the stdlib directory") from None
    try:
        tree = ast.parse(source, filename=str(path))
        value = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                     and any(isinstance(t, ast.Name) and t.id == "topics"
                             for t in node.targets))
        topics = ast.literal_eval(value)
    except (SyntaxError, ValueError, StopIteration) as e:
        raise ValueError(f"stdlib-lm corpus file {path} holds no literal 'topics = {{...}}' "
                         f"assignment ({type(e).__name__}); expected CPython's "
                         f"pydoc_data/topics.py") from None
    if not isinstance(topics, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                               for k, v in topics.items()):
        raise ValueError(f"stdlib-lm corpus file {path}: 'topics' is a "
                         f"{type(topics).__name__}; expected a dict of str -> str")
    return topics


@functools.lru_cache(maxsize=4)
def load_topics_corpus(stdlib_dir: str | None = None) -> TopicsCorpus:
    """Read the pydoc topics under ``stdlib_dir`` (the running Python's stdlib by default) and
    split them by topic (data preparation steps 1-2 and the join of step 3)."""
    path = Path(stdlib_dir or sysconfig.get_paths()["stdlib"]) / TOPICS_FILE
    parts: dict[bool, list[bytes]] = {True: [], False: []}
    names: dict[bool, list[str]] = {True: [], False: []}
    for name, text in _read_topics(path).items():
        is_val = zlib.crc32(name.encode()) % _VAL_MODULUS == 0
        parts[is_val].append(text.encode("utf-8"))
        names[is_val].append(name)
    if not parts[True] or not parts[False]:
        raise ValueError(f"stdlib-lm corpus {path} has {len(names[False])} training and "
                         f"{len(names[True])} validation topics; expected at least one of each")
    return TopicsCorpus(_TOPIC_SEPARATOR.join(parts[False]), _TOPIC_SEPARATOR.join(parts[True]),
                        tuple(names[False]), tuple(names[True]))


def to_causal_sequences(stream: bytes, seq_len: int) -> torch.Tensor:
    """Data preparation step 3: int64 (N, seq_len + 1) sequences, [BOS] then seq_len bytes."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"a stream of {len(stream)} bytes holds no sequence of {seq_len} bytes")
    ids = np.frombuffer(stream, dtype=np.uint8, count=n * seq_len).reshape(n, seq_len)
    out = torch.empty((n, seq_len + 1), dtype=torch.int64)
    out[:, 0] = BOS
    out[:, 1:] = torch.from_numpy(ids.astype(np.int64))
    return out


class CausalTransformer(nn.Module):
    """GPT-style decoder-only transformer: ``forward(ids)`` returns logits (B, L, vocab) where
    the logits at position ``i`` depend on ``ids[:, :i+1]`` only. ``norm_first=False`` gives
    post-LayerNorm layers (BERT's and ``nn.TransformerEncoderLayer``'s default layout)."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, seq_len: int = 64, d_model: int = 128,
                 n_layers: int = 4, n_heads: int = 4, d_ff: int = 256,
                 dropout: float = 0.0, norm_first: bool = True,
                 activation: str = "gelu") -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        self.seq_len = seq_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout,
                                           activation=activation, batch_first=True,
                                           norm_first=norm_first)
        # pre-LN (GPT-2) ends in a LayerNorm of its own; post-LN (BERT) layers already end in one
        final = nn.LayerNorm(d_model) if norm_first else None
        self.decoder = nn.TransformerEncoder(layer, n_layers, norm=final,
                                             enable_nested_tensor=False)
        self.out = nn.Linear(d_model, vocab_size)
        self.apply(normal_init)
        residual_std = 0.02 / math.sqrt(2 * n_layers)
        for block in self.decoder.layers:
            nn.init.normal_(block.self_attn.out_proj.weight, std=residual_std)
            nn.init.normal_(block.linear2.weight, std=residual_std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or not 1 <= ids.shape[1] <= self.seq_len:
            raise ValueError(f"CausalTransformer expects ids of shape (B, 1<=L<={self.seq_len}), "
                             f"got {tuple(ids.shape)}")
        length = ids.shape[1]
        positions = torch.arange(length, device=ids.device)
        h = self.tok(ids) + self.pos(positions)
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device,
                                                              dtype=h.dtype)
        h = self.decoder(h, mask=mask, is_causal=True)
        return self.out(h)


def check_sizes(seq_len: int, num_val_sequences: int, eval_batch_size: int) -> None:
    """ValueError unless ``seq_len >= 2`` and the validation sizes are >= 1."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    if num_val_sequences < 1 or eval_batch_size < 1:
        raise ValueError(f"num_val_sequences and eval_batch_size must be >= 1, got "
                         f"{num_val_sequences} and {eval_batch_size}")


class StdlibLMTask(Task):
    """``stdlib-lm``: next-byte prediction on Python's documentation with
    :class:`CausalTransformer`.

    Args:
        seq_len, d_model, n_layers, n_heads, d_ff, dropout: model and sequence shape.
        num_val_sequences: size of the fixed validation set (evenly spaced over the stream).
        eval_batch_size: batch size of :meth:`evaluate`.
    """

    name = "stdlib-lm"
    description = ("byte-level GPT-style causal LM on the Python documentation that ships with "
                   "CPython (pydoc topics, ~0.5 MB, split by topic), 4-layer d=128 transformer, "
                   "~0.6M parameters")
    # Not tuned for this task: the learning rates are stdlib-mlm's, taken as they are. Enough
    # epochs that max_steps ends a default run on up to 4 workers.
    defaults = TaskDefaults(
        batch_size=32, epochs=8, max_steps=300,
        lr={"adam": 2e-3, "sgd": 0.3, "lans": 1e-2, "lamb": 1e-2},
        momentum=0.9, weight_decay=0.0, warmup_steps=30)

    def __init__(self, seq_len: int = 64, d_model: int = 128, n_layers: int = 4,
                 n_heads: int = 4, d_ff: int = 256, dropout: float = 0.0,
                 num_val_sequences: int = 256, eval_batch_size: int = 128) -> None:
        check_sizes(seq_len, num_val_sequences, eval_batch_size)
        self.model_kwargs: dict[str, Any] = dict(
            seq_len=seq_len, d_model=d_model, n_layers=n_layers, n_heads=n_heads, d_ff=d_ff,
            dropout=dropout)
        corpus = load_topics_corpus()
        self._set_sequences(to_causal_sequences(corpus.train, seq_len),
                            to_causal_sequences(corpus.validation, seq_len),
                            num_val_sequences, eval_batch_size)
        self.uniform_loss = math.log(VOCAB_SIZE)
        self.unigram_loss = self._unigram_loss()

    def _set_sequences(self, train: torch.Tensor, val: torch.Tensor, num_val_sequences: int,
                       eval_batch_size: int) -> None:
        """Both parts' sequences; validation keeps a fixed subset, evenly spaced (step 5)."""
        self.eval_batch_size = eval_batch_size
        self.train_sequences = train
        keep = torch.linspace(0, len(val) - 1, min(num_val_sequences, len(val))).round().long()
        self.val_sequences = val[keep]

    def _unigram_loss(self) -> float:
        """Validation loss of the best context-free model (training byte frequencies)."""
        counts = torch.bincount(self.train_sequences[:, 1:].reshape(-1), minlength=VOCAB_SIZE)
        logp = torch.log((counts.double() + 1.0) / (counts.sum() + VOCAB_SIZE))
        return float(-logp[self.val_sequences[:, 1:]].mean())

    @property
    def num_train_examples(self) -> int:
        return int(self.train_sequences.shape[0])

    def build_model(self, seed: int) -> nn.Module:
        """A :class:`CausalTransformer` initialised under a forked RNG seeded by ``seed``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return CausalTransformer(**self.model_kwargs)

    def train_batches(self, rank: int, world_size: int, batch_size: int, seed: int,
                      epoch: int) -> Iterator[Batch]:
        """Batches ``(inputs, targets)``, int64 (B, seq_len): a sequence and its shift by one."""
        for idx in shard_batches(self.num_train_examples, rank, world_size, batch_size,
                                 seed, epoch):
            seqs = self.train_sequences[idx]
            yield seqs[:, :-1], seqs[:, 1:]

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Mean next-byte cross-entropy over every position of the batch."""
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"{self.name} batch must be a pair (inputs, targets), got "
                             f"{type(batch).__name__}")
        device = model_device(model)
        inputs, targets = batch[0].to(device), batch[1].to(device)
        if inputs.shape != targets.shape:
            raise ValueError(f"{self.name} inputs and targets must have the same shape, got "
                             f"{tuple(inputs.shape)} and {tuple(targets.shape)}")
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(self, model: nn.Module) -> EvalResult:
        """Validation loss (primary), next-byte accuracy and perplexity on the fixed set."""
        def next_bytes(start: int, stop: int, device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor]:
            seqs = self.val_sequences[start:stop].to(device)
            logits = model(seqs[:, :-1])
            return logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1)

        return evaluate_tokens(model, len(self.val_sequences), self.eval_batch_size, next_bytes)

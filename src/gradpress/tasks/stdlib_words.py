"""``stdlib-words``: a word-level, post-LayerNorm causal language model, long-tailed vocabulary.

A task that nobody tuned gradpress's defaults on: BERT's post-LN layer layout
(``nn.TransformerEncoderLayer`` with its own defaults: post-LN, ReLU, dropout 0.1), a real
word-level vocabulary of thousands of entries whose rows are mostly idle on any given step, some
rows that never occur in the training text at all, and validation on held-out modules. Its set-up
is frozen: change nothing here to make a method look better.

Corpus: the docstrings of the top-level modules of the running Python's standard library
(``Lib/*.py``, about 170 files, 0.23M words), read with :mod:`ast` (never imported or executed).
The exact text depends on the Python version, so numbers differ slightly between interpreters
(never between runs).

Steps of data preparation:
  1. Split by module: a module goes to validation when ``crc32(file name) % 10 == 0`` (about
     a tenth of the words).
  2. Tokenize: runs of letters, runs of digits, newlines and single other symbols
     (:data:`TOKEN_RE`); spaces are dropped.
  3. Vocabulary, as a tokenizer trained on the whole corpus would give it: every token that
     occurs at least twice in training and validation text together, most frequent first
     (ties by the token), after [BOS] and [UNK]. So the table holds rows of tokens that occur in
     validation text only: their embedding rows get no gradient from any training batch.
  4. Each part's modules are joined in file-name order with a blank line, cut into
     non-overlapping sequences of ``seq_len`` tokens, [BOS] prepended; the loss is the mean
     next-token cross-entropy over all positions.
  5. Validation uses a fixed subset of validation sequences, evenly spaced over the stream.

Model: :class:`~gradpress.tasks.stdlib_lm.CausalTransformer` with ``norm_first=False`` (no final
LayerNorm: a post-LN layer already ends in one), ReLU, dropout 0.1, d=128, 4 layers, an untied
output layer; the token embedding is about a third of the parameters.
"""

from __future__ import annotations

import ast
import functools
import math
import re
import sysconfig
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from .base import TaskDefaults
from .stdlib_lm import StdlibLMTask, check_sizes

__all__ = ["StdlibWordsTask", "WordsCorpus", "load_words_corpus", "TOKEN_RE", "BOS", "UNK"]

BOS, UNK = 0, 1
#: Step 2's tokens: letters, digits, a newline, or one other non-space symbol.
TOKEN_RE = re.compile(r"[A-Za-z]+|[0-9]+|\n|[^\sA-Za-z0-9]")
_VAL_MODULUS = 10
_MIN_COUNT = 2
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class WordsCorpus:
    """Token ids of both parts, the vocabulary, and the ids absent from the training part."""

    train: torch.Tensor
    validation: torch.Tensor
    vocab: tuple[str, ...]
    unseen_in_training: torch.Tensor  # ids (>= 2) that occur in validation text only


def _docstrings(path: Path) -> str:
    """The docstrings of one module (module, classes, functions), joined by blank lines."""
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return ""  # a file this interpreter cannot parse is left out, deterministically
    docs = (ast.get_docstring(n) for n in ast.walk(tree) if isinstance(n, _DOC_NODES))
    return "\n\n".join(d for d in docs if d)


@functools.lru_cache(maxsize=2)
def load_words_corpus(stdlib_dir: str | None = None) -> WordsCorpus:
    """Data preparation steps 1-3 on the stdlib under ``stdlib_dir`` (the running one's)."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    parts: dict[bool, list[str]] = {True: [], False: []}
    for path in sorted(root.glob("*.py")):
        tokens = TOKEN_RE.findall(_docstrings(path))
        if tokens:
            is_val = zlib.crc32(path.name.encode()) % _VAL_MODULUS == 0
            parts[is_val].extend(tokens + ["\n", "\n"])
    if not parts[True] or not parts[False]:
        raise ValueError(f"stdlib-words corpus under {root}: {len(parts[False])} training and "
                         f"{len(parts[True])} validation tokens; expected some of each (the "
                         f"top-level modules of CPython's Lib directory)")
    counts = Counter(parts[False]) + Counter(parts[True])
    words = sorted((w for w, c in counts.items() if c >= _MIN_COUNT),
                   key=lambda w: (-counts[w], w))
    vocab = ("[BOS]", "[UNK]", *words)
    index = {w: i for i, w in enumerate(vocab)}
    ids = {k: torch.tensor([index.get(w, UNK) for w in v], dtype=torch.int64)
           for k, v in parts.items()}
    seen = torch.zeros(len(vocab), dtype=torch.bool)
    seen[ids[False]] = True
    seen[:2] = True
    return WordsCorpus(ids[False], ids[True], vocab, torch.nonzero(~seen).flatten())


def _sequences(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Step 4: int64 (N, seq_len + 1), [BOS] then ``seq_len`` tokens."""
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"a stream of {len(stream)} tokens holds no sequence of {seq_len}")
    out = torch.full((n, seq_len + 1), BOS, dtype=torch.int64)
    out[:, 1:] = stream[:n * seq_len].view(n, seq_len)
    return out


class StdlibWordsTask(StdlibLMTask):
    """``stdlib-words``: next-word prediction on the stdlib's docstrings, post-LN transformer
    (batches, loss, model building and evaluation are :class:`StdlibLMTask`'s).

    Args:
        seq_len, d_model, n_layers, n_heads, d_ff, dropout: model and sequence shape.
        num_val_sequences: size of the fixed validation set (evenly spaced over the stream).
        eval_batch_size: batch size of :meth:`evaluate`.
    """

    name = "stdlib-words"
    description = ("word-level causal LM on the docstrings of CPython's top-level stdlib "
                   "modules (vocabulary of ~5.4k words, some never in training), 4-layer "
                   "post-LN d=128 transformer, ~2.2M parameters")
    # Frozen when written: stdlib-lm's rates, not tuned here; no warm-up (a constant lr).
    defaults = TaskDefaults(
        batch_size=16, epochs=100, max_steps=1000,
        lr={"adam": 2e-3, "sgd": 0.3, "lans": 1e-2, "lamb": 1e-2},
        momentum=0.9, weight_decay=0.01, warmup_steps=0)

    def __init__(self, seq_len: int = 32, d_model: int = 128, n_layers: int = 4,
                 n_heads: int = 4, d_ff: int = 512, dropout: float = 0.1,
                 num_val_sequences: int = 256, eval_batch_size: int = 64) -> None:
        check_sizes(seq_len, num_val_sequences, eval_batch_size)
        corpus = load_words_corpus()
        self.vocab = corpus.vocab
        self.unseen_in_training = corpus.unseen_in_training
        self.model_kwargs = dict(vocab_size=len(corpus.vocab), seq_len=seq_len, d_model=d_model,
                                 n_layers=n_layers, n_heads=n_heads, d_ff=d_ff, dropout=dropout,
                                 norm_first=False, activation="relu")
        self._set_sequences(_sequences(corpus.train, seq_len),
                            _sequences(corpus.validation, seq_len),
                            num_val_sequences, eval_batch_size)
        self.uniform_loss = math.log(len(corpus.vocab))

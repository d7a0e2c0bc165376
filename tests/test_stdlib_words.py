"""Tests of the bundled ``stdlib-words`` task (gradpress.tasks.stdlib_words)."""

from __future__ import annotations

import pytest
import torch

from gradpress.tasks import get_task
from gradpress.tasks.stdlib_words import BOS, TOKEN_RE, UNK, StdlibWordsTask, load_words_corpus

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def words() -> StdlibWordsTask:
    return get_task("stdlib-words")


def test_corpus_deterministic_with_a_long_tail_and_rows_unseen_in_training():
    a, b = load_words_corpus(), load_words_corpus.__wrapped__()
    assert torch.equal(a.train, b.train) and torch.equal(a.validation, b.validation)
    assert a.vocab == b.vocab and a.vocab[:2] == ("[BOS]", "[UNK]")
    assert len(a.vocab) > 2000                                  # a real vocabulary
    counts = torch.bincount(a.train, minlength=len(a.vocab))
    assert int((counts[2:] <= 5).sum()) > len(a.vocab) // 4     # a long tail of rare words
    unseen = a.unseen_in_training
    assert len(unseen) > 20 and bool((counts[unseen] == 0).all())
    assert bool(torch.isin(unseen, a.validation).all())         # they occur in validation
    assert 0.05 < len(a.validation) / (len(a.train) + len(a.validation)) < 0.3


def test_tokens():
    assert TOKEN_RE.findall("Return x2 (or None).\n") == [
        "Return", "x", "2", "(", "or", "None", ")", ".", "\n"]


def test_model_is_post_ln_with_the_embedding_a_quarter_of_the_parameters(words):
    model = words.build_model(seed=0)
    assert all(not layer.norm_first for layer in model.decoder.layers)
    assert model.decoder.norm is None                           # post-LN: no final norm
    total = sum(p.numel() for p in model.parameters())
    assert model.tok.weight.numel() >= total / 4
    again = words.build_model(seed=0)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_batches_loss_and_evaluation(words):
    batches = list(words.train_batches(0, 2, 4, seed=0, epoch=0))
    other = list(words.train_batches(1, 2, 4, seed=0, epoch=0))
    assert len(batches) == len(other) == words.steps_per_epoch(2, 4)
    x, y = batches[0]
    assert x.shape == y.shape == (4, 32) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(words.train_sequences[:, 0].ne(BOS).sum()) == 0
    model = words.build_model(seed=0)
    loss = words.loss(model, batches[0]).detach()
    assert abs(float(loss) - words.uniform_loss) < 1.0          # near uniform at the start
    small = StdlibWordsTask(num_val_sequences=8, eval_batch_size=4)
    result = small.evaluate(model)
    assert result.primary == "val_loss" and result.num_examples == 8 * 32
    assert UNK in set(words.val_sequences.flatten().tolist())
    with pytest.raises(ValueError, match="seq_len must be >= 2"):
        get_task("stdlib-words", seq_len=1)
    with pytest.raises(ValueError, match="stdlib-words batch must be a pair"):
        words.loss(model, (x,))

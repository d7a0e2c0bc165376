"""Tests of the bundled training tasks (gradpress.tasks)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from gradpress.tasks import EvalResult, TaskDefaults, get_task, shard_batches, task_names
from gradpress.tasks.base import derive_seed
from gradpress.tasks.stdlib_mlm import (
    CLS,
    IGNORE_INDEX,
    MASK,
    VOCAB_SIZE,
    bert_mask,
    load_stdlib_corpus,
)

SMALL_MLM = dict(seq_len=32, d_model=32, n_layers=1, n_heads=2, max_bytes=1 << 20,
                 num_val_sequences=64)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def digits():
    return get_task("digits-cnn")


@pytest.fixture(scope="module")
def mlm():
    return get_task("stdlib-mlm")


@pytest.fixture(scope="module")
def small_mlm():
    return get_task("stdlib-mlm", **SMALL_MLM)


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- registry --------------------------------------------------------------------------------------
def test_task_names_and_unknown_name_lists_valid_ones():
    assert task_names() == ["digits-cnn", "stdlib-lm", "stdlib-mlm", "stdlib-words"]
    valid = "digits-cnn, stdlib-lm, stdlib-mlm, stdlib-words"
    with pytest.raises(ValueError, match=f"unknown task 'mnist'.*{valid}"):
        get_task("mnist")


# -- sharding --------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_shards_disjoint_equal_counts_deterministic(world_size):
    n, bs = 1000, 16
    shards = [list(shard_batches(n, r, world_size, bs, seed=5, epoch=2)) for r in range(world_size)]
    assert {len(s) for s in shards} == {n // (world_size * bs)}
    assert all(b.numel() == bs for s in shards for b in s)
    flat = torch.cat([b for s in shards for b in s])
    assert flat.unique().numel() == flat.numel()  # disjoint across ranks and steps
    again = list(shard_batches(n, 1 % world_size, world_size, bs, seed=5, epoch=2))
    assert all(torch.equal(a, b) for a, b in zip(again, shards[1 % world_size]))
    other = torch.cat(list(shard_batches(n, 0, world_size, bs, seed=5, epoch=3)))
    assert not torch.equal(other, torch.cat(shards[0]))  # a new epoch reshuffles


@pytest.mark.parametrize("args, match", [
    ((100, 2, 2, 8, 0, 0), "rank must be in"),
    ((100, 0, 0, 8, 0, 0), "world_size must be >= 1"),
    ((100, 0, 1, 0, 0, 0), "batch_size must be >= 1"),
    ((100, 0, 4, 32, 0, 0), "exceeds the 100 training examples"),
])
def test_shard_argument_errors(args, match):
    with pytest.raises(ValueError, match=match):
        list(shard_batches(*args))


def test_derive_seed_deterministic_and_distinct():
    assert derive_seed(1, 2, "x") == derive_seed(1, 2, "x")
    assert len({derive_seed(1, 2), derive_seed(2, 1), derive_seed(1, 2, "x")}) == 3
    assert 0 <= derive_seed(7) < 2**63


# -- defaults and results --------------------------------------------------------------------------
def test_defaults_lr_for_aliases_and_errors(digits):
    d = digits.defaults
    assert dataclasses.is_dataclass(d) and isinstance(d, TaskDefaults)
    assert d.lr_for("AdamW") == d.lr_for("adam") and d.lr_for("clan") == d.lr_for("lans")
    with pytest.raises(ValueError, match="no default learning rate for optimizer 'rmsprop'"):
        d.lr_for("rmsprop")
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.batch_size = 7  # type: ignore[misc]
    assert hash(d) == hash(d)
    assert TaskDefaults(32, 4, {"adam": 1e-3}, max_steps=300).total_steps(100) == 300


def test_eval_result_primary_must_be_a_metric():
    with pytest.raises(ValueError, match="primary metric 'acc'"):
        EvalResult({"loss": 1.0}, primary="acc", higher_is_better=True, num_examples=1)


# -- digits-cnn ------------------------------------------------------------------------------------
def test_digits_sizes_split_and_scaling(digits):
    assert digits.num_train_examples == 1437 and digits.y_test.numel() == 360
    assert tuple(digits.x_train.shape) == (1437, 1, 8, 8)
    assert abs(float(digits.x_train.mean())) < 1e-4 and abs(float(digits.x_train.std()) - 1) < 1e-3
    per_class = torch.bincount(digits.y_test, minlength=10)
    assert int(per_class.min()) >= 35 and int(per_class.max()) <= 37  # stratified


def test_digits_batches_match_shards_and_steps(digits):
    spe = digits.steps_per_epoch(world_size=2, batch_size=32)
    assert spe == 1437 // 64
    for rank in range(2):
        batches = list(digits.train_batches(rank, 2, 32, seed=1, epoch=0))
        idx = list(shard_batches(1437, rank, 2, 32, seed=1, epoch=0))
        assert len(batches) == spe
        assert all(torch.equal(x, digits.x_train[i]) and torch.equal(y, digits.y_train[i])
                   for (x, y), i in zip(batches, idx))


def test_digits_model_shapes_and_seeded_init(digits):
    state = torch.random.get_rng_state()
    a, b, c = digits.build_model(3), digits.build_model(3), digits.build_model(4)
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched
    assert _same_params(a, b) and not _same_params(a, c)
    assert a(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    assert max(p.numel() * 4 for p in a.parameters()) >= 64 * 1024
    with pytest.raises(ValueError, match=r"expects input of shape \(N, 1, 8, 8\)"):
        a(torch.zeros(5, 64))


def test_digits_one_epoch_trains_and_evaluates(digits):
    torch.manual_seed(0)
    model = digits.build_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=digits.defaults.lr_for("adam"))
    before = digits.evaluate(model)
    for batch in digits.train_batches(0, 1, 32, seed=0, epoch=0):
        opt.zero_grad()
        digits.loss(model, batch).backward()
        opt.step()
    after = digits.evaluate(model)
    assert isinstance(after, EvalResult) and after.primary == "test_accuracy"
    assert after.higher_is_better and after.num_examples == 360
    assert after.value == after["test_accuracy"] and "test_loss" in after.metrics
    assert after["test_loss"] < before["test_loss"] and after.value > 0.85
    assert model.training  # evaluate restores the mode


# -- stdlib-mlm ------------------------------------------------------------------------------------
def test_mlm_corpus_split_by_file_and_deterministic():
    a, b = load_stdlib_corpus(), load_stdlib_corpus.__wrapped__()
    assert a == b  # reading again gives the same bytes and files
    assert not set(a.train_files) & set(a.validation_files)
    n_files = len(a.train_files) + len(a.validation_files)
    assert len(a.train) + len(a.validation) <= (3 << 20) + n_files  # newline separators
    assert 0.03 < len(a.validation) / (len(a.train) + len(a.validation)) < 0.3


def test_mlm_sizes_and_fixed_validation(mlm):
    assert mlm.train_sequences.shape[1] == 128 and mlm.num_train_examples > 15_000
    assert tuple(mlm.val_inputs.shape) == (256, 128)
    assert int((mlm.train_sequences[:, 0] == CLS).sum()) == mlm.num_train_examples
    again = get_task("stdlib-mlm")
    assert torch.equal(again.val_inputs, mlm.val_inputs)
    assert torch.equal(again.val_labels, mlm.val_labels)
    assert mlm.unigram_loss < mlm.uniform_loss == pytest.approx(math.log(VOCAB_SIZE))


def test_bert_mask_counts_and_proportions():
    ids = torch.randint(0, 256, (400, 128))
    ids[:, 0] = CLS
    inputs, labels = bert_mask(ids, torch.Generator().manual_seed(0))
    chosen = labels != IGNORE_INDEX
    assert set(chosen.sum(dim=1).tolist()) == {19}  # round(0.15 * 127)
    assert not chosen[:, 0].any() and torch.equal(labels[chosen], ids[chosen])
    assert torch.equal(inputs[~chosen], ids[~chosen])
    n = chosen.sum().item()
    frac_mask = (inputs[chosen] == MASK).sum().item() / n
    frac_same = (inputs[chosen] == ids[chosen]).sum().item() / n
    assert 0.77 < frac_mask < 0.83 and 0.08 < frac_same < 0.13
    again = bert_mask(ids, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)


def test_mlm_batches_disjoint_equal_and_deterministic(small_mlm):
    spe = small_mlm.steps_per_epoch(3, 8)
    runs = [list(small_mlm.train_batches(r, 3, 8, seed=0, epoch=1)) for r in range(3)]
    assert [len(r) for r in runs] == [spe] * 3
    for r, batches in enumerate(runs):
        for (_inputs, labels), idx in zip(batches, shard_batches(small_mlm.num_train_examples,
                                                                r, 3, 8, seed=0, epoch=1)):
            original = small_mlm.train_sequences[idx]
            chosen = labels != IGNORE_INDEX
            assert torch.equal(labels[chosen], original[chosen])
    first = next(small_mlm.train_batches(1, 3, 8, seed=0, epoch=1))
    assert all(torch.equal(a, b) for a, b in zip(first, runs[1][0]))


def test_mlm_model_shapes(mlm):
    model = mlm.build_model(0)
    ids = torch.randint(0, 256, (2, 128))
    assert model(ids).shape == (2, 128, VOCAB_SIZE)
    select = torch.zeros(2, 128, dtype=torch.bool)
    select[0, 3] = select[1, 5] = select[1, 9] = True
    assert model(ids, select).shape == (3, VOCAB_SIZE)
    assert max(p.numel() * 4 for p in model.parameters()) >= 64 * 1024
    assert _same_params(model, mlm.build_model(0)) and not _same_params(model, mlm.build_model(1))
    layers = model.encoder.layers
    assert not torch.equal(layers[0].linear1.weight, layers[1].linear1.weight)
    with pytest.raises(ValueError, match="expects ids of shape"):
        model(torch.zeros(2, 200, dtype=torch.long))


def test_mlm_training_steps_reduce_loss(small_mlm):
    model = small_mlm.build_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    before = small_mlm.evaluate(model)
    assert before["val_loss"] == pytest.approx(small_mlm.uniform_loss, abs=0.1)
    for step, batch in enumerate(small_mlm.train_batches(0, 1, 32, seed=0, epoch=0)):
        opt.zero_grad()
        small_mlm.loss(model, batch).backward()
        opt.step()
        if step == 60:
            break
    after = small_mlm.evaluate(model)
    assert isinstance(after, EvalResult) and after.primary == "val_loss"
    assert not after.higher_is_better and after.num_examples == int(
        (small_mlm.val_labels != IGNORE_INDEX).sum())
    assert set(after.metrics) == {"val_loss", "val_accuracy", "val_perplexity"}
    assert after.value < before.value - 1.5
    assert small_mlm.evaluate(model) == after  # same masks every evaluation

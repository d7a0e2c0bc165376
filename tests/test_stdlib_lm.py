"""Tests of the bundled ``stdlib-lm`` task (gradpress.tasks.stdlib_lm)."""

from __future__ import annotations

import math
import sysconfig
import zlib
from pathlib import Path

import pytest
import torch

from gradpress.tasks import EvalResult, get_task, shard_batches, task_names
from gradpress.tasks.stdlib_lm import (
    BOS,
    TOPICS_FILE,
    VOCAB_SIZE,
    CausalTransformer,
    StdlibLMTask,
    _read_topics,
    load_topics_corpus,
    to_causal_sequences,
)
from gradpress.tasks.stdlib_mlm import StdlibMLMTask

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def lm() -> StdlibLMTask:
    return get_task("stdlib-lm")


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- registry and defaults -------------------------------------------------------------------------
def test_registered_with_stdlib_mlm_learning_rates(lm):
    assert "stdlib-lm" in task_names()
    assert isinstance(lm, StdlibLMTask) and lm.name == "stdlib-lm"
    assert dict(lm.defaults.lr) == dict(StdlibMLMTask.defaults.lr)  # not tuned for this task
    assert lm.defaults.max_steps == 300 and lm.defaults.warmup_steps == 30
    assert lm.defaults.total_steps(lm.steps_per_epoch(4, 32)) == 300  # max_steps ends a run


# -- corpus ----------------------------------------------------------------------------------------
def test_corpus_split_by_topic_deterministic_and_disjoint():
    a, b = load_topics_corpus(), load_topics_corpus.__wrapped__()
    assert a == b  # reading again gives the same bytes and topics
    assert not set(a.train_topics) & set(a.validation_topics)
    path = Path(sysconfig.get_paths()["stdlib"]) / TOPICS_FILE
    topics = _read_topics(path)
    assert sorted(topics) == sorted(a.train_topics + a.validation_topics)
    assert all(zlib.crc32(t.encode()) % 10 == 0 for t in a.validation_topics)
    assert all(zlib.crc32(t.encode()) % 10 != 0 for t in a.train_topics)
    assert a.validation == b"\n\n".join(topics[t].encode() for t in a.validation_topics)
    assert a.train == b"\n\n".join(topics[t].encode() for t in a.train_topics)
    assert 0.03 < len(a.validation) / (len(a.train) + len(a.validation)) < 0.3
    assert b"The following methods can be defined" in a.train + a.validation  # prose, parsed
    assert b"'\n           '" not in a.train  # not the generated source's quoting


def test_missing_or_malformed_corpus_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pydoc_data/topics\.py does not exist"):
        load_topics_corpus.__wrapped__(str(tmp_path))
    (tmp_path / "pydoc_data").mkdir()
    (tmp_path / TOPICS_FILE).write_text("topics = load()\n")
    with pytest.raises(ValueError, match=r"topics\.py holds no literal 'topics = \{\.\.\.\}'"):
        load_topics_corpus.__wrapped__(str(tmp_path))
    (tmp_path / TOPICS_FILE).write_text("topics = ['a']\n")
    with pytest.raises(ValueError, match="'topics' is a list; expected a dict"):
        load_topics_corpus.__wrapped__(str(tmp_path))
    (tmp_path / TOPICS_FILE).write_text("topics = {'a': 'x'}\n")  # crc32('a') % 10 != 0
    with pytest.raises(ValueError, match="1 training and 0 validation topics"):
        load_topics_corpus.__wrapped__(str(tmp_path))


# -- sequences and batches -------------------------------------------------------------------------
def test_sequences_bos_then_the_stream():
    stream = bytes(range(200)) * 3
    seqs = to_causal_sequences(stream, 64)
    assert tuple(seqs.shape) == (len(stream) // 64, 65) and seqs.dtype == torch.int64
    assert bool((seqs[:, 0] == BOS).all())
    assert bytes(seqs[:, 1:].reshape(-1).tolist()) == stream[:len(seqs) * 64]
    with pytest.raises(ValueError, match="a stream of 3 bytes holds no sequence of 8 bytes"):
        to_causal_sequences(b"abc", 8)


def test_task_sequences_and_fixed_validation(lm):
    assert tuple(lm.train_sequences.shape[1:]) == (65,) and lm.num_train_examples > 5_000
    assert tuple(lm.val_sequences.shape) == (256, 65)
    assert bool((lm.train_sequences[:, 0] == BOS).all())
    assert int(lm.train_sequences[:, 1:].max()) < 256  # BOS only at the start
    assert torch.equal(get_task("stdlib-lm").val_sequences, lm.val_sequences)
    assert lm.unigram_loss < lm.uniform_loss == pytest.approx(math.log(VOCAB_SIZE))


def test_batches_shifted_disjoint_and_deterministic(lm):
    spe = lm.steps_per_epoch(2, 16)
    runs = [list(lm.train_batches(r, 2, 16, seed=3, epoch=1)) for r in range(2)]
    assert [len(r) for r in runs] == [spe] * 2
    seen = []
    for r, batches in enumerate(runs):
        for (inputs, targets), idx in zip(batches, shard_batches(lm.num_train_examples, r, 2,
                                                                 16, seed=3, epoch=1)):
            assert inputs.shape == targets.shape == (16, 64)
            assert torch.equal(inputs, lm.train_sequences[idx, :-1])
            assert torch.equal(targets, lm.train_sequences[idx, 1:])
            assert torch.equal(inputs[:, 1:], targets[:, :-1]) and bool((inputs[:, 0] == BOS).all())
            seen.append(idx)
    flat = torch.cat(seen)
    assert flat.unique().numel() == flat.numel()  # disjoint across ranks and steps
    first = next(lm.train_batches(1, 2, 16, seed=3, epoch=1))
    assert all(torch.equal(a, b) for a, b in zip(first, runs[1][0]))


# -- model -----------------------------------------------------------------------------------------
def test_model_shape_init_and_seeding(lm):
    state = torch.random.get_rng_state()
    model = lm.build_model(0)
    assert torch.equal(state, torch.random.get_rng_state())  # global RNG untouched
    assert model(torch.randint(0, 256, (2, 64))).shape == (2, 64, VOCAB_SIZE)
    assert model(torch.randint(0, 256, (2, 5))).shape == (2, 5, VOCAB_SIZE)
    assert _same_params(model, lm.build_model(0)) and not _same_params(model, lm.build_model(1))
    assert 550_000 < sum(p.numel() for p in model.parameters()) < 650_000
    assert len(model.decoder.layers) == 4 and model.out.weight is not model.tok.weight
    layers = model.decoder.layers
    assert not torch.equal(layers[0].linear1.weight, layers[1].linear1.weight)
    std = {name: float(p.detach().std()) for name, p in model.named_parameters()}
    assert std["tok.weight"] == pytest.approx(0.02, rel=0.05)  # GPT-2: normal(0, 0.02) ...
    for name in ("decoder.layers.0.linear2.weight", "decoder.layers.3.self_attn.out_proj.weight"):
        assert std[name] == pytest.approx(0.02 / math.sqrt(8), rel=0.05)  # ... residual / sqrt(2N)


@pytest.mark.parametrize("training", [True, False], ids=["train-mode", "eval-mode"])
def test_model_is_causal(lm, training):
    model = lm.build_model(0).train(training)
    ids = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[:, 40] = (changed[:, 40] + 1) % 256
    with torch.no_grad():
        a, b, prefix = model(ids), model(changed), model(ids[:, :40])
    assert torch.allclose(a[:, :40], b[:, :40], atol=1e-6, rtol=0)  # the past ignores the future
    assert torch.allclose(a[:, :40], prefix, atol=1e-5, rtol=0)
    assert (a[:, 40:] - b[:, 40:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees it


def test_model_and_loss_reject_bad_input(lm):
    model = lm.build_model(0)
    with pytest.raises(ValueError, match=r"expects ids of shape \(B, 1<=L<=64\), got \(2, 65\)"):
        model(torch.zeros(2, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"got \(64,\)"):
        model(torch.zeros(64, dtype=torch.long))
    with pytest.raises(ValueError, match="batch must be a pair .*got tuple"):
        lm.loss(model, (torch.zeros(2, 64, dtype=torch.long),))
    with pytest.raises(ValueError, match=r"same shape, got \(2, 64\) and \(2, 63\)"):
        lm.loss(model, (torch.zeros(2, 64, dtype=torch.long), torch.zeros(2, 63, dtype=torch.long)))
    with pytest.raises(ValueError, match=r"d_model \(130\) must be divisible by n_heads \(4\)"):
        CausalTransformer(d_model=130)
    with pytest.raises(ValueError, match="n_layers must be >= 1, got 0"):
        CausalTransformer(n_layers=0)
    with pytest.raises(ValueError, match="seq_len must be >= 2, got 1"):
        get_task("stdlib-lm", seq_len=1)
    with pytest.raises(ValueError, match="got 0 and 128"):
        get_task("stdlib-lm", num_val_sequences=0)


# -- training and evaluation -----------------------------------------------------------------------
def test_loss_at_init_near_uniform_and_training_lowers_it(lm):
    model = lm.build_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=lm.defaults.lr_for("adam"))
    before = lm.evaluate(model)
    assert before["val_loss"] == pytest.approx(math.log(VOCAB_SIZE), abs=0.15)
    batches = lm.train_batches(0, 1, 32, seed=0, epoch=0)
    assert lm.loss(model, next(batches)).item() == pytest.approx(math.log(VOCAB_SIZE), abs=0.15)
    for _, batch in zip(range(30), batches):
        opt.zero_grad()
        lm.loss(model, batch).backward()
        opt.step()
    after = lm.evaluate(model)
    assert isinstance(after, EvalResult) and after.primary == "val_loss"
    assert not after.higher_is_better and after.num_examples == 256 * 64
    assert set(after.metrics) == {"val_loss", "val_accuracy", "val_perplexity"}
    assert after["val_perplexity"] == pytest.approx(math.exp(after.value))
    assert after.value < before.value - 1.5 and after["val_accuracy"] > before["val_accuracy"]
    assert model.training  # evaluate restores the mode
    assert lm.evaluate(model) == after  # the same sequences every evaluation

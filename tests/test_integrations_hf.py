"""The Hugging Face recipes of docs/integrations.md, run for real on 2 CPU processes:
examples/hf_plain.py (a sized-down GPT-2 with gp.OneBitLANS, under torchrun and gradpress
launch) and examples/hf_trainer.py (the Trainer with TwoWayCompressionCallback, checkpoint and
exact resume); and gradpress.huggingface's import rules and one-process behaviour."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, check_training, results, run_env, torchrun

PLAIN = ROOT / "examples" / "hf_plain.py"
TRAINER = ROOT / "examples" / "hf_trainer.py"
PLAIN_ARGS = ["--steps", "40", "--dense-steps", "10"]


@pytest.fixture(scope="module")
def plain_torchrun(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("hf_plain")
    torchrun(2, PLAIN, [*PLAIN_ARGS, "--out", str(out)], run_env())
    return results(out, 2)


@pytest.mark.cluster
def test_hf_plain_under_torchrun(plain_torchrun: list[dict]) -> None:
    # 10 dense steps (bf16) then 30 one-bit steps: about a sixth of fp32's bytes in all;
    # the loss falls from ~5.1 (ln 257 = 5.55 is chance) to ~4.1 in 40 steps
    check_training(plain_torchrun, max_ratio=0.25, loss_ratio=0.9)


@pytest.mark.cluster
def test_hf_plain_under_gradpress_launch(tmp_path: Path, plain_torchrun: list[dict]) -> None:
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--colocate",
           "--", sys.executable, str(PLAIN), *PLAIN_ARGS, "--out", str(tmp_path)]
    p = subprocess.run(cmd, env=run_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    runs = results(tmp_path, 2)
    check_training(runs, max_ratio=0.25, loss_ratio=0.9)
    assert runs[0]["param_hash"] == plain_torchrun[0]["param_hash"]


def _trainer_runs(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.cluster
def test_hf_trainer_with_the_hook_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    args = ["--steps", "30", "--save-steps", "15", "--out", str(tmp_path)]
    torchrun(2, TRAINER, args, run_env())
    runs = _trainer_runs(tmp_path)
    assert len({r["param_hash"] for r in runs}) == 1
    for r in runs:
        s = r["stats"]
        assert r["hook_registered"] and s["iter"] == 30, s
        # every bucket went through the hook, compressed: ~1 bit per element plus headers
        assert s["compressed_buckets"] == 30 and s["allreduced_buckets"] == 0, s
        assert 0 < s["payload_bytes"] < 0.1 * s["dense_bytes"], s
        losses = r["losses"]
        assert len(losses) == 30 and sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    ckpt = tmp_path / "trainer" / "checkpoint-15" / "gradpress_ddp_hook"
    assert sorted(p.name for p in ckpt.iterdir()) == ["rank0.pt", "rank1.pt"]

    # resume from checkpoint-15 (the last one once checkpoint-30 is gone): the hook's residuals
    # come back from the checkpoint, so the run ends on the same bits as the uninterrupted one
    shutil.rmtree(tmp_path / "trainer" / "checkpoint-30")
    torchrun(2, TRAINER, [*args, "--resume"], run_env())
    resumed = _trainer_runs(tmp_path)
    for r in resumed:
        assert r["stats"]["iter"] == 30 and r["stats"]["compressed_buckets"] == 15, r["stats"]
        assert r["param_hash"] == runs[0]["param_hash"]


@pytest.mark.cluster
def test_importing_gradpress_does_not_import_transformers() -> None:
    code = ("import sys, gradpress, gradpress.ddp, gradpress.checkpoint\n"
            "gradpress.DistributedOptimizer; gradpress.OneBitLANS\n"
            "assert 'transformers' not in sys.modules\n"
            "sys.modules['transformers'] = None  # as if not installed\n"
            "try:\n"
            "    import gradpress.huggingface\n"
            "except ImportError as e:\n"
            "    assert 'pip install \"gradpress[hf]\"' in str(e), e\n"
            "else:\n"
            "    raise SystemExit('no ImportError')\n")
    p = subprocess.run([sys.executable, "-c", code], env=run_env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_callback_in_one_process_trains_without_the_hook(tmp_path: Path, one_thread) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from gradpress.huggingface import TwoWayCompressionCallback

    with pytest.raises(TypeError, match="transformers.Trainer"):
        TwoWayCompressionCallback(object())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=257, n_positions=16, n_embd=16, n_layer=1,
                                       n_head=2))
    rows = torch.randint(0, 256, (8, 16))
    data = [{"input_ids": r, "labels": r} for r in rows]
    targs = TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                              report_to="none", use_cpu=True, save_strategy="no",
                              disable_tqdm=True)
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    cb = TwoWayCompressionCallback(trainer, min_compress_bytes=0)
    trainer.add_callback(cb)
    trainer.train()
    assert not cb.registered and cb.state.compression_stats()["iter"] == 0


TOPK = "topk:k=0.01,values=fp16"


@pytest.mark.parametrize("form", ["string", "dict", "CodecSpec"])
def test_callback_takes_compression_as_string_dict_or_codec_spec(tmp_path: Path,
                                                                 form: str) -> None:
    """Each form of ``compression=`` gives the callback's hook codecs that write the same
    bytes; a state passed in is used as it is."""
    import torch
    from transformers import Trainer, TrainingArguments

    from gradpress.compress import build, parse_spec
    from gradpress.ddp import TwoWayCompressionState
    from gradpress.huggingface import TwoWayCompressionCallback

    compression = {"string": TOPK, "dict": {"compressor": "topk", "k": 0.01, "values": "fp16"},
                   "CodecSpec": parse_spec(TOPK)}[form]
    targs = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = Trainer(model=torch.nn.Linear(4, 4), args=targs)
    cb = TwoWayCompressionCallback(trainer, compression=compression, min_compress_bytes=0)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cb.state._build(1000).compress(x, key=1),
                       build(TOPK, 1000, ef="vanilla").compress(x, key=1))
    mine = TwoWayCompressionState(compression)
    assert TwoWayCompressionCallback(trainer, mine).state is mine

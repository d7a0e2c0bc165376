"""gradpress.lightning with the real ``lightning`` package: 2 CPU processes, gloo.

Each distributed test runs ``examples/lightning_train.py`` (the recipe shown in
docs/integrations.md) as a user would; Lightning's own launcher starts the second process. Every
rank writes a hash of its parameters, its losses and its byte counters.

* Lightning's ``DDPStrategy(ddp_comm_hook=...)`` on CPU never calls the hook (the bug this
  module exists for); ``TwoWayCompressionStrategy`` does.
* Both strategies: replicas bit-identical, bytes sent far below fp32, the bytes logged, the loss
  decreases, the checkpoint holds every rank's residuals, and resuming from the epoch-0
  checkpoint ends bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradpress.compress import build, parse_ef, parse_spec
from gradpress.ddp import TwoWayCompressionState, two_way_compression_hook
from gradpress.torch.optimizer import DistributedOptimizer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightning_train.py"
#: launcher variables of an enclosing job would make Lightning think it was started externally
_JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
             "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")


def run_example(root: Path, strategy: str, *extra: str) -> list[dict]:
    """Run the example (2 processes) in ``root``; return each rank's report."""
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARS and not k.startswith(("GRADPRESS_", "SLURM_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = root / "out"
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--strategy", strategy,
                           "--root", str(root), "--out", str(out), *extra],
                          cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def metrics(root: Path) -> str:
    return next(root.glob("logs/version_*/metrics.csv")).read_text()


def check_training(ranks: list[dict]) -> None:
    """Replicas identical, 16 steps, loss lower in epoch 2 than in epoch 1 (same batches)."""
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
    for r in ranks:
        assert r["global_step"] == 16 and r["val_loss"] > 0  # validate after fit ran
        assert r["lr"] == pytest.approx(0.05 * 0.7 ** 2)  # the LR scheduler stepped it
        first, second = r["losses"][:8], r["losses"][8:]
        assert sum(second) < sum(first), r["losses"]


@pytest.mark.cluster
def test_import_gradpress_does_not_import_lightning() -> None:
    code = ("import sys, gradpress, gradpress.api, gradpress.ddp, gradpress.checkpoint; "
            "gradpress.DistributedOptimizer; "
            "assert not [m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning')], 'lightning imported'")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_missing_lightning_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "gradpress.lightning", raising=False)
    for m in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setitem(sys.modules, "lightning", None)  # "not installed"
    with pytest.raises(ImportError, match=re.escape('pip install "gradpress[lightning]"')):
        import gradpress.lightning  # noqa: F401
    monkeypatch.delitem(sys.modules, "gradpress.lightning", raising=False)


def test_public_names_are_in_the_api_reference() -> None:
    import gradpress.lightning as gl

    text = (ROOT / "docs" / "reference" / "api.md").read_text()
    assert "## `gradpress.lightning`" in text
    assert not [n for n in gl.__all__ if not re.search(rf"(?<!\w){n}(?!\w)", text)]


def test_doc_recipes_are_the_example_lines() -> None:
    """The strategy lines shown in docs/integrations.md are the ones the tests run."""
    doc = (ROOT / "docs" / "integrations.md").read_text()
    example = EXAMPLE.read_text()
    for line in ("strategy=TwoWayCompressionStrategy(find_unused_parameters=True)",
                 'strategy=ParameterServerStrategy(compression="onebit", ef="vanilla")'):
        assert line in doc
        assert line.split("=", 1)[1] in example


def test_strategy_defaults_and_arguments() -> None:
    from gradpress.lightning import ParameterServerStrategy, TwoWayCompressionStrategy

    s = TwoWayCompressionStrategy()
    assert isinstance(s.comm_state, TwoWayCompressionState)
    assert s._ddp_comm_hook is two_way_compression_hook
    assert (s.comm_state.compression, s.comm_state.ef) == (parse_spec("int4"),
                                                           parse_ef("vanilla"))
    mine = TwoWayCompressionState("topk:k=0.01", min_compress_bytes=0)
    assert TwoWayCompressionStrategy(ddp_comm_state=mine).comm_state is mine
    assert s.compression_stats["bytes_sent"] == 0
    ps = ParameterServerStrategy()
    assert ps._opt_kwargs["compression"] == "int4" and ps._opt_kwargs["ef"] == "vanilla"
    assert ps.process_group_backend == "gloo"
    with pytest.raises(TypeError, match="ddp_comm_hook"):
        ParameterServerStrategy(ddp_comm_hook=two_way_compression_hook)


TOPK = "topk:k=0.01,values=fp16"


@pytest.mark.parametrize("compression", [
    TOPK, {"compressor": "topk", "k": 0.01, "values": "fp16"}, parse_spec(TOPK),
], ids=["string", "dict", "CodecSpec"])
def test_both_strategies_take_compression_as_string_dict_or_codec_spec(compression) -> None:
    """Each form of ``compression=`` builds codecs that write the same bytes."""
    from gradpress.lightning import ParameterServerStrategy, TwoWayCompressionStrategy

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    ref = build(TOPK, 1000, ef="vanilla").compress(x, key=1)
    hook = TwoWayCompressionStrategy(compression=compression).comm_state
    assert torch.equal(hook._build(1000).compress(x, key=1), ref)
    model = torch.nn.Linear(4, 4)
    opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters(),
                               **ParameterServerStrategy(compression=compression)._opt_kwargs)
    assert torch.equal(build(opt._gp_spec, 1000).compress(x, key=1), ref)
    with pytest.raises(TypeError, match="either compression or ddp_comm_state"):
        TwoWayCompressionStrategy(compression=compression,
                                  ddp_comm_state=TwoWayCompressionState())


def test_checkpoint_entry_is_checked(caplog: pytest.LogCaptureFixture) -> None:
    from gradpress.lightning import CHECKPOINT_KEY, _saved_entry

    assert _saved_entry({}, "parameter_server", 2) is None  # plain checkpoint: from zero
    assert "no 'gradpress' entry" in caplog.text
    entry = {"strategy": "two_way_hook", "world_size": 2, "ranks": [{}, {}]}
    assert _saved_entry({CHECKPOINT_KEY: entry}, "two_way_hook", 2) is entry
    for kind, world in (("parameter_server", 2), ("two_way_hook", 4)):
        with pytest.raises(ValueError, match="resume with the same strategy and number"):
            _saved_entry({CHECKPOINT_KEY: entry}, kind, world)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_lightning_ddp_strategy_never_calls_the_hook_on_cpu(tmp_path: Path) -> None:
    ranks = run_example(tmp_path, "ddp-hook", "--epochs", "1")
    for r in ranks:  # it trained, uncompressed: the hook was registered nowhere
        assert r["global_step"] == 8
        assert r["stats"]["iter"] == 0 and r["stats"]["compressed_buckets"] == 0


@pytest.mark.cluster
@pytest.mark.timeout(400)
def test_two_way_compression_strategy(tmp_path: Path) -> None:
    ranks = run_example(tmp_path / "a", "two-way")
    check_training(ranks)
    for r in ranks:
        s = r["stats"]
        assert s["iter"] == 16 and s["compressed_buckets"] == 16
        # int4, the default: 1/7.8 of fp32 on compressed buckets; buckets under 1 MiB exact
        assert 0 < s["bytes_sent"] < s["fp32_bytes"] / 4, s
    assert "gradpress/bytes_sent" in metrics(tmp_path / "a")
    ckpt = tmp_path / "a" / "ckpt" / "epoch=0-step=8.ckpt"
    entry = torch.load(ckpt, weights_only=True)["gradpress"]
    assert entry["strategy"] == "two_way_hook" and entry["world_size"] == 2
    for rank, st in enumerate(entry["ranks"]):
        assert st["iter"] == 8 and st["buckets"]
        for bucket in st["buckets"].values():
            assert bucket["rank"] == rank
            assert any(t.abs().sum() > 0 for t in _tensors(bucket["worker"]))  # residuals
    resumed = run_example(tmp_path / "b", "two-way", "--ckpt-path", str(ckpt))
    assert [r["params_sha256"] for r in resumed] == [r["params_sha256"] for r in ranks]
    assert resumed[0]["stats"]["compressed_buckets"] == 8  # the resumed half only


@pytest.mark.cluster
@pytest.mark.timeout(400)
def test_parameter_server_strategy(tmp_path: Path) -> None:
    ranks = run_example(tmp_path / "a", "ps")
    check_training(ranks)
    for r in ranks:
        s = r["stats"]
        assert s["steps"] > 0 and 0 < s["bytes_sent"] < s["fp32_bytes"] / 8, s
    assert "gradpress/compression_ratio" in metrics(tmp_path / "a")
    ckpt = tmp_path / "a" / "ckpt" / "epoch=0-step=8.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    entry = saved["gradpress"]
    assert entry["strategy"] == "parameter_server" and entry["world_size"] == 2
    assert sorted(entry["servers"]) == [0, 1]
    assert all("gradpress" not in o for o in saved["optimizer_states"])  # per rank: in entry
    assert entry["workers"][0] and entry["workers"][1]
    assert any(t.abs().sum() > 0 for w in entry["workers"] for t in _tensors(w))  # residuals
    assert any(t.abs().sum() > 0 for s in entry["servers"].values() for t in _tensors(s))
    resumed = run_example(tmp_path / "b", "ps", "--ckpt-path", str(ckpt))
    assert [r["params_sha256"] for r in resumed] == [r["params_sha256"] for r in ranks]


ACCUMULATE = """
import hashlib, sys
sys.path.insert(0, {examples!r})
import lightning as L, torch
from lightning_train import Regressor, data
from gradpress.lightning import ParameterServerStrategy
torch.set_num_threads(1)
L.seed_everything(0)
model, strategy = Regressor(), ParameterServerStrategy()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1,
                    accumulate_grad_batches=3, gradient_clip_val=0.5, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model, data())
blob = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
# one write of the whole line: both ranks share this stdout, and print's pieces (each argument,
# the separators, the newline) can interleave with the other rank's when stdout is unbuffered
sys.stdout.write(f"RESULT {{trainer.global_rank}} {{trainer.global_step}} "
                 f"{{hashlib.sha256(blob).hexdigest()}} {{strategy.compression_stats['steps']}}\\n")
sys.stdout.flush()
"""


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_parameter_server_strategy_accumulates_and_clips(tmp_path: Path) -> None:
    """accumulate_grad_batches=3 over 8 batches: optimizer steps after batches 3, 6 and 8 (epoch
    end), one push_pull per bucket each; clipping sees the averaged gradients."""
    script = tmp_path / "acc.py"
    script.write_text(ACCUMULATE.format(examples=str(EXAMPLE.parent)))
    env = {k: v for k, v in os.environ.items()
           if k not in _JOB_VARS and not k.startswith(("GRADPRESS_", "SLURM_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = sorted(line.split()[1:] for line in proc.stdout.splitlines()
                  if line.startswith("RESULT"))
    assert [r[0] for r in rows] == ["0", "1"], proc.stdout
    assert rows[0][1:] == rows[1][1:]  # same steps, same parameters, same push_pulls
    # 3 steps x (the 4 MiB weight, the cap: alone + one bucket of the other five)
    assert rows[0][1] == "3" and rows[0][3] == "6"


def _tensors(obj: object) -> list[torch.Tensor]:
    """Every floating tensor inside nested dicts and lists."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() else []
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []

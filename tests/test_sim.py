"""The ``gradpress simulate`` pipeline model: exact model sizes, real payloads, sane physics."""

from __future__ import annotations

import argparse
import json

import pytest

from gradpress.compress import build
from gradpress.sim import MODELS, Model, Op, SimConfig, Tensor, compare, get_model, plan_chunks
from gradpress.sim import simulate as sim_one
from gradpress.sim.cli import PAPER_DEFAULTS, add_arguments, main, parse_bandwidth, parse_size, run
from gradpress.sim.rates import CodecRates, measure_rates, parse_rates

GBIT = 1e9 / 8
SPECS = ["onebit", "onebit:ef=vanilla", "topk:k=0.001,values=fp16", "topk:k=0.01",
         "randomk:k=0.01", "dithering:s=7", "fp16", "bf16"]


# -- models ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,params,tensors", [
    ("resnet50", 25_557_032, 161), ("vgg16", 138_357_544, 32), ("bert-base", 110_106_428, 206)])
def test_parameter_counts_exact(name: str, params: int, tensors: int) -> None:
    model = get_model(name)
    assert model.num_params == params
    assert len(model.tensors) == tensors
    assert len({t.name for t in model.tensors}) == tensors  # names are unique


def test_bert_encoder_matches_bertmodel_count() -> None:
    """Without the pre-training heads (cls.*) BERT-base is Hugging Face BertModel's 109,482,240."""
    model = get_model("bert-base")
    assert sum(t.numel for t in model.tensors if not t.name.startswith("cls.")) == 109_482_240
    word = next(t for t in model.tensors if t.name.endswith("word_embeddings.weight"))
    assert word.numel == 30522 * 768


@pytest.mark.parametrize("name,gmacs", [("resnet50", 4.09), ("vgg16", 15.47)])
def test_forward_macs_match_published(name: str, gmacs: float) -> None:
    assert get_model(name).macs / 1e9 == pytest.approx(gmacs, rel=0.01)


def test_torchvision_names() -> None:
    names = [t.name for t in get_model("resnet50").tensors]
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert "layer4.0.downsample.0.weight" in names and names[-1] == "fc.bias"
    vgg = [t.name for t in get_model("vgg16").tensors]
    assert vgg[:2] == ["features.0.weight", "features.0.bias"] and "features.28.weight" in vgg


# -- chunk plans and payload sizes ---------------------------------------------------------------
def _cfg(model: str = "resnet50", **kw) -> SimConfig:
    spec, base = PAPER_DEFAULTS[model]
    kw.setdefault("compression", spec)
    kw.setdefault("baseline", base)
    kw.setdefault("nodes", 4)
    return SimConfig(model=get_model(model), bandwidth=kw.pop("bandwidth", 25 * GBIT), **kw)


@pytest.mark.parametrize("spec", SPECS)
def test_payload_sizes_agree_with_codec_library(spec: str) -> None:
    cfg = _cfg("bert-base", compression=spec, baseline="none")
    chunks = plan_chunks(cfg, compressed=True)
    for c in chunks:
        assert c.payload_bytes == build(c.spec, c.numel).payload_bytes
        assert c.numel <= cfg.partition_bytes // 4
        assert c.compressed == (_tensor_bytes(cfg, c.tensor) >= cfg.min_compress_bytes)
    per_tensor: dict[str, int] = {}
    for c in chunks:
        per_tensor[c.tensor] = per_tensor.get(c.tensor, 0) + c.numel
    assert per_tensor == {t.name: t.numel for t in cfg.model.tensors}
    assert sim_one(cfg).push_bytes == sum(c.payload_bytes for c in chunks)


def _tensor_bytes(cfg: SimConfig, name: str) -> int:
    return 4 * next(t.numel for t in cfg.model.tensors if t.name == name)


@pytest.mark.parametrize("indices,ratio", [("packed", 16 / (0.001 * (16 + 20))),
                                            ("int32", 333)])
def test_bert_topk_ratio_against_fp16(indices: str, ratio: float) -> None:
    """The paper's 333x (top-k 0.1%, fp16 values, int32 indices) against mixed precision, per
    4 MB chunk; with the default bit-packed 20-bit indices about 444x."""
    spec = f"topk:k=0.001,values=fp16,indices={indices}"
    cfg = _cfg("bert-base", compression=spec)
    big = [c for c in plan_chunks(cfg, True) if c.compressed and c.numel == 1 << 20]
    dense = build("fp16", 1 << 20).payload_bytes
    assert big and all(c.payload_bytes == build(spec, c.numel).payload_bytes for c in big)
    assert all(dense / c.payload_bytes == pytest.approx(ratio, rel=0.01) for c in big)


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("spec", SPECS)
def test_compression_never_increases_bytes(model: str, spec: str) -> None:
    for mcb in (0, 1 << 20):
        cfg = _cfg(model, compression=spec, baseline="none", min_compress_bytes=mcb)
        base = sum(c.payload_bytes for c in plan_chunks(cfg, False))
        comp = sum(c.payload_bytes for c in plan_chunks(cfg, True))
        assert comp <= base


def test_compressed_run_moves_fewer_bytes_on_links() -> None:
    cmp = compare(_cfg("vgg16"))
    assert cmp.compressed.network_ms < cmp.baseline.network_ms
    assert cmp.compressed.push_bytes < cmp.baseline.push_bytes / 20


# -- physics of the simulation -------------------------------------------------------------------
BANDWIDTHS = [1, 5, 25, 100, 400]


@pytest.mark.parametrize("model", list(MODELS))
def test_more_bandwidth_never_slows_and_speedup_tracks_scarcity(model: str) -> None:
    results = [compare(_cfg(model, bandwidth=b * GBIT)) for b in BANDWIDTHS]
    for slow, fast in zip(results, results[1:]):
        assert fast.baseline.iteration_ms <= slow.baseline.iteration_ms * (1 + 1e-12)
        assert fast.compressed.iteration_ms <= slow.compressed.iteration_ms * (1 + 1e-12)
        assert fast.speedup <= slow.speedup * (1 + 1e-12)
    assert results[0].speedup > 1.5  # 1 Gbit/s: communication dominates, compression wins


def test_iteration_never_shorter_than_compute() -> None:
    for bw in (1, 1000):
        cmp = compare(_cfg("resnet50", bandwidth=bw * GBIT))
        for r in (cmp.baseline, cmp.compressed):
            assert r.iteration_ms >= r.compute_ms and r.exposed_ms >= 0


def test_per_layer_forward_never_slower_than_waiting_for_all() -> None:
    for model in ("resnet50", "vgg16"):
        a = compare(_cfg(model, forward="all", bandwidth=10 * GBIT))
        b = compare(_cfg(model, forward="layer", bandwidth=10 * GBIT))
        assert b.baseline.iteration_ms <= a.baseline.iteration_ms + 1e-9
        assert b.compressed.iteration_ms <= a.compressed.iteration_ms + 1e-9


def test_single_node_uses_no_network() -> None:
    cmp = compare(_cfg("resnet50", nodes=1))
    assert cmp.baseline.network_ms == 0 and cmp.compressed.network_ms == 0
    assert cmp.compressed.iteration_ms >= cmp.baseline.iteration_ms  # only codec cost is left


def test_dedicated_servers_need_enough_machines() -> None:
    few = compare(_cfg("vgg16", server_machines=1, nodes=4)).baseline.iteration_ms
    many = compare(_cfg("vgg16", server_machines=4, nodes=4)).baseline.iteration_ms
    assert many < few


def test_one_chunk_timeline_is_exact() -> None:
    """One 4 MB tensor, 2 nodes, 1 GPU each: the remote node's critical path by hand."""
    n = 1 << 20
    model = Model("toy", (Op("w", 1.0, (Tensor("w", n),)),), "samples", 1, 1.0, "test")
    dense = CodecRates(10.0, 10.0, 8.0)
    cfg = SimConfig(model=model, bandwidth=1e9, nodes=2, gpus_per_node=1, compute_ms=10.0,
                    compression="none", pcie=5e9, dense_rates=dense, server_threads=1)
    r = sim_one(cfg, compressed=False)
    (c,) = plan_chunks(cfg, False)
    add = 4 * n / 8e9
    copy = 4 * n / 5e9
    wire = c.payload_bytes / 1e9
    # ready at 10 ms; local push arrives after the copy and is summed while the remote one is on
    # the wire; the remote sum ends the round; the reply crosses the wire and is copied back
    expected = 0.010 + copy + wire + add + wire + copy
    assert r.iteration_ms == pytest.approx(1e3 * expected, rel=1e-12)
    assert r.network_ms == pytest.approx(1e3 * wire, rel=1e-12)


# -- arguments -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,bps", [("25gbit", 25 * GBIT), ("25 gbit", 25 * GBIT),
                                      ("25Gb/s", 25 * GBIT), ("3.125GB/s", 3.125e9),
                                      ("100mbit", 100e6 / 8), ("1e9bit", 1e9 / 8),
                                      ("500MB/s", 5e8)])
def test_parse_bandwidth_forms(text: str, bps: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("bad", ["25 gigs", "25", "fast", "25gbits", "-1gbit", "0gbit", "25GB"])
def test_bad_bandwidth_lists_valid_forms(bad: str) -> None:
    with pytest.raises(ValueError, match="bandwidth") as e:
        parse_bandwidth(bad)
    if "greater" not in str(e.value):
        assert "gbit" in str(e.value) and "GB/s" in str(e.value)


def test_parse_size() -> None:
    assert parse_size("4MB") == 4 << 20 and parse_size("512KB") == 512 << 10
    assert parse_size("4096000") == 4096000 and parse_size("0") == 0
    with pytest.raises(ValueError, match="4MB"):
        parse_size("4 megs")


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(ValueError, match="resnet50, vgg16, bert-base"):
        get_model("resnet51")
    with pytest.raises(ValueError, match="valid models"):
        run(_args("--model", "alexnet"))


def test_bad_config_values() -> None:
    with pytest.raises(ValueError, match="unknown codec 'zip'.*onebit"):
        _cfg(compression="zip")
    with pytest.raises(ValueError, match="nodes"):
        _cfg(nodes=0)
    with pytest.raises(ValueError, match="baseline.*none, fp16, bf16"):
        _cfg(baseline="fp8")
    with pytest.raises(ValueError, match="forward.*all, layer"):
        _cfg(forward="sometimes")
    with pytest.raises(ValueError, match="codec-gbps.*measure"):
        parse_rates("fast", "onebit")


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_args("--model", "vgg16", "--nodes", "2", "--compute-ms", "100")) == 0
    out = capsys.readouterr().out
    for label in ("compute", "exposed communication", "codec CPU", "iteration time", "speedup",
                  "training time reduction"):
        assert label in out
    assert run(_args("--model", "bert-base", "--nodes", "2", "--bandwidth", "10Gb/s",
                     "--json")) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"]["params"] == 110_106_428 and d["config"]["baseline"] == "fp16"
    assert d["speedup"] == pytest.approx(d["baseline"]["iteration_ms"]
                                         / d["compressed"]["iteration_ms"])


def test_cli_main_reports_bad_bandwidth(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--bandwidth", "25 gigs"])
    assert e.value.code == 2 and "25 gigs" in capsys.readouterr().err


def test_measure_rates_runs_the_codec() -> None:
    r = measure_rates("onebit:ef=vanilla", numel=1 << 14, reps=1)
    assert r.compress > 0 and r.decompress > 0 and r.decompress_add > 0

"""gradpress.fsdp: FSDP2's reduce-scatter with compressed payloads, real processes on gloo.

One spawn of two ranks and one of four run every distributed scenario and save their results;
the tests below check them:

* ``none``: FSDP2 with the compressed reduce-scatter gives bit-identical parameters to plain
  FSDP2 at world 2 (nested ``fully_shard``, ``reshard_after_forward`` True and False, gradient
  accumulation with ``set_requires_gradient_sync``, a bf16 reduce dtype); at world 4 gloo sums
  in a ring order of its own, so the result equals the rank-order sum bit for bit and gloo's
  within float32 rounding.
* Direct calls of the comm: every owner's output is the rank-order sum of the decoded payloads
  (AVG / SUM / PREMUL_SUM) bit for bit, and every (rank, shard) residual satisfies the
  error-feedback identity (as tests/test_ef.py checks it, in float64).
* the device-side checks (CUDA's deferred checks, forced on) give the immediate checks' bits.
* onebit trains (loss falls), resumes bit-exactly from a checkpoint (DCP for the model and
  optimizer, ``state.save``/``load`` for the residuals), refuses residuals of another world
  size; a NaN input fails every rank (naming the sender) instead of hanging the others; a
  gradpress layer-wise optimizer on sharded parameters is refused.
"""

import datetime
import gc
import os
import socket
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import gradpress.fsdp
from gradpress.compress import build
from gradpress.fsdp import CompressedReduceScatter, FSDPCompressionState
from gradpress.fsdp.comm import reduce_factor

SHARD = 37  # elements per shard in the direct calls (odd: no power-of-two layout)
STEPS = 3


# -- helpers run inside the ranks -----------------------------------------------------------------
def make_model(raf: bool = True, mpp=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 32), nn.ReLU(),
                                                                  nn.Linear(32, 32)),
                      nn.ReLU(), nn.Linear(32, 4))
    kw = {"reshard_after_forward": raf, **({"mp_policy": mpp} if mpp is not None else {})}
    for layer in (m[0], m[2][0], m[2], m[4]):  # nested: m[2][0] inside m[2]
        fully_shard(layer, **kw)
    fully_shard(m, **kw)
    return m


def batch(rank: int, t: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * t + 10 * micro + rank)
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(8, 4, generator=torch.Generator().manual_seed(7))
    return x, torch.tanh(x @ w)  # a learnable target


def run_steps(m, opt, rank: int, steps: range, accum: int = 1) -> list[float]:
    losses = []
    for t in steps:
        for micro in range(accum):
            m.set_requires_gradient_sync(micro == accum - 1)
            x, y = batch(rank, t, micro)
            loss = ((m(x) - y) ** 2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full(m) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in m.parameters()]


def train(rank: int, spec, steps: int = 4, **kw) -> tuple[list[torch.Tensor], list[float]]:
    accum, lr = kw.pop("accum", 1), kw.pop("lr", 0.05)
    m = make_model(**kw)
    if spec is not None:
        gradpress.fsdp.compress(m, spec, "vanilla", min_compress_bytes=0)
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    losses = run_steps(m, opt, rank, range(steps), accum)
    return full(m), losses


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[bool, float]:
    return (all(torch.equal(x, y) for x, y in zip(a, b)),
            max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b)))


def scenario_none(rank: int, res: dict, configs: dict) -> None:
    for name, kw in configs.items():
        res[f"none_{name}"] = same(train(rank, None, **kw)[0], train(rank, "none", **kw)[0])


def direct_input(rank: int, t: int, world: int) -> torch.Tensor:
    return torch.randn(world * SHARD, generator=torch.Generator().manual_seed(100 * t + rank))


def scenario_direct(rank: int, world: int, spec: str, op, res: dict, label: str) -> None:
    """Call the comm as FSDP2 does, recording what it sent, its residuals and its output."""
    st = FSDPCompressionState(spec, "vanilla", min_compress_bytes=0)
    comm = CompressedReduceScatter(st, "block", 3)
    rec = []
    for t in range(STEPS):
        out = torch.empty(SHARD)
        comm(out, direct_input(rank, t, world), dist.group.WORLD, op)
        codecs = st.modules["block"]
        rec.append({"send": codecs.send.clone(), "out": out,
                    "residuals": [w.residual.clone() for w in codecs.workers]})
    res[("direct", spec, label)] = rec


def scenario_gloo(rank: int, world: int, res: dict) -> None:
    """gloo's own reduce-scatter of the direct inputs, for the world-4 comparison."""
    out = torch.empty(SHARD)
    dist.reduce_scatter_single(out, direct_input(rank, 0, world), op=dist.ReduceOp.AVG)
    res["gloo_avg"] = out


def scenario_resume(rank: int, res: dict, root: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build_run():
        m = make_model()
        st = gradpress.fsdp.compress(m, "onebit", "vanilla", min_compress_bytes=0)
        return m, st, torch.optim.AdamW(m.parameters(), lr=0.01)

    m, st, opt = build_run()
    run_steps(m, opt, rank, range(3))
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)
    st.save(root)
    run_steps(m, opt, rank, range(3, 5))
    m2, st2, opt2 = build_run()
    msd, osd = get_state_dict(m2, opt2)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=root)
    set_state_dict(m2, opt2, model_state_dict=msd, optim_state_dict=osd)
    st2.load(root)
    run_steps(m2, opt2, rank, range(3, 5))
    res["resume"] = same(full(m), full(m2))
    res["resume_calls"] = (st.stats()["compressed_calls"], st2.stats()["compressed_calls"])
    sd = st.state_dict()
    sd["world_size"] += 1
    res["other_world"] = [refused(lambda: st.load_state_dict(sd))]  # a state that has run: now
    fresh = FSDPCompressionState("onebit", "vanilla", min_compress_bytes=0)
    fresh.load_state_dict(sd)  # a new state learns its group at its first call: refused there
    comm = CompressedReduceScatter(fresh, "", 0)
    x = direct_input(rank, 0, dist.get_world_size())
    res["other_world"].append(refused(lambda: comm(torch.empty(SHARD), x, dist.group.WORLD,
                                                   dist.ReduceOp.AVG)))


def refused(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "accepted"


def scenario_nan(rank: int, world: int, res: dict) -> None:
    st = FSDPCompressionState("onebit", "vanilla", min_compress_bytes=0)
    comm = CompressedReduceScatter(st, "block", 0)
    x = direct_input(rank, 0, world)
    if rank == 1:
        x[5] = float("nan")  # shard 0, owned by rank 0
    try:
        comm(torch.empty(SHARD), x, dist.group.WORLD, dist.ReduceOp.AVG)
        res["nan"] = ("none", "")
    except ValueError as e:
        res["nan"] = (type(e).__name__, str(e))


def scenario_routing(rank: int, res: dict) -> None:
    """dense_steps: the first calls per module are FSDP2's own; async_op=True gives a work."""
    m = make_model()
    st = gradpress.fsdp.compress(m, "onebit", "vanilla", min_compress_bytes=0, dense_steps=2)
    run_steps(m, torch.optim.SGD(m.parameters(), lr=0.05), rank, range(3))
    res["routing"] = st.stats()
    comm = CompressedReduceScatter(FSDPCompressionState("onebit", min_compress_bytes=0), "", 0)
    out = torch.empty(SHARD)
    work = comm(out, direct_input(rank, 0, dist.get_world_size()), dist.group.WORLD,
                dist.ReduceOp.AVG, async_op=True)
    work.wait()
    res["async"] = out


def scenario_deferred(rank: int, res: dict) -> None:
    """The device-side checks (CUDA's, forced on here) give the immediate checks' bits."""
    def run(defer: bool | None) -> list[torch.Tensor]:
        m = make_model()
        st = gradpress.fsdp.compress(m, "onebit", "vanilla", min_compress_bytes=0)
        st._defer = defer
        run_steps(m, torch.optim.SGD(m.parameters(), lr=0.05), rank, range(STEPS))
        res.setdefault("deferred_pending", []).append(len(st._checks))
        st.check_pending()
        return full(m)

    res["deferred"] = same(run(None), run(True))


def scenario_optimizer(res: dict) -> None:
    from gradpress.optim import LAMB
    m = make_model()
    gradpress.fsdp.check_optimizer(torch.optim.AdamW(m.parameters()))
    try:
        gradpress.fsdp.check_optimizer(LAMB(m.parameters(), lr=0.01))
        res["lamb"] = "accepted"
    except TypeError as e:
        res["lamb"] = str(e)


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    res: dict = {"module_file": gradpress.fsdp.__file__}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    configs = {"nested": {}, "no_reshard": {"raf": False}, "accum": {"accum": 2},
               "bf16": {"mpp": bf16}} if world == 2 else {"nested": {}}
    scenario_none(rank, res, configs)
    for spec in ("none", "onebit", "topk:k=0.2"):
        scenario_direct(rank, world, spec, dist.ReduceOp.AVG, res, "avg")
    if world == 2:
        scenario_direct(rank, world, "none", dist.ReduceOp.SUM, res, "sum")
        scenario_direct(rank, world, "onebit", dist._make_nccl_premul_sum(0.25), res, "premul")
        scenario_optimizer(res)
        scenario_routing(rank, res)
    scenario_gloo(rank, world, res)
    scenario_deferred(rank, res)
    for spec in (None, "onebit"):
        res[f"losses_{spec}"] = train(rank, spec, steps=40, raf=False, lr=0.3)[1]
    scenario_resume(rank, res, os.path.join(out_dir, "ckpt"))
    scenario_nan(rank, world, res)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort at interpreter exit (see tests/test_ddp_hook.py)


# -- the tests ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, out, limit: float) -> list[dict]:
    ctx = mp.start_processes(worker, args=(world, _free_port(), str(out)), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + limit
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"the {world} FSDP ranks did not finish within {limit:.0f} s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def ranks(request, tmp_path_factory) -> list[dict]:
    return _spawn(request.param, tmp_path_factory.mktemp(f"fsdp{request.param}"), 150)


#: for the checks made at world 2 only (the same run as the world-2 case of ``ranks``)
WORLD2 = pytest.mark.parametrize("ranks", [2], indirect=True, ids=["world2"])


@pytest.mark.cluster
def test_ranks_import_this_worktree(ranks):
    want = os.path.dirname(gradpress.fsdp.__file__)
    assert all(os.path.dirname(r["module_file"]) == want for r in ranks)


@pytest.mark.cluster
def test_none_matches_plain_fsdp2(ranks):
    for rank, res in enumerate(ranks):
        for name in [k for k in res if str(k).startswith("none_")]:
            equal, diff = res[name]
            if len(ranks) == 2:
                assert equal, f"rank {rank}, {name}: max |diff| {diff}"
            else:  # gloo's ring order vs the rank order: float32 rounding over 4 steps
                assert diff < 1e-6, f"rank {rank}, {name}: max |diff| {diff}"


def _decoded(spec: str, send: torch.Tensor, shard: int) -> torch.Tensor:
    codec = build(spec, SHARD)
    return codec.decompress(send[shard * codec.payload_bytes:(shard + 1) * codec.payload_bytes])


@pytest.mark.cluster
@pytest.mark.parametrize("spec", ["none", "onebit", "topk:k=0.2"])
def test_owner_output_is_the_rank_order_reduction(ranks, spec):
    world = len(ranks)
    ops = ["avg"] + (["sum"] if world == 2 and spec == "none" else [])
    for op in ops:
        for t in range(STEPS):
            for owner, res in enumerate(ranks):
                acc = torch.zeros(SHARD)
                for src in range(world):
                    acc += _decoded(spec, ranks[src][("direct", spec, op)][t]["send"], owner)
                if op == "avg":
                    acc /= world
                assert torch.equal(res[("direct", spec, op)][t]["out"], acc), (spec, op, t, owner)


@pytest.mark.cluster
@WORLD2
def test_premul_sum_multiplies_the_sum(ranks):
    op = ("direct", "onebit", "premul")
    assert reduce_factor(dist._make_nccl_premul_sum(0.25), 2) == ("mul", 0.25)
    for owner, res in enumerate(ranks):
        acc = _decoded("onebit", ranks[0][op][0]["send"], owner) + \
            _decoded("onebit", ranks[1][op][0]["send"], owner)
        assert torch.equal(res[op][0]["out"], acc * 0.25)


@pytest.mark.cluster
@pytest.mark.parametrize("spec", ["onebit", "topk:k=0.2"])
def test_error_feedback_identity_per_shard(ranks, spec):
    """e_t = fp32(fp32(x_t + e_{t-1}) - D(payload_t)) for every rank and shard (1 ulp at the
    scale |p| + |D|, as tests/test_ef.py), so sum_t D(payload_t) + e_T = sum_t x_t."""
    world, op = len(ranks), "avg"
    for rank, res in enumerate(ranks):
        for s in range(world):
            e_prev = np.zeros(SHARD)
            for t in range(STEPS):
                rec = res[("direct", spec, op)][t]
                x = direct_input(rank, t, world)[s * SHARD:(s + 1) * SHARD].double().numpy()
                p32 = (x + e_prev).astype(np.float32).astype(np.float64)
                d = _decoded(spec, rec["send"], s).double().numpy()
                got = rec["residuals"][s].double().numpy()
                tol = np.spacing((np.abs(p32) + np.abs(d)).astype(np.float32))
                err = np.abs(got - (p32 - d).astype(np.float32))
                assert np.all(err <= tol), (rank, s, t, err.max())
                e_prev = got
            assert np.abs(e_prev).max() > 0  # lossy: something was held back


@pytest.mark.cluster
def test_none_rank_order_vs_gloo(ranks):
    """At world 2 the order cannot matter; at 4, within float32 rounding of the sum."""
    for res in ranks:
        ours = res[("direct", "none", "avg")][0]["out"]
        if len(ranks) == 2:
            assert torch.equal(ours, res["gloo_avg"])
        else:
            torch.testing.assert_close(ours, res["gloo_avg"], rtol=0, atol=1e-6)


@pytest.mark.cluster
def test_deferred_checks_match_the_immediate_ones(ranks):
    for rank, res in enumerate(ranks):
        assert res["deferred"][0], f"rank {rank}: max |diff| {res['deferred'][1]}"
        # immediate: none pending; deferred: the last backward pass's 4 modules still are
        assert res["deferred_pending"] == [0, 4], res["deferred_pending"]


@pytest.mark.cluster
def test_onebit_trains(ranks):
    for res in ranks:
        losses, plain = res["losses_onebit"], res["losses_None"]
        assert np.mean(losses[-10:]) < 0.7 * np.mean(losses[:5]), losses
        assert np.mean(losses[-10:]) < 1.5 * np.mean(plain[-10:]), (losses, plain)


@pytest.mark.cluster
def test_exact_resume_and_other_world_size_refused(ranks):
    for rank, res in enumerate(ranks):
        assert res["resume"][0], f"rank {rank}: max |diff| {res['resume'][1]}"
        assert res["resume_calls"][1] > 0
        for msg in res["other_world"]:
            assert f"world size {len(ranks) + 1}" in msg and "new FSDPCompressionState" in msg, \
                msg


@pytest.mark.cluster
def test_nan_input_fails_every_rank_naming_the_sender(ranks):
    for rank, res in enumerate(ranks):
        kind, msg = res["nan"]
        if rank == 1:
            # a ValueError (the codecs' subclass lets the DDP pipeline tell it apart)
            assert kind in ("ValueError", "_NonFiniteInputError") and "non-finite" in msg, \
                res["nan"]
        else:
            assert kind == "PayloadError" and "rank 1" in msg, res["nan"]


@pytest.mark.cluster
@WORLD2
def test_dense_steps_and_async_op(ranks):
    for res in ranks:  # 4 modules with parameters (the root has none), 3 steps, 2 of them dense
        assert res["routing"]["plain_calls"] == 8 and res["routing"]["compressed_calls"] == 4, \
            res["routing"]
        assert torch.isfinite(res["async"]).all() and res["async"].abs().sum() > 0


@pytest.mark.cluster
@WORLD2
def test_layerwise_optimizer_refused_on_shards(ranks):
    for res in ranks:
        assert "trust ratio" in res["lamb"], res["lamb"]


# -- without processes ----------------------------------------------------------------------------
def test_state_validates_its_arguments():
    with pytest.raises(TypeError, match="compression"):
        FSDPCompressionState(None)
    with pytest.raises(ValueError, match="min_compress_bytes"):
        FSDPCompressionState("onebit", min_compress_bytes=-1)
    with pytest.raises(ValueError, match="unknown codec"):
        FSDPCompressionState("onebits")
    with pytest.raises(ValueError, match="lr"):
        FSDPCompressionState("onebit", lr=0)


def test_state_refuses_a_foreign_state_dict():
    st = FSDPCompressionState("onebit", "vanilla")
    with pytest.raises(ValueError, match="expected keys"):
        st.load_state_dict({"modules": {}})
    sd = FSDPCompressionState("topk:k=0.1", "vanilla").state_dict()
    with pytest.raises(ValueError, match="compression"):
        st.load_state_dict(sd)


def test_reduce_ops():
    assert reduce_factor(dist.ReduceOp.AVG, 4) == ("div", 4.0)
    assert reduce_factor(dist.ReduceOp.SUM, 4) is None
    with pytest.raises(ValueError, match="not supported"):
        reduce_factor(dist.ReduceOp.MAX, 4)


def test_save_and_load_without_a_group(tmp_path):
    st = FSDPCompressionState("onebit", "vanilla", dense_steps=3)
    st.uses_compression("layer", 1 << 20)  # one dense call counted
    path = st.save(tmp_path)
    assert path == tmp_path / "gradpress_fsdp" / "rank0.pt"
    again = FSDPCompressionState("onebit", "vanilla", dense_steps=3)
    again.load(tmp_path)
    assert again.state_dict() == st.state_dict()
    with pytest.raises(ValueError, match="no residuals for this rank"):
        again.load(tmp_path / "elsewhere")


def test_compress_needs_an_fsdp_module():
    with pytest.raises(TypeError, match="fully_shard"):
        gradpress.fsdp.compress(nn.Linear(2, 2))


# -- the torchrun example -------------------------------------------------------------------------
@pytest.mark.cluster
def test_torchrun_example_trains_and_resumes_bit_exactly(tmp_path):
    """examples/fsdp_torchrun.py under torchrun (2 ranks, gloo): 40 steps in one run and 20 + 20
    with a checkpoint between end on the same bits; the loss falls; onebit sends under 1/25 of
    fp32's reduce-scatter bytes."""
    from helpers import ROOT, results, run_env, torchrun
    script, env = ROOT / "examples" / "fsdp_torchrun.py", run_env()
    torchrun(2, script, ["--steps", "40", "--out", str(tmp_path / "whole")], env)
    ckpt = str(tmp_path / "ckpt")
    torchrun(2, script, ["--steps", "20", "--ckpt", ckpt], env)
    torchrun(2, script, ["--steps", "20", "--ckpt", ckpt, "--out", str(tmp_path / "resumed")],
             env)
    whole, resumed = results(tmp_path / "whole", 2), results(tmp_path / "resumed", 2)
    assert len({r["param_hash"] for r in whole + resumed}) == 1
    for r in whole:
        assert np.mean(r["losses"][-10:]) < 0.8 * np.mean(r["losses"][:10]), r["losses"]
        s = r["stats"]
        assert s["compressed_calls"] > 0 and 25 * s["payload_bytes"] < s["dense_bytes"], s


@pytest.mark.cluster
def test_lightning_model_parallel_strategy(tmp_path):
    """examples/lightning_fsdp.py: Lightning's FSDP2 route (ModelParallelStrategy, the module
    shards itself in configure_model and installs gradpress there), 2 CPU processes."""
    import json
    import subprocess
    pytest.importorskip("lightning")
    from helpers import ROOT
    job = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
           "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")
    env = {k: v for k, v in os.environ.items()
           if k not in job and not k.startswith(("GRADPRESS_", "SLURM_", "TORCHELASTIC"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "lightning_fsdp.py"),
                           "--out", str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["params_sha256"] == ranks[1]["params_sha256"]
    for r in ranks:
        losses, s = r["losses"], r["stats"]
        assert np.mean(losses[-8:]) < 0.5 * np.mean(losses[:8]), losses
        assert s["compressed_calls"] > 0 and 25 * s["payload_bytes"] < s["dense_bytes"], s

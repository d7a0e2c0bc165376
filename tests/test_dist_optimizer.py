"""DistributedOptimizer end to end: real worker and server processes from ``gradpress launch``.

One launch runs every scenario (cluster start-up dominates the cost); each worker saves what it saw
and the test compares workers against each other and against a single-process reference.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import gradpress as gp

CODECS = ["fp16", "onebit", "topk:k=0.1", "randomk:k=0.1", "dithering:s=7", "int4", "int3",
          "int8:block=32"]

WORKER = textwrap.dedent('''
    import sys, torch, gradpress as gp
    out = sys.argv[1]
    CODECS = sys.argv[2].split(";")
    gp.init()
    r, W = gp.rank(), gp.size()
    res = {}

    def net(seed, extra=False):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
        if extra:
            m.unused = torch.nn.Parameter(torch.ones(5))
        return m

    def data(step, rank):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)

    def train(tag, steps, make_opt, **kw):
        model = net(3, extra=kw.pop("extra", False))
        opt = gp.DistributedOptimizer(make_opt(model), named_parameters=[
            (f"{tag}.{n}", p) for n, p in model.named_parameters()], **kw)
        gp.broadcast_parameters({f"{tag}.{n}": p for n, p in model.state_dict().items()})
        for step in range(steps):
            opt.zero_grad()
            x, y = data(step, r)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return model, opt

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.1)

    # 1. exact path: compare with one process on the concatenated batch (in the test)
    m, _ = train("none", 4, sgd, compression="none")
    res["none"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    # 1b. worker-side Nesterov momentum on tensors small enough to travel uncompressed
    m, _ = train("mom", 4, lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                 compression="onebit", ef="vanilla", momentum="nesterov", mu=0.9,
                 min_compress_bytes=1 << 20)
    res["momentum_small"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    # 2. every codec with error feedback: replicas must be bit-identical
    for spec in CODECS:
        m, _ = train(spec.split(":")[0], 3, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
                     compression=spec, ef="vanilla", min_compress_bytes=0)
        res[spec] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    # 2b. gp.CLAN, the paper's method: LANS behind the two-way onebit gradient, 1 dense step
    model = net(3)
    opt = gp.CLAN([(f"clan.{n}", p) for n, p in model.named_parameters()], lr=1e-2,
                  dense_steps=1, min_compress_bytes=0)
    for step in range(3):
        opt.zero_grad()
        x, y = data(step, r)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    from gradpress.optim import LANS
    res["clan_is_lans"] = torch.tensor(isinstance(opt, LANS))
    res["clan_normalizes"] = torch.tensor(opt.param_groups[0]["normalize_grad"])
    res["clan"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # 2c. gp.OneBitLANS: a dense step, then the momenta communicated compressed
    EFS = {"vanilla": "vanilla", "corrected": "corrected",
           "vanilla:decay=0.9": "vanilla_decay", "vanilla:decay=0.9,server_decay=1": "srv1",
           "vanilla:decay=0.9,server_decay=0.9": "srv09",
           "vanilla:decay=0.8,server_decay=1": "srv1_d08",
           "vanilla:decay=0.8,server_decay=1,anneal=1": "srv1_d08_anneal"}
    for codec, ef, exact in (("onebit", "vanilla", ()), ("none", "vanilla", ()),
                             ("onebit", "corrected", ()), ("onebit", "exact", ("*",)),
                             ("onebit", "vanilla:decay=0.9", ()),
                             ("onebit", "vanilla:decay=0.9,server_decay=1", ()),
                             ("onebit", "vanilla:decay=0.9,server_decay=0.9", ()),
                             ("onebit", "vanilla:decay=0.8,server_decay=1", ()),
                             ("onebit", "vanilla:decay=0.8,server_decay=1,anneal=1", ()),
                             ("onebit", "default", ())):
        model = net(3)
        key = codec if ef == "vanilla" else f"{codec}_{EFS.get(ef, ef)}"
        kw = {} if ef == "default" else {"ef": ef if ef in EFS else "vanilla"}
        opt = gp.OneBitLANS([(f"clanm_{key}.{n}", p) for n, p in model.named_parameters()],
                            lr=1e-2, dense_steps=1, min_compress_bytes=0, compression=codec,
                            uncompressed_params=exact, **kw)
        for step in range(3):
            opt.zero_grad()
            x, y = data(step, r)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        res[f"clanm_{key}"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        res[f"clanm_{key}_active"] = torch.tensor(opt.compression_active)
    # 3. gradient accumulation: one push_pull per parameter per step, not per backward pass
    model = net(3)
    opt = gp.DistributedOptimizer(sgd(model), named_parameters=[
        (f"acc.{n}", p) for n, p in model.named_parameters()], backward_passes_per_step=2,
        min_compress_bytes=1 << 20)
    before = gp.stats()["steps"]
    for step in range(2):
        for micro in range(2):
            x, y = data(10 * step + micro, r)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step(); opt.zero_grad()
    res["acc_pushes"] = torch.tensor(gp.stats()["steps"] - before)
    # 4. a parameter without gradient does not hang the step
    m, _ = train("unused", 2, sgd, extra=True)
    res["unused"] = m.unused.detach().clone()
    # 5. bf16 parameters: gradients decoded to fp32 for compression, written back as bf16
    model = net(3).to(torch.bfloat16)
    opt = gp.DistributedOptimizer(sgd(model), named_parameters=[
        (f"bf16.{n}", p) for n, p in model.named_parameters()], compression="onebit", ef="vanilla",
        min_compress_bytes=0)
    for step in range(2):
        x, y = data(step, r)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x.bfloat16()).float(), y).backward()
        opt.step()
    res["bf16"] = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    # 6. AMP, GradScaler, nan_policy="skip": an overflow on worker 1 skips the step everywhere
    model = net(3)
    opt = gp.DistributedOptimizer(sgd(model), named_parameters=[
        (f"amp.{n}", p) for n, p in model.named_parameters()], compression="onebit", ef="vanilla",
        min_compress_bytes=0, nan_policy="skip")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    skipped = []
    for step in range(3):
        opt.zero_grad()
        x, y = data(step, r)
        if step == 1 and r == 1:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        opt.synchronize()
        skipped.append(opt.step_skipped)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    res["amp_skipped"] = torch.tensor(skipped)
    res["amp_scale"] = torch.tensor(scaler.get_scale())
    res["amp"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # 7. dense_steps: uncompressed for the first N steps (exact), compressed after them
    m, _ = train("wu4", 4, sgd, compression="onebit", ef="vanilla", min_compress_bytes=0,
                 dense_steps=4)
    res["warmup_all"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    m, _ = train("wu2", 4, sgd, compression="onebit", ef="vanilla", min_compress_bytes=0,
                 dense_steps=2, uncompressed_params=())
    res["warmup_half"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    # 8. uncompressed_params: the named tensors travel exactly, the others compressed
    m, _ = train("ex", 4, sgd, compression="onebit", ef="vanilla", min_compress_bytes=0,
                 uncompressed_params=["ex.*"])
    res["exact_all"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    m, _ = train("ex1", 1, sgd, compression="onebit", ef="vanilla", min_compress_bytes=0,
                 uncompressed_params=["ex1.0.*"])
    res["exact_first"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    m, _ = train("none1", 1, sgd, compression="none")
    res["none_1step"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    m, _ = train("momx", 4, sgd, compression="onebit", ef="vanilla", momentum="nesterov",
                 mu=0.9, min_compress_bytes=0, uncompressed_params=["momx.*"])
    res["exact_momentum"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    # 9. an LR scheduler built before the wrapper, and a closure doing forward and backward:
    # both still average (the exact path equals scenario 1)
    model = net(3)
    base = sgd(model)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=100)
    opt = gp.DistributedOptimizer(base, named_parameters=[
        (f"sch.{n}", p) for n, p in model.named_parameters()], compression="none")
    gp.broadcast_parameters({f"sch.{n}": p for n, p in model.state_dict().items()})
    losses = []
    for step in range(4):
        def closure():
            opt.zero_grad()
            x, y = data(step, r)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss
        losses.append(float(opt.step(closure)))
        sched.step()
    res["closure_loss_ok"] = torch.tensor(all(v > 0 for v in losses))  # step returned the loss
    res["sched_closure"] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    # 10. gp.OneBitLANS on an embedding whose rows 20-29 never get a gradient: the rows are
    # held (a "(rows)" key), not walked by the one-bit code
    torch.manual_seed(5)
    emb = torch.nn.Sequential(torch.nn.Embedding(30, 16), torch.nn.Linear(16, 3))
    start = emb[0].weight.detach().clone()
    opt = gp.OneBitLANS([(f"rows.{n}", p) for n, p in emb.named_parameters()], lr=1e-2,
                        dense_steps=2, min_compress_bytes=0)
    for step in range(8):
        g = torch.Generator().manual_seed(1000 * step + r)
        x, y = torch.randint(0, 20, (8,), generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(emb(x), y).backward()
        opt.step()
    plan = opt.plan()
    res["rows_key"] = torch.tensor(any(t.name == "rows.0.weight (rows)" for t in plan.tensors))
    res["rows_compressed"] = torch.tensor(next(
        t for t in plan.tensors if t.name == "rows.0.weight").codec == "onebit")
    res["rows_unused"] = emb[0].weight.detach()[20:].clone()
    res["rows_unused_start"] = start[20:]
    res["rows_used_moved"] = (emb[0].weight.detach()[:20] - start[:20]).norm()
    # 11. the health watch's recovery path, forced (threshold 1: every probe is a "drift"):
    # exact keys for two steps, then compressed under fresh keys; counted in gp.stats()
    from gradpress.optim.health import HealthWatch
    torch.manual_seed(6)
    m = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    opt = gp.OneBitLANS([(f"watch.{n}", p) for n, p in m.named_parameters()], lr=1e-2,
                        dense_steps=2, min_compress_bytes=0, uncompressed_params=())
    opt.watch = HealthWatch(every=2, threshold=1.0, recover_steps=2)
    before = gp.stats()["drift_recoveries"]
    for step in range(9):
        x, y = data(step, r)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    res["watch_recoveries"] = torch.tensor(gp.stats()["drift_recoveries"] - before)
    res["watch_generation"] = torch.tensor(opt.generation(0))
    res["watch"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    res["watch_plan"] = torch.tensor("drifted and recovered" in opt.plan().format())
    # 11b. resumed into a fresh optimizer (no watch: no new drift), the drifts before the
    # checkpoint are not counted again (review of issue 54)
    saved = opt.state_dict()
    opt = gp.OneBitLANS([(f"watch.{n}", p) for n, p in m.named_parameters()], lr=1e-2,
                        dense_steps=2, min_compress_bytes=0, uncompressed_params=())
    opt.load_state_dict(saved)
    opt.watch = None
    before = gp.stats()["drift_recoveries"]
    x, y = data(9, r)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(x), y).backward()
    opt.step()
    res["watch_resumed_recoveries"] = torch.tensor(gp.stats()["drift_recoveries"] - before)
    res["watch_resumed_generation"] = torch.tensor(opt.generation(0))
    # 12. the default (int4, error feedback on both sides) with AdamW, nothing else passed
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2)  # noqa: E731
    m, opt = train("dflt", 4, adamw)
    res["default"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    res["default_codecs"] = torch.tensor(all(t.codec.startswith("int4") for t in
                                             opt.plan().tensors))
    # 13. compression="none" is AdamW on the exactly averaged gradients, bit for bit, at
    # every step: a local replica steps on (g0 + g1) / 2 computed here
    model, ref = net(3), net(3)
    opt = gp.DistributedOptimizer(adamw(model), named_parameters=[
        (f"exact.{n}", p) for n, p in model.named_parameters()], compression="none")
    ref_opt = adamw(ref)
    same = []
    for step in range(4):
        opt.zero_grad()
        x, y = data(step, r)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        grads = []
        for w in range(W):
            ref.zero_grad()
            xw, yw = data(step, w)
            torch.nn.functional.cross_entropy(ref(xw), yw).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = sum((g[i] for g in grads), torch.zeros_like(p)) / W
        ref_opt.step()
        same.append(all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                          ref.parameters())))
    res["exact_every_step"] = torch.tensor(same)
    # 14. rows without gradient: int4 leaves them exactly where uncompressed AdamW does
    for spec in ("none", "int4", "int2"):
        torch.manual_seed(5)
        emb = torch.nn.Sequential(torch.nn.Embedding(30, 16), torch.nn.Linear(16, 3))
        opt = gp.DistributedOptimizer(torch.optim.AdamW(emb.parameters(), lr=1e-2), [
            (f"zr_{spec}.{n}", p) for n, p in emb.named_parameters()], compression=spec)
        for step in range(6):
            g = torch.Generator().manual_seed(1000 * step + r)
            x, y = torch.randint(0, 20, (8,), generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(emb(x), y).backward()
            opt.step()
        res[f"zero_rows_{spec}"] = emb[0].weight.detach()[20:].clone()
        res[f"used_rows_{spec}"] = emb[0].weight.detach()[:20].clone()
    torch.save(res, f"{out}/worker{r}.pt")
    gp.shutdown()
''')


def _reference_none(steps: int, workers: int, momentum: float = 0.0) -> torch.Tensor:
    """One process, SGD on the concatenated batch of all workers (mean loss = mean of halves)."""
    torch.manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum, nesterov=momentum > 0)
    for step in range(steps):
        xs, ys = [], []
        for r in range(workers):
            g = torch.Generator().manual_seed(1000 * step + r)
            xs.append(torch.randn(8, 12, generator=g))
            ys.append(torch.randint(0, 3, (8,), generator=g))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


@pytest.mark.cluster
def test_distributed_optimizer_end_to_end(tmp_path: Path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "gradpress.cli", "launch", "--workers", "2", "--servers", "1",
           "--", sys.executable, str(script), str(tmp_path), ";".join(CODECS)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    w0, w1 = (torch.load(tmp_path / f"worker{w}.pt") for w in range(2))
    for key in w0:
        assert torch.equal(w0[key], w1[key]), f"replicas differ: {key}"
    torch.testing.assert_close(w0["none"], _reference_none(4, 2), rtol=1e-5, atol=1e-6)
    # all tensors < 1 MiB: sent exactly, with the worker-side momentum = torch's Nesterov SGD
    torch.testing.assert_close(w0["momentum_small"], _reference_none(4, 2, momentum=0.9),
                               rtol=1e-5, atol=1e-6)
    for spec in CODECS:
        assert torch.isfinite(w0[spec]).all() and not torch.equal(w0[spec], w0["none"]), spec
    assert bool(w0["clan_is_lans"]) and torch.isfinite(w0["clan"]).all()
    assert not bool(w0["clan_normalizes"])   # CLAN: LANS without gradient normalisation
    assert bool(w0["clanm_onebit_active"]) and torch.isfinite(w0["clanm_onebit"]).all()
    assert not torch.equal(w0["clanm_onebit"], w0["clanm_none"])  # the momentum was compressed
    assert bool(w0["clanm_onebit_corrected_active"])                  # ran with the step's lr
    assert torch.isfinite(w0["clanm_onebit_corrected"]).all()
    assert torch.equal(w0["clanm_onebit_exact"], w0["clanm_none"])  # every momentum exact
    # residuals decaying on workers and servers: the steps after the first compressed one differ
    assert not torch.equal(w0["clanm_onebit_vanilla_decay"], w0["clanm_onebit"])
    # the servers' own decay: the same value is the same run; plain server residuals differ
    assert torch.equal(w0["clanm_onebit_srv09"], w0["clanm_onebit_vanilla_decay"])
    for other in ("clanm_onebit_vanilla_decay", "clanm_onebit"):
        assert not torch.equal(w0["clanm_onebit_srv1"], w0[other]), other
    # gp.OneBitLANS's default ef: the workers' residuals decay by 0.8, the servers' do not
    assert not torch.equal(w0["clanm_onebit_srv1_d08"], w0["clanm_onebit_srv1"])
    assert torch.equal(w0["clanm_onebit_default"], w0["clanm_onebit_srv1_d08"])
    # anneal=1: the pushes carry the lr (else push_pull raises); at a constant lr, B_t = B
    assert torch.equal(w0["clanm_onebit_srv1_d08_anneal"], w0["clanm_onebit_srv1_d08"])
    assert torch.equal(w0["exact_all"], w0["none"])
    # named tensors keep the worker-side momentum, as small tensors do
    assert torch.equal(w0["exact_momentum"], w0["momentum_small"])
    first = 12 * 40 + 40  # layer 0 is exact after one step, layer 2 was compressed
    assert torch.equal(w0["exact_first"][:first], w0["none_1step"][:first])
    assert not torch.equal(w0["exact_first"][first:], w0["none_1step"][first:])
    # 2 steps x 1 push: the 4 parameter tensors are small (below 1 MiB) and share one fused key
    assert int(w0["acc_pushes"]) == 2 * 1
    assert torch.equal(w0["unused"], torch.ones(5))  # zero gradient pushed, SGD left it alone
    assert w0["amp_skipped"].tolist() == [False, True, False]
    assert float(w0["amp_scale"]) < 2.0 ** 8  # the scaler saw the overflow and backed off
    assert torch.equal(w0["warmup_all"], w0["none"])  # 4 warm-up steps of 4: exact
    assert torch.equal(w0["sched_closure"], w0["none"])  # scheduler first, closure: averaged
    assert bool(w0["closure_loss_ok"])
    assert not torch.equal(w0["warmup_half"], w0["none"])  # compressed from step 2
    assert bool(w0["rows_key"]) and bool(w0["rows_compressed"])
    # unused rows: weight decay only (never longer than at the start), no one-bit walk
    unused, begin = w0["rows_unused"].norm(dim=1), w0["rows_unused_start"].norm(dim=1)
    assert bool((unused <= begin).all()) and bool((unused > 0.99 * begin).all())
    assert float(w0["rows_used_moved"]) > 0.01
    # probes at steps 4 and 8 (every 2 after 2 dense steps; 5-6 recover exact): 2 drifts per
    # tensor, counted once each; the replicas stayed identical (checked above)
    assert int(w0["watch_generation"]) == 2 and int(w0["watch_recoveries"]) >= 2
    assert int(w0["watch_resumed_generation"]) == 2 and int(w0["watch_resumed_recoveries"]) == 0
    assert torch.isfinite(w0["watch"]).all() and bool(w0["watch_plan"])
    # the default: int4 on every tensor (the small ones in a compressed fused key)
    assert bool(w0["default_codecs"]) and torch.isfinite(w0["default"]).all()
    assert w0["exact_every_step"].tolist() == [True] * 4
    for spec in ("int4", "int2"):
        assert torch.equal(w0[f"zero_rows_{spec}"], w0["zero_rows_none"]), spec
        assert not torch.equal(w0[f"used_rows_{spec}"], w0["used_rows_none"]), spec


FACTORIES = [gp.CLAN, gp.OneBitLANS]


@pytest.mark.parametrize("factory", FACTORIES, ids=["CLAN", "OneBitLANS"])
def test_factories_take_at_most_ten_parameters(factory) -> None:
    params = inspect.signature(factory).parameters
    assert len(params) <= 10, list(params)
    assert list(params)[:2] == ["named_parameters", "lr"]
    assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[2:])
    assert {"compression", "ef", "dense_steps", "uncompressed_params"} <= set(params)


@pytest.mark.parametrize("factory", FACTORIES, ids=["CLAN", "OneBitLANS"])
@pytest.mark.parametrize("old", ["warmup_steps", "communicate", "freeze_variance", "variance",
                                 "blend", "refresh_every", "backward_passes_per_step"])
def test_factories_reject_removed_names(factory, old: str) -> None:
    with pytest.raises(TypeError, match=old):
        factory([("w", torch.nn.Parameter(torch.ones(3)))], **{old: 1})


@pytest.mark.parametrize("factory, kw, err, words", [
    (gp.OneBitLANS, {"dense_steps": 0}, ValueError, ["dense_steps must be an int >= 1", "0"]),
    (gp.CLAN, {"dense_steps": -1}, ValueError, ["dense_steps must be an int >= 0", "-1"]),
    (gp.CLAN, {"dense_steps": True}, ValueError, ["dense_steps must be an int >= 0", "True"]),
    (gp.OneBitLANS, {"compression": "sign"}, ValueError, ["sign"]),
    (gp.CLAN, {"compression": "sign"}, ValueError, ["sign"]),
    (gp.OneBitLANS, {"ef": "ef21"}, ValueError, ["ef21"]),
    (gp.CLAN, {"uncompressed_params": ["pos.*"]}, ValueError,
     ["uncompressed_params: 'pos.*' matches no parameter name", "names are: w"]),
    (gp.OneBitLANS, {"uncompressed_params": "w"}, TypeError, ["collection of names", "['w']"]),
    (gp.CLAN, {"uncompressed_params": [3]}, TypeError, ["must hold strings", "3"]),
])
def test_factories_reject_bad_input(factory, kw: dict, err: type, words: list[str]) -> None:
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(err) as e:
        factory([("w", p)], **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_onebit_lans_builds_the_momentum_method() -> None:
    # what gp.CLAN built before it became the paper's method: each worker's own v, LAMB's step
    from gradpress.optim import OneBitLANSCore

    opt = gp.OneBitLANS([("w", torch.nn.Parameter(torch.ones(3)))])
    assert isinstance(opt, OneBitLANSCore)
    assert callable(opt.hold_idle_rows) and opt.watch is not None   # rows held, watched
    assert opt.param_groups[0]["dense_steps"] == 100 and not opt.compression_active
    assert opt.communicate is not None and callable(opt.blend)


@pytest.mark.parametrize("compression, limit, names, want", [
    ("onebit", 1024, ["named"], False),          # "big" is compressed
    ("none", 1024, ["named"], True),             # nothing is
    ("onebit", 1 << 20, (), True),               # every tensor below min_compress_bytes
    ("onebit", 1024, ["big"], True),             # the only large tensor named exact
])
def test_onebit_lans_blends_only_when_every_momentum_travels_exact(
        compression: str, limit: int, names: Any, want: bool) -> None:
    # step 3's blend (LANS's step proper) needs exact momenta; one compressed tensor turns it
    # off for all, as measured (log 2.19)
    named = [(n, torch.nn.Parameter(torch.ones(k))) for n, k in
             (("small", 8), ("big", 4096), ("named", 8))]
    opt = gp.OneBitLANS(named, compression=compression, min_compress_bytes=limit,
                        uncompressed_params=names)
    assert [opt.blend(i) for i in range(3)] == [want] * 3


def test_clan_builds_the_papers_method() -> None:
    from gradpress.optim import LANS, OneBitLANSCore

    opt = gp.CLAN([("w", torch.nn.Parameter(torch.ones(3)))])
    assert isinstance(opt, LANS) and not isinstance(opt, OneBitLANSCore)
    assert opt.param_groups[0]["normalize_grad"] is False
    assert "freeze_variance_after" not in opt.param_groups[0]   # LANS proper
    assert opt._gp_dense_steps == 100 and opt._gp_spec.wrappers.get("ef") == "vanilla"


def test_match_names_patterns_and_exact_names() -> None:
    from gradpress.torch.optimizer import match_names

    names = ["tok.weight", "pos.weight", "enc.0.bias", "enc.1.bias"]
    assert match_names(names, ["pos.weight", "*.bias"], "x") == {"pos.weight", "enc.0.bias",
                                                                  "enc.1.bias"}
    assert match_names(names, (), "x") == frozenset()
    with pytest.raises(ValueError, match="'Pos.weight' matches no parameter name"):
        match_names(names, ["Pos.weight"], "x")  # case-sensitive on every platform


def test_distributed_optimizer_rejects_unmatched_uncompressed_params() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'lin.bais' matches no parameter name"):
        gp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                named_parameters=[(f"lin.{n}", p)
                                                  for n, p in model.named_parameters()],
                                uncompressed_params=["lin.bais"])


@pytest.mark.parametrize("factory", FACTORIES, ids=["CLAN", "OneBitLANS"])
def test_factories_decay_matrices_only(factory) -> None:
    # BERT's recipe, as gradpress train: no weight decay on biases and normalisation weights;
    # the flat order (the momenta's keys) is the matrices first, each part in the given order
    model = torch.nn.Sequential(torch.nn.LayerNorm(3), torch.nn.Linear(3, 4),
                                torch.nn.Linear(4, 2))
    model[2].bias.requires_grad_(False)
    opt = factory(model.named_parameters(), weight_decay=0.05)
    flat = [(p, g["weight_decay"]) for g in opt.param_groups for p in g["params"]]
    want = [(model[1].weight, 0.05), (model[2].weight, 0.05), (model[0].weight, 0.0),
            (model[0].bias, 0.0), (model[1].bias, 0.0)]
    assert [(id(p), wd) for p, wd in flat] == [(id(p), wd) for p, wd in want]


def test_gradients_are_averaged_in_place_on_any_device_when_float32() -> None:
    from gradpress.torch.optimizer import _in_place

    for device in ("cpu", "meta"):  # meta stands in for CUDA: the rule is the same
        g = torch.empty(3, 4, device=device)
        assert _in_place(g) is g, device
        assert _in_place(g.to(torch.float16)) is None, device  # another dtype: a copy
        assert _in_place(g.t()) is None, device  # not contiguous


def test_nonfinite_gradients_are_zeroed_without_reading_them_on_the_host() -> None:
    from gradpress.torch.optimizer import _any_set, _zero_if_nonfinite

    g = torch.tensor([1.0, float("inf"), 3.0])
    bad = _zero_if_nonfinite(g)
    assert torch.equal(g, torch.zeros(3)) and bad.shape == () and bool(bad)
    ok = torch.tensor([1.0, -2.0])
    assert not bool(_zero_if_nonfinite(ok)) and torch.equal(ok, torch.tensor([1.0, -2.0]))
    nan = torch.tensor([float("nan")], dtype=torch.bfloat16)
    assert bool(_zero_if_nonfinite(nan)) and nan.item() == 0
    # a meta tensor has no values: any host read (bool(), .item()) of the flag would raise,
    # as the per-parameter check it replaces did; the one read is _any_set's, per step
    m = _zero_if_nonfinite(torch.empty(1000, device="meta"))
    assert m.device.type == "meta"
    assert _any_set([]) is False
    assert _any_set([torch.tensor(False), torch.tensor(True)]) is True
    assert _any_set([torch.tensor(False)] * 3) is False



@pytest.mark.parametrize("spec, words", [
    ("dithering:s=300", ["dithering", "s='300'", "[1, 127]"]),
    ("onebit:foo=1", ["onebit", "foo", "valid parameters: scaling"]),
    ("nonsense", ["unknown codec 'nonsense'", "int4"]),
    ({"compressor": "nonsense"}, ["nonsense"]),
])
def test_distributed_optimizer_rejects_a_bad_codec_when_built(spec, words: list[str]) -> None:
    """Before any forward or backward (review of issue 54): the codec is built once on
    construction, so its own message names the codec, the value and what was expected."""
    m = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError) as e:
        gp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                compression=spec)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    with pytest.raises(ValueError, match="unknown codec 'nonsense'"):
        gp.DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), compression="nonsense")

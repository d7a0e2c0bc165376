"""OneBitLANSCore's idle rows (issue 38): rows of an embedding that get no gradient on any worker do
not walk under a one-bit code; they move as uncompressed LANS moves them.

Two workers run in threads against an in-process two-way "server" built from the real codecs
(``gradpress.compress.build``: one-bit with the workers' and the server's error feedback, as the
PS path runs them), so the test needs no processes; the multi-process path is the same core.
"""

from __future__ import annotations

import threading

import pytest
import torch

from gradpress.compress import build
from gradpress.optim import LANS, OneBitLANSCore
from gradpress.optim.idle_rows import has_idle_rows

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROWS, DIM, USED = 64, 16, 40     # rows USED.. never get a gradient
WORKERS, STEPS, DENSE = 2, 120, 10


class TwoWay:
    """``communicate`` for WORKERS threads: each worker's tensor is compressed with its own
    residual, the server averages the decoded pushes, compresses again with its residual and
    every worker gets the same decoded reply. ``"<i>.rows"`` keys travel exact."""

    def __init__(self, spec: str = "onebit", ef: str = "vanilla:decay=0.8,server_decay=1.0"):
        self.spec, self.ef = spec, ef
        self.codecs: dict[tuple[str, int], object] = {}
        self.pushes: dict[str, dict[int, torch.Tensor]] = {}
        self.replies: dict[str, torch.Tensor] = {}
        self.cond = threading.Condition()
        self.rank = threading.local()

    def _codec(self, key: str, who: int, numel: int):
        if (key, who) not in self.codecs:
            self.codecs[key, who] = build(self.spec, numel, ef=self.ef)
        return self.codecs[key, who]

    def __call__(self, key: str, t: torch.Tensor) -> torch.Tensor:
        rank, flat = self.rank.value, t.detach().reshape(-1).float()
        if not key.endswith(".rows"):
            c = self._codec(key, rank, flat.numel())
            flat = c.decompress(c.compress(flat.clone()))
        with self.cond:
            got = self.pushes.setdefault(key, {})
            got[rank] = flat
            if len(got) == WORKERS:
                avg = sum(got[r] for r in range(WORKERS)) / WORKERS
                if not key.endswith(".rows"):
                    s = self._codec(key, -1, avg.numel())
                    avg = s.decompress(s.compress(avg))
                self.replies[key] = avg.reshape(t.shape)
                del self.pushes[key]
                self.cond.notify_all()
            else:
                self.cond.wait_for(lambda: key in self.replies and key not in self.pushes,
                                   timeout=30)
            return self.replies[key].clone()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(ROWS, DIM), torch.nn.Linear(DIM, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, USED, (32,), generator=g), torch.randint(0, 4, (32,), generator=g)


def _grad(model: torch.nn.Module, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()


def _lans_run() -> torch.nn.Module:
    """Uncompressed LANS on the workers' averaged gradient."""
    model = _model(0)
    opt = LANS(model.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(STEPS):
        grads = []
        for rank in range(WORKERS):
            _grad(model, rank, step)
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / WORKERS
        opt.step()
    return model


def _onebit_run() -> tuple[list[torch.nn.Module], list[OneBitLANSCore]]:
    """OneBitLANSCore on WORKERS threads: dense steps averaged exactly, then the two-way codec."""
    net = TwoWay()
    models = [_model(0) for _ in range(WORKERS)]
    opts = [OneBitLANSCore(m.parameters(), lr=0.01, weight_decay=0.01, dense_steps=DENSE,
                       communicate=net, hold_idle_rows=True) for m in models]
    barrier = threading.Barrier(WORKERS)
    dense_grads: list[list[torch.Tensor]] = [[] for _ in range(WORKERS)]

    def work(rank: int) -> None:
        net.rank.value = rank
        model, opt = models[rank], opts[rank]
        for step in range(STEPS):
            _grad(model, rank, step)
            if not opt.compression_active:   # the dense phase: the exact average
                dense_grads[rank] = [p.grad.clone() for p in model.parameters()]
                barrier.wait(timeout=30)
                for i, p in enumerate(model.parameters()):
                    p.grad = sum(g[i] for g in dense_grads) / WORKERS
                barrier.wait(timeout=30)
            opt.step()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a worker thread did not finish"
    return models, opts


def test_idle_rows_stay_as_lans_leaves_them_and_replicas_agree():
    lans = _lans_run()
    models, opts = _onebit_run()
    emb = [m[0].weight for m in models]
    assert torch.equal(emb[0], emb[1])                    # replicas identical
    state = opts[0].state[emb[0]]
    assert has_idle_rows(state) and state["idle_rows"] is True  # measured in the dense phase
    assert not has_idle_rows(opts[0].state[models[0][1].weight])  # dense rows
    idle = emb[0][USED:].detach().norm(dim=1).mean()
    idle_lans = lans[0].weight[USED:].detach().norm(dim=1).mean()
    start = _model(0)[0].weight[USED:].norm(dim=1).mean()
    # never-used rows only decay (weight decay), as under LANS: within 10% of LANS's norm
    assert abs(float(idle / idle_lans) - 1.0) < 0.10, (float(idle), float(idle_lans))
    assert idle <= start
    # the rows in use still learn: they moved away from their start
    used_moved = (emb[0][:USED] - _model(0)[0].weight[:USED]).norm()
    assert used_moved > 0.1


def test_rows_key_is_sent_only_for_tensors_with_idle_rows():
    keys: list[str] = []

    def record(key: str, t: torch.Tensor) -> torch.Tensor:
        keys.append(key)
        return t

    model = _model(0)
    opt = OneBitLANSCore(model.parameters(), lr=0.01, dense_steps=1, communicate=record,
                     hold_idle_rows=lambda i: i == 0)
    for step in range(3):
        _grad(model, 0, step)
        opt.step()
    assert "0.rows" in keys and not any(k.endswith(".rows") and k != "0.rows" for k in keys)
    # state_dict round trip keeps the decision and the shared momentum of the idle rows
    sd = opt.state_dict()
    fresh = OneBitLANSCore(_model(0).parameters(), lr=0.01, dense_steps=1, communicate=record,
                       hold_idle_rows=True)
    fresh.load_state_dict(sd)
    assert fresh.state_dict()["state"][0]["idle_rows"] is True
    assert torch.equal(fresh.state_dict()["state"][0]["shared_momentum"],
                       sd["state"][0]["shared_momentum"])
    keys.clear()
    # a checkpoint taken in the dense phase hands the mark back as a tensor; it goes on
    model = _model(0)
    mid = OneBitLANSCore(model.parameters(), lr=0.01, dense_steps=3, communicate=record)
    _grad(model, 0, 0)
    mid.step()
    again = OneBitLANSCore(model.parameters(), lr=0.01, dense_steps=3, communicate=record)
    again.load_state_dict(mid.state_dict())
    _grad(model, 0, 1)
    again.step()
    assert has_idle_rows(again.state[model[0].weight])
    with pytest.raises(TypeError, match="hold_idle_rows must be a bool or a callable"):
        OneBitLANSCore(_model(0).parameters(), hold_idle_rows="yes")


def test_no_hold_by_default_sends_no_rows():
    keys: list[str] = []
    model = _model(0)
    opt = OneBitLANSCore(model.parameters(), lr=0.01, dense_steps=1,
                     communicate=lambda k, t: keys.append(k) or t)
    for step in range(3):
        _grad(model, 0, step)
        opt.step()
    assert has_idle_rows(opt.state[model[0].weight])
    assert keys and not any(k.endswith(".rows") for k in keys)

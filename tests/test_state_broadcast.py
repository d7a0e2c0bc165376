"""Optimizer state broadcast and checkpoint RNG state, in one process (issue 30, findings 3, 9).

The broadcast is run twice in this process, once as root and once as another worker, through a
fake ``torch.distributed.broadcast_object_list`` that hands root's pickled bytes over (the
wire). Devices other than the CPU are stood in for by ``"meta"`` (tensors without data, so the
moves are visible on a machine without a GPU). The CUDA RNG save/restore logic takes its
device list and generator functions as parameters and is tested with fakes.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import gradpress.torch.broadcast as bc
from gradpress import checkpoint as ck
from gradpress.optim import LAMB, LANS, OneBitAdam, OneBitLANSCore, clan_core
from gradpress.torch.broadcast import (
    broadcast_optimizer_state,
    host_pickle,
    load_optimizer_state,
    shared_state_dict,
)


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


class _Wire:
    """Stands in for the workers' process group: root's bytes are kept for the next call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[Any] = []
        self.rank = 0
        monkeypatch.setattr(bc, "_group_and_root", lambda root: (None, root))
        monkeypatch.setattr(bc.dist, "broadcast_object_list", self._broadcast)
        import gradpress.api as api
        monkeypatch.setattr(api, "rank", lambda: self.rank)
        monkeypatch.setattr(api, "size", lambda: 2)

    def _broadcast(self, box: list[Any], src: int, group: Any) -> None:
        if self.rank == src:
            self.sent.append(pickle.dumps(box[0]))  # what broadcast_object_list pickles
        else:
            box[0] = pickle.loads(self.sent[-1])


def _optimizers() -> list[tuple[str, Any]]:
    return [
        ("LANS", lambda ps: LANS(ps, lr=1e-2, fused=False)),
        ("LANS-fused", lambda ps: LANS(ps, lr=1e-2)),
        ("LAMB", lambda ps: LAMB(ps, lr=1e-2)),
        ("clan", lambda ps: clan_core(ps, lr=1e-2)),
        ("OneBitAdam", lambda ps: OneBitAdam(ps, lr=1e-2, dense_steps=2)),
        ("OneBitLANSCore", lambda ps: OneBitLANSCore(ps, lr=1e-2, dense_steps=2)),
        ("Adam", lambda ps: torch.optim.Adam(ps, lr=1e-2)),
        ("SGD-momentum", lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)),
    ]


def _model(seed: int, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    return m.to(device)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.randn(4, 5, generator=g)).square().mean().backward()
        opt.step()


def _state(opt: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    return opt.state_dict()["state"]


@pytest.mark.parametrize("name,make", _optimizers(), ids=[n for n, _ in _optimizers()])
def test_broadcast_state_is_cpu_and_loads_equal(name: str, make: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    wire = _Wire(monkeypatch)
    m0, m1 = _model(0), _model(1)
    root, other = make(m0.parameters()), make(m1.parameters())
    _train(m0, root, 4)
    _train(m1, other, 1)  # another state, to be replaced whole
    before = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
              for k, s in _state(root).items()}
    wire.rank = 0
    broadcast_optimizer_state(root, root_rank=0)
    wire.rank = 1
    broadcast_optimizer_state(other, root_rank=0)
    sent = pickle.loads(pickle.loads(wire.sent[0]))  # the bytes of host_pickle, on the wire
    assert _tensors(sent) and all(t.device.type == "cpu" for t in _tensors(sent))
    assert _state(root).keys() == before.keys()  # root keeps its own state
    got = _state(other)
    assert got.keys() == before.keys()
    for k, s in before.items():
        assert got[k].keys() == s.keys()
        for n, v in s.items():
            if isinstance(v, torch.Tensor):
                assert v.dtype == got[k][n].dtype and torch.equal(v, got[k][n]), (k, n)
            else:
                assert v == got[k][n], (k, n)
    assert other.state_dict()["param_groups"] == root.state_dict()["param_groups"]


class Box:
    """A plain object holding a tensor (pickled by its ``__dict__``)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_host_pickle_moves_every_tensor() -> None:
    # "meta" stands for the host here, so the move is visible: every tensor at any depth
    # (dict, list, tuple, an object's attribute, a Parameter) arrives on it.
    obj = {"a": torch.ones(3), "b": [torch.zeros(2), (torch.arange(4),)], "c": Box(torch.ones(1)),
           "p": torch.nn.Parameter(torch.ones(2)), "n": 5}
    back = pickle.loads(host_pickle(obj, host="meta"))
    assert back["n"] == 5
    found = [back["a"], back["b"][0], back["b"][1][0], back["c"].t, back["p"]]
    assert all(t.device.type == "meta" for t in found)
    assert isinstance(back["p"], torch.nn.Parameter) and back["p"].requires_grad
    assert back["b"][1][0].dtype == torch.int64
    # the production host: CPU tensors stay, values equal
    cpu = pickle.loads(host_pickle(obj))
    assert torch.equal(cpu["b"][1][0], obj["b"][1][0]) and cpu["p"].device.type == "cpu"


def test_load_puts_state_on_each_params_device() -> None:
    # a worker whose parameters live on another device ("meta" here, a GPU in a job) and one
    # on two devices: each state tensor lands on its own parameter's device, in its dtype
    m0 = _model(0)
    root = LANS(m0.parameters(), lr=1e-2, fused=False)
    _train(m0, root, 2)
    state = pickle.loads(host_pickle(shared_state_dict(root)))
    m1 = _model(1)
    m1[0].to("meta")
    m1[2].to(torch.float64)
    other = LANS(m1.parameters(), lr=1e-2, fused=False)
    load_optimizer_state(other, state)
    for p in m1.parameters():
        st = other.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            assert st[key].device == p.device and st[key].dtype == p.dtype
        assert isinstance(st["step"], int)
    adam = torch.optim.Adam(_model(2).parameters(), lr=1e-2, capturable=True)
    m3 = _model(3)
    _train(m3, torch.optim.Adam(m3.parameters(), lr=1e-2), 1)
    # torch's rule: "step" stays as saved unless the group is capturable or fused
    plain = torch.optim.Adam(m3.parameters(), lr=1e-2)
    _train(m3, plain, 1)
    load_optimizer_state(adam, pickle.loads(host_pickle(plain.state_dict())))
    step = next(iter(adam.state.values()))["step"]
    assert step.dtype == torch.float32


def test_load_checks_layout_before_dropping_state() -> None:
    m = _model(0)
    opt = LAMB(m.parameters(), lr=1e-2)
    _train(m, opt, 1)
    other = LAMB(list(m.parameters())[:2], lr=1e-2)
    with pytest.raises(ValueError, match="parameter group 0 has 4 parameters, the optimizer's 2"):
        load_optimizer_state(other, opt.state_dict())
    two = LAMB([{"params": list(m.parameters())[:2]}, {"params": list(m.parameters())[2:]}])
    with pytest.raises(ValueError, match="has 1 parameter groups, the optimizer 2"):
        load_optimizer_state(two, opt.state_dict())
    kept = dict(opt.state)
    with pytest.raises(ValueError):
        load_optimizer_state(opt, {"param_groups": [], "state": {}})
    assert dict(opt.state) == kept  # nothing released when the layout does not fit


def test_shared_state_dict_skips_codec_state() -> None:
    class Wrapped(torch.optim.SGD):
        def _gp_state_dict(self, codec: bool) -> dict[str, Any]:
            self.asked = codec
            return super().state_dict()

    opt = Wrapped(_model(0).parameters(), lr=0.1)
    shared_state_dict(opt)
    assert opt.asked is False
    plain = torch.optim.SGD(_model(0).parameters(), lr=0.1)
    plain.state_dict = lambda: {"state": {}, "param_groups": [], "gradpress": {}}  # type: ignore
    assert "gradpress" not in shared_state_dict(plain)


# -- CUDA RNG state, keyed by the devices this process trains on ---------------------------------

class _Gens:
    """Fake CUDA generators: a state per device index."""

    def __init__(self, n: int) -> None:
        self.states = {i: torch.tensor([100 + i], dtype=torch.uint8) for i in range(n)}

    def get(self, d: torch.device) -> torch.Tensor:
        return self.states[d.index].clone()

    def set(self, s: torch.Tensor, d: torch.device) -> None:
        if d.index not in self.states:
            raise RuntimeError(f"no device {d}")
        self.states[d.index] = s.clone()


def test_rng_restores_into_the_device_trained_on() -> None:
    # saved by a worker on cuda:1 of two GPUs; resumed with CUDA_VISIBLE_DEVICES=1, where that
    # GPU is cuda:0 and the only one: the saved generator goes to cuda:0
    saved_gens, new_gens = _Gens(2), _Gens(1)
    state = ck.rng_state([torch.device("cuda", 1)], get_cuda=saved_gens.get)
    assert [int(s[0]) for s in state["cuda_devices"]] == [101]
    ck.set_rng_state(state, [torch.device("cuda", 0)], set_cuda=new_gens.set)
    assert int(new_gens.states[0][0]) == 101
    # and back on a machine where it is cuda:1 again
    other = _Gens(2)
    ck.set_rng_state(state, [torch.device("cuda", 1)], set_cuda=other.set)
    assert [int(other.states[i][0]) for i in (0, 1)] == [100, 101]


def test_rng_count_mismatch_names_both() -> None:
    gens = _Gens(2)
    state = ck.rng_state([torch.device("cuda", 0), torch.device("cuda", 1)], get_cuda=gens.get)
    with pytest.raises(ValueError, match=r"state of 2 device\(s\), this worker trains on 1 "
                                         r"\(cuda:0\)"):
        ck.set_rng_state(state, [torch.device("cuda", 0)], set_cuda=gens.set)


def test_rng_cpu_state_and_cpu_only_resume() -> None:
    torch.manual_seed(3)
    gens = _Gens(1)
    state = ck.rng_state([torch.device("cuda", 0)], get_cuda=gens.get)
    a = torch.rand(3)
    calls: list[Any] = []
    ck.set_rng_state(state, [], set_cuda=lambda s, d: calls.append(d))  # trains on no GPU
    assert torch.equal(torch.rand(3), a) and not calls
    assert "cuda_devices" not in ck.rng_state([])


def test_train_devices_of_a_cpu_model() -> None:
    # no CUDA parameter: the current CUDA device once CUDA is initialized (a GPU test ran in
    # this process), else none
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    current = [torch.device("cuda", torch.cuda.current_device())] if cuda else []
    assert ck.train_devices(_model(0)) == current


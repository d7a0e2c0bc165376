"""Checkpoint methods of the worker and server engines (the protocol: :mod:`.state`).

Kept apart from the pipelines so that :mod:`.worker` and :mod:`.server` only call in at three
points: a tensor's plan or a server key is created (pending loaded state is applied), and a
server's control thread reads a save/load request.
"""

from __future__ import annotations

import logging
from typing import Any

from .protocol import OP_SAVE, Control
from .state import (
    FORMAT,
    ArrivalCounter,
    acknowledge,
    atomic_save,
    check_worker_state,
    plan_state,
    read_meta,
    read_request,
    read_server_states,
    request_server_op,
    restore_key,
    restore_plan,
    server_file,
    server_snapshot,
    wait_quiescent,
)

__all__ = ["WorkerStateMixin", "ServerStateMixin"]

log = logging.getLogger(__name__)


class WorkerStateMixin:
    """``state_dict``/``load_state_dict`` and server state requests of ``WorkerEngine``.

    Uses the engine's ``_plans``, ``_pending`` (name -> loaded entry not applied yet),
    ``_state_seq``, ``_lock``, ``_live``, ``cluster``, ``transport`` and ``cfg``.
    """

    def state_dict(self, names: set[str] | None = None) -> dict[str, Any]:
        """Per tensor (``names``, default all): each chunk's step counter and worker codec state
        (error-feedback residual, momentum) as CPU copies; no push_pull may be in flight.

        Tensors are keyed by name and chunk index, so the state loads into fresh processes.
        """
        self._check_idle("state_dict")
        with self._lock:
            plans = {n: p for n, p in self._plans.items() if names is None or n in names}
            pending = {n: e for n, e in self._pending.items() if names is None or n in names}
        return {"format": FORMAT,
                "tensors": {**pending, **{n: plan_state(p) for n, p in plans.items()}}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output.

        Tensors already pushed are restored at once; the others when their first push_pull
        creates them, which then raises ValueError naming the tensor if its size, codec or
        chunking differs from the saved one.
        """
        tensors = check_worker_state(state)
        self._check_idle("load_state_dict")
        with self._lock:
            plans = {n: self._plans.get(n) for n in tensors}
            self._pending.update({n: e for n, e in tensors.items() if plans[n] is None})
        for name, entry in tensors.items():
            if plans[name] is not None:
                restore_plan(plans[name], entry)

    def server_state(self, op: str, directory: str, tag: str | None = None) -> None:
        """Ask every server to ``"save"`` its state to, or ``"load"`` it from, ``directory``.

        Collective over the workers, bounded by ``cfg.timeout``; errors name the server.
        """
        if op not in ("save", "load"):
            raise ValueError(f"server state operation must be 'save' or 'load', got {op!r}")
        self._check_idle(f"{op} of server state")
        seq, self._state_seq = self._state_seq, self._state_seq + 1
        request_server_op(self.cluster, self.transport, self.cfg.timeout, seq, op, directory,
                          tag)

    def _restore_pending(self, plan: Any) -> None:
        """Apply loaded state to a new plan; on a mismatch keep it pending and raise."""
        with self._lock:
            entry = self._pending.pop(plan.name, None)
        if entry is None:
            return
        try:
            restore_plan(plan, entry)
        except BaseException:
            with self._lock:
                self._pending.setdefault(plan.name, entry)
            raise

    def _check_idle(self, what: str) -> None:
        self._check_usable()
        with self._lock:
            busy = sorted({h.name for h in self._live})
        if busy:
            raise RuntimeError(f"{what}: push_pull of {busy} in flight; call the optimizer's "
                               f"step() or synchronize() (or wait the handles) first")


class ServerStateMixin:
    """Save/load of a ``ServerEngine``'s keys (residuals, step counters).

    Uses the engine's ``_keys``, ``_keys_lock``, ``cluster``, ``cfg``, ``index``, ``name`` and
    ``pushers``; owns ``_pending`` ((tensor, chunk) -> saved entry) and ``_arrivals``.
    """

    def _init_state(self) -> None:
        """Called by ``__init__``; loads ``cfg.resume`` when set (before serving)."""
        self._pending: dict[tuple[str, int], dict[str, Any]] = {}
        self._arrivals = ArrivalCounter(len(self.pushers))
        if self.cfg.resume:
            meta = read_meta(self.cfg.resume)
            self._pending = read_server_states(self.cfg.resume, self.cluster.layout, self.name,
                                               None if meta is None else meta.get("tag"))
            log.info("%s: %d saved keys pending from %s", self.name, len(self._pending),
                     self.cfg.resume)

    def _restore(self, ks: Any) -> None:
        """Apply pending saved state to key ``ks`` (caller holds ``_keys_lock``)."""
        entry = self._pending.pop((ks.desc.name, ks.desc.chunk), None)
        if entry is not None:
            restore_key(ks, entry, len(self.pushers), self.name)

    def _state_request(self, w: int, msg: Control) -> None:
        """Pusher ``w``'s save/load message; the last of all pushers runs the request."""
        seq = msg.step
        if not self._arrivals.arrive(seq, w):
            return
        try:
            req = read_request(self.cluster, seq, msg.op)
            with self._keys_lock:
                keys = list(self._keys.values())
            wait_quiescent(keys, self.cfg.timeout, self.name)
            if msg.op == OP_SAVE:
                atomic_save(server_snapshot(keys, self.cluster.layout, self.index, req["tag"]),
                            server_file(req["dir"], self.index))
            else:
                self._load(req["dir"], req["tag"], keys)
        except Exception as e:  # noqa: BLE001 - reported to the workers; serving goes on
            log.error("%s: server state request %d failed: %s", self.name, seq, e)
            acknowledge(self.cluster, seq, self.index, e)
            return
        acknowledge(self.cluster, seq, self.index, None)

    def _load(self, directory: str, tag: str | None, keys: list[Any]) -> None:
        loaded = read_server_states(directory, self.cluster.layout, self.name, tag)
        with self._keys_lock:
            self._pending.update(loaded)
            for ks in sorted(keys, key=lambda k: -k.desc.generation):  # newest generation
                self._restore(ks)

"""The roll call: the processes of a group restarted by torchrun's elastic agent agree on the
attempt that scopes their store keys.

torchrun's restart count (``TORCHELASTIC_RESTART_COUNT``) is not the same on every node when
the membership changes: an agent whose workers failed counts a restart, an agent that restarts
healthy workers because a node joins does not, and a replacement node's new agent starts at 0.
Processes of one group then scope their keys under different attempts and never meet. The roll
call gives every group one attempt of its own, equal on all its processes and different from
every earlier group's, through the agent's store (which outlives the groups):

1. every process draws a ticket (``gradpress/rollcall/tickets``, a counter of the store: no two
   processes, of this group or an earlier one, hold the same);
2. world rank 0's ticket is the attempt;
3. every other rank posts its ticket under ``hello/<rank>``, waits for the answer under
   ``reply/<ticket>`` and acknowledges it by writing the attempt it got under ``ack/<ticket>``;
4. rank 0 answers whatever ticket each rank has posted until every rank has acknowledged its
   attempt (a ticket an earlier group's process left is answered too; its acknowledgement, if
   any, names an earlier attempt).

Every wait is bounded by the job's timeout and names the ranks that did not answer.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from .errors import GradpressError

__all__ = ["roll_call"]

log = logging.getLogger(__name__)

#: Where the roll call's keys live (outside every attempt's prefix).
PREFIX = "gradpress/rollcall/"
_POLL_S = 0.01


def roll_call(store: dist.Store, rank: int, world_size: int, timeout: float,
              describe: Callable[[int], str] = str) -> int:
    """The attempt of this group (steps 1-4 of the module docstring); ``store`` unprefixed."""
    ticket = store.add(PREFIX + "tickets", 1)  # step 1
    if rank == 0:
        _answer(store, ticket, world_size, timeout, describe)  # steps 2, 4
        return ticket
    store.set(f"{PREFIX}hello/{rank}", str(ticket))  # step 3
    reply = f"{PREFIX}reply/{ticket}"
    try:
        store.wait([reply], datetime.timedelta(seconds=timeout))
    except Exception as e:  # DistStoreError: timed out, or the store is gone
        raise GradpressError(f"{describe(rank)}: no answer from {describe(0)} to the roll "
                             f"call of a restarted group after {timeout:g} s: {e}") from e
    attempt = int(store.get(reply))
    store.set(f"{PREFIX}ack/{ticket}", str(attempt))
    return attempt


def _answer(store: dist.Store, attempt: int, world_size: int, timeout: float,
            describe: Callable[[int], str]) -> None:
    """Step 4: rank 0 answers the posted tickets until every rank acknowledged one."""
    pending = set(range(1, world_size))
    answered: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    while pending:
        for r in sorted(pending):
            hello = f"{PREFIX}hello/{r}"
            if not store.check([hello]):
                continue
            ticket = store.get(hello).decode()
            if answered.get(r) != ticket:
                store.set(f"{PREFIX}reply/{ticket}", str(attempt))
                answered[r] = ticket
                continue
            ack = f"{PREFIX}ack/{ticket}"
            if store.check([ack]) and store.get(ack).decode() == str(attempt):
                pending.discard(r)
        if pending and time.monotonic() > deadline:
            raise GradpressError(
                f"{describe(0)}: the roll call of a restarted group got no answer after "
                f"{timeout:g} s from {', '.join(describe(r) for r in sorted(pending))}")
        if pending:
            time.sleep(_POLL_S)
    log.info("roll call: attempt %d for %d processes", attempt, world_size)

"""Join authentication: every process proves the job secret at rendezvous (HMAC challenge).

The job secret is ``GRADPRESS_SECRET`` (``gradpress launch`` generates one for a single-node job
when it is unset and hands it to its children through the environment, never the command line).
A job whose rank 0 has no secret is *open*: nothing is proved, and every process must then have
no secret either. The TCP store itself has no authentication, so the handshake runs through it
in plain sight; HMAC proofs bound to a fresh nonce reveal nothing about the secret and cannot be
replayed in another job. Threat model and limits: ``docs/reliability.md``.

Protocol (store keys under ``gradpress/<attempt>/auth/``, ``attempt`` = torchrun's restart
count, else 0: the caller's store is already scoped to the attempt); ``me`` is a process's role
and rank as :meth:`Layout.describe` writes it:

1. World rank 0, the verifier, writes the challenge ``nonce`` (32 random bytes in hex, or
   ``"open"`` without a secret) with ``compare_set``; if another value is already there, another
   process claimed the job first (a second job on the same store port?) and rank 0 stops.
2. Every other process waits for the challenge, picks a random ``cid`` and appends the line
   ``"<cid> <proof>"`` to ``resp/<rank>``: ``proof = HMAC-SHA256(secret, "gradpress-join|" +
   nonce + "|" + me + "|" + cid)``, or ``-`` without a secret. A process whose secret does not
   match the job's kind (secret vs. open) stops at once with a clear error.
3. Rank 0 reads each rank's lines in order. The first line whose proof verifies admits that
   rank: ``verdict/<cid>`` = ``"ok <HMAC(secret, "gradpress-admit|" + nonce + "|" + cid)>"``
   (``"ok open"`` in an open job). Each other line before it gets ``"refused: <reason>"`` and a
   warning in rank 0's log. Rank 0 returns once every rank is admitted (bounded by the timeout;
   the error names the missing processes and the refused attempts).
4. Each process waits for its verdict: ``ok`` with a valid admit proof (so the verifier holds
   the secret too) lets it continue; anything else raises :class:`AuthError`.

Nothing else is read from or written to the store before a process is admitted, so a refused
process cannot set the job's shape, declare keys or join the process group.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import logging
import re
import secrets
import time
from collections.abc import Callable

import torch.distributed as dist

from .errors import AuthError, CommTimeoutError

__all__ = ["authenticate", "proof", "OPEN"]

log = logging.getLogger(__name__)

#: The challenge of a job without a secret.
OPEN = "open"
_POLL_S = 0.02
_CID = re.compile(r"^[0-9a-f]{32}$")


def proof(secret: str, *parts: str) -> str:
    """HMAC-SHA256 of ``parts`` joined by ``|`` under ``secret``, in hex."""
    msg = "|".join(parts).encode()
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def authenticate(store: dist.Store, *, rank: int, world_size: int, describe: Callable[[int], str],
                 secret: str | None, timeout: float) -> None:
    """Run the join handshake for world rank ``rank`` (see the module docstring).

    Args:
        store: the job's store under gradpress's prefix of this attempt; keys go under ``auth/``.
        rank: this process's world rank; rank 0 verifies everyone else.
        world_size: number of processes of the job.
        describe: role and rank of a world rank, e.g. ``"server 0 (rank 2)"``.
        secret: the job secret, or None for an open job.
        timeout: seconds any wait of the handshake may last.
    """
    auth = dist.PrefixStore("auth/", store)
    if rank == 0:
        _verify_all(auth, secret, world_size, describe, timeout)
    else:
        _join(auth, secret, describe(rank), rank, describe(0), timeout)


# -- rank 0: steps 1 and 3 ----------------------------------------------------------------------
def _verify_all(auth: dist.Store, secret: str | None, world_size: int,
                describe: Callable[[int], str], timeout: float) -> None:
    nonce = secrets.token_hex(32) if secret else OPEN
    stored = auth.compare_set("nonce", "", nonce).decode(errors="replace")
    if stored != nonce:  # step 1
        raise AuthError(f"{describe(0)}: another process already started this job's rendezvous "
                        f"in the store (is another job using the same MASTER_ADDR:MASTER_PORT, "
                        f"or another process started as rank 0?)")
    pending = set(range(1, world_size))
    seen = dict.fromkeys(pending, 0)
    refused: list[str] = []
    deadline = time.monotonic() + timeout
    while pending:  # step 3
        for r in sorted(pending):
            if _admit_rank(auth, secret, nonce, r, describe(r), seen, refused):
                pending.discard(r)
        if not pending:
            return
        if time.monotonic() > deadline:
            missing = ", ".join(describe(r) for r in sorted(pending))
            extra = f"; refused join attempts: {'; '.join(refused)}" if refused else ""
            raise CommTimeoutError(f"{describe(0)}: {missing} did not join the job within "
                                   f"{timeout:g} s{extra}", peer=missing, stage="rendezvous")
        time.sleep(_POLL_S)


def _admit_rank(auth: dist.Store, secret: str | None, nonce: str, rank: int, who: str,
                seen: dict[int, int], refused: list[str]) -> bool:
    """Judge the new lines of ``rank``; True once one of them is admitted."""
    key = f"resp/{rank}"
    if not auth.check([key]):
        return False
    lines = auth.get(key).decode(errors="replace").splitlines()
    for line in lines[seen[rank]:]:
        seen[rank] += 1
        cid, _, given = line.partition(" ")
        if not _CID.match(cid):
            refused.append(f"{who}: malformed line {line[:80]!r}")
            continue
        if secret is None:
            auth.set(f"verdict/{cid}", f"ok {OPEN}")
            return True
        if hmac.compare_digest(given, proof(secret, "gradpress-join", nonce, who, cid)):
            auth.set(f"verdict/{cid}", "ok " + proof(secret, "gradpress-admit", nonce, cid))
            return True
        reason = "no secret (GRADPRESS_SECRET is not set)" if given == "-" else \
            "wrong secret (the HMAC proof of GRADPRESS_SECRET did not verify)"
        log.warning("refused a process joining as %s: %s", who, reason)
        refused.append(f"{who}: {reason}")
        auth.set(f"verdict/{cid}", f"refused: {reason}")
    return False


# -- every other rank: steps 2 and 4 ------------------------------------------------------------
def _join(auth: dist.Store, secret: str | None, me: str, rank: int, verifier: str,
          timeout: float) -> None:
    nonce = _wait_get(auth, "nonce", timeout,
                      f"{me}: no rendezvous challenge from {verifier} within {timeout:g} s "
                      f"(is rank 0 running, with the same MASTER_ADDR:MASTER_PORT?)")
    if nonce == OPEN and secret:
        raise AuthError(f"{me} has a job secret (GRADPRESS_SECRET) but {verifier} started the "
                        f"job without one: give every process the same secret")
    cid = secrets.token_hex(16)
    given = proof(secret, "gradpress-join", nonce, me, cid) if secret else "-"
    # step 2 (Store.append is not in torch's stubs)
    auth.append(f"resp/{rank}", f"{cid} {given}\n")  # type: ignore[attr-defined]
    if nonce != OPEN and not secret:
        raise AuthError(f"{me} was refused: this job requires the job secret, and "
                        f"GRADPRESS_SECRET is not set in this process")
    verdict = _wait_get(auth, f"verdict/{cid}", timeout,
                        f"{me} was not admitted by {verifier} within {timeout:g} s (is the "
                        f"rank already taken by another process?)")
    status, _, rest = verdict.partition(" ")  # step 4
    if status != "ok":
        raise AuthError(f"{me} was refused by {verifier}: {verdict.removeprefix('refused: ')}")
    expected = OPEN if secret is None else proof(secret, "gradpress-admit", nonce, cid)
    if not hmac.compare_digest(rest, expected):
        raise AuthError(f"{me}: the admission from {verifier} does not prove the job secret "
                        f"(different GRADPRESS_SECRET on rank 0?); not joining")


def _wait_get(auth: dist.Store, key: str, timeout: float, message: str) -> str:
    try:
        auth.wait([key], datetime.timedelta(seconds=timeout))
    except Exception as e:
        raise CommTimeoutError(message, stage="rendezvous") from e
    return auth.get(key).decode(errors="replace")

"""Turning gloo/torch exceptions into meshcomm errors that say who, what and what to do.

gloo reports a dead peer as "Connection closed by peer [ip]:port" (or reset / broken
pipe) and a silent one as "Timed out waiting ...ms"; neither names a rank. What the
backend knows (rank, group, op, peer of a send/recv, the timeout) is added here.
"""

from __future__ import annotations

from meshcomm.plugin import CommTimeoutError, DistributedError, PeerLostError

__all__ = ["translate", "first_line", "lost_connection", "store_timed_out", "StoreAuthError", "ConnectAbandoned"]

_LOST = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "closed by peer",
    "connection refused",
    "socket closed",
    "eof",
    "read error",
    "write error",
    "pair closed",
)
_TIMEOUT = ("timed out", "timeout", "deadline")


class StoreAuthError(DistributedError):
    """A rendezvous-store value failed the job secret check (see :mod:`.authstore`); never used.

    ``key`` is the store key (without the store's namespace); ``peer`` the world rank whose
    record it was, when the key names one; ``replayed``: the value was sealed with this job's
    secret for another start-up (recorded in an earlier job and written here again).
    """

    def __init__(self, message: str, *, key: str, peer: int | None = None, replayed: bool = False) -> None:
        super().__init__(message)
        self.key = key
        self.peer = peer
        self.replayed = replayed


class ConnectAbandoned(RuntimeError):
    """meshcomm stopped waiting for gloo's mesh connection (:mod:`.meshwait`): a member on this
    host died, or the deadline passed, or gloo lost a connection (``suspects``: (group rank,
    description) of the members to blame; ``seen``: where they were seen so, put before their
    descriptions). Its text reads like gloo's ("connection closed" / "timed out"), so
    :func:`translate` turns it into PeerLostError or CommTimeoutError."""

    def __init__(self, message: str, suspects: list[tuple[int, str]], seen: str = "on this host") -> None:
        super().__init__(message)
        self.suspects = suspects
        self.seen = seen


def store_timed_out(exc: BaseException) -> bool:
    """Whether a torch store call failed because it timed out (torch gives that no class of its own)."""
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


def lost_connection(exc: BaseException) -> bool:
    """Whether gloo's error says a connection was lost (closed, reset, refused ...)."""
    return any(s in first_line(exc).lower() for s in _LOST)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("Exception raised from")]
    return (lines[0] if lines else type(exc).__name__)[:400]


def translate(
    exc: BaseException,
    *,
    where: str,
    op: str,
    timeout: float,
    peer: int | None = None,
    suspects: list[tuple[int, str]] | None = None,
) -> DistributedError:
    """The meshcomm error for ``exc`` raised by gloo during ``op`` on ``where`` (e.g. "rank 1 of ...").

    ``peer`` is the group rank the operation talked to, when it talked to one; ``suspects``
    are (group rank, description) of members found dead or stopped (see :mod:`.liveness`).
    """
    said = first_line(exc)
    low = said.lower()
    seen = "on this host"
    if not suspects and isinstance(exc, ConnectAbandoned):
        suspects, seen = exc.suspects, exc.seen
    suspects = suspects or []
    told = "meshcomm stopped waiting" if isinstance(exc, ConnectAbandoned) else "gloo said"
    if peer is None and len(suspects) == 1:
        peer = suspects[0][0]
    target = f"rank {peer}" if peer is not None else "a peer"
    if suspects:
        findings = f"; {seen} " if seen else "; "
        findings += "; ".join(text for _, text in suspects)
    elif peer is None:
        findings = " (gloo does not say which rank, and no rank on this host is dead or stopped)"
    else:
        findings = ""
    if any(s in low for s in _TIMEOUT) and "connection refused" not in low:  # refused: the peer is gone
        return CommTimeoutError(
            f"[gloo] {where}: {op} timed out: {target} did not answer within {timeout:g} s "
            f"(MLX_TIMEOUT){findings}. {told}: {said}. A rank may have skipped this call, be stuck, "
            "or be too slow; raise MLX_TIMEOUT if it is only slow.",
            peer=peer,
        )
    if any(s in low for s in _LOST):
        return PeerLostError(
            f"[gloo] {where}: {op} failed: lost the connection to {target}, which probably crashed or "
            f"exited{findings}. {told}: {said}. Check that rank's output; this group cannot be used any more.",
            peer=peer,
        )
    return DistributedError(f"[gloo] {where}: {op} failed: {type(exc).__name__}: {said}")

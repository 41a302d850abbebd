"""Each rank's *progress record*: a small memory-mapped file saying what the rank is doing.

The stall inspector of a waiting rank must learn what the other ranks are doing without
the help of the transport it is stuck in. Every rank of a job started by ``meshcomm
launch`` keeps ``<MESHCOMM_JOB_DIR>/progress/rank-<R>.bin`` up to date (a few bytes
written into shared memory per operation, no system call) and the inspector reads the
others' files. Under a plain PMIx launcher (Open MPI's ``mpirun``) the records go to the
launcher's per-job session directory, ``$PMIX_SERVER_TMPDIR/meshcomm-<PMIX_NAMESPACE>``,
which the launcher removes when the job ends. The record holds the operation the rank is in or last finished, and for
each group it used, the sequence number of the last collective it started there::

    header: magic "MCP1", world rank, pid, state (0 idle, 1 in an operation, 2 finished,
            3 failed), wall time of the last change, operation, group, sequence, peer
    slots:  up to SLOTS x (group, last started collective sequence)

Readers may see a record in the middle of an update (no lock): the inspector only reports,
so a torn read costs at most one slightly wrong line. Only ranks on one host share the
directory: ranks on other hosts have no record there.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ProgressWriter",
    "Progress",
    "read_progress",
    "progress_dir",
    "job_progress_dir",
    "IDLE",
    "RUNNING",
    "FINISHED",
    "FAILED",
]

IDLE, RUNNING, FINISHED, FAILED = 0, 1, 2, 3
STATES = {IDLE: "idle", RUNNING: "in", FINISHED: "finished", FAILED: "failed in"}
MAGIC = b"MCP1"
SLOTS = 32
_HEAD = struct.Struct("<4siii d 24s 64s q i")  # magic rank pid state time op group seq peer
_NOW = struct.Struct("<i d 24s 64s q i")  # the header after magic, rank and pid: what changes per operation
_STATE = struct.Struct("<i d")  # state and time
_STATE_AT = 12  # after magic, rank and pid
_SLOT = struct.Struct("<64s q")
_SEQ = struct.Struct("<q")  # a slot's sequence, after its group name
SIZE = _HEAD.size + SLOTS * _SLOT.size


def progress_dir(job_dir: str | os.PathLike[str]) -> Path:
    """Where the ranks of the job with directory ``job_dir`` keep their records."""
    return Path(job_dir) / "progress"


def job_progress_dir(environ: Mapping[str, str]) -> Path | None:
    """Where this job's ranks on this host keep their records: the launcher's job directory
    (``MESHCOMM_JOB_DIR``), else a PMIx launcher's session directory; None when neither is set."""
    job_dir = environ.get("MESHCOMM_JOB_DIR", "")
    if job_dir:
        return progress_dir(job_dir)
    tmp, namespace = environ.get("PMIX_SERVER_TMPDIR", ""), environ.get("PMIX_NAMESPACE", "")
    if tmp and namespace and os.path.isdir(tmp):
        return Path(tmp) / ("meshcomm-" + re.sub(r"[^A-Za-z0-9_.-]", "_", namespace))
    return None


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


class ProgressWriter:
    """This rank's record, mapped in memory; ``begin``/``end`` around every operation."""

    def __init__(self, folder: Path, rank: int) -> None:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = folder / f"rank-{rank}.bin"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._mm = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._rank = rank
        self._pid = os.getpid()
        self._slots: dict[str, int] = {}
        #: (op, group) -> their encoded names and the group's slot (nothing encoded per operation)
        self._known: dict[tuple[str, str], tuple[bytes, bytes, int]] = {}
        #: the last operation and group begun (compared by identity) and their entry of _known
        self._op: str | None = None
        self._group: str | None = None
        self._cur: tuple[bytes, bytes, int] = (b"", b"", 0)
        _HEAD.pack_into(self._mm, 0, MAGIC, rank, os.getpid(), IDLE, 0.0, b"", b"", 0, -1)

    def begin(self, op: str, group: str, seq: int, peer: int, now: float) -> None:
        """This rank entered ``op`` (collective number ``seq`` of ``group``, or a send/recv with ``peer``)."""
        if op is self._op and group is self._group:  # the same operation again: the commonest case
            op_b, group_b, slot = self._cur
        else:
            known = self._known.get((op, group))
            if known is None:
                known = self._learn(op, group)
            op_b, group_b, slot = self._cur = known
            self._op, self._group = op, group
        _NOW.pack_into(self._mm, _STATE_AT, RUNNING, now, op_b, group_b, seq, peer)
        if peer < 0 and slot:
            _SEQ.pack_into(self._mm, slot + 64, seq)

    def _learn(self, op: str, group: str) -> tuple[bytes, bytes, int]:
        """The encoded names of ``op`` on ``group`` and the group's slot (0: none left; the
        newest groups go unrecorded when there are more than SLOTS), computed once."""
        group_b = group.encode()[:64]
        slot = self._slots.get(group)
        if slot is None and len(self._slots) < SLOTS:
            slot = self._slots[group] = _HEAD.size + len(self._slots) * _SLOT.size
            _SLOT.pack_into(self._mm, slot, group_b, 0)
        known = self._known[(op, group)] = (op.encode()[:24], group_b, slot or 0)
        return known

    def lane_fields(self, op: str, group: str) -> tuple[mmap.mmap, bytes, bytes, int]:
        """What a compiled call path writes for ``op`` on ``group`` instead of calling
        :meth:`begin` and :meth:`end`: this record's buffer, the encoded names and the group's
        slot (0: none). It writes the fields of ``_NOW`` at ``_STATE_AT``, the slot's sequence
        (``_SEQ`` at slot + 64) and, at the end, ``_STATE`` (tests/test_trace.py compares
        its bytes with these methods')."""
        known = self._known.get((op, group))
        if known is None:
            known = self._learn(op, group)
        op_b, group_b, slot = known
        return self._mm, op_b, group_b, slot

    def end(self, ok: bool, now: float) -> None:
        """The operation begun last ended (``ok``: it returned)."""
        _STATE.pack_into(self._mm, _STATE_AT, FINISHED if ok else FAILED, now)

    def close(self) -> None:
        try:
            self._mm.close()
        except (BufferError, ValueError):
            pass


@dataclass(frozen=True)
class Progress:
    """Another rank's record as read from its file."""

    rank: int
    pid: int
    state: int
    time: float
    op: str
    group: str
    seq: int
    peer: int
    started: dict[str, int]  #: group -> last collective sequence started there

    def doing(self, now: float) -> str:
        """``"in all_sum #5 of world for 2.1 s"``, ``"finished barrier #4 of world 0.3 s ago"``."""
        if self.state == IDLE:
            return "no operation yet"
        what = (
            f"{self.op} #{self.seq} of {self.group}"
            if self.peer < 0
            else f"{self.op} with rank {self.peer} of {self.group}"
        )
        age = max(0.0, now - self.time)
        if self.state == RUNNING:
            return f"in {what} for {age:.1f} s"
        return f"{STATES.get(self.state, '?')} {what} {age:.1f} s ago"


def read_progress(folder: Path) -> dict[int, Progress]:
    """Every readable record in ``folder``, by world rank."""
    out: dict[int, Progress] = {}
    try:
        names = sorted(folder.glob("rank-*.bin"))
    except OSError:
        return out
    for path in names:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if len(data) < SIZE or data[:4] != MAGIC:
            continue
        _, rank, pid, state, t, op, group, seq, peer = _HEAD.unpack_from(data, 0)
        started = {}
        for i in range(SLOTS):
            g, s = _SLOT.unpack_from(data, _HEAD.size + i * _SLOT.size)
            if g[:1] != b"\0":
                started[_text(g)] = s
        out[rank] = Progress(rank, pid, state, t, _text(op), _text(group), seq, peer, started)
    return out

"""Shared memory between the ranks of one host: the fast path of the sockets backend.

Ranks that share a host (decided by an explicit host identity exchanged at start-up:
``MESHCOMM_HOST_ID``, else hostname + boot id + the device of ``/dev/shm``) map one
segment: a control line per rank and two data slots per rank. A collective moves the
array in pieces; for each piece every rank copies its part into its slot, publishes a
sequence number, waits until every local rank has published it, then reads what it
needs from the others' slots (for a reduction: all slots, combined in rank order, so
every rank computes the same bytes; on 3+ ranks each rank combines only its block and
publishes it as the next piece). Two slots per rank and one wait per piece are
enough: a rank overwrites a slot only after every rank has published the next piece,
which each does only after it finished reading the previous one.

Waiting never spins for long: after a bounded spin (``MESHCOMM_SOCKETS_SPIN_US``) a rank announces that it sleeps and
blocks in ``poll`` on its own FIFO (a peer that publishes writes one byte to the FIFO of
every sleeping peer) and on the TCP connections of its local peers, which report a dead
peer (closed connection) or a failure elsewhere (ABORT frame) at once.

The segment and the FIFOs live in one private directory, ``/dev/shm/meshcomm-<job>-<hex>``
(mode 0700, created by the host's first rank with ``mkdir``, which fails rather than reuse
a name someone else made), so no other user can create, replace or open a name in it
first. A name received from a peer is used only if it has exactly that form for this
job, and the directory and segment only if this user owns them, with the expected mode,
type and size (:func:`check_name`, :func:`open_dir`). The directory is removed as soon as
every local rank has opened what it needs, and also (``finally``) when set-up fails, so
nothing is left in ``/dev/shm`` when the job ends, however it ends (except for a rank
killed during set-up: then ``meshcomm launch`` removes ``/dev/shm/meshcomm-<job id>-*``). The creator reserves
the segment's pages (``posix_fallocate``) before anyone maps it: a ``/dev/shm`` too small
for it is a clear :class:`ShmSpaceError` at start-up (the job then uses TCP), never a
SIGBUS on the first write to a page the filesystem cannot provide.

Piece sequence numbers count 1, 2, ..., 2**32, 1, ... (never 0, which means "not
waiting"; the parity alternates across the wrap, as the two slots need): a rank is never
more than one piece ahead of another, so "every rank has published my piece" is "no rank
still shows the previous number", an equality test that survives the wrap.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import math
import mmap
import os
import platform
import re
import secrets
import select
import socket
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
from meshcomm.plugin import (
    UFUNCS,
    CollectiveMismatchError,
    CommTimeoutError,
    DistributedError,
    PeerLostError,
    algorithms,
    dtype_code,
    reducer,
)

from . import cma, wire
from .engine import Call, Fabric, shape_differs
from .results import OwnResults, PeerResults

__all__ = [
    "host_key",
    "ShmGroup",
    "SHM_DIR",
    "ShmSpaceError",
    "ShmSetupError",
    "SEQ_WRAP",
    "next_piece",
    "new_name",
    "check_name",
    "check_piece",
    "remove_dir",
    "MIN_PIECE",
    "MAX_PIECE",
    "DIRECT_MIN_BYTES",
]

SHM_DIR = Path("/dev/shm")
_LINE = 24  # int64 words per rank's control line (three cache lines)
_SEQ, _WAIT = 0, 1  # then, per slot parity p, the call descriptor at 2 + 5p: op, dtype, total, seq, arg
_DESC = 5
#: the descriptor's first word for slot parity 0 and 1
_DESC_AT = (2, 2 + _DESC)
#: direct reads (cma.py): the rank's pid, the address and value of its 16-byte probe token,
#: and per parity p the addresses of the call's send and receive buffers at _ADDR + 2p
_PID, _TOKEN_AT, _TOKEN, _ADDR = 12, 13, 14, 16
#: the push path (results.py): the fd and ident of the shared buffer the rank's result of
#: this direct all-reduce is in (fd -1: a private array), and the mask of the local ranks
#: whose results it wrote its block into
_RESULT_FD, _RESULT_ID, _PUSHED = 20, 21, 22
#: collectives of at least this many bytes read peers' arrays directly when every local
#: rank can (below it the two-copy slots are faster: one wait instead of two or three)
DIRECT_MIN_BYTES = 256 * 1024
#: all-reduces on three local ranks or more from this size split the reduction: each rank
#: combines its block of every slot, then copies the others' (ShmGroup._split_all_reduce;
#: below it one wait with every rank combining everything is faster: at 128 KiB 0.70-0.84x
#: the split's time on 3 and 4 ranks, docs/sockets.md)
SPLIT_MIN_BYTES = 256 * 1024
#: all-reduces below this size stay on the slots (split on 3+ ranks), piece by piece, even
#: when direct reads are possible: on 3 and 4 ranks the slots measured 1.06-1.12x faster
#: up to 12 MiB (docs/sockets.md)
DIRECT_REDUCE_MIN_BYTES = 16 << 20
#: the same on 2 local ranks, where the direct path halves each rank's additions: it measured
#: 0.78-0.89x the slots' time at 2 MiB and 0.68-0.77x from 4 MiB, quiet or beside a busy
#: process; at 1 MiB the same as the slots (docs/sockets.md)
DIRECT_REDUCE_MIN_BYTES_TWO = 2 << 20
#: bytes a rank reduces per direct read (a peer's chunk is read into a buffer this size; in
#: C, 64 KiB-256 KiB measured the same at 1 MiB and 256 KiB best from 4 MiB up)
_DIRECT_CHUNK_BYTES = 256 * 1024
#: piece numbers run 1..SEQ_WRAP (even, so parity alternates across the wrap)
SEQ_WRAP = 1 << 32


def next_piece(seq: int) -> int:
    """The piece number after ``seq`` (1, 2, ..., SEQ_WRAP, 1, ...)."""
    return seq % SEQ_WRAP + 1


#: slot sizes a peer may announce (MESHCOMM_SOCKETS_SHM_PIECE_KIB: 4..65536 KiB)
MIN_PIECE, MAX_PIECE = 4 << 10, 64 << 20
_SEGMENT, _FIFO = "segment", "fifo"


class ShmSetupError(OSError):
    """A shared-memory name, size or file is not what this job's set-up makes (the message
    says what was found); the job uses TCP instead."""


def job_tag(job_id: str | None) -> str:
    """The job's part of a segment directory's name: the launcher's job id when it is a
    plain word, else a digest of it (never a path), 'nojob' without one."""
    if not job_id:
        return "nojob"
    if re.fullmatch(r"[A-Za-z0-9_]{1,64}", job_id):
        return job_id
    return "j" + hashlib.sha256(job_id.encode()).hexdigest()[:16]


def new_name(job_id: str | None) -> str:
    """A fresh directory name the launcher can find and remove if a job dies during start-up."""
    return f"meshcomm-{job_tag(job_id)}-{secrets.token_hex(6)}"


def check_name(name: str, job_id: str | None) -> str:
    """``name`` if it is exactly a name :func:`new_name` makes for this job (no ``/``, no
    ``..``, nothing else), else ShmSetupError."""
    if not re.fullmatch(rf"meshcomm-{re.escape(job_tag(job_id))}-[0-9a-f]{{12}}", name):
        raise ShmSetupError(
            f"the host's first rank announced the shared-memory name {name[:80]!r}, which is not "
            f"of the form meshcomm-{job_tag(job_id)}-<12 hex digits> (is MESHCOMM_JOB_ID the same "
            "on every rank?)"
        )
    return name


def check_piece(text: str) -> int:
    """The slot size a peer announced, if it is one MESHCOMM_SOCKETS_SHM_PIECE_KIB allows."""
    if not re.fullmatch(r"[0-9]{1,9}", text) or not MIN_PIECE <= int(text) <= MAX_PIECE or int(text) % 1024:
        raise ShmSetupError(
            f"the host's first rank announced a shared-memory slot of {text[:40]!r} bytes; "
            f"expected a multiple of 1024 from {MIN_PIECE} to {MAX_PIECE}"
        )
    return int(text)


def open_dir(path: Path) -> None:
    """Check that ``path`` is a directory (not a link) of this user with mode 0700."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
        raise ShmSetupError(
            f"{path} is not a private directory of this user (type {stat.filemode(st.st_mode)}, "
            f"owner uid {st.st_uid}, this process runs as uid {os.geteuid()}); not using it"
        )


def remove_dir(path: Path) -> None:
    """Remove a segment directory and what is in it (only if it is this user's directory)."""
    try:
        open_dir(path)
    except OSError:
        return
    try:
        for entry in os.scandir(path):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass


class ShmSpaceError(OSError):
    """The shared-memory filesystem cannot hold this host's segment (the message says how
    much is needed and how to get it)."""


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def reserve(fd: int, size: int, path: Path, ranks: int) -> None:
    """Give the file ``fd`` its ``size`` bytes and reserve them in the filesystem, so no page
    of the mapping can fail later (tmpfs has no space: SIGBUS); ShmSpaceError if it cannot."""
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        try:
            st = os.statvfs(path.parent)
            room = f"{_mib(st.f_bavail * st.f_frsize)} free of {_mib(st.f_blocks * st.f_frsize)}"
        except OSError:
            room = "unknown free space"
        raise ShmSpaceError(
            exc.errno,
            f"{path.parent} cannot hold the shared-memory segment of this host's {ranks} ranks: it needs "
            f"{_mib(size)} ({size} bytes) and {path.parent} has {room} ({exc.strerror}). Using TCP "
            f"between every rank instead (slower). Fix: give it more room (containers: docker run "
            f"--shm-size={max(64, -(-2 * size // (1 << 20)))}m, Kubernetes: an emptyDir with medium: "
            "Memory on /dev/shm), use smaller slots (MESHCOMM_SOCKETS_SHM_PIECE_KIB), or set "
            "MESHCOMM_SOCKETS_SHM=0 to use TCP without this warning.",
        ) from None


_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier (lock/unlock pairs are atomic read-modify-writes): between a
    store and a later load of another word (publish, then look whether a peer sleeps)."""
    with _fence_lock:
        pass
    with _fence_lock:
        pass


def _no_fence() -> None:
    """x86-64 keeps stores in order and loads in order (only a store may pass a later load),
    so publishing (descriptor, then sequence number) and reading (sequence number, then
    descriptor) need no barrier there; each is a separate C call the compiler cannot reorder."""


#: the barrier between writing a piece's descriptor and its sequence number, and between
#: seeing a sequence number and reading the descriptor (free where the CPU already orders them)
_ordered = _no_fence if platform.machine().lower() in ("x86_64", "amd64") else _fence


def host_key(override: str | None = None) -> bytes:
    """16 bytes naming this host for shared memory: equal only where /dev/shm is shared and
    the network namespace is the same (ranks in different network namespaces are treated
    as different hosts: they are how several hosts are simulated on one machine)."""
    if override:
        text = "id:" + override
    else:
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            boot = "?"
        try:
            dev = os.stat(SHM_DIR).st_dev
        except OSError:
            dev = -1
        try:
            netns = os.stat("/proc/self/ns/net").st_ino
        except OSError:
            netns = -1
        text = f"{socket.gethostname()}|{boot}|{dev}|{netns}"
    return hashlib.sha256(text.encode()).digest()[:16]


class ShmGroup:
    """The shared-memory channel of the local ranks ``local`` (world ranks, sorted)."""

    def __init__(
        self, fabric: Fabric, local: list[int], name: str, piece: int, create: bool, seq_start: int = 0
    ) -> None:
        self.fabric = fabric
        self.local = local
        self.n = len(local)
        self.me = local.index(fabric.rank)
        self.piece = piece
        self.timeout = fabric.timeout
        #: the last piece this rank published, and the one before (what laggards still show)
        self.seq = self.prev = seq_start % SEQ_WRAP
        size = segment_size(self.n, piece)
        self.dir = SHM_DIR / name
        path = self.dir / _SEGMENT
        self.peer_fifos: dict[int, int] = {}
        self.fifo = -1
        #: the compiled hot loop (``_shm``), when attached (:meth:`attach_native`)
        self.native: Any = None
        #: dtype -> element kind the C channel sums in the one-piece all_sum (empty: NumPy sums)
        self.native_sums: dict[np.dtype, int] = {}
        #: dtype -> (its kind in native_sums, its wire code): what quick_sum looks up per call
        self._sum_codes: dict[np.dtype, tuple[int, int]] = {}
        #: (parity, dtype) -> each local rank's whole slot of that parity viewed as dtype
        self._slots: dict[tuple[int, np.dtype], list[np.ndarray]] = {}
        #: (parity, dtype, count) -> those slots cut to count elements (the one-piece all-reduce)
        self._small: dict[tuple[int, np.dtype, int], list[np.ndarray]] = {}
        #: word offsets of the other local ranks' control lines
        self._others = [i * _LINE for i in range(len(local)) if i != local.index(fabric.rank)]
        self._mine = local.index(fabric.rank) * _LINE
        try:
            if create:
                os.mkdir(self.dir, 0o700)  # fails if the name exists: never someone else's
                os.chmod(self.dir, 0o700)  # whatever the umask
            else:
                open_dir(self.dir)
            flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
            fd = os.open(path, flags, 0o600)
            try:
                if create:
                    reserve(fd, size, path, self.n)
                else:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != size:
                        raise ShmSetupError(
                            f"{path} is not this job's segment: {st.st_size} bytes where {self.n} local ranks with "
                            f"{piece}-byte slots need {size}, owner uid {st.st_uid}; not using it"
                        )
                self.map = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.ctrl = np.frombuffer(self.map, dtype=np.int64, count=_LINE * self.n).reshape(self.n, _LINE)
            #: the same control words as Python ints (reading one is several times cheaper)
            self.words = memoryview(self.map)[: 8 * _LINE * self.n].cast("q")
            self.ctrl[self.me, _SEQ] = self.seq  # every rank does before the start-up barrier
            self._token = np.frombuffer(secrets.token_bytes(16), np.int64).copy()
            self.ctrl[self.me, _PID] = os.getpid()
            self.ctrl[self.me, _TOKEN_AT] = self._token.ctypes.data
            self.ctrl[self.me, _TOKEN : _TOKEN + 2] = self._token
            self.data = np.frombuffer(self.map, dtype=np.uint8, offset=8 * _LINE * self.n)
            # my wake-up FIFO; peers' FIFOs are opened in connect_fifos()
            fifo_path = self.dir / f"{_FIFO}{self.me}"
            os.mkfifo(fifo_path, 0o600)
            self.fifo = os.open(fifo_path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW)
        except BaseException:
            if create:
                remove_dir(self.dir)
            self.close()
            raise
        self.links = fabric.link_all([q for q in local if q != fabric.rank])
        #: every local rank reads the others' arrays directly (set by topology after probe_direct)
        self.direct = False
        #: this rank's results of large all-reduces in shared memory, and the peers' mapped here
        self.results = OwnResults()
        self.peer_results = PeerResults()

    def attach_native(self) -> bool:
        """Publish, spin and compare descriptors in C (the extension ``meshcomm_sockets._shm``,
        in the distribution's wheels) if this installation has it; the protocol is the same,
        so every local rank may choose on its own. Returns whether it is attached."""
        try:
            from ._shm import Channel
        except ImportError:  # built where no compiler was: the pure-Python loop
            return False
        self.native = Channel(self.map, self.n, self.me, _LINE, self.piece)
        self.native_sums = dict(_NATIVE_SUMS)
        self._sum_codes = {dt: (kind, dtype_code(dt)) for dt, kind in _NATIVE_SUMS.items()}
        return True

    def connect_fifos(self) -> None:
        """Open every local peer's FIFO (after all created theirs)."""
        for i in range(self.n):
            if i != self.me:
                path = self.dir / f"{_FIFO}{i}"
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
                self.peer_fifos[i] = fd
                if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                    raise ShmSetupError(f"{path} is not a FIFO; not using it")

    def probe_direct(self) -> bool:
        """Whether this rank can read every local peer's memory (after the start-up barrier):
        it reads each peer's random token at the address the peer published and compares it
        with the value in the segment, so a peer in another PID namespace (where its pid
        names some other process) or one the kernel will not let us read fails the probe."""
        if not cma.supported():
            return False
        got = np.empty(2, np.int64)
        for i in range(self.n):
            if i == self.me:
                continue
            try:
                cma.read(int(self.ctrl[i, _PID]), int(self.ctrl[i, _TOKEN_AT]), got)
            except OSError:
                return False
            if not (got == self.ctrl[i, _TOKEN : _TOKEN + 2]).all():
                return False
        return True

    def unlink(self) -> None:
        """Remove the directory and its names (after everyone opened them; the host's first
        rank does it); the mappings and open FIFOs stay valid."""
        remove_dir(self.dir)

    def close(self) -> None:
        for fd in [self.fifo, *self.peer_fifos.values()]:
            if fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        self.fifo = -1
        self.peer_fifos.clear()
        if self.native is not None:
            self.native.release()  # its hold on the map, before closing it
            self.native = None
            self._sum_codes = {}
        if hasattr(self, "results"):
            self.results.close()
            self.peer_results.close()
        try:
            self.ctrl = np.zeros((0, _LINE), np.int64)  # drop views before closing the map
            self.data = np.zeros(0, np.uint8)
            self._slots.clear()
            self._small.clear()
            if hasattr(self, "words"):
                self.words.release()
            if hasattr(self, "map"):
                self.map.close()
        except (BufferError, ValueError):
            pass

    # -- slots ----------------------------------------------------------------------------
    def slot(self, i: int, k: int, dtype: np.dtype, count: int) -> np.ndarray:
        """The first ``count`` elements of local rank ``i``'s slot for piece ``k``."""
        return self.slots(k, dtype)[i][:count]

    def slots(self, k: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every local rank's whole slot for piece ``k`` as ``dtype`` (views made once)."""
        key = (k & 1, dtype)
        views = self._slots.get(key)
        if views is None:
            per = self.piece // dtype.itemsize
            views = [
                self.data[(2 * i + (k & 1)) * self.piece :][: per * dtype.itemsize].view(dtype) for i in range(self.n)
            ]
            self._slots[key] = views
        return views

    def _small_views(self, key: tuple[int, np.dtype, int]) -> list[np.ndarray]:
        """Every local rank's first ``count`` elements of its slot of parity ``k`` for
        ``key = (k, dtype, count)``, remembered for the next call of that size (up to 64 sizes)."""
        k, dtype, count = key
        if len(self._small) >= 64:
            self._small.clear()
        views = self._small[key] = [v[:count] for v in self.slots(k, dtype)]
        return views

    # -- synchronisation ------------------------------------------------------------------
    def _publish(self, call: Call, src: np.ndarray | None) -> None:
        """Copy ``src`` (at most one slot, or None) into this rank's slot of the next piece,
        publish the piece and wake the local ranks asleep waiting for it."""
        prev = self.seq
        seq = prev % SEQ_WRAP + 1  # next_piece, inline: this is the hot path
        nat = self.native
        if nat is not None:
            mask = nat.publish(src, _DESC_AT[prev & 1], call.op, call.dtype, call.total, call.seq, call.arg, seq, prev)
            self.prev, self.seq = prev, seq
            if mask > 0:
                for i, fd in self.peer_fifos.items():
                    if mask >> i & 1:
                        self._wake(call, i, fd)
            elif mask < 0:  # too many local ranks for a mask
                self._wake_sleepers(call)
            return
        if src is not None:
            self.slots(prev, src.dtype)[self.me][: src.size] = src
        w, me = self.words, self._mine
        d = me + _DESC_AT[prev & 1]  # a peer reads it before we can reach the same parity again
        w[d], w[d + 1], w[d + 2], w[d + 3], w[d + 4] = call.op, call.dtype, call.total, call.seq, call.arg
        self.prev, self.seq = prev, seq
        _ordered()
        w[me + _SEQ] = seq
        _fence()
        self._wake_sleepers(call)

    def _wake_sleepers(self, call: Call) -> None:
        """Wake every local rank asleep waiting for the piece just published (or the last)."""
        w, seq, prev = self.words, self.seq, self.prev
        for i, fd in self.peer_fifos.items():
            waits = w[i * _LINE + _WAIT]
            if waits and (waits == seq or waits == prev):
                self._wake(call, i, fd)

    def _wake(self, call: Call, i: int, fd: int) -> None:
        """Wake local rank ``i`` through its FIFO ``fd``; a FIFO nobody reads means it is gone."""
        try:
            os.write(fd, b"\0")
        except BlockingIOError:
            pass  # its FIFO is full of wake-ups already
        except BrokenPipeError:  # nobody reads its FIFO: it is gone
            if self.words[i * _LINE + _SEQ] == self.seq:
                # it published this piece too, then saw ours without the wake-up and ended
                # (its last call): nothing of this piece is lost; a later piece that needs it
                # finds its connection closed
                return
            # it may have failed because of someone else and said so (ABORT): that wins
            self.fabric.probe(self.fabric.link_to(self.local[i]))
            mine = self.fabric.pending_abort() or self.fabric.stalled_error(f"found local rank {self.local[i]} gone")
            if mine is not None:
                raise mine from None
            raise PeerLostError(
                f"rank {self.fabric.rank}: rank {self.local[i]} (same host) died while "
                f"waiting in {call.describe()} in group {call.label}; check its output.",
                peer=self.local[i],
            ) from None

    def _ready(self) -> bool:
        """Every local rank published piece ``seq`` (none still shows the previous one)."""
        w, prev = self.words, self.prev
        for o in self._others:
            if w[o + _SEQ] == prev:
                return False
        return True

    def _wait(self, call: Call) -> None:
        nat = self.native
        if nat is not None:
            fab = self.fabric
            if not nat.spin(self.prev, fab.spin_ns, fab.yielding):
                self._sleep(call)
            if not nat.matches(_DESC_AT[self.prev & 1], call.op, call.dtype, call.total, call.seq, call.arg):
                self._check(call)  # raises the mismatch
            return
        if not self._ready():
            fab = self.fabric
            until = time.perf_counter() + fab.spin  # bounded spin first (see topology.wait_policy)
            while time.perf_counter() < until:
                if fab.yielding:
                    os.sched_yield()
                if self._ready():
                    break
            else:
                self._sleep(call)
        _ordered()
        self._check(call)

    def _sleep(self, call: Call) -> None:
        me = self.ctrl[self.me]
        poller = select.poll()
        poller.register(self.fifo, select.POLLIN)
        watch = {lk.fd: lk for lk in self.links}
        for fd in watch:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + self.timeout
        try:
            self._sleep_until_ready(call, poller, watch, deadline)
        finally:
            me[_WAIT] = 0  # also when raising: a waiting flag left behind would be signalled

    def _sleep_until_ready(self, call: Call, poller: select.poll, watch: dict, deadline: float) -> None:
        me = self.ctrl[self.me]
        while True:
            me[_WAIT] = self.seq
            _fence()
            if self._ready():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                mine = self.fabric.pending_abort() or self.fabric.stalled_error("its wait timed out")
                if mine is not None:
                    raise mine
                lagging = [self.local[i] for i in range(self.n) if self.ctrl[i, _SEQ] == self.prev]
                who = ("rank " if len(lagging) == 1 else "ranks ") + ", ".join(map(str, lagging))
                raise CommTimeoutError(
                    f"rank {self.fabric.rank}: {who} (same host, shared memory) did not join "
                    f"{call.describe()} in group {call.label} for {self.timeout:g} s. "
                    f"{'It is' if len(lagging) == 1 else 'They are'} stuck, slower than MLX_TIMEOUT={self.timeout:g}, "
                    "or calling a different operation.",
                    peer=lagging[0] if lagging else None,
                )
            asked_at = time.monotonic()
            events = poller.poll(min(left, 0.01) * 1000)
            self.fabric.note_stall(asked_at, min(left, 0.01))
            if any(fd == self.fifo for fd, _ in events):
                try:
                    while os.read(self.fifo, 4096):
                        pass
                except BlockingIOError:
                    pass
            if self._ready():  # a peer may publish and then exit: its data counts first
                break
            for fd, _ev in events:
                if fd != self.fifo and self.fabric.probe(watch[fd], call):
                    poller.unregister(fd)  # data of a later operation: not our concern now

    def _check(self, call: Call) -> None:
        w = self.words
        d = _DESC_AT[self.prev & 1]
        op, dtype, total, seq, arg = call.op, call.dtype, call.total, call.seq, call.arg
        for o in self._others:
            o += d
            if w[o] != op or w[o + 1] != dtype or w[o + 2] != total or w[o + 3] != seq or w[o + 4] != arg:
                break
        else:
            return
        mine = (op, dtype, total, seq, arg)
        for i in range(self.n):
            theirs = tuple(int(v) for v in self.ctrl[i, d : d + _DESC])
            if theirs != mine:
                raise CollectiveMismatchError(
                    f"rank {self.fabric.rank} called {call.describe()} in group {call.label}, but local "
                    f"rank {self.local[i]} is in {call.theirs(theirs[0], theirs[3], theirs[1], theirs[2], theirs[4])}"
                    f"{shape_differs(total, theirs[2])} (shared memory). "
                    "Every rank must make the same calls in the same order with the same shapes, "
                    "dtypes and roots."
                )

    def _step(self, call: Call, src: np.ndarray | None, use: Callable[[], None] | None) -> None:
        """One piece: copy ``src`` (if any) into this rank's slot, publish, wait for every
        local rank, ``use()`` the slots; on failure tell every peer (ABORT)."""
        self.fabric.check()
        try:
            self._publish(call, src)
            self._wait(call)
            if use is not None:
                use()
        except DistributedError as exc:
            self.fabric.fail(exc)
            raise

    def _run(
        self, call: Call, src: np.ndarray, count: int, fill: bool, use: Callable[[int, int, int], None] | None
    ) -> None:
        """Move ``count`` elements piece by piece: copy ``src[lo:hi]`` into this rank's slot
        (when ``fill``), publish, wait for every local rank, then ``use(k, lo, hi)``."""
        dt = src.dtype
        per = max(1, self.piece // dt.itemsize)
        for lo in range(0, count, per):
            hi = min(lo + per, count)
            k = self.seq
            self._step(
                call, src[lo:hi] if fill else None, functools.partial(use, k, lo, hi) if use is not None else None
            )

    def _combine(self, f: np.ufunc, k: int, dt: np.dtype, count: int, part: slice, out: np.ndarray) -> None:
        """``out`` = every local rank's slot of piece ``k`` (elements ``part``) combined with
        ``f`` in rank order, the same expression on every rank (bit-identical results)."""
        f(self.slot(0, k, dt, count)[part], self.slot(1, k, dt, count)[part], out=out)
        for i in range(2, self.n):
            f(out, self.slot(i, k, dt, count)[part], out=out)

    # -- collectives ----------------------------------------------------------------------
    def is_direct(self, nbytes: int) -> bool:
        """Take the direct path (the same answer on every local rank making this call): from
        DIRECT_MIN_BYTES, and only above one slot (the slots then need two waits or more,
        the direct path two or three; at one slot, one wait of the slots is cheaper, most of
        all when ranks outnumber cores and every wait costs context switches)."""
        return self.direct and nbytes >= DIRECT_MIN_BYTES and nbytes > self.piece

    def _direct_reduce(self, nbytes: int) -> bool:
        """An all-reduce of ``nbytes`` takes the direct path (:meth:`_direct_all_reduce`)."""
        least = DIRECT_REDUCE_MIN_BYTES_TWO if self.n == 2 else DIRECT_REDUCE_MIN_BYTES
        return self.is_direct(nbytes) and nbytes >= least

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A new array for the result of an all-reduce of this shape and dtype: in shared
        memory when that call takes the direct path and a shared buffer is free (the peers
        then write their blocks into it), else an ordinary one."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._direct_reduce(nbytes):
            res = self.results.empty(shape, dtype)
            if res is not None:
                return res
        return np.empty(shape, dtype)

    def all_reduce(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        f, dt = UFUNCS[op], sendbuf.dtype
        if sendbuf.nbytes <= self.piece:  # one piece (never direct)
            if self.n > 2 and sendbuf.nbytes >= SPLIT_MIN_BYTES:
                self._split_all_reduce(call, sendbuf, recvbuf, f)
                return
            # the latency path: one wait, every rank combines every slot
            if op == "sum" and self.quick_sum(call.owner, sendbuf, recvbuf, call):
                return
            self._slots_reduce(call, sendbuf, recvbuf, f, self.seq & 1, publish=True)
            return
        if self._direct_reduce(sendbuf.nbytes):
            self._direct_all_reduce(call, sendbuf, recvbuf, f)
            return
        if self.n > 2:
            per = self.piece // dt.itemsize
            for lo in range(0, sendbuf.size, per):
                self._split_all_reduce(call, sendbuf[lo : lo + per], recvbuf[lo : lo + per], f)
            return
        self._run(
            call,
            sendbuf,
            sendbuf.size,
            True,
            lambda k, lo, hi: self._combine(f, k, dt, hi - lo, slice(None), recvbuf[lo:hi]),
        )

    def _slots_reduce(
        self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, f: np.ufunc, parity: int, *, publish: bool
    ) -> None:
        """The one-piece all-reduce in Python: publish ``sendbuf`` (unless already
        published) and wait, then combine every local rank's slot of ``parity`` in rank order."""
        key = (parity, sendbuf.dtype, sendbuf.size)
        views = self._small.get(key)
        if views is None:
            views = self._small_views(key)
        if publish:
            self._step(call, sendbuf, None)
        f(views[0], views[1], out=recvbuf)
        for v in views[2:]:
            f(recvbuf, v, out=recvbuf)

    def quick_sum(self, owner: Any, sendbuf: np.ndarray, recvbuf: np.ndarray, call: Call | None = None) -> bool:
        """One piece of a dtype the compiled channel sums (:attr:`native_sums`): publish, spin,
        compare and sum in one C call. ``call``: the collective it is part of (a sum_scatter or
        a hierarchical sum runs through here too); None: a plain all_sum of backend ``owner``
        numbered as its next collective (its ``call_seq`` + 1, taken when this returns True,
        as its ``_new_call`` would), never inside another of its collectives. The latency path
        of a small call: a :class:`Call` is made only if the C call leaves work to Python
        (peers to wake, a sleep, a mismatch). False when it does not apply: nothing was
        published, take :meth:`all_reduce`. ``partial(quick_sum, owner)`` is the backend's
        ``sum_now`` (the entry of the core's compiled call path)."""
        codes = self._sum_codes.get(sendbuf.dtype)  # empty without the compiled channel
        nbytes = sendbuf.nbytes
        if codes is None or nbytes > self.piece or (nbytes >= SPLIT_MIN_BYTES and self.n > 2):
            return False
        kind, dcode = codes
        if call is None:
            cseq = (owner.call_seq + 1) & wire.SEQ_MASK
            key = owner.shape_key
            total = wire.call_total(sendbuf.size, key) if key else sendbuf.size
            code, arg = _ALL_SUM, 0
        else:
            # published as the call it is part of: every check compares descriptors with that
            # call's op and argument
            cseq, total, code, arg = call.seq, call.total, call.op, call.arg
        nat = self.native
        fab = self.fabric
        fab.check()
        prev = self.seq
        seq = prev % SEQ_WRAP + 1
        status = nat.all_sum(
            sendbuf,
            recvbuf,
            kind,
            _DESC_AT[prev & 1],
            code,
            dcode,
            total,
            cseq,
            arg,
            seq,
            prev,
            fab.spin_ns,
            fab.yielding,
        )
        self.prev, self.seq = prev, seq
        if status == 0:
            if call is None:
                owner.call_seq = cseq
            return True
        return self.quick_rest(owner, call, sendbuf, recvbuf, status, prev, cseq, dcode, total)

    def quick_rest(
        self,
        owner: Any,
        call: Call | None,
        sendbuf: np.ndarray,
        recvbuf: np.ndarray,
        status: int,
        prev: int,
        cseq: int,
        dcode: int,
        total: int,
    ) -> bool:
        """What :meth:`quick_sum` does after a C call that left work to Python (``status``
        1: peers to wake, 2: sleep, 3: a mismatch; the piece after ``prev`` is published, as
        call ``cseq`` of ``dcode`` and ``total``): then the sum in Python. Returns True."""
        fab = self.fabric
        mine = call if call is not None else Call(owner.gid, cseq, _ALL_SUM, dcode, total, owner.label, 0, owner)
        try:
            if status == 1:
                self._wake_sleepers(mine)
                self._wait(mine)
            else:
                if status == 2:
                    self._sleep(mine)
                self._check(mine)  # raises a mismatch
        except DistributedError as exc:
            fab.fail(exc)
            raise
        self._slots_reduce(mine, sendbuf, recvbuf, np.add, prev & 1, publish=False)
        if call is None:
            owner.call_seq = cseq
        return True

    def sum_entry(self, owner: Any) -> Callable[[np.ndarray, np.ndarray], bool] | None:
        """``quick_sum(owner, sendbuf, recvbuf)`` for backend ``owner``'s own small all_sums
        (its ``sum_now``): in C (``_shm.QuickSum``) when the channel is attached; None without it."""
        if self.native is None:
            return None
        from ._shm import QuickSum

        return QuickSum(
            self.native,
            self,
            owner,
            self.fabric,
            self._sum_codes,
            SPLIT_MIN_BYTES,
            wire.SEQ_MASK,
            SEQ_WRAP,
            wire.COUNT_MASK,
            wire.SHAPE_SHIFT,
            _ALL_SUM,
            _DESC_AT[0],
            _DESC_AT[1],
        ).run

    def _split_all_reduce(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, f: np.ufunc) -> None:
        """One piece in two waits: every rank copies its input into its slot; each combines
        only its block of every slot (the expression of :meth:`_combine`) into its slot of the
        next piece; then each copies every block out. A rank computes 1/n of the result
        instead of all of it, for one more wait."""
        dt, count = sendbuf.dtype, sendbuf.size
        bounds = algorithms.block_bounds(count, self.n)
        mine = slice(bounds[self.me], bounds[self.me + 1])
        k = self.seq
        self._step(call, sendbuf, None)
        k2 = self.seq  # every rank has used piece k - 1: this rank's slot of k + 1 is free
        self._combine(f, k, dt, count, mine, self.slot(self.me, k2, dt, count)[mine])
        self._step(call, None, None)
        for i, v in enumerate(self.slots(k2, dt)):
            recvbuf[bounds[i] : bounds[i + 1]] = v[bounds[i] : bounds[i + 1]]

    def reduce_scatter(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, op: str) -> None:
        """This local rank's block (``len(recvbuf)`` elements at ``me * len``) of the reduction."""
        f, dt = reducer(op), sendbuf.dtype
        first, last = self.me * recvbuf.size, (self.me + 1) * recvbuf.size
        if self.is_direct(sendbuf.nbytes):
            sendbuf = _apart(sendbuf, recvbuf)
            self._announce(sendbuf, recvbuf)
            self._step(call, None, lambda: self._reduce_block(call, sendbuf, first, last, recvbuf, f))
            self._step(call, None, None)  # nobody still reads this rank's input
            return

        def use(k: int, lo: int, hi: int) -> None:
            a, b = max(lo, first), min(hi, last)
            if a < b:
                self._combine(f, k, dt, hi - lo, slice(a - lo, b - lo), recvbuf[a - first : b - first])

        self._run(call, sendbuf, sendbuf.size, True, use)

    def all_gather(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        dt, m = sendbuf.dtype, sendbuf.size
        if self.is_direct(sendbuf.nbytes):
            sendbuf = _apart(sendbuf, recvbuf)
            self._announce(sendbuf, recvbuf)

            def gather() -> None:
                for i in range(self.n):
                    if i != self.me:
                        self._read(call, i, 0, 0, recvbuf[i * m : (i + 1) * m])

            self._step(call, None, gather)
            recvbuf[self.me * m : (self.me + 1) * m] = sendbuf
            self._step(call, None, None)  # nobody still reads this rank's input
            return

        def use(k: int, lo: int, hi: int) -> None:
            for i in range(self.n):
                if i != self.me:
                    recvbuf[i * m + lo : i * m + hi] = self.slot(i, k, dt, hi - lo)

        self._run(call, sendbuf, m, True, use)
        recvbuf[self.me * m : (self.me + 1) * m] = sendbuf

    def broadcast(self, call: Call, buf: np.ndarray, root: int) -> None:
        """``root`` is a local index."""
        dt = buf.dtype
        if self.is_direct(buf.nbytes):
            self._announce(buf, buf)
            self._step(call, None, None if self.me == root else lambda: self._read(call, root, 0, 0, buf))
            self._step(call, None, None)  # nobody still reads the root's array
            return

        def use(k: int, lo: int, hi: int) -> None:
            buf[lo:hi] = self.slot(root, k, dt, hi - lo)

        self._run(call, buf, buf.size, self.me == root, None if self.me == root else use)

    def barrier(self, call: Call) -> None:
        self._step(call, None, None)

    def all_to_all(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """Direct only (:meth:`is_direct`): block ``me`` of every rank's ``sendbuf`` into
        block i of ``recvbuf``, read straight from rank i."""
        m = sendbuf.size // self.n
        item = sendbuf.itemsize
        sendbuf = _apart(sendbuf, recvbuf)
        self._announce(sendbuf, recvbuf)

        def exchange() -> None:
            for i in range(self.n):
                if i != self.me:
                    self._read(call, i, 0, self.me * m * item, recvbuf[i * m : (i + 1) * m])

        self._step(call, None, exchange)
        recvbuf[self.me * m : (self.me + 1) * m] = sendbuf[self.me * m : (self.me + 1) * m]
        self._step(call, None, None)  # nobody still reads this rank's input

    def gather(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray | None, root: int) -> None:
        """Direct only: the root reads every rank's ``sendbuf`` (``root``: a local index)."""
        m = sendbuf.size
        self._announce(sendbuf, sendbuf)

        def collect() -> None:
            if self.me == root and recvbuf is not None:
                for i in range(self.n):
                    if i != self.me:
                        self._read(call, i, 0, 0, recvbuf[i * m : (i + 1) * m])
                recvbuf[self.me * m : (self.me + 1) * m] = sendbuf

        self._step(call, None, collect)
        self._step(call, None, None)  # the root has read everything

    def scatter(self, call: Call, sendbuf: np.ndarray | None, recvbuf: np.ndarray, root: int) -> None:
        """Direct only: every rank reads its block of the root's ``sendbuf``."""
        m = recvbuf.size
        if self.me == root and sendbuf is not None:
            sendbuf = _apart(sendbuf, recvbuf)
        self._announce(sendbuf if sendbuf is not None else recvbuf, recvbuf)

        def take() -> None:
            if self.me != root:
                self._read(call, root, 0, self.me * m * recvbuf.itemsize, recvbuf)
            elif sendbuf is not None:
                recvbuf[...] = sendbuf[self.me * m : (self.me + 1) * m]

        self._step(call, None, take)
        self._step(call, None, None)  # nobody still reads the root's array

    # -- the direct path (one copy, see cma.py) --------------------------------------------
    def _announce(self, sendbuf: np.ndarray, recvbuf: np.ndarray) -> None:
        """Publish where this rank's buffers are, with the next piece (its parity's words)."""
        a = _ADDR + 2 * (self.seq & 1)
        self.ctrl[self.me, a] = sendbuf.ctypes.data
        self.ctrl[self.me, a + 1] = recvbuf.ctypes.data

    def _read(self, call: Call, i: int, which: int, offset: int, into: np.ndarray) -> None:
        """Fill ``into`` from local rank ``i``'s send (``which`` 0) or receive (1) buffer of
        this call, starting ``offset`` bytes in (addresses of the piece just waited for)."""
        address = int(self.ctrl[i, _ADDR + 2 * (self.prev & 1) + which]) + offset
        try:
            cma.read(int(self.ctrl[i, _PID]), address, into)
        except cma.CmaError as exc:
            self._read_failed(call, i, exc.errno or 0, str(exc.strerror))

    def _read_failed(self, call: Call, i: int, err: int, reason: str) -> NoReturn:
        """Raise for a direct read from local rank ``i`` that the kernel refused (``err``)."""
        peer = self.local[i]
        # it may have failed because of someone else and said so (ABORT): that wins
        mine = self.fabric.pending_abort() or self.fabric.stalled_error(f"found local rank {peer} gone")
        if mine is not None:
            raise mine from None
        if err == errno.ESRCH:
            raise PeerLostError(
                f"rank {self.fabric.rank}: rank {peer} (same host) died during "
                f"{call.describe()} in group {call.label}; check its output.",
                peer=peer,
            ) from None
        raise DistributedError(
            f"rank {self.fabric.rank}: cannot read rank {peer}'s array (same host) during "
            f"{call.describe()} in group {call.label}: {reason}. Set "
            "MESHCOMM_SOCKETS_DIRECT=0 to copy through shared memory instead."
        ) from None

    def _reduce_block(
        self,
        call: Call,
        sendbuf: np.ndarray,
        first: int,
        last: int,
        out: np.ndarray,
        f: np.ufunc,
        copies: list[int] | None = None,
    ) -> None:
        """``out`` = elements ``first:last`` of every local rank's send buffer combined with
        ``f`` in rank order (the expression of :meth:`_combine`: the same bytes whichever
        path or rank computes them), a chunk at a time read straight from each peer.
        ``out`` may be this rank's own ``sendbuf[first:last]`` (in place), nothing else of it.
        ``copies``: addresses here (peers' shared results) that get the same bytes."""
        item = sendbuf.itemsize
        kind = self.native_sums.get(sendbuf.dtype) if self.native is not None and f is np.add else None
        if kind is not None:  # one C call: chunks small enough to add from cache
            ctrl = self.ctrl
            where = np.stack((ctrl[:, _PID], ctrl[:, _ADDR + 2 * (self.prev & 1)] + first * item), axis=1)
            extra = (np.array(copies, np.int64),) if copies else ()
            failed = self.native.read_sum(out, sendbuf[first:last], kind, where, _DIRECT_CHUNK_BYTES, *extra)
            if failed is not None:
                self._read_failed(call, failed[0], failed[1], os.strerror(failed[1]))
            return
        self._reduce_chunks(call, sendbuf, first, last, out, f)
        for address in copies or ():
            ctypes.memmove(address, out.ctypes.data, out.nbytes)

    def _reduce_chunks(
        self, call: Call, sendbuf: np.ndarray, first: int, last: int, out: np.ndarray, f: np.ufunc
    ) -> None:
        """:meth:`_reduce_block` in NumPy (any dtype and op), a chunk at a time."""
        item = sendbuf.itemsize
        per = max(1, _DIRECT_CHUNK_BYTES // item)
        alias = np.may_share_memory(sendbuf[first:last], out)
        # two peers' chunks at once (the first step combines ranks 0 and 1), and in place a
        # copy of this rank's own chunk, which the first step overwrites
        tmp = [np.empty(min(per, last - first), sendbuf.dtype) for _ in range(3 if alias else 2)]
        for lo in range(first, last, per):
            hi = min(lo + per, last)
            acc = out[lo - first : hi - first]
            own = sendbuf[lo:hi]
            if alias:
                own = tmp[2][: hi - lo]
                own[...] = sendbuf[lo:hi]

            def part(i: int, t: np.ndarray, lo: int = lo, hi: int = hi, own: np.ndarray = own) -> np.ndarray:
                if i == self.me:
                    return own
                into = t[: hi - lo]
                self._read(call, i, 0, lo * item, into)
                return into

            f(part(0, tmp[0]), part(1, tmp[1]), out=acc)
            for i in range(2, self.n):
                f(acc, part(i, tmp[0]), out=acc)

    def _direct_all_reduce(self, call: Call, sendbuf: np.ndarray, recvbuf: np.ndarray, f: np.ufunc) -> None:
        """Each local rank reduces its block reading the others' inputs and writes it into
        its result and into every peer's result that is in shared memory (results.py); then
        it reads the blocks nobody wrote into its result from the others' results. Two
        waits when every result is shared (one copy of every byte), else three."""
        bounds = algorithms.block_bounds(sendbuf.size, self.n)
        item = sendbuf.itemsize
        if sendbuf.ctypes.data != recvbuf.ctypes.data:  # in place is fine; any other overlap is not
            sendbuf = _apart(sendbuf, recvbuf)
        self._announce(sendbuf, recvbuf)
        own = self.results.find(recvbuf.ctypes.data, recvbuf.nbytes)
        w, me = self.words, self._mine
        w[me + _RESULT_FD], w[me + _RESULT_ID] = (-1, 0) if own is None else (own.fd, own.ident)
        mine = slice(bounds[self.me], bounds[self.me + 1])

        def reduce() -> None:
            copies, pushed = self._push_targets(recvbuf.nbytes, mine.start * item)
            w[me + _PUSHED] = pushed  # read by the peers after the next wait
            self._reduce_block(call, sendbuf, mine.start, mine.stop, recvbuf[mine], f, copies)

        self._step(call, None, reduce)
        masks: list[int] = []

        def gather() -> None:  # after the wait: every rank has written its mask
            masks.extend(w[i * _LINE + _PUSHED] for i in range(self.n))
            for i in range(self.n):
                if i != self.me and bounds[i] < bounds[i + 1] and not masks[i] >> self.me & 1:
                    self._read(call, i, 1, bounds[i] * item, recvbuf[bounds[i] : bounds[i + 1]])

        self._announce(sendbuf, recvbuf)
        self._step(call, None, gather)
        everyone = (1 << self.n) - 1
        if any(m != everyone & ~(1 << i) for i, m in enumerate(masks)):
            self._step(call, None, None)  # somebody read a result: nobody still does

    def _push_targets(self, nbytes: int, offset: int) -> tuple[list[int], int]:
        """Where this rank's block goes in the peers' shared results of ``nbytes`` (the
        block starts ``offset`` bytes in), and the mask of those peers."""
        copies, mask = [], 0
        for i in range(self.n):
            fd = self.words[i * _LINE + _RESULT_FD]
            if i == self.me or fd < 0:
                continue
            address = self.peer_results.address(
                i, int(self.ctrl[i, _PID]), fd, self.words[i * _LINE + _RESULT_ID], nbytes
            )
            if address is not None:
                copies.append(address + offset)
                mask |= 1 << i
        return copies, mask


#: the wire code of all_sum (what :meth:`ShmGroup.quick_sum` publishes)
_ALL_SUM = wire.OP_CODES["all_sum"]

#: dtype -> the element kind the compiled channel sums (``Channel.all_sum``)
_NATIVE_SUMS = {
    np.dtype(t): k
    for t, k in ((np.float32, 1), (np.float64, 2), (np.int32, 3), (np.uint32, 3), (np.int64, 4), (np.uint64, 4))
}


def _apart(sendbuf: np.ndarray, recvbuf: np.ndarray) -> np.ndarray:
    """``sendbuf``, or a copy of it if it overlaps ``recvbuf`` (peers read a rank's input
    while it writes its output)."""
    return sendbuf.copy() if np.may_share_memory(sendbuf, recvbuf) else sendbuf


def segment_size(ranks: int, piece: int) -> int:
    """Bytes of the segment of ``ranks`` local ranks with slots of ``piece`` bytes."""
    return 8 * _LINE * ranks + 2 * ranks * piece

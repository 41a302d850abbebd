"""The call check's own channel: a few TCP connections per group, beside gloo's.

The core compares every collective's call across ranks with one small all-reduce (max) of
a key before the collective (``Backend.check_key``). Through gloo that is one more
ProcessGroupGloo work item, which costs as much as the user's own small collective (a
hand-off to gloo's threads and back on every rank). Here it is a dissemination exchange
on plain sockets, driven by the calling thread: in round ``k`` rank ``r`` sends its running
maximum to rank ``r + 2**k`` and takes the maximum with what rank ``r - 2**k`` sent
(``ceil(log2(size))`` rounds; afterwards every rank holds the maximum over all).

The same rounds also carry small all-reduces (:meth:`CheckLine.gather`): each frame takes
the blocks the sender holds along with its key, so after the last round every rank holds
every rank's block (Bruck's all-gather) and reduces them in rank order; a gloo work item
would cost several times the whole exchange. A key-only check and a gathering exchange send
the same frames to the same peers, so ranks making different calls still meet in step.

* **Who may connect.** Each rank listens on a fresh port and publishes ``ip port nonce`` in
  the rendezvous store (sealed with the job secret, :mod:`.authstore`). A connecting rank
  proves the secret over the listener's nonce and its own: a process without the secret,
  or one replaying an earlier job's hello, is refused and the listener keeps waiting.
  The listener's answer proves the secret back, so a rank never checks calls with a
  stranger that took a peer's place.
* **Every frame is authenticated**: ``seq | value | tag`` with an HMAC-SHA256 tag (16
  bytes) under a key for that connection, so a changed frame is an error, not a passed
  check.
* **Failures look like gloo's.** A peer that does not send within the timeout raises
  ``RuntimeError("... timed out ...")``, a closed connection ``RuntimeError("... connection
  closed by peer ...")``; the backend explains them as it explains gloo's (who is dead,
  stopped, or called something else).

Pure Python + NumPy (no torch), so it is testable in one process.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct
import time
from typing import Any, cast

import numpy as np

__all__ = ["BLOCKS_MAX", "CheckLine", "PeerClosed", "open_line", "ROUNDS"]

_HELLO = struct.Struct("<4sIIII16s32s")  # magic, group size, from rank, to rank, round, nonce, tag
_ANSWER = struct.Struct("<16s32s")  # nonce, tag
_HEAD = struct.Struct("<QqqI")  # seq, value (2 x int64), bytes of blocks that follow; then the tag
_MAGIC = b"mcl2"
_TAG = 16
_OUT_OF_STEP = np.iinfo(np.int64).max  # a value no check key has: the calls differ
_GAVE_UP = 0xFFFFFFFF  # a frame's length that says: the sender gave up on its check ``seq``

#: the most bytes a gathering exchange collects per rank (group size x block). Measured
#: against a gloo all-reduce on one 2-core host (docs/backends/gloo.md), the exchange was
#: faster up to 512 KiB and about even at 1 MiB on 2 ranks, slower at 1 MiB on 4; the bound
#: also keeps the blocks a rank holds small when groups are large (2 KiB each on 256 ranks)
BLOCKS_MAX = 512 << 10
#: frames up to this size are sent whole before the rank reads: each connection's send
#: buffer holds them (the kernel doubles the request for its bookkeeping, up to
#: net.core.wmem_max), so no rank can wait in a send for a receiver that waits in one too;
#: larger frames are sent while the peer's frame is read (:func:`_swap`)
_SENT_WHOLE = 64 << 10
_SNDBUF = 2 * _SENT_WHOLE


def ROUNDS(size: int) -> int:  # noqa: N802 - a formula, named as the docs name it
    """How many exchanges one check takes in a group of ``size`` ranks."""
    return (size - 1).bit_length()


def _to(rank: int, size: int, k: int) -> int:
    """The rank this one sends to in round ``k``."""
    return (rank + (1 << k)) % size


def _from(rank: int, size: int, k: int) -> int:
    """The rank this one receives from in round ``k``."""
    return (rank - (1 << k)) % size


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(struct.pack("<I", len(p)) + p for p in parts), hashlib.sha256).digest()


class CheckLine:
    """One group's connections for the call check (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        size: int,
        outs: list[socket.socket],
        ins: list[socket.socket],
        keys: list[tuple[bytes, bytes]],
    ) -> None:
        self._rank = rank
        self._size = size
        self._outs = outs  # round k: to rank + 2**k
        self._ins = ins  # round k: from rank - 2**k
        self._keys = keys  # round k: (key of the frames sent, key of the frames received)
        self._seq = 0
        self._finished = 0  # the last check this rank completed (see give_up)
        #: seconds a read polls before it sleeps (0 where ranks outnumber this host's cores:
        #: a polling rank would take the core its peer needs)
        self.spin = 0.0

    def reduce_max(self, mine: np.ndarray, out: np.ndarray, timeout: float) -> None:
        """``out`` = the element-wise max over the group of ``mine`` (int64 [h, -h]).

        A peer at another check (a rank that skipped a collective) makes the result one no
        key has, so the core sees the calls differ. Raises RuntimeError as gloo would."""
        out[0], out[1] = self._exchange(int(mine[0]), int(mine[1]), None, timeout)

    def gather(self, mine: np.ndarray, table: np.ndarray, timeout: float) -> tuple[int, int]:
        """The max of the keys, as :meth:`reduce_max`, while every rank's block travels along:
        ``table`` (uint8, one row per rank, ``table[0]`` this rank's block) ends with row ``j``
        holding the block of rank ``(rank - j) % size``. The rows are only complete when the
        returned max equals ``mine`` (the same call on every rank, so blocks of one length)."""
        return self._exchange(int(mine[0]), int(mine[1]), table, timeout)

    def _exchange(self, a: int, b: int, table: np.ndarray | None, timeout: float) -> tuple[int, int]:
        """One check's rounds; with ``table``, the blocks of Bruck's all-gather ride along."""
        if not self._outs:  # closed: a check of no rounds would pass anything
            raise RuntimeError("call check: the channel was closed (the group failed or was closed)")
        self._seq = seq = self._seq + 1
        size = self._size
        width = 0 if table is None else table.shape[1]
        for k, (send_key, recv_key) in enumerate(self._keys):
            step = 1 << k
            rows = min(step, size - step)  # the blocks the receiver still lacks
            blocks = b"" if table is None else table[:rows].tobytes()
            body = _HEAD.pack(seq, a, b, len(blocks)) + blocks
            frame = body + _tag(send_key, body)
            to, frm = _to(self._rank, size, k), _from(self._rank, size, k)
            if len(frame) <= _SENT_WHOLE:
                try:
                    self._outs[k].sendall(frame)
                except OSError as exc:
                    raise PeerClosed(
                        f"call check: connection closed by peer (sending to rank {to}): {exc}", to
                    ) from None
                head = self._read(self._ins[k], _HEAD.size, timeout, frm, self.spin)
                rest = self._read(self._ins[k], _rest(head, frm), timeout, frm, self.spin)
            else:
                head, rest = _swap(self._outs[k], self._ins[k], frame, timeout, to, frm)
            their_seq, x, y, n = _HEAD.unpack(head)
            if not hmac.compare_digest(rest[-_TAG:], _tag(recv_key, head + rest[:-_TAG])):
                raise _Forged(
                    f"call check: a frame from rank {frm} failed its authentication (changed on the way, "
                    "or not sent by that rank of this job)"
                )
            if n == _GAVE_UP:
                raise PeerClosed(f"call check: connection closed by peer (rank {frm} gave up on its call)", frm)
            if their_seq != seq or n != rows * width:  # another check, or blocks of another call
                a = b = _OUT_OF_STEP
            else:
                a, b = max(a, x), max(b, y)
                if table is not None:
                    table[step : step + rows] = np.frombuffer(rest, np.uint8, n).reshape(rows, width)
        self._given_up(seq)
        self._finished = seq
        return a, b

    def _given_up(self, seq: int) -> None:
        """Raise if a peer that sends to this rank gave up on check ``seq`` after it sent its
        frames (it timed out on another rank): a rank that was stopped meanwhile finds every
        frame it needs in its buffers when it resumes, but must fail the call as the others did.
        Only looks at what has already arrived (a non-blocking peek)."""
        for k, s in enumerate(self._ins):
            s.settimeout(0.0)  # with a timeout set, Python would wait for data despite MSG_DONTWAIT
            try:
                got = s.recv(_HEAD.size + _TAG, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                continue  # a reset connection: the next read says so
            if len(got) < _HEAD.size + _TAG:
                continue
            their_seq, _, _, n = _HEAD.unpack(got[: _HEAD.size])
            if n != _GAVE_UP or their_seq != seq:
                continue
            if hmac.compare_digest(got[_HEAD.size :], _tag(self._keys[k][1], got[: _HEAD.size])):
                frm = _from(self._rank, self._size, k)
                raise PeerClosed(f"call check: connection closed by peer (rank {frm} gave up on this call)", frm)

    def give_up(self) -> None:
        """Tell the ranks this one sends to that it gave up (never waits), then close: see
        :meth:`_given_up`. The notice names the check this rank failed in, or, when it failed
        after its last check completed, the next one: a slower peer still finishing that
        completed check then does, and meets the notice at its next."""
        seq = self._seq + 1 if self._finished == self._seq else self._seq
        head = _HEAD.pack(seq, 0, 0, _GAVE_UP)
        for k, s in enumerate(self._outs):
            try:
                s.setblocking(False)  # with a timeout set, Python would wait for room despite MSG_DONTWAIT
                s.send(head + _tag(self._keys[k][0], head))
            except OSError:
                pass
        self.close()

    @staticmethod
    def _read(sock: socket.socket, n: int, timeout: float, peer: int, spin: float = 0.0) -> bytes:
        """``n`` bytes from ``sock``; polls without sleeping for up to ``spin`` seconds first (a
        sleeping rank's wake-up costs tens of microseconds on a busy host), then waits."""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        if spin > 0.0:
            sock.settimeout(0.0)
            end = time.perf_counter() + spin
            while got < n:
                try:
                    k = sock.recv_into(view[got:])
                except BlockingIOError:
                    if time.perf_counter() > end:
                        break
                    continue
                except OSError:
                    break  # the waiting read below says what happened
                if not k:
                    break
                got += k
            if got == n:
                return bytes(buf)
        sock.settimeout(timeout)
        try:
            while got < n:
                k = sock.recv_into(view[got:])
                if not k:
                    raise PeerClosed(f"call check: connection closed by peer (rank {peer})", peer)
                got += k
        except TimeoutError:
            raise RuntimeError(f"call check: timed out after {timeout:g} s waiting for rank {peer}") from None
        except OSError as exc:
            raise PeerClosed(f"call check: connection reset by peer (rank {peer}): {exc}", peer) from None
        return bytes(buf)

    def close(self) -> None:
        """Close every connection: peers waiting in a check learn now (EOF)."""
        for s in self._outs + self._ins:
            try:
                s.close()
            except OSError:
                pass
        self._outs, self._ins = [], []


def _tag(key: bytes, body: bytes) -> bytes:
    """A frame's tag: HMAC-SHA256 of ``body`` under the connection's ``key``, cut to 16 bytes."""
    return hmac.digest(key, body, "sha256")[:_TAG]


def _rest(head: bytes, frm: int) -> int:
    """How many bytes follow the frame header ``head`` from rank ``frm`` (blocks and tag)."""
    n = _HEAD.unpack(head)[3]
    if n == _GAVE_UP:
        return _TAG
    if n > BLOCKS_MAX // 2:  # more than any rank sends in one frame: not a frame of ours
        raise _Forged(f"call check: rank {frm} sent a frame of {n} bytes, more than a frame can hold")
    return n + _TAG


def _swap(
    out: socket.socket, inn: socket.socket, frame: bytes, timeout: float, to: int, frm: int
) -> tuple[bytes, bytes]:
    """Send ``frame`` to rank ``to`` while reading rank ``frm``'s (header, rest): for frames a
    send buffer may not hold, so no rank waits in a send while its receiver waits in one too.
    Gives up after ``timeout`` seconds without progress, as a read would."""
    sent, view = 0, memoryview(frame)
    got = bytearray()
    need = _HEAD.size
    head: bytes | None = None
    was = out.gettimeout()
    out.setblocking(False)
    inn.setblocking(False)
    poll = select.poll()
    poll.register(out, select.POLLOUT)
    poll.register(inn, select.POLLIN)
    try:
        while sent < len(frame) or len(got) < need:
            events = poll.poll(timeout * 1000)
            if not events:
                who = frm if len(got) < need else to
                raise RuntimeError(f"call check: timed out after {timeout:g} s waiting for rank {who}")
            for fd, _ in events:
                if fd == out.fileno():
                    try:
                        sent += out.send(view[sent:])
                    except BlockingIOError:
                        continue
                    except OSError as exc:
                        raise PeerClosed(
                            f"call check: connection closed by peer (sending to rank {to}): {exc}", to
                        ) from None
                    if sent == len(frame):
                        poll.unregister(out)
                    continue
                try:
                    chunk = inn.recv(need - len(got))
                except BlockingIOError:
                    continue
                except OSError as exc:
                    raise PeerClosed(f"call check: connection reset by peer (rank {frm}): {exc}", frm) from None
                if not chunk:
                    raise PeerClosed(f"call check: connection closed by peer (rank {frm})", frm)
                got += chunk
                if head is None and len(got) == _HEAD.size:
                    head = bytes(got)
                    got.clear()
                    need = _rest(head, frm)
                if head is not None and len(got) == need:
                    poll.unregister(inn)
                    if _HEAD.unpack(head)[3] == _GAVE_UP:  # it sends no more, nor reads: stop sending
                        return head, bytes(got)
    finally:
        out.settimeout(was)
    return cast(bytes, head), bytes(got)  # the loop ends only once the header and the rest are read


class _Forged(RuntimeError):
    """A check frame or hello that failed its authentication."""


class PeerClosed(RuntimeError):
    """The connection to group rank ``peer`` closed (worded as gloo words it)."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


def open_line(store: Any, prefix: str, rank: int, size: int, timeout: float, host: str) -> CheckLine | None:
    """Connect this rank's check channel in the group under ``prefix`` (None for one rank).

    Every member calls it at the same point (right after the group's ProcessGroupGloo is
    made); ``host`` is the address this rank's peers reach it at (its gloo address)."""
    rounds = ROUNDS(size)
    if rounds == 0:
        return None
    secret = store.derive(f"{prefix}/meshcomm-line")  # an AuthStore (:mod:`.authstore`)
    listener = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    nonce = os.urandom(16)
    outs: list[socket.socket] = []
    ins: list[socket.socket | None] = [None] * rounds
    deadline = time.monotonic() + timeout
    try:
        port = listener.getsockname()[1]
        store.set(f"{prefix}/meshcomm-line/{rank}", f"{host} {port} {nonce.hex()}")
        # 1. one connection to each round's receiver, with a hello proving the secret
        mine: list[bytes] = []
        for k in range(rounds):
            to = _to(rank, size, k)
            ip, p, theirs = bytes(store.get(f"{prefix}/meshcomm-line/{to}")).decode().split()
            s = socket.create_connection((ip, int(p)), timeout=max(0.1, deadline - time.monotonic()))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
            outs.append(s)
            n_out = os.urandom(16)
            mine.append(n_out)
            tag = _mac(secret, b"hello", _pair(size, rank, to, k), bytes.fromhex(theirs), n_out)
            s.sendall(_HELLO.pack(_MAGIC, size, rank, to, k, n_out, tag))
        # 2. each round's sender: accepted once its hello proves the secret over our nonce
        answers: list[bytes] = [b""] * rounds
        hellos: list[bytes] = [b""] * rounds
        while any(s is None for s in ins):
            left = deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                listener.settimeout(left)  # not select(): a process of many ranks has descriptors past 1024
                conn, _ = listener.accept()
            except TimeoutError:
                missing = [_from(rank, size, k) for k in range(rounds) if ins[k] is None]
                raise RuntimeError(
                    f"call check: timed out after {timeout:g} s waiting for ranks {missing} to connect"
                ) from None
            conn.settimeout(None)
            got = _hello(conn, secret, size, rank, nonce, deadline)
            if got is None or ins[got[0]] is not None:
                conn.close()
                continue
            k, n_in = got
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ins[k], hellos[k] = conn, n_in
            frm = _from(rank, size, k)
            n_mine = os.urandom(16)
            answers[k] = n_mine
            conn.sendall(_ANSWER.pack(n_mine, _mac(secret, b"answer", _pair(size, frm, rank, k), n_in, n_mine)))
        # 3. each receiver's answer proves the secret back
        keys: list[tuple[bytes, bytes]] = []
        for k in range(rounds):
            to, frm = _to(rank, size, k), _from(rank, size, k)
            raw = CheckLine._read(outs[k], _ANSWER.size, max(0.1, deadline - time.monotonic()), to)
            n_ans, tag = _ANSWER.unpack(raw)
            if not hmac.compare_digest(tag, _mac(secret, b"answer", _pair(size, rank, to, k), mine[k], n_ans)):
                raise _Forged(f"call check: rank {to}'s answer failed the job secret check (a stranger took its port?)")
            keys.append(
                (
                    _mac(secret, b"frames", _pair(size, rank, to, k), mine[k], n_ans),
                    _mac(secret, b"frames", _pair(size, frm, rank, k), hellos[k], answers[k]),
                )
            )
        for s in outs:  # sends wait at most this long (not what was left of the start-up's deadline)
            s.settimeout(timeout)
        return CheckLine(rank, size, outs, [s for s in ins if s is not None], keys)
    except BaseException as exc:
        for s in outs + [s for s in ins if s is not None]:
            s.close()
        if isinstance(exc, TimeoutError):
            raise RuntimeError(f"call check: timed out connecting to the group's ranks: {exc}") from None
        if isinstance(exc, OSError):
            raise RuntimeError(f"call check: connection refused or closed while connecting: {exc}") from None
        raise
    finally:
        listener.close()


def _pair(size: int, frm: int, to: int, k: int) -> bytes:
    return struct.pack("<IIII", size, frm, to, k)


def _hello(
    conn: socket.socket, secret: bytes, size: int, rank: int, nonce: bytes, deadline: float
) -> tuple[int, bytes] | None:
    """(round, the sender's nonce) of a valid hello on ``conn``, or None (a stranger, a replay)."""
    try:
        raw = CheckLine._read(conn, _HELLO.size, max(0.1, min(2.0, deadline - time.monotonic())), -1)
    except RuntimeError:
        return None
    magic, n, frm, to, k, n_out, tag = _HELLO.unpack(raw)
    if magic != _MAGIC or n != size or to != rank or k >= ROUNDS(size) or frm != _from(rank, size, k):
        return None
    if not hmac.compare_digest(tag, _mac(secret, b"hello", _pair(size, frm, rank, k), nonce, n_out)):
        return None
    return k, n_out

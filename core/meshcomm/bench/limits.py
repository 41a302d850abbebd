"""What this machine allows at best: single-core copy and add bandwidth, loopback TCP.

These bound every all_sum in ``meshcomm bench --compare``: a ring all-reduce on n ranks moves
2(n-1)/n of the buffer through the network stack and adds (n-1)/n of it on each rank,
and every library copies its result at least once. Run alone::

    python -m meshcomm.bench.limits   # prints the three figures as JSON

* ``memcpy``: ``np.copyto`` of 64 MiB float32, bytes copied per second (one core);
* ``add``: ``np.add(a, b, out=a)`` on 64 MiB float32, bytes of ``a`` per second;
* ``tcp_latency``: half the median round trip of 8 bytes over loopback TCP between two
  processes (one-way latency, seconds; the best of three runs, see :func:`tcp_latency`),
  with the receiver sleeping in the kernel (``tcp_latency``) or polling (``tcp_latency_spin``);
* ``tcp``: one TCP stream over 127.0.0.1 between two processes, payload bytes per second
  (the receiver reads into a preallocated buffer, as the sockets backend does);
* ``tcp_duplex``: two processes each sending to the other at once over one connection, payload
  bytes per second in each direction. A ring all-reduce on 2 ranks sends and receives the
  whole buffer on each rank at the same time, so on loopback, where the kernel's copies of
  both directions share the same cores, this (not ``tcp``) is its ceiling;
* ``tcp_duplex_4``: the same over four connections at once (a thread per connection and
  direction on each side): whether several connections per pair of ranks could go faster.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

__all__ = ["memcpy_bw", "add_bw", "tcp_bw", "tcp_duplex_bw", "tcp_latency", "measure_all"]

_BYTES = 64 << 20
#: seconds the TCP figures wait for their helper process (to connect, send, reply) before
#: giving up with an error: a helper that died or stopped must not hang the benchmark
HELPER_TIMEOUT = 60.0

#: the child's receiving loop (``s``: its socket, ``total``: the bytes to read)
_RECEIVE = r"""
view = memoryview(bytearray(4 << 20))
got = 0
while got < total:
    n = s.recv_into(view)
    if not n:
        raise SystemExit("peer closed early")
    got += n
"""

_SINK = (
    r"""
import socket, sys
port, total = int(sys.argv[1]), int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port))
"""
    + _RECEIVE
    + r"""
s.sendall(b"k")
s.close()
"""
)


def _best_rate(fn: Callable[[], None], nbytes: int, reps: int) -> float:
    """Bytes per second of the fastest of ``reps`` calls (noise only ever slows a call down)."""
    fn()  # page in the buffers
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def memcpy_bw(nbytes: int = _BYTES, reps: int = 10) -> float:
    """Single-core copy bandwidth, bytes/s."""
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    return _best_rate(lambda: np.copyto(dst, src), nbytes, reps)


def add_bw(nbytes: int = _BYTES, reps: int = 10) -> float:
    """Single-core in-place add bandwidth (bytes of the accumulated array per second)."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)

    def add() -> None:
        np.add(a, b, out=a)

    return _best_rate(add, nbytes, reps)


def _send(conn: socket.socket, payload: memoryview, nbytes: int) -> None:
    """Send ``nbytes`` on ``conn``, ``payload`` (or the start of it) at a time."""
    sent = 0
    while sent < nbytes:
        n = min(len(payload), nbytes - sent)
        conn.sendall(payload[:n])
        sent += n


@contextlib.contextmanager
def _helper(code: str, *args: object) -> Iterator[subprocess.Popen[bytes]]:
    """A child Python running ``code`` with ``args``; killed on the way out if still running
    (after an error here), and always waited for."""
    child = subprocess.Popen([sys.executable, "-c", code, *map(str, args)])
    try:
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def _accept(srv: socket.socket, child: subprocess.Popen[bytes], timeout: float | None = None) -> socket.socket:
    """The next connection of ``child`` to ``srv`` (blocking, with ``timeout`` on every send
    and receive); raises RuntimeError if the child exits first or does not connect in time."""
    timeout = HELPER_TIMEOUT if timeout is None else timeout
    deadline = time.monotonic() + timeout
    srv.settimeout(0.1)
    while True:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            if child.poll() is not None:
                raise RuntimeError(
                    f"the loopback TCP helper exited with {child.returncode} before "
                    "connecting; its error is printed above"
                ) from None
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the loopback TCP helper did not connect within {timeout:g} s (is the machine overloaded?)"
                ) from None
            continue
        conn.settimeout(timeout)
        return conn


def tcp_bw(nbytes: int = 256 << 20, reps: int = 3) -> float:
    """Loopback TCP throughput between two processes, payload bytes/s (best of ``reps``)."""
    payload = np.ones(_BYTES, dtype=np.uint8).data
    best = 0.0
    for _ in range(reps):
        with socket.create_server(("127.0.0.1", 0)) as srv, _helper(_SINK, srv.getsockname()[1], nbytes) as child:
            conn = _accept(srv, child)
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                t0 = time.perf_counter()
                _send(conn, payload, nbytes)
                if conn.recv(1) != b"k":
                    raise RuntimeError("loopback TCP sink did not acknowledge")
                best = max(best, nbytes / (time.perf_counter() - t0))
            if child.wait(timeout=HELPER_TIMEOUT) != 0:
                raise RuntimeError(f"loopback TCP sink exited with {child.returncode}")
    return best


def _pump(socks: list[socket.socket], nbytes: int) -> int:
    """Send ``nbytes`` split evenly over ``socks`` while receiving as much from them, one
    thread per socket and direction (each releases the GIL in the kernel's copy); the bytes
    received."""
    share = nbytes // len(socks)
    got = [0] * len(socks)

    def send(conn: socket.socket) -> None:
        _send(conn, memoryview(bytearray(4 << 20)), share)

    def receive(i: int, conn: socket.socket) -> None:
        inbox = memoryview(bytearray(4 << 20))
        while got[i] < share:
            n = conn.recv_into(inbox)
            if not n:
                return
            got[i] += n

    threads = [threading.Thread(target=send, args=(c,)) for c in socks]
    threads += [threading.Thread(target=receive, args=(i, c)) for i, c in enumerate(socks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(got)


_DUPLEX = r"""
import socket, sys
from meshcomm.bench.limits import _pump
port, streams, total = map(int, sys.argv[1:4])
socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]
for s in socks:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
_pump(socks, total)
for s in socks:
    s.close()
"""


def _duplex_seconds(nbytes: int, streams: int) -> float:
    """Seconds until this process and a child have each sent ``nbytes`` to the other over
    ``streams`` connections at once."""
    with (
        socket.create_server(("127.0.0.1", 0), backlog=streams) as srv,
        _helper(_DUPLEX, srv.getsockname()[1], streams, nbytes) as child,
    ):
        conns: list[socket.socket] = []
        try:
            for _ in range(streams):
                conns.append(_accept(srv, child))
            for conn in conns:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            got = _pump(conns, nbytes)
            elapsed = time.perf_counter() - t0
        finally:
            for conn in conns:
                conn.close()
        want = nbytes // streams * streams
        if child.wait(timeout=HELPER_TIMEOUT) != 0 or got < want:
            raise RuntimeError(f"loopback TCP duplex peer exited with {child.returncode} after {got} bytes")
    return elapsed


def tcp_duplex_bw(nbytes: int = 128 << 20, reps: int = 3, streams: int = 1) -> float:
    """Loopback TCP throughput in each direction when two processes send ``nbytes`` to each
    other at the same time over ``streams`` connections, payload bytes/s (best of ``reps``)."""
    return max(nbytes // streams * streams / _duplex_seconds(nbytes, streams) for _ in range(reps))


_ECHO = r"""
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
spin = sys.argv[2] == "1"
s.setblocking(not spin)
while True:
    try:
        b = s.recv(8)
    except BlockingIOError:
        continue
    if not b:
        break
    s.sendall(b)
"""


def _recv_exact(conn: socket.socket, n: int) -> None:
    """Receive ``n`` bytes; raises if the peer closes, or (polling) stays silent for
    HELPER_TIMEOUT (a blocking ``conn`` has that timeout itself)."""
    got = spins = 0
    deadline = 0.0
    while got < n:
        try:
            b = conn.recv(n - got)
        except BlockingIOError:  # spinning: poll again at once, and look at the clock now and then
            spins += 1
            if spins & 0xFFFF == 0:
                deadline = deadline or time.monotonic() + HELPER_TIMEOUT
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the loopback TCP echo helper sent nothing for {HELPER_TIMEOUT:g} s") from None
            continue
        if not b:
            raise RuntimeError("the loopback TCP echo helper closed its connection early")
        got += len(b)


def _rtt_median(rounds: int, spin: bool) -> float:
    """Median 8-byte round trip between this process and an echoing child, seconds; ``spin``
    polls non-blocking sockets on both sides instead of sleeping in the kernel."""
    with socket.create_server(("127.0.0.1", 0)) as srv, _helper(_ECHO, srv.getsockname()[1], int(spin)) as child:
        conn = _accept(srv, child)
        times = np.empty(rounds)
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if spin:
                conn.setblocking(False)  # (blocking keeps _accept's timeout)
            for i in range(rounds):
                t0 = time.perf_counter()
                conn.sendall(b"12345678")
                _recv_exact(conn, 8)
                times[i] = time.perf_counter() - t0
        child.wait(timeout=HELPER_TIMEOUT)
    return float(np.median(times))


def tcp_latency(rounds: int = 2000, reps: int = 3, *, spin: bool = False) -> float:
    """One-way loopback TCP latency between two processes: half the lowest of ``reps`` median
    8-byte round trips. Blocking receives (``spin=False``) include the kernel's wake-up of
    the sleeping receiver, which can be bimodal on a VM (much slower when the wake-up crosses
    to an idle vCPU; docs/benchmarks.md has figures); ``spin=True`` polls and measures the TCP
    stack alone."""
    return min(_rtt_median(rounds, spin) for _ in range(reps)) / 2


def measure_all() -> dict[str, float]:
    """memcpy, add, tcp, tcp_duplex and tcp_duplex_4 in bytes per second; the latencies in seconds."""
    return {
        "memcpy": memcpy_bw(),
        "add": add_bw(),
        "tcp": tcp_bw(),
        "tcp_duplex": tcp_duplex_bw(),
        "tcp_duplex_4": tcp_duplex_bw(streams=4),
        "tcp_latency": tcp_latency(),
        "tcp_latency_spin": tcp_latency(spin=True),
    }


if __name__ == "__main__":
    lim = measure_all()
    print(
        json.dumps(
            {k: f"{v * 1e6:.1f} us" if k.startswith("tcp_latency") else f"{v / 1e9:.2f} GB/s" for k, v in lim.items()}
        )
    )

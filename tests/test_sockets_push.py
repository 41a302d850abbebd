"""Large all-reduce results in shared memory (the push path, results.py): each local rank
writes its block straight into the others' results. A result the caller keeps is never
written again, a dropped one's buffer is reused, ranks whose results are private and ranks
whose results are shared meet in one call, and every result has the bytes of the reading
path (MESHCOMM_SOCKETS_DIRECT=0 copies through the slots, no push)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from jobs import finish, free_ports, start_ranks, write_hostfile
from meshcomm_sockets.results import SLOTS, OwnResults, PeerResults

PROG = "tests/programs/push_rank.py"


def _run(
    tmp_path, n: int, mode: list[str], env: dict[str, str] | None = None, died: tuple[int, ...] = ()
) -> dict[int, dict]:
    hf = write_hostfile(tmp_path / "h.json", free_ports(n))
    procs = start_ranks(n, [PROG, *mode], hf, env={"MLX_TIMEOUT": "60", **(env or {})})
    reports = {}
    for r, (rc, out, err) in finish(procs, timeout=300).items():
        if r in died:
            assert rc == -signal.SIGKILL, (r, rc)
            continue
        assert rc == 0, (r, out[-2000:], err[-3000:])
        reports[r] = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return reports


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mode", [[], ["uneven"]], ids=["even", "uneven"])
def test_kept_results_stay_and_every_rank_gets_the_reading_paths_bytes(tmp_path, n, mode):
    pushed = _run(tmp_path, n, mode)
    everyone = (1 << n) - 1
    for r, rep in pushed.items():
        assert rep["direct"] is True, rep
        if mode == ["uneven"]:
            assert rep["shared_kept"] == ([True] * SLOTS + [False] if r == 0 else [True]), rep
        else:
            assert rep["shared_kept"] == [True] * SLOTS, rep
        assert rep["reused_while_viewed"] is False, "a buffer an array still views was handed out again"
        assert rep["reused_after_drop"] is True, "a dropped result's buffer was not reused"
        assert rep["survives_close"] is True
        others = [everyone & ~(1 << q) for q in range(n)]
        if mode == ["uneven"]:  # rank 0's result of call 2 is private: nobody writes into it
            assert rep["pushed_2"] == [m & ~1 for m in others], rep
        else:  # every result of call 2 is private: every rank read the others' blocks
            assert rep["pushed_2"] == [0] * n, rep
        assert rep["pushed"] == others, rep
    read = _run(tmp_path, n, mode, env={"MESHCOMM_SOCKETS_DIRECT": "0"})
    assert [read[r]["direct"] for r in range(n)] == [False] * n
    assert [pushed[r]["digest"] for r in range(n)] == [read[r]["digest"] for r in range(n)]


def test_the_numpy_path_pushes_the_same_bytes_as_the_compiled_one(tmp_path):
    compiled = _run(tmp_path, 2, [])
    numpy_only = _run(tmp_path, 2, [], env={"MESHCOMM_SOCKETS_NATIVE": "0"})
    assert [numpy_only[r]["pushed"] for r in range(2)] == [[2, 1], [2, 1]]
    assert [compiled[r]["digest"] for r in range(2)] == [numpy_only[r]["digest"] for r in range(2)]


def test_a_buffer_is_handed_out_again_only_when_no_array_uses_it():
    own = OwnResults()
    try:
        f32 = np.dtype(np.float32)
        a = own.empty((256, 256), f32)
        b = own.empty((1000,), f32)
        assert a is not None and b is not None and not np.shares_memory(a, b)
        assert own.empty((10,), f32) is None, f"all {SLOTS} buffers are held: the caller gets a private array"
        view = a.T[3:]
        del a
        assert own.empty((10,), f32) is None, "a view of a result still uses its buffer"
        del view
        c = own.empty((10,), f32)
        assert c is not None and own.find(c.ctypes.data, c.nbytes) is not None
        c[:] = 7
    finally:
        own.close()
    assert (c == 7).all(), "an array outlives the buffers' owner"


def test_a_peer_maps_a_buffer_by_pid_and_fd_and_refuses_a_wrong_one():
    own, peers = OwnResults(), PeerResults()
    try:
        a = own.empty((1 << 16,), np.dtype(np.int64))
        buf = own.find(a.ctypes.data, a.nbytes)
        address = peers.address(1, os.getpid(), buf.fd, buf.ident, a.nbytes)
        assert address is not None and address != a.ctypes.data
        np.ctypeslib.as_array((np.ctypeslib.ctypes.c_int64 * 4).from_address(address))[:] = [5, 6, 7, 8]
        assert a[:4].tolist() == [5, 6, 7, 8], "the peer's mapping is the same memory"
        assert peers.address(1, os.getpid(), buf.fd, buf.ident + 1, buf.size + 1) is None, "smaller than announced"
        assert peers.address(1, os.getpid(), 10**6, buf.ident + 2, 8) is None, "no such fd"
    finally:
        peers.close()
        own.close()


def test_a_peer_killed_between_calls_is_named_within_the_timeout(tmp_path):
    started = time.monotonic()
    reports = _run(tmp_path, 2, ["die"], env={"MLX_TIMEOUT": "10"}, died=(1,))
    assert reports[0]["error"] == "PeerLostError" and reports[0]["peer"] == 1, reports
    assert time.monotonic() - started < 60


OPENER = """
import os, sys
try:
    os.open(sys.argv[1], os.O_RDWR)
    print("opened")
except OSError as exc:
    print(type(exc).__name__)
"""


def test_another_user_cannot_open_a_ranks_result_buffer():
    """The path peers use (/proc/<pid>/fd/<fd>) is closed to a process of another user."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root (to run the opener as uid 65534) and /usr/bin/python3")
    own = OwnResults()
    try:
        a = own.empty((1 << 16,), np.dtype(np.float32))
        path = f"/proc/{os.getpid()}/fd/{own.find(a.ctypes.data, a.nbytes).fd}"
        other = subprocess.run(
            ["/usr/bin/python3", "-c", OPENER, path],
            user=65534,
            group=65534,
            extra_groups=[],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        same = subprocess.run([sys.executable, "-c", OPENER, path], capture_output=True, text=True, timeout=60)
    finally:
        own.close()
    assert other.stdout.strip() == "PermissionError", other
    assert same.stdout.strip() == "opened", "the same user (a peer rank) can open it"

"""Ranks that connect only when needed (MESHCOMM_SOCKETS_CONNECT=needed, the default above 64
ranks): the whole contract on it, a rank's sockets grow with the peers it talks to, and
failures are named by every survivor, also by ranks that never connected to the failed one."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest
from jobs import finish, free_ports, launch, start_ranks, write_hostfile
from meshcomm.protocol import algorithms
from meshcomm_sockets.connect import MAX_PENDING
from meshcomm_sockets.dialing import CONNECT_ALL_UP_TO, connects_all, overlay

PROG = "tests/programs/connect_rank.py"
NEEDED = {"MESHCOMM_SOCKETS_CONNECT": "needed"}
#: 6 ranks: rank 0's start-up peers are 1, 2, 4 and 5; 0 and 3 (and 1 and 4) connect when needed
N = 6


def _lines(out: str) -> list[dict]:
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def _job(tmp_path, mode: str, env: dict[str, str], n: int = N) -> dict[int, tuple[int, str, str]]:
    hf = write_hostfile(tmp_path / "h.json", free_ports(n))
    env = {"MLX_TIMEOUT": "10", **NEEDED, **env}
    return finish(start_ranks(n, [PROG, mode], hf, env=env), timeout=120)


class _Partners:
    """A point-to-point surface that records whom an algorithm talks to (no data moves)."""

    def __init__(self, rank: int, n: int) -> None:
        self._rank, self._n, self.peers = rank, n, set()

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._n

    def send(self, buf, dst):
        self.peers.add(dst)

    def recv(self, buf, src):
        self.peers.add(src)

    def sendrecv(self, sendbuf, dst, recvbuf, src):
        self.peers.update((dst, src))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12, 64, 100, 256, 1000])
def test_start_up_peers_are_symmetric_small_and_cover_the_latency_algorithms(n):
    """Each pair is in both ranks' sets; about 3 log2(n) peers; recursive doubling, the
    dissemination barrier and Bruck's all-gather need no other connection."""
    sets = [overlay(r, n) for r in range(n)]
    bound = 3 * max(n - 1, 1).bit_length() + 1
    for r, peers in enumerate(sets):
        assert r not in peers and all(r in sets[q] for q in peers), (r, peers)
        assert len(peers) <= min(bound, n - 1), (r, len(peers), bound)
        for algorithm in (
            lambda b: algorithms.recursive_doubling(b, np.zeros(1), "sum"),
            algorithms.barrier,
            lambda b: algorithms.all_gather(b, np.zeros(1), np.zeros(n)),
        ):
            b = _Partners(r, n)
            algorithm(b)
            assert b.peers <= peers, (r, b.peers - peers)


def test_auto_connects_every_pair_up_to_its_limit_and_only_the_needed_ones_above():
    assert connects_all("auto", CONNECT_ALL_UP_TO) and not connects_all("auto", CONNECT_ALL_UP_TO + 1)
    assert connects_all("all", 4096) and not connects_all("needed", 2)


@pytest.mark.parametrize("shm", ["0", "1"])
def test_the_contract_holds_when_ranks_connect_as_needed(shm):
    res = launch(
        N, "-m", "meshcomm.testing.contract", "--more", timeout=400, env={**NEEDED, "MESHCOMM_SOCKETS_SHM": shm}
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("on sockets: 20 passed, 0 failed") == N


def test_a_ranks_sockets_grow_with_the_peers_it_talks_to(tmp_path):
    """Over TCP: after start-up a rank holds its start-up peers and its listener; the ring
    and the doubling algorithms add nothing; an all-to-all connects every pair."""
    n = 16
    results = _job(tmp_path, "count", {"MESHCOMM_SOCKETS_SHM": "0"}, n)
    for r in range(n):
        rc, out, err = results[r]
        assert rc == 0, (r, out, err[-3000:])
        held = {line["stage"]: line["sockets"] for line in _lines(out) if "stage" in line}
        assert held == {
            "init": len(overlay(r, n)) + 1,
            "all_sum, all_gather, barrier": len(overlay(r, n)) + 1,
            "all_to_all": n,
        }, (r, held)


@pytest.mark.parametrize("shm", ["0", "1"])
def test_a_killed_rank_is_named_by_every_survivor_also_those_not_connected_to_it(tmp_path, shm):
    victim = 3  # not among rank 0's start-up peers
    results = _job(tmp_path, "kill", {"VICTIM": str(victim), "MESHCOMM_SOCKETS_SHM": shm})
    assert results[victim][0] == -9
    for r in set(range(N)) - {victim}:
        first = _lines(results[r][1])[0]
        assert first["error"] == "PeerLostError" and first["peer"] == victim, (r, first)
        assert first["elapsed"] < 10, "named when its connections closed, not after MLX_TIMEOUT"


def test_a_first_contact_with_a_rank_whose_program_ended_is_a_lost_peer_at_once(tmp_path):
    victim = 3
    results = _job(tmp_path, "ended", {"VICTIM": str(victim), "MESHCOMM_SOCKETS_SHM": "0"})
    first = _lines(results[0][1])[0]
    assert first["error"] == "PeerLostError" and first["peer"] == victim, first
    assert first["elapsed"] < 1.0 + 5, first
    for r in set(range(1, N)) - {victim}:
        assert _lines(results[r][1])[0]["error"] is None


def test_grow_says_newcomers_need_every_pair_connected(tmp_path):
    results = _job(tmp_path, "grow", {}, 4)
    for r in range(4):
        first = _lines(results[r][1])[0]
        assert first["error"] == "NotSupportedError", first
        assert "MESHCOMM_SOCKETS_CONNECT=all" in first["message"], first


def test_ranks_that_disagree_on_the_setting_fail_at_start_up_naming_it(tmp_path):
    hf = write_hostfile(tmp_path / "h.json", free_ports(4))
    procs = start_ranks(
        4,
        [PROG, "count"],
        hf,
        env={"MLX_TIMEOUT": "5", "MESHCOMM_SOCKETS_SHM": "0"},
        rank_env={0: NEEDED, 1: {"MESHCOMM_SOCKETS_CONNECT": "all"}},
    )
    results = finish(procs, timeout=60)
    text = "".join(err for _rc, _out, err in results.values())
    assert all(rc != 0 for rc, _o, _e in results.values()), results
    assert "connect needed" in text, text[-3000:]


def test_strangers_flooding_a_listener_delay_a_first_contact_but_do_not_break_it(tmp_path):
    """Mid-job, a rank's listener answers first contacts; strangers on its port (garbage, and
    more idle connections than it runs handshakes at once) are turned away, and the real
    peer's dial, turned away too while the handshakes are full, is tried again and gets in."""
    ports = free_ports(N)
    hf = write_hostfile(tmp_path / "h.json", ports)
    env = {"MLX_TIMEOUT": "20", "PAUSE": "2", "MESHCOMM_SOCKETS_SHM": "0", **NEEDED}
    procs = start_ranks(N, [PROG, "strangers"], hf, env=env)
    strangers: list[socket.socket] = []
    try:
        assert procs[3].stdout is not None
        line = procs[3].stdout.readline()  # rank 3 is past start-up: its listener serves first contacts
        assert '"ready": 3' in line, line
        for _ in range(MAX_PENDING + 8):  # silent: each holds a handshake until its limit
            strangers.append(socket.create_connection(("127.0.0.1", ports[3]), timeout=5))
        noisy = socket.create_connection(("127.0.0.1", ports[3]), timeout=5)
        noisy.sendall(b"GET / HTTP/1.0\r\n\r\n" * 100)
        strangers.append(noisy)
        time.sleep(3.5)  # the ranks' first contacts begin after 2 s and are turned away meanwhile
    finally:
        for sock in strangers:
            sock.close()
    results = finish(procs, timeout=120)
    for r in range(N):
        rc, out, err = results[r]
        assert rc == 0 and _lines(out)[-1] == {"error": None}, (r, out, err[-3000:])

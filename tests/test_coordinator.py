"""Issue 15: the coordinator rendezvous (meshcomm_sockets.coordinator) on its own, with real processes.

* 1-4 hand-started ranks all get the same table, in rank order;
* a stranger without the secret is rejected (and learns nothing) while the job completes;
  a fake coordinator cannot feed a rank addresses (its replies fail the MAC);
* a missing rank is a CommTimeoutError naming it, on rank 0 and on the ranks that came;
* a wrong world size and a rank registered twice are clear errors; an unreachable
  coordinator is a CommTimeoutError naming the address and the fix;
* no secret: it works and rank 0 warns once;
* issue 33 item 5: a flood of silent connections that reconnect as soon as they are closed
  does not keep the ranks out (the oldest handshake is evicted, newcomers queue in order),
  rank 0's timeout error names such a flood (count and busiest source), and a rank whose
  connections were closed before its HELLO does not blame the secret;
* Config takes rank, world size and coordinator from other starters' variables, and
  ``any`` refuses to run a rank of a bigger job alone.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time

import pytest
from jobs import ROOT, finish, free_ports
from meshcomm import BackendUnavailableError, CommTimeoutError, Config
from meshcomm.runtime.placement import parse_coordinator
from meshcomm.runtime.registry import Registry
from meshcomm_sockets import coordinator as rdv

PROG = ROOT / "tests" / "programs" / "coordinator_rank.py"
SECRET = "test-coordinator-secret"


def _start(
    addr: str, rank: int, size: int, timeout: float = 60, secret: str | None = SECRET, **env: str
) -> subprocess.Popen[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "MESHCOMM_"))}
    e.update(PYTHONUNBUFFERED="1", **env)
    if secret is not None:
        e["MESHCOMM_JOB_SECRET"] = secret
    return subprocess.Popen(
        [sys.executable, str(PROG), addr, str(rank), str(size), str(timeout)],
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _report(result: tuple[int, str, str]) -> dict:
    lines = [ln for ln in result[1].splitlines() if ln.startswith("{")]
    assert lines, f"no report (exit {result[0]}):\n{result[1]}\n{result[2][-3000:]}"
    return json.loads(lines[-1])


class _Procs(dict):
    """Rank -> process; every one still running is killed when the test ends."""

    def stop(self) -> None:
        for p in self.values():
            if p.poll() is None:
                p.kill()
            p.communicate()


@pytest.fixture
def procs():
    ps = _Procs()
    try:
        yield ps
    finally:
        ps.stop()


def _addr() -> str:
    return f"127.0.0.1:{free_ports(1)[0]}"


def _connect_when_up(addr: str, deadline_s: float = 60) -> socket.socket:
    host, port = addr.rsplit(":", 1)
    end = time.monotonic() + deadline_s
    while True:
        try:
            return socket.create_connection((host, int(port)), timeout=5)
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_rank_gets_the_same_table_in_rank_order(procs, n):
    addr = _addr()
    for r in reversed(range(n)):  # rank 0 last: the others retry until it serves
        procs[r] = _start(addr, r, n)
    results = finish(procs, timeout=120)
    reports = {r: _report(res) for r, res in results.items()}
    tables = [reports[r].get("table") for r in range(n)]
    assert all(t == tables[0] for t in tables), reports
    assert [e["rank"] for e in tables[0]] == list(range(n))
    assert [e["pid"] for e in tables[0]] == [procs[r].pid for r in range(n)]
    assert all(res[0] == 0 for res in results.values()), results


def test_a_stranger_without_the_secret_is_rejected_and_the_job_completes(procs):
    addr = _addr()
    procs[0] = _start(addr, 0, 3)
    # closed without a word: the stranger learns nothing
    assert _stranger_hello(addr, b"not the secret", 1, 3) == b""
    procs[1] = _start(addr, 1, 3)
    procs[2] = _start(addr, 2, 3)
    results = finish(procs, timeout=120)
    reports = {r: _report(res) for r, res in results.items()}
    assert all("table" in rep for rep in reports.values()), reports
    assert [e["rank"] for e in reports[0]["table"]] == [0, 1, 2]
    assert "203.0.113.9" not in json.dumps(reports)
    assert "rejected a connection" in results[0][2] and "wrong job secret" in results[0][2], results[0][2]


def test_a_fake_coordinator_cannot_feed_a_rank_addresses(procs):
    with socket.create_server(("127.0.0.1", 0)) as server:
        addr = f"127.0.0.1:{server.getsockname()[1]}"
        procs[1] = _start(addr, 1, 2)
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            conn.sendall(rdv._CHALLENGE.pack(rdv.MAGIC, os.urandom(16)))
            head = b""
            while len(head) < rdv._HELLO.size:
                head += conn.recv(rdv._HELLO.size - len(head))
            _m, nonce_c, _cid, rank, size, _n = rdv._HELLO.unpack(head)
            assert (rank, size) == (1, 2)
            table = json.dumps([{"ip": "203.0.113.66", "port": 6666}, {"rank": 1}]).encode()
            reply = rdv._REPLY.pack(rdv.TABLE, len(table)) + table
            conn.sendall(reply + rdv._mac(b"guessed", b"meshcomm rendezvous reply", nonce_c, 0, reply))
            rep = _report(finish(procs, timeout=60)[1])
    assert rep["error"] == "RendezvousError", rep
    assert "fails the job secret check" in rep["message"] and "Nothing it sent was used" in rep["message"]


def test_a_missing_rank_is_a_timeout_naming_it(procs):
    addr = _addr()
    procs[0] = _start(addr, 0, 3, timeout=3)
    procs[1] = _start(addr, 1, 3, timeout=3)
    reports = {r: _report(res) for r, res in finish(procs, timeout=120).items()}
    for r in (0, 1):
        assert reports[r]["error"] == "CommTimeoutError", reports
        assert reports[r]["peer"] == 2, reports
    assert "ranks 2 of 3" in reports[0]["message"] and "never registered" in reports[0]["message"]
    assert "2" in reports[1]["message"].split("ranks", 1)[1], reports[1]


def test_a_wrong_world_size_is_a_clear_error(procs):
    addr = _addr()
    procs[0] = _start(addr, 0, 3, timeout=20)
    procs[2] = _start(addr, 2, 4, timeout=20)
    reports = {r: _report(res) for r, res in finish(procs, timeout=120).items()}
    for r in (0, 2):
        assert reports[r]["error"] == "RendezvousError", reports
        assert "says the job has 4 ranks, rank 0 says 3" in reports[r]["message"], reports
        assert "same world size" in reports[r]["message"]


def test_a_rank_registered_twice_is_a_clear_error(procs):
    addr = _addr()
    procs[0] = _start(addr, 0, 3, timeout=20)
    procs[1] = _start(addr, 1, 3, timeout=20)
    procs[11] = _start(addr, 1, 3, timeout=20)
    reports = {r: _report(res) for r, res in finish(procs, timeout=120).items()}
    assert reports[0]["error"] == "RendezvousError", reports
    assert "rank 1 registered twice" in reports[0]["message"] and "same rank" in reports[0]["message"]
    assert {reports[1].get("error"), reports[11].get("error")} == {"RendezvousError"}, reports


def test_an_unreachable_coordinator_is_a_timeout_naming_it(procs):
    addr = _addr()
    procs[1] = _start(addr, 1, 2, timeout=1.5)
    rep = _report(finish(procs, timeout=60)[1])
    assert rep["error"] == "CommTimeoutError", rep
    assert f"could not reach the coordinator at {addr}" in rep["message"] and "MLX_COORDINATOR" in rep["message"]


def test_without_a_secret_it_works_and_rank_0_warns_once(procs):
    addr = _addr()
    for r in range(3):
        procs[r] = _start(addr, r, 3, secret=None)
    results = finish(procs, timeout=120)
    assert all("table" in _report(res) for res in results.values()), results
    assert results[0][2].count("MESHCOMM_JOB_SECRET is not set") == 1, results[0][2]
    assert "MESHCOMM_JOB_SECRET is not set" not in results[1][2] + results[2][2]


# -- configuration: where rank, size and coordinator come from ---------------------------------


def test_config_reads_torchrun_and_takes_the_port_after_master_port():
    c = Config.load({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"})
    assert (c.rank, c.world_size, c.placement_source) == (2, 3, "torchrun")
    coord = c.coordinator_address()
    assert coord is not None and (coord.host, coord.port) == ("localhost", 29501)
    assert "MASTER_PORT+1" in coord.source


def test_config_prefers_meshcomm_variables_and_reads_mpirun():
    c = Config.load({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "MLX_COORDINATOR": "h:5"})
    assert (c.rank, c.world_size, c.placement_source, c.coordinator) == (1, 4, "Open MPI", "h:5")
    c = Config.load({"MLX_RANK": "0", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"})
    assert (c.rank, c.world_size, c.placement_source) == (0, None, "MLX_RANK")


def test_any_refuses_to_run_a_rank_of_a_bigger_job_alone():
    reg = Registry().load(environ={}, entry_points=False)  # only the size-1 backend
    with pytest.raises(BackendUnavailableError, match="rank 1 of a job of 4 ranks.*Open MPI"):
        reg.start("any", Config.load({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4"}), strict=False)
    with pytest.raises(BackendUnavailableError, match="coordinator"):
        reg.start("any", Config.load({"MLX_RANK": "1", "MLX_COORDINATOR": "h:5"}), strict=False)
    assert reg.start("any", Config.load({}), strict=False)[1] == "single"
    assert reg.start("any", Config.load({"RANK": "0", "WORLD_SIZE": "1"}), strict=False)[1] == "single"


def test_sockets_counts_a_coordinator_as_its_environment():
    plugin = pytest.importorskip("meshcomm_sockets.plugin")
    settings = plugin.SocketsSettings()
    assert (
        plugin._environment(
            Config.load(
                {
                    "SLURM_PROCID": "0",
                    "SLURM_NTASKS": "2",
                    "SLURM_JOB_ID": "7",
                    "SLURM_STEP_ID": "0",
                    "SLURM_STEP_NODELIST": "n[1-2]",
                }
            ),
            settings,
        )
        is None
    )
    assert plugin._environment(Config.load({"RANK": "0", "WORLD_SIZE": "2"}), settings) is not None


def _stranger_hello(addr: str, secret: bytes, rank: int, size: int) -> bytes:
    """Connect, answer the challenge with a HELLO under ``secret``; what came back before EOF."""
    with _connect_when_up(addr) as s:
        s.settimeout(30)
        challenge = b""
        while len(challenge) < rdv._CHALLENGE.size:
            challenge += s.recv(rdv._CHALLENGE.size - len(challenge))
        _magic, nonce_s = rdv._CHALLENGE.unpack(challenge)
        data = json.dumps({"ip": "203.0.113.9", "port": 1}).encode()
        body = rdv._HELLO.pack(rdv.MAGIC, os.urandom(16), os.urandom(16), rank, size, len(data)) + data
        s.sendall(body + rdv._mac(secret, b"meshcomm rendezvous hello", nonce_s, 0, body))
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got


def test_without_a_secret_a_bad_claim_is_refused_and_the_job_goes_on(procs):
    """Without a secret anybody can register, so a claim that cannot be right (another world
    size) is refused to the claimant only; the real ranks still meet."""
    addr = _addr()
    procs[0] = _start(addr, 0, 2, secret=None)
    reply = _stranger_hello(addr, b"", 1, 7)
    assert b"says the job has 7 ranks" in reply  # the claimant is told why (an ERROR reply)
    procs[1] = _start(addr, 1, 2, secret=None)
    results = finish(procs, timeout=120)
    reports = {r: _report(res) for r, res in results.items()}
    assert all("table" in rep for rep in reports.values()), reports
    assert "203.0.113.9" not in json.dumps(reports)
    assert "refused" in results[0][2], results[0][2]


def test_a_flood_of_silent_connections_does_not_stop_the_job(procs):
    """More connections than MAX_PENDING that never say anything: the surplus waits in the
    accept queue, the oldest silent ones are evicted for it, the real ranks get in."""
    addr = _addr()
    procs[0] = _start(addr, 0, 3)
    flood = [_connect_when_up(addr)]
    host, port = addr.rsplit(":", 1)
    try:
        for _ in range(3 * rdv.MAX_PENDING):
            try:
                flood.append(socket.create_connection((host, int(port)), timeout=5))
            except OSError:
                pass
        procs[1] = _start(addr, 1, 3)
        procs[2] = _start(addr, 2, 3)
        results = finish(procs, timeout=180)
    finally:
        for s in flood:
            s.close()
    reports = {r: _report(res) for r, res in results.items()}
    assert all("table" in rep for rep in reports.values()), reports
    assert "never completed a handshake" in results[0][2] and "evicted" in results[0][2], results[0][2][-2000:]


# -- issue 33 item 5: a flood that reconnects at once ------------------------------------------

#: the attacker's source address (any 127/8 address is this machine's loopback)
ATTACKER = "127.0.0.66"
#: the attacker's connections (issue 33 saw 150-300 keep the job out)
FLOOD = 300


class _Flood:
    """The attack: ``n`` connections to ``addr`` from ATTACKER that never send a byte; each
    one the coordinator closes is opened again at once. Runs on its own thread while in a
    ``with`` block; leaving it stops the thread and closes every socket."""

    def __init__(self, addr: str, n: int) -> None:
        host, port = addr.rsplit(":", 1)
        self.target, self.n = (host, int(port)), n
        self.sel = selectors.DefaultSelector()
        self.stopping = threading.Event()
        self.reopened = 0  # connections opened again after the coordinator closed them
        self.thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> _Flood:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the attacker thread did not stop"

    def wait_reopened(self, count: int, within: float) -> None:
        """Until the coordinator closed ``count`` of the connections (and they came back)."""
        end = time.monotonic() + within
        while self.reopened < count:
            assert time.monotonic() < end, f"only {self.reopened} connections were closed and reopened"
            time.sleep(0.02)

    def _open(self) -> bool:
        s = socket.socket()
        s.setblocking(False)
        try:
            s.bind((ATTACKER, 0))
            s.connect_ex(self.target)
        except OSError:  # e.g. no local port free for a moment: the next round tries again
            s.close()
            return False
        self.sel.register(s, selectors.EVENT_READ)
        return True

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                while len(self.sel.get_map()) < self.n and self._open():
                    pass
                for key, _ in self.sel.select(0.05):
                    s = key.fileobj
                    try:
                        data = s.recv(4096)  # the challenge, never answered
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:  # closed by the coordinator: straight back in
                        self.sel.unregister(s)
                        s.close()
                        self.reopened += 1
        finally:
            for key in list(self.sel.get_map().values()):
                key.fileobj.close()
            self.sel.close()


def test_a_flood_that_reconnects_at_once_does_not_keep_the_ranks_out(procs):
    """300 silent connections that reconnect as soon as rank 0 closes them: the ranks still
    get their table (a full handshake table evicts its oldest entry, newcomers queue in order
    of arrival, so an honest rank is answered and has time to answer)."""
    addr = _addr()
    procs[0] = _start(addr, 0, 3, timeout=12)
    _connect_when_up(addr).close()
    with _Flood(addr, FLOOD) as flood:
        flood.wait_reopened(rdv.MAX_PENDING, within=10)  # the table is full and being recycled
        start = time.monotonic()
        procs[1] = _start(addr, 1, 3, timeout=10)
        procs[2] = _start(addr, 2, 3, timeout=10)
        results = finish(procs, timeout=60)
        took = time.monotonic() - start
    reports = {r: _report(res) for r, res in results.items()}
    errors = "\n".join(rep["message"] for rep in reports.values() if "table" not in rep)
    assert not errors, errors
    assert [e["rank"] for e in reports[0]["table"]] == [0, 1, 2]
    print(f"\nunder a flood of {FLOOD} connections the job formed in {took:.1f} s")
    assert f"most from {ATTACKER}" in results[0][2], results[0][2][-2000:]


def test_rank_0_names_a_flood_that_keeps_the_ranks_out(procs):
    """No rank comes while the flood runs: rank 0's timeout error says a flood it was, how
    many connections and from where, and does not send the user after the secret."""
    addr = _addr()
    procs[0] = _start(addr, 0, 2, timeout=3)
    _connect_when_up(addr).close()
    with _Flood(addr, 150):
        rep = _report(finish(procs, timeout=60)[0])
    assert rep["error"] == "CommTimeoutError" and rep["peer"] == 1, rep
    msg = rep["message"]
    assert "ranks 1 of 2" in msg and "a flood of connections" in msg, msg
    seen = re.search(
        r"saw (\d+) connections that never completed a handshake in the last [\d.]+ s, "
        rf"most from {re.escape(ATTACKER)} \((\d+)\)",
        msg,
    )
    assert seen, msg
    assert int(seen[1]) >= int(seen[2]) > rdv.MAX_PENDING, msg
    assert "evicted" in msg and f"dport = :{addr.rsplit(':', 1)[1]}" in msg, msg
    assert "MESHCOMM_JOB_SECRET" not in msg, msg


def test_a_rank_shut_out_before_its_hello_does_not_blame_the_secret():
    """A coordinator port that closes every connection at once: the rank's timeout says it
    never got to send its HELLO (so the secret cannot be why) and does not blame the secret."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(0.1)
        stop = threading.Event()

        def slam() -> None:
            while not stop.is_set():
                try:
                    server.accept()[0].close()
                except TimeoutError:
                    pass

        t = threading.Thread(target=slam, daemon=True)
        t.start()
        try:
            coord = parse_coordinator(f"127.0.0.1:{server.getsockname()[1]}")
            with pytest.raises(CommTimeoutError) as err:
                rdv.exchange(coord, 1, 2, {"rank": 1}, secret=b"s", timeout=1.0)
        finally:
            stop.set()
            t.join(10)
    msg = str(err.value)
    assert "before this rank could send its HELLO" in msg and "not over the secret" in msg, msg
    assert "MESHCOMM_JOB_SECRET" not in msg, msg

"""The sockets backend on real processes: the contract on 1-5 ranks, and every way a job can fail."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from jobs import connect_when_listening, finish, free_ports, launch, start_ranks, write_hostfile
from meshcomm import DistributedError
from meshcomm.protocol.errors import ConfigError

PROG = "tests/programs/sockets_faults.py"


def _lines(out: str) -> list[dict]:
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_contract_on_real_processes(n):
    """The contract on the compiled call path, and on 3 ranks on the pure-Python one."""
    path = "pure-Python" if n == 3 else "compiled"
    env = {"MESHCOMM_COMPILED": "0" if n == 3 else "1"}
    res = launch(n, "-m", "meshcomm.testing.contract", "--more", timeout=400, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count(f"on sockets: 20 passed, 0 failed ({path} call path)") == n, res.stdout[-3000:]


def test_many_chunks_and_seven_ranks(tmp_path):
    """Odd group size, tiny chunks: thousands of frames, sizes that divide nothing."""
    prog = tmp_path / "chunks.py"
    prog.write_text(
        "import numpy as np, meshcomm as mc\n"
        "g = mc.init(strict=True); r, n = g.rank(), g.size()\n"
        "for size in (1_000_003, 333_331):\n"
        "    x = (np.arange(size) % 97 + r).astype(np.float64)\n"
        "    want = sum((np.arange(size) % 97 + q) for q in range(n)).astype(np.float64)\n"
        "    assert np.array_equal(mc.all_sum(x), want)\n"
        "    s = mc.sum_scatter(np.tile(x[: size - size % n], 1)) if size % n == 0 else None\n"
        "    y = np.arange(7 * 40_009, dtype=np.int32) * (r + 1)\n"
        "    k = len(y) // n * n\n"
        "    got = mc.sum_scatter(y[:k])\n"
        "    full = np.arange(k, dtype=np.int32) * (n * (n + 1) // 2)\n"
        "    assert np.array_equal(got, full[r * (k // n):(r + 1) * (k // n)])\n"
        "print('ok', r)\n"
    )
    res = launch(7, str(prog), env={"MESHCOMM_SOCKETS_CHUNK_KIB": "4"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("ok") == 7


def test_killed_rank_makes_every_survivor_raise_naming_it(tmp_path):
    hf = write_hostfile(tmp_path / "h.json", free_ports(4))
    results = finish(start_ranks(4, [PROG, "kill"], hf, env={"MLX_TIMEOUT": "20"}), timeout=90)
    assert results[3][0] == -9
    for r in range(3):
        rc, out, err = results[r]
        first = _lines(out)[0]
        assert first["error"] == "PeerLostError", (r, out, err)
        assert first["peer"] == 3, first
        assert "rank 3" in first["message"]
        assert first["elapsed"] < 20, "must not wait for the timeout when the connection closes"
        again = _lines(out)[1]
        assert again["again"] == "PeerLostError" and "earlier failure" in again["message"]


def test_silent_peer_times_out_naming_it(tmp_path):
    hf = write_hostfile(tmp_path / "h.json", free_ports(3))
    procs = start_ranks(3, [PROG, "sleep"], hf, env={"MLX_TIMEOUT": "3", "SLEEP": "8"})
    results = finish(procs, timeout=60)
    for r in (0, 2):
        first = _lines(results[r][1])[0]
        assert first["error"] == "CommTimeoutError", results[r]
        assert "rank 1" in first["message"]
        assert first["elapsed"] < 3 + 10, first


def test_rank_that_never_starts_fails_the_others_at_startup(tmp_path):
    ports = free_ports(3)
    hf = write_hostfile(tmp_path / "h.json", ports)
    results = finish(start_ranks(3, [PROG, "ok"], hf, ranks=[0, 2], env={"MLX_TIMEOUT": "3"}), timeout=60)
    r0 = _lines(results[0][1])[0]
    assert r0["phase"] == "init" and r0["error"] == "CommTimeoutError"
    assert f"ranks 1 (127.0.0.1:{ports[1]})" in r0["message"] or f"1 (127.0.0.1:{ports[1]})" in r0["message"]
    r2 = _lines(results[2][1])[0]
    assert r2["phase"] == "init" and f"rank 1 at 127.0.0.1:{ports[1]}" in r2["message"]
    assert r0["elapsed"] < 3 + 10 and r2["elapsed"] < 3 + 10


def test_port_in_use_is_a_clear_error(tmp_path):
    ports = free_ports(2)
    hf = write_hostfile(tmp_path / "h.json", ports)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", ports[0]))
    blocker.listen()
    try:
        results = finish(start_ranks(2, [PROG, "ok"], hf, env={"MLX_TIMEOUT": "3"}), timeout=60)
    finally:
        blocker.close()
    r0 = _lines(results[0][1])[0]
    assert "already in use" in r0["message"] and str(ports[0]) in r0["message"]


@pytest.mark.parametrize("mode", ["shape", "op"])
def test_mismatched_calls_raise_on_every_rank_without_debug(tmp_path, mode):
    hf = write_hostfile(tmp_path / "h.json", free_ports(3))
    results = finish(start_ranks(3, [PROG, mode], hf, env={"MLX_TIMEOUT": "20"}), timeout=60)
    for r in range(3):
        first = _lines(results[r][1])[0]
        assert first["error"] == "CollectiveMismatchError", (r, results[r])
        assert first["elapsed"] < 20


def test_strangers_are_rejected_and_the_job_goes_on(tmp_path):
    from meshcomm_sockets import wire

    ports = free_ports(2)
    hf = write_hostfile(tmp_path / "h.json", ports)
    env = {"MLX_TIMEOUT": "30", "MESHCOMM_JOB_SECRET": "s3cret"}
    procs = start_ranks(2, [PROG, "ok"], hf, ranks=[0], env=env)  # rank 1 is not started yet

    def stranger(payload: bytes) -> None:
        with connect_when_listening(ports[0]) as s:
            s.recv(wire.CHALLENGE_SIZE)
            s.sendall(payload)
            time.sleep(0.2)

    stranger(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\x00" * 100)
    with connect_when_listening(ports[0]) as s:
        nonce = wire.parse_challenge(s.recv(wire.CHALLENGE_SIZE))
        s.sendall(wire.hello(b"wrong", nonce, wire.Hello(2, 1, 0, b"n" * 16, "x")))
        assert s.recv(100) == b"", "a wrong secret must get no answer"
    procs.update(start_ranks(2, [PROG, "ok"], hf, ranks=[1], env=env))
    results = finish(procs, timeout=60)
    for r in range(2):
        assert _lines(results[r][1])[0]["result"] == [3.0, 3.0, 3.0], results[r]
    assert results[0][2].count("rejected a connection") == 2, results[0][2]
    assert "wrong job secret" in results[0][2] and "bad magic" in results[0][2]


@pytest.mark.parametrize("secret", [b"s3cret", b""])
def test_version_skew_is_refused_on_both_sides(secret):
    """With a secret both ranks name both versions at once. Without one anybody could send
    that HELLO: rank 0 names no version to rank 1 and does not stop start-up for it (it
    names the refused claim when its wait times out)."""
    from meshcomm_sockets.connect import establish
    from meshcomm_sockets.hostfile import Peer

    ports = free_ports(2)
    peers = [Peer(ip="127.0.0.1", port=p) for p in ports]
    errors: dict[int, BaseException] = {}

    def rank(r: int, version: str) -> None:
        try:
            establish(peers, r, secret=secret, version=version, timeout=4)
        except BaseException as exc:
            errors[r] = exc

    ts = [
        threading.Thread(target=rank, args=(0, "meshcomm 1.0")),
        threading.Thread(target=rank, args=(1, "meshcomm 2.0")),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert isinstance(errors[0], DistributedError) and "meshcomm 2.0" in str(errors[0])
    assert isinstance(errors[1], DistributedError) and "same meshcomm versions" in str(errors[1])
    if secret:
        assert "meshcomm 1.0" in str(errors[1]), errors[1]
    else:
        assert "meshcomm 1.0" not in str(errors[1]) and "only to peers that prove" in str(errors[1]), errors[1]
        assert "waited 4 s" in str(errors[0]) and "was refused" in str(errors[0]), errors[0]


def test_ipv6_and_separate_bind_address(tmp_path):
    v6 = socket.has_ipv6
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        v6 = False
    ports = free_ports(2)
    entries = [{"ip": "127.0.0.1", "port": ports[0], "bind": "0.0.0.0"}]
    if v6:
        entries.append({"ip": "::1", "port": free_ports(1, "::1")[0]})
    else:
        entries.append({"ip": "127.0.0.1", "port": ports[1]})
    hf = tmp_path / "h.json"
    hf.write_text(json.dumps(entries))
    results = finish(start_ranks(2, [PROG, "ok"], hf, env={"MLX_TIMEOUT": "20"}), timeout=60)
    for r in range(2):
        assert _lines(results[r][1])[0]["result"] == [3.0, 3.0, 3.0], results[r]


class TestHostfile:
    def parse(self, data):
        from meshcomm_sockets.hostfile import parse_hostfile

        return parse_hostfile(data, "test")

    def test_design_format_with_string_ports(self):
        peers = self.parse([{"ip": "10.0.0.1", "port": "5000"}, {"ip": "node-b", "port": 5001}])
        assert [(p.ip, p.port) for p in peers] == [("10.0.0.1", 5000), ("node-b", 5001)]

    def test_mlx_ring_format_and_ipv6(self):
        peers = self.parse([["10.0.0.1:5000", "10.0.0.1:5001"], ["[fe80::1]:6000"]])
        assert [(p.ip, p.port) for p in peers] == [("10.0.0.1", 5000), ("fe80::1", 6000)]
        assert str(peers[1]) == "[fe80::1]:6000"

    @pytest.mark.parametrize(
        "data,needle",
        [
            ([], "non-empty JSON list"),
            ([{"ip": "a"}], "entry 0 (rank 0) field 'port': Field required"),
            ([{"ip": "a", "port": 1}, {"ip": "b", "port": 70000}], "entry 1 (rank 1) field 'port'"),
            ([{"ip": "a", "port": 1}, {"ip": "a", "port": 1}], "ranks 0 and 1 both use a:1"),
            ([{"ip": "a", "port": 1, "colour": 2}], "field 'colour'"),
            ([42], "entry 0"),
        ],
    )
    def test_bad_entries_name_the_entry(self, data, needle):
        with pytest.raises(ConfigError, match="^test: ") as err:
            self.parse(data)
        assert needle in str(err.value)

    def test_bad_file(self, tmp_path):
        from meshcomm_sockets.hostfile import read_hostfile

        bad = tmp_path / "bad.json"
        bad.write_text("[{")
        with pytest.raises(ConfigError, match="is not valid JSON"):
            read_hostfile(bad)
        with pytest.raises(ConfigError, match="cannot be read"):
            read_hostfile(tmp_path / "missing.json")


def test_rank_outside_hostfile_is_a_config_error(tmp_path, monkeypatch):
    import meshcomm as mc
    from meshcomm.api import world
    from meshcomm.runtime import registry

    hf = write_hostfile(tmp_path / "h.json", free_ports(2))
    monkeypatch.setenv("MLX_HOSTFILE", str(hf))
    monkeypatch.setenv("MLX_RANK", "5")
    registry.reset_registry()
    world.shutdown()
    with pytest.raises(ConfigError, match="MLX_RANK=5 but MLX_HOSTFILE=.* lists 2 ranks"):
        mc.init(backend="sockets")


def test_a_member_lost_after_the_survivors_agreed_is_named_by_the_new_worlds_first_call():
    """Rank 0 saw rank 2 die after the others had decided without it: its connection to rank
    2 is missing from the new world. That world starts failed naming rank 2 on rank 0, and
    rank 1 (which has a connection to it) hears so at its first call: PeerLostError naming
    rank 2 on both, which the survivors answer with another shrink (no internal error)."""
    import numpy as np
    from meshcomm import PeerLostError
    from meshcomm.runtime.config import Config
    from meshcomm_sockets.connect import establish, open_listener
    from meshcomm_sockets.hostfile import Peer
    from meshcomm_sockets.plugin import SocketsSettings, _world
    from meshcomm_sockets.recovery import Recovery

    peers = [Peer(ip="127.0.0.1", port=p) for p in free_ports(3)]
    conns: dict[int, dict] = {}
    listeners = {r: open_listener(r, peers[r], None, 3) for r in range(3)}

    def connect(r: int) -> None:
        conns[r] = establish(peers, r, secret=b"s", version="v", timeout=10, listener=listeners[r], keep_listener=True)

    threads = [threading.Thread(target=connect, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in conns[2].values():  # rank 2 dies
        c.sock.close()
    conns[0][2].sock.close()  # rank 0 saw it go: the recovery handed over no connection to it
    del conns[0][2]
    settings = SocketsSettings()
    errors: dict[int, BaseException] = {}

    def survivor(r: int) -> None:
        config = Config(backend="sockets", rank=r, world_size=3, timeout=5)
        recovery = Recovery(peers, r, b"s", "v", 5, listeners[r], lambda *a: None, epoch=1)
        try:
            world = _world(config, settings, r, 3, conns[r], None, 0, recovery)
            x = np.ones(4, np.float32)
            world.all_reduce(x, np.empty_like(x), "sum")
        except BaseException as exc:
            errors[r] = exc

    threads = [threading.Thread(target=survivor, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for r in (0, 1):
        assert isinstance(errors.get(r), PeerLostError) and errors[r].peer == 2, (r, errors.get(r))
        assert "rank 2" in str(errors[r]), errors[r]
    for r in range(3):
        listeners[r].close()
        for c in conns[r].values():
            c.sock.close()

"""Issue 14, the sockets backend: strangers are not peers. Real processes throughout.

* no secret: rank 0 warns once (how to make one); MESHCOMM_REQUIRE_SECRET=1 makes it an error;
  a stranger's HELLO neither stops start-up nor learns the versions; with a secret a
  stranger connecting first is rejected and the real rank joins;
* an on-path relay that knows no secret: a flipped payload byte, a forged ABORT, a
  rewritten shared-memory name -> a clear authentication error, never wrong data, never
  the forged text shown as a rank's error, never a file opened outside /dev/shm;
* shared-memory names cannot be squatted by another uid (the job uses shared memory, or
  logs why not); names and sizes from a peer are checked;
* a flood of ~1000 silent connections during start-up (open-file limit 1024) does not
  crash rank 0; running out of descriptors is a DistributedError naming the limit;
* a rank failing during shared-memory set-up leaves nothing in /dev/shm (no launcher).
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import select
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import ROOT, connect_when_listening, finish, free_ports, start_ranks, write_hostfile

wire = pytest.importorskip("meshcomm_sockets.wire")
SHM = Path("/dev/shm")

#: rank 1's object in the object jobs (the relay knows its pickle and swaps it)
OBJECT = ("HARMLESS-OBJECT-OF-RANK-1", "x" * 200)

PROG = """
import json, os, sys, time
import numpy as np
import meshcomm as mc
OBJECT = OBJECT_REPR

def say(**kw):
    print(json.dumps(kw), flush=True)

try:
    g = mc.init(strict=True)
    t = g.transport
    say(rank=g.rank(), path=getattr(getattr(t, "path", None), "name", "?"))
    if os.environ.get("OBJECTS"):  # rank 1's object is what the pickle relay swaps
        got = mc.all_gather_object(OBJECT if g.rank() == 1 else g.rank())
        say(error=None, ok=got == [0, OBJECT], objects=repr(got)[:200])
    else:
        n = int(os.environ.get("SIZE", str(1 << 18)))
        got = mc.all_sum(np.full(n, g.rank() + 1.0, np.float32))
        bad = np.flatnonzero(got != 3.0)
        say(error=None, ok=bool(bad.size == 0), bad=bad[:5].tolist(), values=got[bad[:5]].tolist())
except mc.DistributedError as exc:
    say(error=type(exc).__name__, message=str(exc))
"""

PROG = PROG.replace("OBJECT_REPR", repr(OBJECT))


def _reports(out: str) -> list[dict]:
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def _last(results, r: int) -> dict:
    reps = [x for x in _reports(results[r][1]) if "error" in x]
    assert reps, (r, results[r][1][-2000:], results[r][2][-3000:])
    return reps[-1]


def _prog(tmp_path: Path) -> str:
    p = tmp_path / "prog.py"
    p.write_text(PROG)
    return str(p)


def _version_bytes() -> bytes:
    from meshcomm_sockets.plugin import _version

    return _version(256).split(",")[0].encode()  # "meshcomm <version>"


# -- 1. no secret, strangers ------------------------------------------------------------------


#: no usable place for the per-user key file, so a job without a secret has no key at all
NO_USER_KEY = {"HOME": "", "XDG_CONFIG_HOME": ""}


def test_no_secret_warns_once_on_rank_0_and_require_secret_makes_it_an_error(tmp_path):
    """No secret and no per-user key (no HOME): rank 0 warns once, saying why no key was used."""
    prog = _prog(tmp_path)
    hf = write_hostfile(tmp_path / "h.json", free_ports(2))
    env = {"MLX_TIMEOUT": "30", "MESHCOMM_JOB_SECRET": "", "SIZE": "8", **NO_USER_KEY}
    results = finish(start_ranks(2, [prog], hf, env=env), timeout=120)
    for r in range(2):
        assert _last(results, r)["ok"] is True, results[r]
    assert results[0][2].count("MESHCOMM_JOB_SECRET is not set") == 1, results[0][2]
    assert "secrets.token_hex(16)" in results[0][2] and "MESHCOMM_REQUIRE_SECRET=1" in results[0][2]
    assert "per-user key file was not used: HOME is not set" in results[0][2], results[0][2]
    assert "MESHCOMM_JOB_SECRET is not set" not in results[1][2], results[1][2]

    results = finish(start_ranks(2, [prog], hf, env={**env, "MESHCOMM_REQUIRE_SECRET": "1"}), timeout=120)
    for r in range(2):
        rc, out, err = results[r]
        assert rc != 0 and "ConfigError" in err and "MESHCOMM_REQUIRE_SECRET is set" in err, (r, out, err[-2000:])


def _stranger_hello(port: int, secret: bytes, version: str) -> bytes:
    """Connect as a stranger claiming rank 1, send a HELLO under ``secret``; what came back."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(10)
        nonce = wire.parse_challenge(s.recv(wire.CHALLENGE_SIZE))
        s.sendall(wire.hello(secret, nonce, wire.Hello(2, 1, 0, b"n" * 16, version)))
        reply = b""
        try:
            while chunk := s.recv(4096):
                reply += chunk
        except OSError:
            pass
        return reply


@pytest.mark.parametrize("secret", ["", "job-secret"])
def test_a_stranger_connecting_first_is_rejected_learns_nothing_and_the_real_rank_joins(tmp_path, secret):
    """The stranger claims rank 1 with a HELLO of another version (without a secret it can
    compute a valid MAC; with one it cannot). Either way start-up goes on, the reply names
    no version, and the real rank 1 joins and gets the right sum."""
    prog = _prog(tmp_path)
    ports = free_ports(2)
    hf = write_hostfile(tmp_path / "h.json", ports)
    env = {"MLX_TIMEOUT": "30", "MESHCOMM_JOB_SECRET": secret, "SIZE": "8"}
    procs = start_ranks(2, [prog], hf, ranks=[0], env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = _stranger_hello(ports[0], b"", "meshcomm 0.0-stranger")
                break
            except OSError:
                assert time.monotonic() < deadline, "rank 0 never listened"
                time.sleep(0.1)
        assert _version_bytes() not in reply and b"meshcomm-sockets" not in reply, reply
        procs.update(start_ranks(2, [prog], hf, ranks=[1], env=env))
    finally:
        results = finish(procs, timeout=120)
    for r in range(2):
        assert _last(results, r)["ok"] is True, (r, results[r][1][-2000:], results[r][2][-3000:])
    assert "rejected" in results[0][2], results[0][2][-2000:]


def test_a_rank_with_another_secret_is_told_its_secret_was_refused(tmp_path):
    """Rank 1 was given a different MESHCOMM_JOB_SECRET: it does not report 'connection
    refused' or a timeout of an unreachable rank, but that rank 0 refused its secret -- also
    when rank 0 gave up first (its timeout is shorter here), so that rank 1's last attempts
    found nobody listening."""
    ports = free_ports(2)
    hf = write_hostfile(tmp_path / "h.json", ports)
    procs = start_ranks(
        2,
        [_prog(tmp_path)],
        hf,
        env={"SIZE": "8"},
        rank_env={
            0: {"MESHCOMM_JOB_SECRET": "one", "MLX_TIMEOUT": "1"},
            1: {"MESHCOMM_JOB_SECRET": "another", "MLX_TIMEOUT": "4"},
        },
    )
    results = finish(procs, timeout=60)
    rc, out, err = results[1]
    assert _last(results, 1)["error"] == "DistributedError", (rc, out[-2000:], err[-3000:])
    assert "refused this rank's MESHCOMM_JOB_SECRET" in _last(results, 1)["message"], out[-2000:]
    assert "Connection refused" not in out + err, err[-3000:]


# -- 2. an on-path relay without the secret ------------------------------------------------------

RELAY = """
import os, pickle, select, socket, sys, time
from meshcomm_sockets import wire
OBJECT = OBJECT_REPR

listen_port, target_port, mode, decoy = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
srv = socket.create_server(("127.0.0.1", listen_port))
print("ready", flush=True)
c, _ = srv.accept()                                   # rank 1 (connector)
for _ in range(600):                                  # rank 0 (acceptor), once it listens
    try:
        a = socket.create_connection(("127.0.0.1", target_port))
        break
    except OSError:
        time.sleep(0.05)
tag = getattr(wire, "TAG", 0)


class Evil:  # unpickling it runs a command: what a relay would put in place of an object
    def __reduce__(self):
        return (os.system, ("touch " + decoy,))


ORIGINAL = pickle.dumps(OBJECT, protocol=pickle.HIGHEST_PROTOCOL)
EVIL = pickle.dumps(Evil(), protocol=pickle.HIGHEST_PROTOCOL)
EVIL += b"\\0" * (len(ORIGINAL) - len(EVIL))  # pickle.loads stops at STOP: the rest is ignored


def recv_exact(s, n):
    b = b""
    while len(b) < n:
        k = s.recv(n - len(b))
        if not k:
            raise SystemExit(0)
        b += k
    return b


a2c = recv_exact(a, wire.CHALLENGE_SIZE)
c.sendall(a2c)
head = recv_exact(c, wire.HELLO_FIXED)
hello = head + recv_exact(c, wire.hello_size(head) - len(head))
a.sendall(hello)
head = recv_exact(a, wire.WELCOME_FIXED)
c.sendall(head + recv_exact(a, wire.welcome_size(head) - len(head)))
if mode == "abort":  # a forged ABORT, as the first frame rank 0 reads from rank 1
    msg = b"FORGED: rank 1 ran out of disk space"
    a.sendall(wire.HEADER.pack(0xFFFFFFFF, 1, wire.ABORT, 4, len(msg), 0, 0) + os.urandom(tag) + msg + os.urandom(tag))
seen = {a: 0, c: 0}
flipped = False
peer = {a: c, c: a}
buf = {a: b"", c: b""}
open_ = [a, c]
while open_:  # half-close like TCP: an end's EOF is passed on, the other direction keeps flowing
    r, _, _ = select.select(open_, [], [], 60)
    if not r:
        break
    for s in r:
        try:
            data = s.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            open_.remove(s)
            try:
                peer[s].shutdown(socket.SHUT_WR)
            except OSError:
                pass
            continue
        if mode == "flip" and s is c and not flipped and seen[c] + len(data) > 200_000:
            i = 200_000 - seen[c]
            data = data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]
            flipped = True
            print("flipped", flush=True)
        if mode == "pickle" and s is c and not flipped:  # rank 1's pickled object, as it crosses
            k = data.find(ORIGINAL)  # one small frame: it arrives in one piece on loopback
            if k >= 0:
                data = data[:k] + EVIL + data[k + len(ORIGINAL):]
                flipped = True
                print("swapped", flush=True)
        if mode == "rename" and s is a and not flipped:  # the name is the start of a 64-byte payload
            buf[a] += data
            data = b""
            k = buf[a].find(b"meshcomm-")
            if k < 0:  # pass on all but what could be the start of the name
                data, buf[a] = buf[a][:-8], buf[a][-8:]
            elif k >= 0 and len(buf[a]) >= k + 64:
                old = buf[a][k : k + 64].rstrip(b"\\0")
                new = (decoy + "/segment " + old.split(b" ")[1].decode()).encode()
                data = buf[a][:k] + new.ljust(64, b"\\0") + buf[a][k + 64 :]
                buf[a] = b""
                flipped = True
                print("renamed", old, new, flush=True)
        seen[s] += len(data)
        if data and peer[s] in open_:
            try:
                peer[s].sendall(data)
            except OSError:  # that end is gone: drop what it can no longer take, keep relaying
                pass         # the other way (crashing here would reset the survivor's link)
"""

RELAY = RELAY.replace("OBJECT_REPR", repr(OBJECT))


def _relayed_job(
    tmp_path: Path,
    mode: str,
    *,
    shm: bool = False,
    decoy: str = "-",
    size: int = 1 << 18,
    secret: str = "relay-test-secret",
    integrity: str = "auto",
    objects: bool = False,
):
    """Ranks 0 and 1, rank 1 reaching rank 0 only through the relay (its hostfile names the
    relay's port); returns (results, relay output)."""
    prog = _prog(tmp_path)
    relay = tmp_path / "relay.py"
    relay.write_text(RELAY)
    p0, p1, pr = free_ports(3)
    h0 = write_hostfile(tmp_path / "h0.json", [p0, p1])
    h1 = write_hostfile(tmp_path / "h1.json", [pr, p1])
    rp = subprocess.Popen(
        [sys.executable, str(relay), str(pr), str(p0), mode, decoy],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert rp.stdout is not None and rp.stdout.readline().strip() == "ready"
    env = {
        "MLX_TIMEOUT": "20",
        "MESHCOMM_JOB_SECRET": secret,
        "MESHCOMM_SOCKETS_SHM": "1" if shm else "0",
        "SIZE": str(size),
        "MESHCOMM_JOB_ID": "relaytest",
        "MESHCOMM_SOCKETS_INTEGRITY": integrity,
        **({"OBJECTS": "1"} if objects else {}),
    }
    procs = start_ranks(2, [prog], h0, env=env, rank_env={1: {"MLX_HOSTFILE": str(h1)}})
    try:
        results = finish(procs, timeout=120)
    finally:
        rp.kill()
        rout, rerr = rp.communicate()
    return results, rout + rerr


def test_relay_flipping_a_payload_byte_ends_in_a_clear_error_never_wrong_data(tmp_path):
    """With payload integrity every payload byte is protected. (This relay runs on loopback,
    where the default, auto, does not tag payloads: only a process of this host could relay
    there, and only if the hostfile names it. Links that leave the host get payload tags by
    default: test_auto_integrity_tags_payloads_only_on_links_that_leave_the_host.)"""
    results, relay = _relayed_job(tmp_path, "flip", integrity="payload")
    assert "flipped" in relay, relay
    for r in range(2):
        rep = _last(results, r)
        assert rep["error"] is not None, f"rank {r} returned a result through a tampered link: {rep}"
        assert "failed authentication" in rep["message"], (r, rep)
    assert _last(results, 0)["error"] == "FrameAuthError"
    assert "rank 0 stopped the job" in _last(results, 1)["message"]


def test_a_relay_on_loopback_cannot_change_payloads_under_the_default_integrity(tmp_path):
    """Loopback addresses do not mean nobody is on the path: the relay's link is loopback at
    both ends, but the ends' views of it (exchanged in the authenticated handshake) differ,
    so auto tags its payloads and the flipped byte is caught."""
    results, relay = _relayed_job(tmp_path, "flip")
    assert "flipped" in relay, relay
    for r in range(2):
        rep = _last(results, r)
        assert rep["error"] is not None, f"rank {r} returned a result through a tampered link: {rep}"
    assert _last(results, 0)["error"] == "FrameAuthError", _last(results, 0)


#: a relay another local user runs: it listens on 127.0.0.1 at rank 0's port (rank 0 listens
#: on ::1, the first address of the name), passes bytes on to [::1] and flips one of them
NAME_SQUATTER = """
import select, socket, sys, time
port = int(sys.argv[1])
srv = socket.create_server(("127.0.0.1", port))
print("ready", flush=True)
srv.settimeout(30)
try:
    c, _ = srv.accept()
except OSError:
    sys.exit(0)
print("accepted", flush=True)
for _ in range(600):  # rank 0, once it listens
    try:
        a = socket.create_connection(("::1", port))
        break
    except OSError:
        time.sleep(0.05)
seen, flipped, ends = 0, False, {a: c, c: a}
while True:
    r, _, _ = select.select([a, c], [], [], 30)
    if not r:
        break
    for s in r:
        data = s.recv(1 << 16)
        if not data:
            sys.exit(0)
        if s is c and not flipped and seen + len(data) > 200_000:
            i = 200_000 - seen
            data = data[:i] + bytes([data[i] ^ 0x40]) + data[i + 1:]
            flipped = True
            print("flipped", flush=True)
        seen += len(data) if s is c else 0
        ends[s].sendall(data)
"""


@pytest.mark.skipif(
    os.geteuid() != 0
    or not shutil.which("unshare")
    or not shutil.which("setpriv")
    or not os.path.exists("/usr/bin/python3"),
    reason="needs root (a private /etc/hosts in a mount namespace, another uid) and the system python",
)
def test_a_local_user_on_the_other_loopback_address_of_a_name_never_gets_the_link(tmp_path):
    """A hostfile name that resolves to ::1 and 127.0.0.1: rank 0 listens on ::1, another
    user (uid nobody) on 127.0.0.1 at the same port. Rank 1, started first, connects to the
    name's first address only (retrying until rank 0 listens), never to the other one."""
    hosts = tmp_path / "hosts"
    hosts.write_text("::1 duo\n127.0.0.1 duo\n")
    p0, p1 = free_ports(2)
    hf = tmp_path / "h.json"
    hf.write_text(json.dumps([{"ip": "duo", "port": p0}, {"ip": "duo", "port": p1}]))
    squatter = subprocess.Popen(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            NAME_SQUATTER,
            str(p0),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    prefix = ["unshare", "-m", "sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$@"', "sh"]
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "ready"
        env = {"MLX_TIMEOUT": "20", "MESHCOMM_JOB_SECRET": "s", "MESHCOMM_SOCKETS_SHM": "0"}
        procs = start_ranks(2, [_prog(tmp_path)], hf, env=env, ranks=[1], prefix=prefix)
        time.sleep(1.5)  # rank 1 has found nobody on ::1 and retries
        procs.update(start_ranks(2, [_prog(tmp_path)], hf, env=env, ranks=[0], prefix=prefix))
        results = finish(procs, timeout=120)
    finally:
        squatter.kill()
        sout, serr = squatter.communicate()
    assert "accepted" not in sout, "rank 1 connected to the other user's listener"
    for r in range(2):
        assert _last(results, r) == {"error": None, "ok": True, "bad": [], "values": []}, (r, results[r])


def test_relay_swapping_a_pickled_object_runs_no_code(tmp_path):
    """With a secret and header-only link integrity, a relay replaces rank 1's pickled object
    with one that runs a command when unpickled: rank 0 unpickles nothing (the core's seal
    over the object fails) and the command never runs."""
    marker = tmp_path / "code-ran"
    results, relay = _relayed_job(tmp_path, "pickle", integrity="header", objects=True, decoy=str(marker))
    assert "swapped" in relay, relay
    rep0 = _last(results, 0)
    assert rep0["error"] == "ObjectAuthError" and "failed authentication" in rep0["message"], rep0
    assert not marker.exists(), "the swapped pickle ran its command on rank 0"


@pytest.mark.parametrize("unsafe", [False, True])
def test_objects_without_a_secret_are_refused_unless_the_user_opts_in(tmp_path, unsafe):
    """No MESHCOMM_JOB_SECRET and no per-user key: nothing can authenticate another rank's
    pickle, so both ranks refuse all_gather_object before sending anything;
    MESHCOMM_UNSAFE_OBJECTS=1 allows it."""
    hf = write_hostfile(tmp_path / "h.json", free_ports(2))
    env = {
        "MLX_TIMEOUT": "20",
        "MESHCOMM_JOB_SECRET": "",
        "OBJECTS": "1",
        **NO_USER_KEY,
        **({"MESHCOMM_UNSAFE_OBJECTS": "1"} if unsafe else {}),
    }
    results = finish(start_ranks(2, [_prog(tmp_path)], hf, env=env), timeout=120)
    for r in range(2):
        rc, out, err = results[r]
        if unsafe:
            assert _last(results, r)["ok"] is True, (r, out[-2000:], err[-2000:])
        else:
            assert rc != 0 and "ConfigError" in err and "MESHCOMM_UNSAFE_OBJECTS=1" in err, (r, err[-2000:])
            assert "arbitrary code execution" in err, err[-2000:]


def test_relay_forging_an_abort_is_rejected_not_shown_as_a_ranks_error(tmp_path):
    results, _relay = _relayed_job(tmp_path, "abort", size=8)
    for r in range(2):
        rep = _last(results, r)
        assert "FORGED" not in json.dumps(rep) and "disk space" not in json.dumps(rep), (r, rep)
        assert rep["error"] is not None, (r, rep)
    rep0 = _last(results, 0)
    assert rep0["error"] == "FrameAuthError" and "failed authentication" in rep0["message"], rep0


def test_relay_rewriting_the_shared_memory_name_opens_nothing_outside_dev_shm(tmp_path):
    """The relay points rank 1 at a decoy directory outside /dev/shm holding a file of the
    segment's size: rank 1 must neither open it nor create a FIFO there."""
    decoy = Path(f"/tmp/mcdecoy{secrets.token_hex(3)}")
    decoy.mkdir(mode=0o700)
    try:
        target = "../.." + str(decoy)
        sentinel = b"\xab" * (8 * 16 * 2 + 4 * 512 * 1024)  # the size of 2 ranks' segment, not zeros
        (decoy / "segment").write_bytes(sentinel)
        results, relay = _relayed_job(tmp_path, "rename", shm=True, decoy=target, size=8)
        assert "renamed" in relay, relay
        assert sorted(p.name for p in decoy.iterdir()) == ["segment"], "something was created next to the decoy"
        assert (decoy / "segment").read_bytes() == sentinel, "the decoy was opened and written to"
        for r in range(2):
            rep = _last(results, r)
            assert rep["error"] is None and rep["ok"] or "failed authentication" in rep.get("message", ""), (r, rep)
    finally:
        shutil.rmtree(decoy, ignore_errors=True)


# -- 3. shared-memory names and the squatter ----------------------------------------------------


def test_names_and_sizes_from_a_peer_are_checked():
    from meshcomm_sockets import shm

    assert shm.check_name(shm.new_name(None), None).startswith("meshcomm-nojob-")
    assert shm.check_name(shm.new_name("abc123"), "abc123")
    for bad in (
        "../../etc/x",
        "meshcomm-nojob-../../x",
        "meshcomm-nojob-0123456789ab/x",
        "meshcomm-other-0123456789ab",
        "meshcomm-nojob-0123456789AB",
        "meshcomm-nojob-0123456789abc",
        "/dev/shm/meshcomm-nojob-0123456789ab",
    ):
        with pytest.raises(shm.ShmSetupError, match="not of the form"):
            shm.check_name(bad, None)
    assert shm.check_piece("524288") == 524288
    for bad in ("", "abc", "-4096", "4095", "4097", str(1 << 40), "1e6", " 4096", "4096\n"):
        with pytest.raises(shm.ShmSetupError, match="slot of"):
            shm.check_piece(bad)


def test_a_segment_of_the_wrong_size_or_owner_is_a_clear_error(tmp_path):
    from meshcomm_sockets import engine, shm

    name = shm.new_name("sizecheck" + secrets.token_hex(3))
    d = SHM / name
    d.mkdir(mode=0o700)
    try:
        (d / "segment").write_bytes(b"\0" * 4096)  # far smaller than two ranks' 4 KiB slots need
        fab = engine.Fabric(1, 2, {}, 5.0)
        with pytest.raises(shm.ShmSetupError, match="4096 bytes where 2 local ranks"):
            shm.ShmGroup(fab, [0, 1], name, 4096, create=False)
        os.chmod(d, 0o755)
        with pytest.raises(shm.ShmSetupError, match="not a private directory"):
            shm.ShmGroup(fab, [0, 1], name, 4096, create=False)
    finally:
        shutil.rmtree(d, ignore_errors=True)


SQUATTER = """
import os, sys, time
prefix, until = sys.argv[1], time.monotonic() + float(sys.argv[2])
seen, made, denied = set(), 0, 0
while time.monotonic() < until:
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        continue
    for n in names:
        if not n.startswith(prefix) or ".fifo" in n or n in seen:
            continue
        seen.add(n)
        for i in range(4):
            for p in (f"/dev/shm/{n}.fifo{i}", f"/dev/shm/{n}/fifo{i}", f"/dev/shm/{n}/segment"):
                try:
                    os.mkfifo(p, 0o666)
                    made += 1
                except OSError:
                    denied += 1
print(f"seen {len(seen)} made {made} denied {denied}", flush=True)
"""


def test_another_user_cannot_squat_the_fifos(tmp_path):
    """A process of uid 65534 watches /dev/shm and creates FIFOs under every name of the
    job the moment it appears; each job must still use shared memory (or log why not)."""
    if os.geteuid() != 0 or not Path("/usr/bin/python3").exists():
        pytest.skip("needs root (to run the squatter as uid 65534) and /usr/bin/python3")
    job = "squat" + secrets.token_hex(4)
    prefix = f"meshcomm-{job}-"
    squatter = subprocess.Popen(
        ["/usr/bin/python3", "-c", SQUATTER, prefix, "90"],
        user=65534,
        group=65534,
        extra_groups=[],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    prog = _prog(tmp_path)
    paths = []
    try:
        time.sleep(0.5)
        for i in range(6):
            hf = write_hostfile(tmp_path / f"h{i}.json", free_ports(2))
            env = {"MLX_TIMEOUT": "30", "MESHCOMM_JOB_SECRET": "s", "SIZE": "8", "MESHCOMM_JOB_ID": job}
            results = finish(start_ranks(2, [prog], hf, env=env), timeout=120)
            for r in range(2):
                assert _last(results, r)["ok"] is True, results[r]
            path = [x["path"] for x in _reports(results[0][1]) if "path" in x][0]
            logged = "using TCP" in results[0][2] + results[1][2] or "shared memory is off" in results[0][2]
            assert path == "local" or logged, f"job {i} silently used {path}: {results[0][2][-2000:]}"
            paths.append(path)
    finally:
        squatter.kill()
        out, err = squatter.communicate()
        for p in SHM.glob(prefix + "*"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    print(f"\nsquatter: {out.strip()} {err.strip()[-300:]}; paths {paths}")
    assert paths == ["local"] * 6, paths


# -- 4. handshake flood, descriptors ------------------------------------------------------------

LIMITED = """
import resource, runpy, sys
soft = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_flood_of_silent_connections_during_start_up_does_not_stop_the_job(tmp_path):
    """Rank 0 runs with the common open-file limit of 1024; 1000 connections that never say
    anything arrive before rank 1 starts."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("the test process needs more than 1100 descriptors")
    resource.setrlimit(
        resource.RLIMIT_NOFILE,
        (max(resource.getrlimit(resource.RLIMIT_NOFILE)[0], 1200), resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
    )
    prog = _prog(tmp_path)
    limited = tmp_path / "limited.py"
    limited.write_text(LIMITED)
    ports = free_ports(2)
    hf = write_hostfile(tmp_path / "h.json", ports)
    env = {"MLX_TIMEOUT": "60", "MESHCOMM_JOB_SECRET": "s", "SIZE": "8"}
    procs = start_ranks(2, [str(limited), "1024", prog], hf, ranks=[0], env=env)
    flood: list[socket.socket] = []
    try:
        connect_when_listening(ports[0]).close()  # rank 0 listens
        poller = select.poll()
        for _ in range(1000):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", ports[0]))
            flood.append(s)
            poller.register(s, select.POLLOUT)
        done: set[int] = set()  # connected (rank 0 accepted them; SYNs beyond its backlog are retried)
        deadline = time.monotonic() + 40
        while len(done) < 990 and time.monotonic() < deadline:
            for fd, _ev in poller.poll(500):
                poller.unregister(fd)
                if socket.socket(fileno=os.dup(fd)).getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    done.add(fd)
        print(f"\nflood: {len(done)} of 1000 connections reached rank 0")
        assert len(done) >= 990, f"only {len(done)} connections got through"
        procs.update(start_ranks(2, [prog], hf, ranks=[1], env=env))
        results = finish(procs, timeout=150)
    finally:
        for s in flood:
            s.close()
    for r in range(2):
        assert _last(results, r)["ok"] is True, (r, results[r][1][-2000:], results[r][2][-3000:])
    assert "Too many open files" not in results[0][2]
    assert "handshakes were already pending" in results[0][2], results[0][2][-3000:]


EXHAUST = """
import json, os, socket, sys
from meshcomm.protocol.errors import DistributedError
from meshcomm_sockets.connect import establish, open_listener
from meshcomm_sockets.hostfile import Peer
peers = [Peer(ip="127.0.0.1", port=int(sys.argv[1])), Peer(ip="127.0.0.1", port=int(sys.argv[2]))]
listener = open_listener(0, peers[0], None, 2)
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
print("full", flush=True)
try:
    establish(peers, 0, secret=b"s", version="v", timeout=20, listener=listener)
    print(json.dumps({"error": None}), flush=True)
except Exception as exc:
    for fd in held:
        os.close(fd)
    print(json.dumps({"error": type(exc).__name__, "message": str(exc),
                      "distributed": isinstance(exc, DistributedError)}), flush=True)
"""


def test_running_out_of_descriptors_is_a_distributed_error_naming_the_limit(tmp_path):
    prog = tmp_path / "exhaust.py"
    prog.write_text(EXHAUST)
    limited = tmp_path / "limited.py"
    limited.write_text(LIMITED)
    ports = free_ports(2)
    p = subprocess.Popen(
        [sys.executable, str(limited), "64", str(prog), str(ports[0]), str(ports[1])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "full", p.stderr.read() if p.stderr else ""
        # a knock for the full process to accept; its accept fails, it closes its listener and
        # the kernel resets the queued connection, on a loaded machine before connect() returns
        knock: socket.socket | None = None
        try:
            knock = socket.create_connection(("127.0.0.1", ports[0]), timeout=10)
        except ConnectionResetError:
            pass
        out, err = p.communicate(timeout=60)
        if knock is not None:
            knock.close()
    finally:
        p.kill()
    rep = json.loads(out.splitlines()[-1])
    assert rep["distributed"] is True, (rep, err[-2000:])
    assert "Too many open files" in rep["message"] and "open-file limit of this process: 64" in rep["message"], rep
    assert "ulimit -n" in rep["message"]


# -- 8. no leftovers when shared-memory set-up fails --------------------------------------------

BREAK_SHM = """
import os, runpy, sys
from meshcomm_sockets import shm
rank, how, prog = int(os.environ["MLX_RANK"]), sys.argv[1], sys.argv[2]
if how == "follower-exits" and rank == 1:
    def boom(self, *a, **k):
        os._exit(7)
    shm.ShmGroup.__init__ = boom
elif how == "follower-raises" and rank == 1:
    def boom(self, *a, **k):
        raise RuntimeError("injected failure in connect_fifos")
    shm.ShmGroup.connect_fifos = boom
elif how == "leader-raises" and rank == 0:
    def boom(self, *a, **k):
        raise RuntimeError("injected failure in connect_fifos")
    shm.ShmGroup.connect_fifos = boom
sys.argv = [prog]
runpy.run_path(prog, run_name="__main__")
"""


@pytest.mark.parametrize("how", ["follower-exits", "follower-raises", "leader-raises"])
def test_a_rank_failing_during_shared_memory_set_up_leaves_nothing_in_dev_shm(tmp_path, how):
    """Without the launcher (nothing would clean up after the job): the ranks that are
    still running remove the job's directory in ``finally``."""
    job = "leak" + secrets.token_hex(4)
    brk = tmp_path / "break.py"
    brk.write_text(BREAK_SHM)
    prog = _prog(tmp_path)
    hf = write_hostfile(tmp_path / "h.json", free_ports(3))
    env = {"MLX_TIMEOUT": "20", "MESHCOMM_JOB_SECRET": "s", "SIZE": "8", "MESHCOMM_JOB_ID": job}
    results = finish(start_ranks(3, [str(brk), how, prog], hf, env=env), timeout=120)
    left = sorted(p.name for p in SHM.glob(f"meshcomm-{job}-*"))
    for p in SHM.glob(f"meshcomm-{job}-*"):
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    assert left == [], (left, {r: results[r][2][-1500:] for r in results})
    survivors = [r for r in range(3) if results[r][0] == 0 and _reports(results[r][1])]
    assert survivors, results
    for r in survivors:
        rep = _last(results, r)
        assert rep["error"] is not None, (r, rep)


def test_auto_integrity_tags_payloads_only_on_links_that_leave_the_host():
    """auto leaves payloads untagged only on a loopback link that both ends saw alike in the
    handshake (direct: no relay on it), and tags all others."""
    from meshcomm_sockets import engine

    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    try:
        assert engine.is_loopback(a)
        fab = engine.Fabric(0, 2, {1: a}, 5.0, payload_integrity=None, direct={1})
        assert fab.links[1].seal_payload is False
        assert engine.Fabric(0, 2, {1: a}, 5.0, payload_integrity=None).links[1].seal_payload is True
        assert engine.Fabric(0, 2, {1: a}, 5.0, payload_integrity=True).links[1].seal_payload is True
    finally:
        a.close()
        b.close()
    # a connection whose peer is not a loopback address: a UDP socket "connected" to a
    # documentation address has that peer name without sending anything
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        u.connect(("192.0.2.1", 9))
        assert not engine.is_loopback(u)
        assert engine.Fabric(0, 2, {1: u}, 5.0, payload_integrity=None, direct={1}).links[1].seal_payload is True
    finally:
        u.close()

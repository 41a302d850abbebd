"""Issue 33: a one-host job without MESHCOMM_JOB_SECRET authenticates with the per-user key.

* the attack: another local user (uid 65534) joins a hand-started 2-rank sockets job that has
  no secret by claiming rank 1 with a HELLO under the empty secret -> refused, and the real
  rank 1 joins and gets the right sum;
* the key file: created 0600 in a 0700 directory and reused, the same for ranks racing to
  create it; a key file that is group/other-readable, another user's or a symbolic link is a
  ConfigError naming the path and the fix; no usable home -> no key (the old warning, saying why);
* objects in a one-host job using the key work without MESHCOMM_UNSAFE_OBJECTS;
* multi-host jobs (any non-loopback address) and MESHCOMM_REQUIRE_SECRET are unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from jobs import finish, free_ports, start_ranks, write_hostfile
from meshcomm.protocol.errors import ConfigError
from meshcomm.runtime.jobsecret import JobSecretSettings, check_job_secret
from meshcomm.runtime.userkey import KeyUnavailable, all_loopback, user_key, user_key_path

wire = pytest.importorskip("meshcomm_sockets.wire")

PROG = """
import json, os
import numpy as np
import meshcomm as mc

try:
    g = mc.init(strict=True)
    got = mc.all_sum(np.full(8, g.rank() + 1.0, np.float32))
    out = {"error": None, "sum": got.tolist()}
    if os.environ.get("OBJECTS"):
        out["objects"] = mc.all_gather_object({"rank": g.rank()})
    print(json.dumps(out), flush=True)
except mc.DistributedError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
"""

#: the stranger, run as uid 65534 with the system python (argv: port, version, HELLO and
#: CHALLENGE layouts): connects to rank 0, claims rank 1 of 2 with a HELLO authenticated
#: under the empty secret (all a stranger can compute) and prints the reply in hex
ATTACKER = r"""
import hashlib, hmac, socket, struct, sys, time
port, version, hello_fmt, challenge_fmt = int(sys.argv[1]), sys.argv[2].encode(), sys.argv[3], sys.argv[4]
magic, proto = b"MESHCOMM", int(sys.argv[5])
deadline = time.monotonic() + 60
while True:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
s.settimeout(10)
want, data = struct.calcsize(challenge_fmt), b""
while len(data) < want:
    data += s.recv(want - len(data))
_, _, nonce_a = struct.unpack(challenge_fmt, data)
body = struct.pack(hello_fmt, magic, proto, 2, 1, 0, b"n" * 16, len(version)) + version
s.sendall(body + hmac.new(b"", nonce_a + body, hashlib.sha256).digest())
reply = b""
try:
    while chunk := s.recv(4096):
        reply += chunk
        if len(reply) >= 4096:
            break
except OSError:
    pass
print(reply.hex(), flush=True)
"""


def _key_env(tmp_path: Path) -> dict[str, str]:
    """A home and config directory of the test's own (the real home is never touched)."""
    (tmp_path / "home").mkdir(exist_ok=True)
    return {"HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "config")}


def _report(result: tuple[int, str, str]) -> dict:
    lines = [ln for ln in result[1].splitlines() if ln.startswith("{")]
    assert lines, (result[0], result[1][-2000:], result[2][-3000:])
    return json.loads(lines[-1])


def _prog(tmp_path: Path) -> str:
    p = tmp_path / "prog.py"
    p.write_text(PROG)
    return str(p)


def _welcome_ok(reply: bytes) -> bool:
    """Whether ``reply`` is a WELCOME admitting the stranger (authenticated under the empty secret)."""
    try:  # rank 0's first frames may follow the WELCOME in the same read
        size = wire.welcome_size(reply[: wire.WELCOME_FIXED])
        return wire.parse_welcome(b"", b"n" * 16, reply[:size]).status == wire.STATUS_OK
    except wire.HandshakeError:
        return False


def test_another_local_user_cannot_join_a_hand_started_job_without_a_secret(tmp_path):
    if os.geteuid() != 0 or not Path("/usr/bin/python3").exists() or not shutil.which("setpriv"):
        pytest.skip("needs root (to run the stranger as uid 65534), setpriv and /usr/bin/python3")
    from meshcomm_sockets.plugin import _version

    ports = free_ports(2)
    hf = write_hostfile(tmp_path / "h.json", ports)
    env = {"MLX_TIMEOUT": "20", "MESHCOMM_JOB_SECRET": "", **_key_env(tmp_path)}
    procs = start_ranks(2, [_prog(tmp_path)], hf, ranks=[0], env=env)
    try:
        attacker = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "/usr/bin/python3",
                "-c",
                ATTACKER,
                str(ports[0]),
                _version(4096, "auto"),
                wire._HELLO.format,
                wire._CHALLENGE.format,
                str(wire.PROTOCOL),
            ],
            capture_output=True,
            text=True,
            timeout=90,
            cwd="/",
        )
        assert attacker.returncode == 0, attacker.stderr[-2000:]
        reply = bytes.fromhex(attacker.stdout.strip())
        assert not _welcome_ok(reply), "the stranger (uid 65534) completed the handshake as rank 1"
        procs.update(start_ranks(2, [_prog(tmp_path)], hf, ranks=[1], env=env))
    finally:
        results = finish(procs, timeout=90)
    for r in range(2):
        rep = _report(results[r])
        assert rep["error"] is None and rep["sum"] == [3.0] * 8, (r, rep, results[r][2][-2000:])
    assert "rejected a connection" in results[0][2], results[0][2][-2000:]
    key = Path(env["XDG_CONFIG_HOME"]) / "meshcomm" / "job-key"
    assert f"authenticates with the per-user key at {key}" in results[0][2], results[0][2][-2000:]
    assert "per-user key" not in results[1][2], results[1][2][-2000:]


def test_objects_work_without_unsafe_objects_in_a_one_host_job_using_the_key(tmp_path):
    hf = write_hostfile(tmp_path / "h.json", free_ports(2))
    env = {"MLX_TIMEOUT": "20", "MESHCOMM_JOB_SECRET": "", "OBJECTS": "1", **_key_env(tmp_path)}
    env.pop("MESHCOMM_UNSAFE_OBJECTS", None)
    results = finish(start_ranks(2, [_prog(tmp_path)], hf, env=env), timeout=90)
    for r in range(2):
        rep = _report(results[r])
        assert rep["error"] is None and rep["objects"] == [{"rank": 0}, {"rank": 1}], (r, rep, results[r][2][-2000:])


# -- the key file --------------------------------------------------------------------------------


def test_the_key_file_is_created_0600_in_a_0700_directory_and_reused(tmp_path):
    env = _key_env(tmp_path)
    key, path = user_key(env)
    assert path == tmp_path / "config" / "meshcomm" / "job-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert len(key) == 64 and user_key(env) == (key, path)
    assert sorted(os.listdir(path.parent)) == ["job-key"]  # no temporary file left
    assert user_key_path({"HOME": env["HOME"]}) == Path(env["HOME"]) / ".config" / "meshcomm" / "job-key"


def test_ranks_creating_the_key_at_once_all_get_the_same_key(tmp_path):
    env = _key_env(tmp_path)
    with ThreadPoolExecutor(8) as pool:
        keys = {k for k, _ in pool.map(lambda _: user_key(env), range(32))}
    assert len(keys) == 1, keys


@pytest.mark.parametrize("bad", ["mode 644", "another uid", "symlink"])
def test_a_key_file_others_could_read_or_replace_is_refused(tmp_path, bad):
    env = _key_env(tmp_path)
    _, path = user_key(env)
    if bad == "mode 644":
        path.chmod(0o644)
        expect = "has mode 644"
    elif bad == "another uid":
        if os.geteuid() != 0:
            pytest.skip("needs root to give the file to another uid")
        os.chown(path, 65534, 65534)
        expect = "belongs to uid 65534"
    else:
        target = tmp_path / "elsewhere"
        target.write_text("0" * 64)
        target.chmod(0o600)
        path.unlink()
        path.symlink_to(target)
        expect = "is a symbolic link"
    with pytest.raises(ConfigError) as err:
        user_key(env)
    assert str(path) in str(err.value) and expect in str(err.value) and "rm " in str(err.value), err.value


def test_no_home_means_no_key_and_the_warning_says_why(caplog):
    with pytest.raises(KeyUnavailable, match="HOME is not set"):
        user_key_path({})
    log = logging.getLogger("test-user-key")
    with caplog.at_level(logging.WARNING, logger="test-user-key"), pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", "")
        mp.setenv("XDG_CONFIG_HOME", "")
        got = check_job_secret(
            JobSecretSettings(),
            who="test backend",
            rank=0,
            size=2,
            warning="no secret, no-home case",
            log=log,
            hosts=["127.0.0.1"],
        )
    assert got is None and "The per-user key file was not used: HOME is not set" in caplog.text, caplog.text


def test_only_one_host_jobs_use_the_key_and_require_secret_still_wants_a_secret(tmp_path, caplog):
    assert all_loopback(["127.0.0.1", "localhost", "::1", "127.8.9.10"])
    assert not all_loopback(["127.0.0.1", "192.0.2.7"]) and not all_loopback([])
    log = logging.getLogger("test-user-key")
    with caplog.at_level(logging.WARNING, logger="test-user-key"), pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
        kw = {"who": "test backend", "rank": 0, "size": 2, "log": log}
        assert (
            check_job_secret(JobSecretSettings(), warning="multi-host case", hosts=["127.0.0.1", "192.0.2.7"], **kw)
            is None
        )
        assert "multi-host case" in caplog.text and not (tmp_path / "config").exists()
        assert check_job_secret(JobSecretSettings(), warning="one-host case", hosts=["localhost"], **kw)
        assert "one-host case" not in caplog.text and "other users of this machine cannot join" in caplog.text
        with pytest.raises(ConfigError, match="MESHCOMM_REQUIRE_SECRET is set"):
            check_job_secret(JobSecretSettings(require_secret=True), warning="w", hosts=["127.0.0.1"], **kw)
        assert check_job_secret(JobSecretSettings(secret="s"), warning="w", hosts=["127.0.0.1"], **kw) is None

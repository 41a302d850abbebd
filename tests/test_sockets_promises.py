"""The sockets backend's part of issue 13, on real processes (shared memory on and off):

* ranks disagreeing on a broadcast's root get CollectiveMismatchError on every rank;
* sequence numbers wrap around 2**32 (TCP frames and shared-memory pieces);
* huge MLX_TIMEOUT values are waited for in slices (no OverflowError);
* a /dev/shm too small for the segment means a clear warning and TCP, never SIGBUS;
* blame: a failing rank tells its peers (ABORT) what happened, a rank that fails mid-frame
  finishes the frame first so nobody blames it for a third rank's death, and a rank resumed
  after SIGSTOP is told its peers gave up on it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from jobs import ROOT, finish, free_ports, start_ranks, write_hostfile

PROG = """
import json, os, sys, time
import numpy as np
import meshcomm as mc

mode = sys.argv[1]
g = mc.init(strict=True)
t = g.transport
r, n = g.rank(), g.size()


def say(**kw):
    print(json.dumps(kw), flush=True)


say(rank=r, path=getattr(getattr(t, "path", None), "name", "?"))
t0 = time.monotonic()
try:
    if mode == "root-each":  # every rank names itself the root
        got = mc.broadcast(np.full(int(os.environ.get("SIZE", "8")), float(r), np.float32), r)
        say(error=None, result=float(got[0]))
    elif mode == "root-one":  # the last rank disagrees with the others
        got = mc.broadcast(np.full(int(os.environ.get("SIZE", "8")), float(r), np.float32), int(r == n - 1))
        say(error=None, result=float(got[0]))
    elif mode == "calls":  # a mix of everything, with known answers
        ok = True
        for i in range(int(os.environ.get("ROUNDS", "4"))):
            for size in (5, 300_000):
                x = np.arange(size, dtype=np.float64) + r
                ok &= bool(np.array_equal(mc.all_sum(x), np.arange(size) * n + n * (n - 1) / 2))
                ok &= bool(np.array_equal(mc.broadcast(x, i % n), np.arange(size, dtype=np.float64) + i % n))
                ok &= bool(np.array_equal(mc.all_gather(np.full(3, r)), np.repeat(np.arange(n), 3)))
                ok &= bool(np.array_equal(mc.all_max(np.full(size, r)), np.full(size, n - 1)))
            dst, src = (r + 1) % n, (r - 1) % n
            if r % 2 == 0:
                mc.send(np.full(4, r), dst)
                got = mc.recv((4,), np.int64, src)
            else:
                got = mc.recv((4,), np.int64, src)
                mc.send(np.full(4, r), dst)
            ok &= bool((got == src).all())
            if r == 1 and os.environ.get("LATE"):
                time.sleep(float(os.environ["LATE"]))  # the others wait for it in the kernel
            g.barrier()
        say(error=None, ok=ok, seconds=time.monotonic() - t0)
    elif mode == "reshaped":  # the last rank passes the same number of elements in another shape
        shape = tuple(int(d) for d in os.environ["SHAPE"].split(","))
        mine = (shape[::-1] if len(shape) > 1 else ()) if r == n - 1 else shape
        x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(mine) + r
        got = getattr(mc, os.environ["OP"])(x)
        say(error=None, shape=list(np.shape(got)))
    elif mode == "abort":  # rank 1's program fails while the others wait in an all_sum
        if r == 1:
            time.sleep(0.5)
            t.abort(3, "KeyError: 'weights'")
            time.sleep(float(os.environ.get("STAY", "6")))  # stays alive: only the ABORT tells
            say(error=None)
        else:
            mc.all_sum(np.ones(1 << 16, np.float32))
            say(error=None)
    elif mode == "loop":
        x = np.ones(int(os.environ.get("SIZE", str(1 << 18))), np.float32)
        i = 0
        while time.monotonic() - t0 < float(os.environ.get("LOOP_SECONDS", "120")):
            mc.all_sum(x)
            if i == 0:
                say(ready=r)
            i += 1
        say(error=None)
except mc.DistributedError as exc:
    say(error=type(exc).__name__, peer=getattr(exc, "peer", None), elapsed=time.monotonic() - t0,
        t=time.time(), message=str(exc))
"""

PATHS = {"shm": {}, "tcp": {"MESHCOMM_SOCKETS_SHM": "0"}}


def _lines(out: str) -> list[dict]:
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def _report(results: dict, r: int) -> dict:
    rc, out, err = results[r]
    lines = [ln for ln in _lines(out) if "error" in ln]
    assert lines, f"rank {r} reported nothing (rc {rc}): {out[-2000:]} {err[-3000:]}"
    return lines[0]


def _job(
    tmp_path: Path,
    n: int,
    mode: str,
    env: dict[str, str],
    *,
    timeout: float = 180,
    rank_env: dict[int, dict[str, str]] | None = None,
) -> dict[int, tuple[int, str, str]]:
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    hf = write_hostfile(tmp_path / "h.json", free_ports(n))
    return finish(start_ranks(n, [str(prog), mode], hf, env=env, rank_env=rank_env), timeout=timeout)


def _path(results: dict, r: int) -> str:
    return _lines(results[r][1])[0]["path"]


# -- 1. the root is part of every call's descriptor ---------------------------------------------


@pytest.mark.parametrize("path", ["shm", "tcp"])
@pytest.mark.parametrize(
    "mode,size",
    [("root-each", 8), ("root-one", 8), ("root-one", 1 << 20)],
    ids=["each-own-root", "one-disagrees", "one-disagrees-4MiB"],
)
def test_ranks_disagreeing_on_the_root_all_raise_a_mismatch(tmp_path, path, mode, size):
    results = _job(tmp_path, 3, mode, {"MLX_TIMEOUT": "20", "SIZE": str(size), **PATHS[path]})
    for r in range(3):
        assert _path(results, r) == ("local" if path == "shm" else "tcp")
        first = _report(results, r)
        assert first["error"] == "CollectiveMismatchError", (r, first, results[r][2][-2000:])
        assert first["elapsed"] < 20, first
        assert "root" in first["message"], first


# -- 1b. the shape is part of every call (never reinterpreted) ----------------------------------

#: how each path is chosen: the compiled loop (when installed), the pure-Python loop, TCP
#: only, and two "hosts" (TCP between them, shared memory within)
SHAPE_PATHS = {
    "c": ({}, None),
    "python": ({"MESHCOMM_SOCKETS_NATIVE": "0"}, None),
    "tcp": (PATHS["tcp"], None),
    "hier": ({}, {r: {"MESHCOMM_HOST_ID": "ab"[r // 2]} for r in range(3)}),
}


@pytest.mark.parametrize(
    "op,shape", [("all_sum", "6,3"), ("all_gather", "6,3"), ("all_to_all", "6,3"), ("all_sum", "1")]
)
@pytest.mark.parametrize("path", list(SHAPE_PATHS))
def test_same_count_in_another_shape_is_a_mismatch_on_every_path(tmp_path, path, op, shape):
    """Rank 2 passes (3, 6) where ranks 0 and 1 pass (6, 3) (or () against (1,)): the same
    18 float32s. Every rank raises CollectiveMismatchError, none returns an array of its own
    shape holding the others' reinterpreted rows."""
    if shape == "1" and path != "c":
        pytest.skip("() against (1,) once is enough: the key is the same on every path")
    env, rank_env = SHAPE_PATHS[path]
    results = _job(tmp_path, 3, "reshaped", {"MLX_TIMEOUT": "20", "OP": op, "SHAPE": shape, **env}, rank_env=rank_env)
    reports = [_report(results, r) for r in range(3)]
    assert [rep["error"] for rep in reports] == ["CollectiveMismatchError"] * 3, reports
    assert any("another shape" in rep["message"] for rep in reports), reports


# -- 2. sequence numbers wrap around ------------------------------------------------------------


@pytest.mark.parametrize("layout", ["shm", "tcp", "hier"])
def test_calls_across_the_sequence_number_wrap(tmp_path, layout):
    """Every counter starts 5 below 2**32 (a test setting); dozens of calls cross the wrap."""
    env = {
        "MLX_TIMEOUT": "30",
        "MESHCOMM_SOCKETS_TEST_SEQ_START": str(2**32 - 5),
        "ROUNDS": "3",
        **PATHS["tcp" if layout == "tcp" else "shm"],
    }
    rank_env = {r: {"MESHCOMM_HOST_ID": "ab"[r // 2]} for r in range(3)} if layout == "hier" else None
    results = _job(tmp_path, 3, "calls", env, rank_env=rank_env)
    want = {"shm": "local", "tcp": "tcp", "hier": "hier"}[layout]
    for r in range(3):
        rc, out, err = results[r]
        assert _path(results, r) == want, out
        rep = _report(results, r)
        assert rc == 0 and rep["error"] is None and rep["ok"] is True, (r, rep, err[-3000:])


def test_shared_memory_piece_numbers_alternate_parity_across_the_wrap():
    from meshcomm_sockets.shm import SEQ_WRAP, next_piece

    seq, seen = SEQ_WRAP - 3, []
    for _ in range(6):
        seq = next_piece(seq)
        seen.append(seq)
    assert seen == [SEQ_WRAP - 2, SEQ_WRAP - 1, SEQ_WRAP, 1, 2, 3]
    assert all((a ^ b) & 1 for a, b in zip(seen, seen[1:], strict=False)), "the two slots must alternate"


# -- 3. huge timeouts ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_huge_timeout_on_a_short_job(tmp_path, path):
    """MLX_TIMEOUT=2000000 (the core's cap is about 2147483 s): ranks start late and wait for a
    slow rank in the kernel (no spinning), every result is right."""
    n = 3
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    hf = write_hostfile(tmp_path / "h.json", free_ports(n))
    env = {"MLX_TIMEOUT": "2000000", "MESHCOMM_SOCKETS_SPIN_US": "0", "LATE": "0.3", "ROUNDS": "2", **PATHS[path]}
    procs = start_ranks(n, [str(prog), "calls"], hf, ranks=[0, 1], env=env)
    time.sleep(1.0)  # ranks 0 and 1 wait for rank 2 at start-up
    procs.update(start_ranks(n, [str(prog), "calls"], hf, ranks=[2], env=env))
    results = finish(procs, timeout=180)
    for r in range(n):
        rc, out, err = results[r]
        rep = _report(results, r)
        assert rc == 0 and rep["error"] is None and rep["ok"] is True, (r, out, err[-3000:])


@pytest.mark.parametrize("timeout", [2147483.0, 1e10, float("inf")])
def test_the_transfer_loop_waits_in_slices_for_any_timeout(timeout):
    """The engine's wait on a real socket pair: the peer answers after a moment; no
    OverflowError whatever the timeout (poll() takes an int of milliseconds)."""
    from meshcomm_sockets import engine, wire

    with socket.create_server(("127.0.0.1", 0)) as srv:
        b = socket.create_connection(srv.getsockname()[:2])
        a, _ = srv.accept()
    try:
        fab = engine.Fabric(0, 2, {1: a}, timeout)
        a.setblocking(False)
        call = engine.Call(0, 1, wire.OP_CODES["send"], 0, 8, "world")
        target = memoryview(bytearray(8))
        fab.post_recv(fab.links[1], call, target, 1 << 20)
        mac = wire.Mac(b"")  # the engine's keys when none are given
        frame = mac.seal(0, wire.HEADER.pack(0, 1, call.op, 0, 8, 0, 8)) + b"abcdefgh" + mac.tag(b"P", 0, b"abcdefgh")
        later = threading.Timer(0.3, lambda: b.sendall(frame))
        later.start()
        fab.progress([fab.links[1]])
        later.join()
        assert bytes(target) == b"abcdefgh"
    finally:
        a.close()
        b.close()


# -- 4. a /dev/shm too small for the segment ---------------------------------------------------


def test_small_dev_shm_means_a_clear_warning_and_tcp_never_sigbus(tmp_path):
    """The job runs in a private mount namespace whose /dev/shm is an 8 MiB tmpfs; the
    segment of 3 ranks with 4 MiB slots needs 24 MiB."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to mount a small tmpfs on /dev/shm privately")
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    launch = f"{sys.executable} -m meshcomm launch -n 3 --backend sockets -- {prog} calls"
    script = (
        f"mount -t tmpfs -o size=8m meshcomm-test /dev/shm || exit 77\n{launch}\nrc=$?\n"
        "echo \"LEFT: $(ls -A /dev/shm | tr '\\n' ' ')\"\nexit $rc\n"
    )
    env = {**os.environ, "MLX_TIMEOUT": "60", "MESHCOMM_SOCKETS_SHM_PIECE_KIB": "4096", "ROUNDS": "2"}
    res = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    if res.returncode == 77:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace: {res.stderr[-500:]}")
    assert res.returncode == 0, (res.returncode, res.stdout[-3000:], res.stderr[-3000:])
    reports = [json.loads(ln.split("] ", 1)[1]) for ln in res.stdout.splitlines() if "] {" in ln]
    assert sorted(x["path"] for x in reports if "path" in x) == ["tcp"] * 3, res.stdout
    assert [x["ok"] for x in reports if "ok" in x] == [True] * 3, res.stdout
    text = res.stdout + res.stderr
    assert "needs 24.0 MiB" in text and "--shm-size=" in text and "MESHCOMM_SOCKETS_SHM=0" in text, text[-3000:]
    assert text.count("cannot hold the shared-memory segment") == 1, "one warning, from the host's first rank"
    assert "LEFT: \n" in res.stdout or res.stdout.rstrip().endswith("LEFT:"), res.stdout[-500:]


# -- 5. blame ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_a_failing_rank_tells_its_peers_at_once(tmp_path, path):
    """Rank 1's program fails (the core calls Backend.abort) but the process stays alive a
    while: the waiting ranks raise PeerLostError naming rank 1 and its reason at once, not
    after MLX_TIMEOUT, and not by noticing a closed connection."""
    results = _job(tmp_path, 3, "abort", {"MLX_TIMEOUT": "60", "STAY": "8", **PATHS[path]})
    for r in (0, 2):
        first = _report(results, r)
        assert first["error"] == "PeerLostError" and first["peer"] == 1, (r, first)
        assert "KeyError: 'weights'" in first["message"] and "exit code 3" in first["message"], first
        assert first["elapsed"] < 8, "the ABORT must arrive while rank 1 is still alive"


def _start_loop(
    tmp_path: Path, n: int, env: dict[str, str], rank_env: dict[int, dict[str, str]] | None = None
) -> dict[int, subprocess.Popen[str]]:
    prog = tmp_path / "prog.py"
    prog.write_text(PROG)
    hf = write_hostfile(tmp_path / "h.json", free_ports(n))
    procs = start_ranks(n, [str(prog), "loop"], hf, env=env, rank_env=rank_env)
    deadline = time.monotonic() + 120
    for r, p in procs.items():
        assert p.stdout is not None
        while True:
            line = p.stdout.readline()
            if line.startswith("{") and json.loads(line).get("ready") == r:
                break
            assert line and time.monotonic() < deadline, f"rank {r} never got ready: {p.communicate()[1][-2000:]}"
    return procs


def test_a_rank_failing_mid_frame_does_not_get_blamed(tmp_path):
    """4 ranks on a TCP ring with 16 MiB frames, so a rank is almost always in the middle of
    sending one: when rank 2 is killed, its right neighbour fails while sending to rank 0. It
    must finish the frame and send ABORT, so rank 0 blames rank 2, not the live rank 3."""
    runs, wrong = 3, []
    for k in range(runs):
        d = tmp_path / str(k)
        d.mkdir()
        env = {
            "MLX_TIMEOUT": "20",
            "MESHCOMM_SOCKETS_SHM": "0",
            "MESHCOMM_SOCKETS_CHUNK_KIB": "16384",
            "SIZE": str(16 << 20),
        }
        procs = _start_loop(d, 4, env)
        time.sleep(0.5)
        os.kill(procs[2].pid, signal.SIGKILL)
        results = finish(procs, timeout=90)
        for r in (0, 1, 3):
            first = _report(results, r)
            assert first["error"] in ("PeerLostError", "CommTimeoutError"), (r, first)
            if first["peer"] != 2:
                wrong.append((k, r, first["message"]))
    assert not wrong, wrong


@pytest.mark.parametrize(
    "path,size", [("shm", 1 << 16), ("tcp", 1 << 16), ("tcp", 1 << 22)], ids=["shm", "tcp-small", "tcp-full-buffers"]
)
def test_a_rank_resumed_after_sigstop_is_told_the_peers_gave_up_on_it(tmp_path, path, size):
    timeout = 3
    procs = _start_loop(tmp_path, 3, {"MLX_TIMEOUT": str(timeout), "SIZE": str(size), **PATHS[path]})
    time.sleep(0.3)
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        for r in (0, 2):  # the survivors time out on rank 1 and end
            procs[r].wait(timeout + 30)
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    results = finish(procs, timeout=60)
    named = []
    for r in (0, 2):
        first = _report(results, r)
        assert first["error"] == "CommTimeoutError" and first["elapsed"] < 0.3 + timeout + 5, (r, first)
        named.append(first["peer"])
    # a survivor waiting on a live rank that itself waits on the stopped one may time out first
    # and name the live one (a known limit, see the report); the stopped rank is always named
    assert 1 in named, named
    mine = _report(results, 1)
    assert mine["error"] == "CommTimeoutError", mine
    if named == [1, 1]:
        assert "gave up waiting for this rank" in mine["message"], mine
    else:  # a survivor named the live rank (the limit above); rank 1 may read that survivor's notice first
        assert "gave up waiting for this rank" in mine["message"] or "stopped the job" in mine["message"], mine
    assert f"MLX_TIMEOUT={timeout}" in mine["message"] and "exited or crashed" not in mine["message"], mine


def test_a_rank_told_it_was_given_up_on_while_it_waits_for_a_stopped_one_names_that_one(tmp_path):
    """The chain the test above meets by chance, made certain: on a 3-rank TCP ring rank 0
    waits for rank 2, which waits for rank 1; rank 1 is stopped and rank 0's deadline is the
    shortest, so rank 0 gives up first and can only name rank 2 (the live rank it waits for).
    Rank 2, told that rank 0 gave up waiting for it while it was running and had waited for
    rank 1 with nothing from it (3 s, more than half its own MLX_TIMEOUT), names rank 1: the
    stopped rank is named by a survivor."""
    procs = _start_loop(
        tmp_path, 3, {"MLX_TIMEOUT": "4", "SIZE": str(1 << 22), **PATHS["tcp"]}, rank_env={0: {"MLX_TIMEOUT": "3"}}
    )
    time.sleep(0.3)
    os.kill(procs[1].pid, signal.SIGSTOP)
    try:
        for r in (0, 2):
            procs[r].wait(40)
    finally:
        os.kill(procs[1].pid, signal.SIGCONT)
    results = finish(procs, timeout=60)
    first, third = _report(results, 0), _report(results, 2)
    assert (first["error"], first["peer"]) == ("CommTimeoutError", 2), first
    assert (third["error"], third["peer"]) == ("CommTimeoutError", 1), third
    assert "gave up waiting for this rank, which was itself waiting for rank 1" in third["message"], third

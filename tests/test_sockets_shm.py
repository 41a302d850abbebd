"""Shared memory between ranks of one host: chosen by host identity, the whole contract on
it (alone and hierarchical across hosts), dead peers detected, nothing left in /dev/shm."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import ROOT, finish, free_ports, start_ranks, write_hostfile

SHM = Path("/dev/shm")
PROG = "tests/programs/shm_rank.py"
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="no /dev/shm on this machine")


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("meshcomm-*")}


def _infos(results) -> list[dict]:
    return [json.loads(out.splitlines()[0]) for _rc, out, _err in results.values()]


def _run(n, tmp_path, mode="ok", env=None, rank_env=None, args=None):
    hf = write_hostfile(tmp_path / "h.json", free_ports(n))
    procs = start_ranks(n, args or [PROG, mode], hf, env={"MLX_TIMEOUT": "30", **(env or {})}, rank_env=rank_env)
    return finish(procs, timeout=300)


@pytest.mark.exclusive  # compares every meshcomm segment in /dev/shm before and after
def test_same_host_ranks_use_shared_memory_and_leave_nothing(tmp_path):
    before = _segments()
    results = _run(3, tmp_path)
    assert all(rc == 0 for rc, _o, _e in results.values()), results
    assert [i["mode"] for i in _infos(results)] == ["local"] * 3
    assert _infos(results)[0]["local"] == [0, 1, 2]
    assert _segments() == before


def test_the_compiled_loop_is_used_when_installed_and_can_be_switched_off(tmp_path):
    """meshcomm-sockets builds its compiled loop (scripts/setup.sh here, the wheels for users);
    the pure-Python loop stays for builds without a compiler and for MESHCOMM_SOCKETS_NATIVE=0."""
    from meshcomm_sockets import _shm  # noqa: F401  (its absence is a failed build, not a skip)

    assert [i["native"] for i in _infos(_run(2, tmp_path))] == [True, True]
    off = _run(2, tmp_path, env={"MESHCOMM_SOCKETS_NATIVE": "0"})
    assert [i["native"] for i in _infos(off)] == [False, False]


def test_switch_turns_it_off(tmp_path):
    results = _run(2, tmp_path, env={"MESHCOMM_SOCKETS_SHM": "0"})
    assert [i["mode"] for i in _infos(results)] == ["tcp", "tcp"]


def test_host_identity_decides_not_addresses(tmp_path):
    hosts = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c"}
    results = _run(5, tmp_path, rank_env={r: {"MESHCOMM_HOST_ID": h} for r, h in hosts.items()})
    infos = _infos(results)
    assert [i["mode"] for i in infos] == ["hier"] * 5
    assert [i["local"] for i in infos] == [[0, 1], [0, 1], [2, 3], [2, 3], None]


@pytest.mark.parametrize("layout", ["local", "local-python", "local-mixed", "hier", "tcp"])
def test_whole_contract(tmp_path, layout):
    """local-python: the pure-Python loop instead of the compiled one;
    local-mixed: ranks 0 and 2 in C, 1 and 3 in Python (the protocol is the same)."""
    n = 4
    env, rank_env = {}, None
    if layout == "hier":
        rank_env = {r: {"MESHCOMM_HOST_ID": f"h{r // 2}"} for r in range(n)}
    if layout == "tcp":
        env = {"MESHCOMM_SOCKETS_SHM": "0"}
    if layout == "local-python":
        env = {"MESHCOMM_SOCKETS_NATIVE": "0"}
    if layout == "local-mixed":
        rank_env = {r: {"MESHCOMM_SOCKETS_NATIVE": str(r % 2 ^ 1)} for r in range(n)}
    results = _run(n, tmp_path, env=env, rank_env=rank_env, args=["-m", "meshcomm.testing.contract", "--more"])
    for r, (rc, out, err) in results.items():
        assert rc == 0 and "20 passed, 0 failed" in out, (r, out[-2000:], err[-3000:])


@pytest.mark.exclusive  # compares every meshcomm segment in /dev/shm before and after
@pytest.mark.parametrize("native", ["1", "0"])
def test_dead_rank_on_the_same_host_is_detected(tmp_path, native):
    before = _segments()
    results = _run(3, tmp_path, mode="kill", env={"MLX_TIMEOUT": "20", "MESHCOMM_SOCKETS_NATIVE": native})
    assert results[1][0] == -signal.SIGKILL
    for r in (0, 2):
        report = json.loads(results[r][1].splitlines()[-1])
        assert report["error"] == "PeerLostError" and report["peer"] == 1, results[r]
        assert report["elapsed"] < 20, "a closed connection must be noticed before the timeout"
    assert _segments() == before


def test_waking_a_rank_that_ended_after_publishing_the_same_piece_is_not_a_loss(tmp_path):
    """A sleeping rank can see a piece without its wake-up, finish its last call and exit
    before the publisher writes to its FIFO (seen with 4 ranks on 2 busy cores): the
    broken pipe is then no error; it is one when the rank had not published the piece."""
    results = _run(2, tmp_path, mode="wake-ended")
    assert all(rc == 0 for rc, _o, _e in results.values()), results
    assert json.loads(results[0][1].splitlines()[-1]) == {"ahead": "PeerLostError peer=1"}, results[0]


@pytest.mark.exclusive  # compares every meshcomm segment in /dev/shm before and after
def test_nothing_left_after_the_launcher_is_interrupted():
    before = _segments()
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshcomm", "launch", "-n", "3", "--", PROG, "loop"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ready = 0
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while ready < 3 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            ready += line.strip().endswith("ready")
        assert ready == 3, proc.stderr.read() if proc.stderr else ""
        assert _segments() == before, "segment names must be gone once every rank mapped them"
    finally:  # the job stops also when an assertion failed (its ranks loop for minutes)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(60)
    assert rc == 128 + signal.SIGINT
    assert _segments() == before


@pytest.mark.exclusive  # compares every meshcomm segment in /dev/shm before and after
def test_launcher_removes_segments_of_a_job_that_died_during_start_up(tmp_path):
    """A rank that dies between creating and unlinking leaves a name; the launcher's clean-up
    (the sockets backend's cleanup_command) removes the job's names."""
    prog = tmp_path / "leak.py"
    prog.write_text(
        "import os, pathlib\n"
        "p = pathlib.Path('/dev/shm') / f\"meshcomm-{os.environ['MESHCOMM_JOB_ID']}-leaked\"\n"
        "p.write_bytes(b'x')\n"
        "print('wrote', p, flush=True)\n"
        "os._exit(3)\n"
    )
    before = _segments()
    res = subprocess.run(
        [sys.executable, "-m", "meshcomm", "launch", "-n", "2", "--", str(prog)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 3 and "wrote /dev/shm/meshcomm-" in res.stdout
    assert _segments() == before


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("native", ["all", "mixed"])
@pytest.mark.parametrize("late", [False, True])
def test_small_sums_in_one_c_call_keep_the_call_numbers_of_every_other_path(tmp_path, n, native, late):
    """A small all_sum on the compiled channel runs without the Python call descriptor
    (ShmGroup.quick_sum): between calls of every other path, with late peers, and with ranks
    on the pure-Python loop ("mixed": rank 1), every result is right, and a mismatch names
    the user's call number (the 73rd call), the same on every rank; the peer's call is named
    by what it is (its own number is not on the wire)."""
    rank_env = {1: {"MESHCOMM_SOCKETS_NATIVE": "0"}} if native == "mixed" else None
    results = _run(n, tmp_path, rank_env=rank_env, args=[PROG, "numbering", *(["late"] if late else [])])
    infos = _infos(results)
    assert [i["native"] for i in infos] == [native == "all" or r != 1 for r in range(n)]
    numbers = set()
    for r, (rc, out, err) in results.items():
        report = json.loads(out.splitlines()[-1])
        assert rc == 0 and report["results"] is True, (r, out, err[-2000:])
        named = re.findall(r"all_sum #(\d+)", report["error"])
        assert named == ["73"] and "float32" in report["error"] and "float64" in report["error"], (r, report)
        assert re.search(r"is in all_sum \(2 x float(32|64)\)", report["error"]), (r, report)
        numbers.update(named)
    assert len(numbers) == 1, f"every rank must name the same call number: {numbers}"

"""Ranks on one host read each other's arrays in place (process_vm_readv) for large
collectives: the results are right, bit-identical to the two-copy path, and a job whose
ranks cannot read each other (another PID namespace, or MESHCOMM_SOCKETS_DIRECT=0) uses
the two-copy path without failing."""

from __future__ import annotations

import json
import shutil

import pytest
from jobs import finish, free_ports, start_ranks, write_hostfile

PROG = "tests/programs/direct_rank.py"


def _run(tmp_path, n: int, env: dict[str, str] | None = None, rank_env=None, mode: list[str] | None = None):
    hf = write_hostfile(tmp_path / "h.json", free_ports(n))
    procs = start_ranks(n, [PROG, *(mode or [])], hf, env={"MLX_TIMEOUT": "60", **(env or {})}, rank_env=rank_env)
    results = finish(procs, timeout=300)
    reports = {}
    for r, (rc, out, err) in results.items():
        assert rc == 0, (r, out[-2000:], err[-3000:])
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        reports[r] = {k: v for line in lines for k, v in line.items()}
    return reports


@pytest.mark.parametrize("n", [2, 3])
def test_direct_reads_give_the_same_bytes_as_the_two_copy_path(tmp_path, n):
    direct = _run(tmp_path, n)
    assert [direct[r]["direct"] for r in range(n)] == [True] * n, direct
    copied = _run(tmp_path, n, env={"MESHCOMM_SOCKETS_DIRECT": "0"})
    assert [copied[r]["direct"] for r in range(n)] == [False] * n, copied
    digests = {direct[r]["digest"] for r in range(n)} | {copied[r]["digest"] for r in range(n)}
    assert len(digests) == 1, "every rank, on either path, must hold the same bytes"


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_rank_in_another_pid_namespace_falls_back_to_copies(tmp_path):
    reports = _run(tmp_path, 2, rank_env={1: {"MESHCOMM_TEST_UNSHARE": "1"}})
    assert [reports[r]["path"] for r in range(2)] == ["local", "local"], reports
    assert [reports[r]["direct"] for r in range(2)] == [False, False], reports
    assert reports[0]["digest"] == reports[1]["digest"]


def test_direct_and_copied_calls_that_differ_are_a_mismatch(tmp_path):
    reports = _run(tmp_path, 3, mode=["mismatch"])
    assert [reports[r]["error"] for r in range(3)] == ["CollectiveMismatchError"] * 3, reports


@pytest.mark.parametrize("n", [2, 3, 4])
def test_in_place_and_out_over_the_tcp_ring(tmp_path, n):
    """direct_out over TCP: ``all_sum(y, out=y)`` runs the pipelined ring in place (small
    chunks: many frames of a block in flight) and gives what a fresh buffer gives."""
    reports = _run(tmp_path, n, env={"MESHCOMM_SOCKETS_SHM": "0", "MESHCOMM_SOCKETS_CHUNK_KIB": "64"})
    assert [reports[r]["path"] for r in range(n)] == ["tcp"] * n, reports
    assert len({reports[r]["digest"] for r in range(n)}) == 1

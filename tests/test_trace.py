"""Observability (issue 19): the merged trace, the stall inspector, the summary and its plot.

Real jobs run ``tests/programs/trace_rank.py`` under ``meshcomm launch --trace DIR`` on
every bundled backend; the merged ``DIR/trace.json`` is checked event by event. The
summary's arithmetic (waits, stragglers, bandwidth) is checked on hand-made rank files
whose times are known, and the recorder's ring on a size-1 world in this process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jobs import ROOT, launch, without_launch_vars

PROG = str(ROOT / "tests" / "programs" / "trace_rank.py")
BACKENDS = ["sockets", "mpi", "gloo"]
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def _job(
    backend: str, tmp: Path, *args: str, env: dict[str, str] | None = None, trace: bool = True
) -> subprocess.CompletedProcess[str]:
    extra = ("--trace", str(tmp / "trace")) if trace else ()
    return launch(
        3, PROG, *args, backend=backend, launch_args=extra, env={**MPI_ENV, "MLX_TIMEOUT": "60", **(env or {})}
    )


def _lines(out: str, rank: int, tag: str) -> list[str]:
    prefix = f"[rank {rank}] {tag} "
    return [ln[len(prefix) :] for ln in out.splitlines() if ln.startswith(prefix)]


def _ops(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "op"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_merged_trace_has_every_operation_of_every_rank(backend: str, tmp_path: Path) -> None:
    res = _job(backend, tmp_path, "ops")
    assert res.returncode == 0, res.stdout + res.stderr
    merged = tmp_path / "trace" / "trace.json"
    assert f"trace written to {merged}" in res.stderr
    trace = json.loads(merged.read_text())
    ops = _ops(trace)
    # one track per rank: a named process per rank, one thread in it
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert sorted(names) == [0, 1, 2] and all(names[r].startswith(f"rank {r} ") for r in names)
    assert {(e["pid"], e["tid"]) for e in ops} == {(0, 0), (1, 0), (2, 0)}
    for r in range(3):
        issued = json.loads(_lines(res.stdout, r, "OPS")[0])
        mine = sorted((e for e in ops if e["pid"] == r), key=lambda e: e["ts"])
        # every operation present, in the order issued (the split's and the object
        # collective's internal exchanges are not separate operations)
        assert [e["args"]["op"] for e in mine] == issued, (r, [e["args"]["op"] for e in mine])
        assert all(e["args"]["ok"] for e in mine)
        # times ordered: each ends before the next starts; waits inside their operation
        for a, b in zip(mine, mine[1:], strict=False):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (a, b)
        for e in mine:
            assert e["ts"] >= 0 and e["dur"] >= 0 and 0 <= e["args"]["wait_us"] <= e["dur"] + 1e-3
        # sequence numbers of the world's collectives count up from 1 in time order
        seqs = [e["args"]["seq"] for e in mine if e["args"]["group"] == "world" and e["args"]["peer"] < 0]
        assert seqs == list(range(1, len(seqs) + 1))
        assert _lines(res.stdout, r, "ACTIVE") == ["True"]
    # every collective of the world was recorded by all three ranks; sizes and dtypes
    by_key = Counter((e["args"]["group"], e["args"]["seq"]) for e in ops if e["args"]["peer"] < 0)
    assert all(by_key[k] == 3 for k in by_key if k[0] == "world")
    first = [e for e in ops if e["args"]["op"] == "all_sum" and e["args"]["seq"] == 1]
    assert {(e["args"]["bytes"], e["args"]["dtype"]) for e in first} == {(16, "float32")}
    # the split groups are named alike on their members: ranks 0 and 2 share one
    sub = {e["pid"]: e["args"]["group"] for e in ops if e["args"]["op"] == "all_max"}
    assert sub[0] == sub[2] != sub[1] and sub[0].startswith("world/")
    # the send and the recv pair up: the later of the two waits 0
    pair = [e for e in ops if e["args"]["op"] in ("send", "recv")]
    assert sorted(e["pid"] for e in pair) == [0, 1]
    assert min(e["args"]["wait_us"] for e in pair) == 0
    # what the operations hand the recorder: the peers, what each rank passed (for recv the
    # received array; for the object collectives the pickled bytes), the split's color
    assert {(e["pid"], e["args"]["peer"], e["args"]["bytes"], e["args"]["dtype"]) for e in pair} == {
        (0, 1, 24, "float64"),
        (1, 0, 24, "float64"),
    }
    objs = [e for e in ops if e["args"]["op"] == "all_gather_object"]
    assert len(objs) == 3 and all(e["args"]["bytes"] > 0 and e["args"]["dtype"] == "object" for e in objs)
    assert sub[0].endswith(".0") and sub[1].endswith(".1")
    # one waiting slice per waiting operation, inside it
    for w in (e for e in trace["traceEvents"] if e.get("cat") == "wait"):
        assert any(o["pid"] == w["pid"] and o["ts"] == w["ts"] and o["dur"] >= w["dur"] for o in ops)
    meta = trace["otherData"]["meshcomm"]
    assert sorted(meta["ranks"]) == ["0", "1", "2"] and meta["size"] == 3


def test_tracing_off_leaves_no_hook_and_no_files(tmp_path: Path) -> None:
    res = _job("sockets", tmp_path, "ops", env={"MESHCOMM_STALL_AFTER": "0"}, trace=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert all(_lines(res.stdout, r, "ACTIVE") == ["False"] for r in range(3))
    assert "trace written" not in res.stderr


@pytest.mark.parametrize("backend", BACKENDS)
def test_stall_inspector_names_the_rank_that_has_not_joined(backend: str, tmp_path: Path) -> None:
    # rank 2 sleeps 4 s before the second all_sum; ranks 0 and 1 wait in it and, after
    # MESHCOMM_STALL_AFTER=1 s, each says once that rank 2 has not joined
    res = _job(backend, tmp_path, "stall", "4", env={"MESHCOMM_STALL_AFTER": "1"}, trace=False)
    assert res.returncode == 0, res.stdout + res.stderr
    for r in (0, 1):
        lines = [ln for ln in _lines(res.stderr, r, "meshcomm:") if ln.startswith("stall:")]
        assert len(lines) == 1, res.stderr
        line = lines[0]
        assert f"stall: rank {r} has waited" in line and "in all_sum #2 of group world" in line
        assert "not joined: rank 2 (finished all_sum #1 of world" in line, line
        assert f"joined: ranks {1 - r}" in line
    assert not [ln for ln in _lines(res.stderr, 2, "meshcomm:") if ln.startswith("stall:")]


def _errors(out: str, rank: int) -> str:
    """Rank ``rank``'s error lines (``meshcomm.protocol.errors.X: ...``)."""
    prefix = f"[rank {rank}] meshcomm.protocol.errors."
    return "\n".join(ln[len(prefix) :] for ln in out.splitlines() if ln.startswith(prefix))


def _numbers(out: str, rank: int) -> list[str]:
    """The call numbers (``#N``) in rank ``rank``'s error lines."""
    return re.findall(r"#(\d+)", _errors(out, rank))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_call_has_one_number_everywhere(backend: str, tmp_path: Path) -> None:
    """The user's second all_sum is #2 in the stall notice, the timeout error and the trace, on
    every backend (the backend's own count also counts meshcomm's internal calls: start-up
    exchanges, call checks); a mismatch in the first call names all_sum #1."""
    res = _job(backend, tmp_path, "stall", "8", env={"MESHCOMM_STALL_AFTER": "0.5", "MLX_TIMEOUT": "2"})
    assert res.returncode != 0, res.stdout + res.stderr
    for r in (0, 1):
        assert "in all_sum #2 of group world" in "\n".join(_lines(res.stderr, r, "meshcomm:")), res.stderr
        numbers = _numbers(res.stderr, r)
        assert numbers and set(numbers) == {"2"}, (r, _errors(res.stderr, r))
        assert "all_sum #2" in _errors(res.stderr, r)
        data = json.loads((tmp_path / "trace" / f"rank-{r}.json").read_text())
        assert [(e[1], e[2], e[8]) for e in data["events"]] == [(1, "all_sum", True), (2, "all_sum", False)]
    res = _job(backend, tmp_path, "mismatch", trace=False)
    assert res.returncode != 0, res.stdout + res.stderr
    for r in (0, 2):
        errors = _errors(res.stderr, r)
        assert "CollectiveMismatchError" in errors and "all_sum #1 " in errors, res.stderr
        assert set(_numbers(res.stderr, r)) == {"1"}, errors


def test_stall_inspector_under_a_plain_mpirun(tmp_path: Path) -> None:
    """Without meshcomm launch, under Open MPI's mpirun: the records go to its session directory."""
    pytest.importorskip("meshcomm_mpi")
    from meshcomm_mpi.launcher import mpiexec_command

    env = without_launch_vars(**MPI_ENV, PYTHONUNBUFFERED="1", MLX_TIMEOUT="60", MESHCOMM_STALL_AFTER="1")
    env["PRTE_MCA_prte_tmpdir_base"] = str(tmp_path)  # where mpirun makes its session directory
    cmd = mpiexec_command(3, [sys.executable, PROG, "stall", "4"])
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    if (
        "PMIX_SERVER_TMPDIR"
        not in subprocess.run(
            mpiexec_command(1, [sys.executable, "-c", "import os; print(*os.environ)"]),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    ):
        pytest.skip("this mpiexec is not a PMIx launcher (MPICH's Hydra): no session directory to share")
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("meshcomm: stall:")]
    assert sorted(ln.split()[3] for ln in lines) == ["0", "1"], res.stderr
    assert all("not joined: rank 2 (finished all_sum #1 of world" in ln for ln in lines), lines
    assert not [p for p in tmp_path.rglob("meshcomm-*")], "the session directory was left behind"


def test_failed_rank_writes_its_trace_and_the_launcher_merges(tmp_path: Path) -> None:
    res = _job("sockets", tmp_path, "fail")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "trace written to" in res.stderr
    files = {r: json.loads((tmp_path / "trace" / f"rank-{r}.json").read_text()) for r in range(3)}
    assert all(f["reason"] == "failure" for f in files.values())
    assert [e[2] for e in files[1]["events"]] == ["all_sum", "all_sum"]
    # the survivors recorded the all_sum rank 1 never joined, as failed
    assert files[0]["events"][-1][2] == "all_sum" and files[0]["events"][-1][-1] is False
    trace = json.loads((tmp_path / "trace" / "trace.json").read_text())
    assert {e["pid"] for e in _ops(trace)} == {0, 1, 2}


# -- the merge and the summary on hand-made rank files -----------------------------------


def _rank_file(folder: Path, rank: int, events: list[list[Any]], size: int = 3) -> None:
    data = {
        "format": "meshcomm-trace-rank/1",
        "rank": rank,
        "size": size,
        "backend": "test",
        "host": "h",
        "pid": 100 + rank,
        "started": 1000.0,
        "written": 1010.0,
        "reason": "exit",
        "dropped": 0,
        "groups": {"world": {"rank": rank, "size": size}},
        "fields": ["group", "seq", "op", "peer", "bytes", "dtype", "start", "end", "ok"],
        "events": events,
    }
    (folder / f"rank-{rank}.json").write_text(json.dumps(data))


def _made_up(folder: Path) -> None:
    """Ten 1 KiB all_sums at 10 ms intervals lasting 1 ms, except #7, where rank 2 arrives
    50 ms late (the others wait for it), and one send 0 -> 1 of 8 bytes."""
    for r in range(3):
        events: list[list[Any]] = []
        for s in range(1, 11):
            t = 1000.0 + s * 0.01
            late = 0.05 if s == 7 else 0.0
            start = t + (late if r == 2 else 0.0)
            events.append(["world", s, "all_sum", -1, 1024, "float32", start, t + late + 0.001, True])
        if r == 0:
            events.append(["world", 1, "send", 1, 8, "float64", 1001.0, 1001.002, True])
        if r == 1:
            events.append(["world", 1, "recv", 0, 8, "float64", 1001.001, 1001.002, True])
        _rank_file(folder, r, events)


def test_merge_computes_waits_from_the_latest_start(tmp_path: Path) -> None:
    from meshcomm.trace.chrome import merge_dir

    _made_up(tmp_path)
    path, missing = merge_dir(tmp_path)
    assert missing == [] and path == tmp_path / "trace.json"
    ops = _ops(json.loads(path.read_text()))
    seven = {e["pid"]: e for e in ops if e["args"]["seq"] == 7 and e["args"]["op"] == "all_sum"}
    assert seven[0]["args"]["wait_us"] == pytest.approx(50_000, abs=1) and seven[2]["args"]["wait_us"] == 0
    assert seven[0]["dur"] == pytest.approx(51_000, abs=1)
    send = next(e for e in ops if e["args"]["op"] == "send")
    recv = next(e for e in ops if e["args"]["op"] == "recv")
    assert send["name"] == "send to 1" and recv["name"] == "recv from 0"
    assert send["args"]["wait_us"] == pytest.approx(1000, abs=1) and recv["args"]["wait_us"] == 0
    (tmp_path / "rank-1.json").unlink()
    assert merge_dir(tmp_path)[1] == [1]


def test_summary_table_and_straggler(tmp_path: Path) -> None:
    _made_up(tmp_path)
    res = subprocess.run(
        [sys.executable, "-m", "meshcomm", "trace", "summary", str(tmp_path)], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "11 operations on 3 ranks"
    row = next(ln.split() for ln in lines if ln.startswith("all_sum"))
    # all_sum <= 1 KiB: 10 instances, median 1 ms, busbw = 1024 B * 4/3 / 1 ms
    assert row[1:4] == ["<=", "1", "KiB"] and row[4] == "10"
    assert float(row[6]) == pytest.approx(1000.0, abs=0.2)
    assert float(row[7]) == pytest.approx(1024 * 4 / 3 / 1e-3 / 1e9, rel=1e-2)
    slow = lines[lines.index(next(ln for ln in lines if ln.startswith("slow operations"))) + 2].split()
    assert slow[0] == "all_sum" and slow[2] == "7" and slow[4:6] == ["rank", "2"]
    assert float(slow[6]) == pytest.approx(50_000, abs=1)
    assert any(ln.startswith("send/recv") for ln in lines)


def test_summary_rows_take_bus_bandwidth_from_the_operation_table() -> None:
    from meshcomm.trace.summary import Instance, table

    def inst(op: str) -> Instance:
        return Instance(op, "world", 1, 1024, {r: (0.0, 1e-3, 0.0) for r in range(4)}, 4)

    rows = {row.op: row for row in table([inst("all_sum"), inst("barrier"), inst("an_op_of_a_newer_version")])}
    assert rows["all_sum"].busbw == pytest.approx(1024 * 1.5 / 1e-3 / 1e9)  # 2(n-1)/n on 4 ranks
    assert rows["barrier"].busbw is None and rows["an_op_of_a_newer_version"].busbw is None


def test_summary_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    _made_up(tmp_path)
    from meshcomm.trace.chrome import merge_dir

    merged, _ = merge_dir(tmp_path)
    png = tmp_path / "timeline.png"
    res = subprocess.run(
        [sys.executable, "-m", "meshcomm", "trace", "summary", str(merged), "--plot", str(png)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_merge_command(tmp_path: Path) -> None:
    _made_up(tmp_path)
    out = tmp_path / "merged.json"
    res = subprocess.run(
        [sys.executable, "-m", "meshcomm", "trace", "merge", str(tmp_path), "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert res.returncode == 0 and f"merged trace written to {out}" in res.stdout, res.stderr
    assert len(_ops(json.loads(out.read_text()))) == 32
    empty = tmp_path / "empty"
    empty.mkdir()
    res = subprocess.run(
        [sys.executable, "-m", "meshcomm", "trace", "merge", str(empty)], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 2 and "no rank files" in res.stderr


def test_summary_of_a_file_that_is_not_a_trace_says_so(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2]")
    res = subprocess.run(
        [sys.executable, "-m", "meshcomm", "trace", "summary", str(bad)], capture_output=True, text=True, cwd=ROOT
    )
    assert res.returncode == 2 and "not a merged meshcomm trace" in res.stderr


# -- the recorder itself, in this process ---------------------------------------------------


def test_ring_keeps_the_newest_events_and_counts_the_dropped(tmp_path: Path, fresh_registry: None) -> None:
    import meshcomm as mc
    from meshcomm.trace import recorder

    world = mc.init(backend="any", strict=False)
    assert world.size() == 1 and recorder.active is None
    rec = recorder.Recorder(world, folder=tmp_path, capacity=4, progress=None)
    recorder.attach(rec)
    try:
        for i in range(6):
            world.all_sum(np.full(3, i, np.int16))
        world.broadcast_object({"a": 1})
    finally:
        recorder.stop()
    path = rec.dump("exit")
    assert path == tmp_path / "rank-0.json"
    data = json.loads(path.read_text())
    assert data["dropped"] == 3 and len(data["events"]) == 4
    assert [e[1] for e in data["events"]] == [4, 5, 6, 7]
    assert data["events"][0][2:6] == ["all_sum", -1, 6, "int16"]
    assert data["events"][-1][2] == "broadcast_object" and data["events"][-1][5] == "object"


def test_stall_message_without_a_job_directory() -> None:
    from meshcomm.trace.stall import stall_message

    line = stall_message(("world", 0, 0, 2, 3, "barrier", -1, 100.0), None, 2, 102.5)
    assert line.startswith("meshcomm: stall: rank 0 has waited 2.5 s in barrier #3 of group world")
    assert "start the job with meshcomm launch" in line


def test_settings_validate() -> None:
    from meshcomm import Config
    from meshcomm.protocol.errors import ConfigError

    cfg = Config.load({"MESHCOMM_TRACE": "/tmp/x", "MESHCOMM_STALL_AFTER": "0"})
    assert str(cfg.trace) == "/tmp/x" and cfg.stall_after == 0 and cfg.trace_events == 100_000
    with pytest.raises(ConfigError, match="MESHCOMM_STALL_AFTER"):
        Config.load({"MESHCOMM_STALL_AFTER": "-1"})
    with pytest.raises(ConfigError, match="MESHCOMM_TRACE_EVENTS"):
        Config.load({"MESHCOMM_TRACE_EVENTS": "0"})

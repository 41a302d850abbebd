"""``meshcomm bench``: size parsing, bus-bandwidth factors, the timer, the result check
(a substituted wrong ``all_sum`` must void the figures) and one real launched sweep.

No timing thresholds: only counts, shapes and the relations between figures are checked.
"""

from __future__ import annotations

import json
import sys

import meshcomm
import numpy as np
import pytest
from jobs import launch
from meshcomm.bench import OPS, bus_factor, parse_size, parse_sizes, time_op
from meshcomm.bench.collectives import describe_mismatch
from meshcomm.bench.measure import Stats, plan_iters
from meshcomm.bench.runner import ResultCheckError, require_ok, run_sweep
from meshcomm.bench.sizes import format_size
from meshcomm.cli import main
from meshcomm.testing.threaded import run_threaded

KiB, MiB = 1 << 10, 1 << 20


# -- sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8", 8),
        ("8B", 8),
        ("8 b", 8),
        ("4KiB", 4 * KiB),
        ("4K", 4 * KiB),
        ("4KB", 4000),
        ("64MiB", 64 * MiB),
        ("1.5MiB", 3 * MiB // 2),
        ("1GiB", 1 << 30),
        ("2MB", 2_000_000),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "-1", "4 parsecs", "1.3B", "64GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


def test_parse_sizes_doubles_by_default():
    sizes = parse_sizes("8B:64MiB")
    assert sizes[0] == 8 and sizes[-1] == 64 * MiB
    assert len(sizes) == 24
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:], strict=False))


def test_parse_sizes_factor_and_high_always_included():
    assert parse_sizes("8B:64MiB:4")[-2:] == [32 * MiB, 64 * MiB]
    assert parse_sizes("8B:64MiB:x4")[:3] == [8, 32, 128]
    assert parse_sizes("1KiB:3KiB") == [1024, 2048, 3072]
    assert parse_sizes("1MiB") == [MiB]
    assert parse_sizes("8B:16B,1KiB,8B") == [8, 16, 1024]


@pytest.mark.parametrize("text", ["64MiB:8B", "8B:1KiB:1", "8B:1KiB:two", "8B:1KiB:2:3", "8B,,16B", "0:8"])
def test_parse_sizes_rejects(text):
    with pytest.raises(ValueError):
        parse_sizes(text)


def test_format_size():
    assert [format_size(s) for s in (8, 1024, 1536, 64 * MiB)] == ["8 B", "1 KiB", "1.5 KiB", "64 MiB"]


def test_format_size_is_exact_or_bytes():
    # one style for every label: never a rounded "16.0 KiB" for a buffer that is not 16 KiB
    assert [format_size(s) for s in (0, 1008, 16380, 16 * KiB, 1280 * KiB, 1537 * KiB, 3 << 30)] == [
        "0 B",
        "1008 B",
        "16380 B",
        "16 KiB",
        "1.25 MiB",
        "1537 KiB",
        "3 GiB",
    ]
    assert all(parse_size(format_size(s).replace(" ", "")) == s for s in (8, 1008, 16380, 1280 * KiB, 1537 * KiB))


# -- bus bandwidth -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, n, factor",
    [
        ("all_sum", 1, 0.0),
        ("all_sum", 2, 1.0),
        ("all_sum", 4, 1.5),
        ("all_sum", 8, 1.75),
        ("all_gather", 2, 0.5),
        ("all_gather", 4, 0.75),
        ("sum_scatter", 4, 0.75),
        ("broadcast", 4, 1.0),
        ("sendrecv", 2, 1.0),
        ("barrier", 3, 0.0),
        ("all_to_all", 4, 0.75),
        ("gather", 4, 0.75),
        ("scatter", 2, 0.5),
        ("reduce", 4, 1.0),
    ],
)
def test_bus_factor(op, n, factor):
    assert bus_factor(op, n) == pytest.approx(factor)
    assert OPS[op].bus_factor(n) == pytest.approx(factor)


def test_bus_factor_rejects_unknown():
    with pytest.raises(ValueError, match="unknown operation"):
        bus_factor("all_prod", 2)


# -- the timer ---------------------------------------------------------------------------


class _DoublingSync:
    """A one-rank Sync whose 'other rank' was always twice as slow."""

    def __init__(self):
        self.barriers = 0

    def barrier(self):
        self.barriers += 1

    def max_over_ranks(self, values):
        return np.asarray(values, dtype=np.float64) * 2


def test_time_op_fixed_iters_uses_the_slowest_rank():
    sync, calls = _DoublingSync(), []
    timing = time_op(lambda: calls.append(1) or len(calls), sync, iters=7, warmup=2)
    assert timing.stats.iters == 7
    assert len(calls) == 9 and sync.barriers == 9  # a barrier before every call
    assert timing.first == 1 and timing.last == 9
    assert timing.stats.min <= timing.stats.p10 <= timing.stats.median <= timing.stats.p90 <= timing.stats.max


def test_time_op_adapts_iterations():
    timing = time_op(lambda: None, _DoublingSync(), warmup=0, min_time=1e-9, min_iters=4, max_iters=50)
    assert timing.stats.iters == 4
    assert plan_iters(1e-3, min_time=0.3, min_iters=5, max_iters=1000) == 300
    assert plan_iters(1.0, min_time=0.3, min_iters=5, max_iters=1000) == 5
    assert plan_iters(1e-9, min_time=0.3, min_iters=5, max_iters=1000) == 1000


def test_stats_percentiles():
    s = Stats.from_times(np.arange(1.0, 12.0))
    assert (s.iters, s.median, s.p10, s.p90, s.min, s.max) == (11, 6.0, 2.0, 10.0, 1.0, 11.0)
    with pytest.raises(ValueError):
        Stats.from_times(np.array([]))


# -- result checks -----------------------------------------------------------------------


def test_describe_mismatch():
    e = np.arange(6, dtype=np.float32)
    assert describe_mismatch(e.copy(), e) is None
    bad = e.copy()
    bad[4] += 1
    assert "1 of 6 elements differ; first at index 4" in describe_mismatch(bad, e)
    assert "dtype" in describe_mismatch(e.astype(np.float64), e)
    assert "shape" in describe_mismatch(e.reshape(2, 3), e)
    assert "NumPy array" in describe_mismatch([0, 1], e)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_op_checks_out_on_threaded_ranks(n):
    ops = [o for o in OPS if OPS[o].min_ranks <= n]
    rows = run_threaded(n, lambda g: run_sweep(g, ops, [8, 100, 4 * KiB], np.float32, iters=2, warmup=1))
    for ranks_rows in rows:
        assert all(r.ok for r in ranks_rows), [r.error for r in ranks_rows if not r.ok]
        require_ok(ranks_rows)
    gathered = [r for r in rows[0] if r.op == "all_gather"]
    assert all(r.nbytes % (4 * n) == 0 for r in gathered)  # whole elements on every rank


@pytest.mark.parametrize("dtype", [np.int8, np.float16, np.complex64, np.bool_])
def test_result_check_holds_for_other_dtypes(dtype):
    rows = run_threaded(3, lambda g: run_sweep(g, ["all_sum", "sum_scatter"], [300], dtype, iters=1, warmup=0))
    assert all(r.ok for r in rows[0])


def test_wrong_all_sum_on_one_rank_voids_the_figures(monkeypatch):
    real = meshcomm.all_sum

    def broken(x, *, group=None):
        out = real(x, group=group)
        if group is not None and group.rank() == 1:
            out.reshape(-1)[-1] += 1  # one wrong element on one rank
        return out

    monkeypatch.setattr(meshcomm, "all_sum", broken)
    rows = run_threaded(3, lambda g: run_sweep(g, ["all_sum", "broadcast"], [64, 4 * KiB], iters=2, warmup=1))
    for ranks_rows in rows:  # every rank agrees on what was wrong
        sums = [r for r in ranks_rows if r.op == "all_sum"]
        assert [r.ok for r in sums] == [False, False]
        assert all(r.wrong_ranks == [1] and r.stats is None and r.busbw is None for r in sums)
        assert all(r.ok for r in ranks_rows if r.op == "broadcast")
        with pytest.raises(ResultCheckError, match="all_sum at 64 B"):
            require_ok(ranks_rows)
    assert "elements differ" in next(r for r in rows[1] if r.op == "all_sum").error


@pytest.mark.parametrize("n", [2, 3])
def test_second_round_ops_sizes_and_results(n):
    """all_to_all, gather, scatter and reduce (issue 16) on threaded ranks: results checked
    on every rank, sizes in whole elements per rank, busbw = algbw x the nccl-tests factor."""
    ops = ["all_to_all", "gather", "scatter", "reduce"]
    rows = run_threaded(n, lambda g: run_sweep(g, ops, [8, 100, 4 * KiB], np.float32, iters=2, warmup=1))
    for ranks_rows in rows:
        require_ok(ranks_rows)
        assert {r.op for r in ranks_rows} == set(ops)
        for r in ranks_rows:
            assert r.busbw == pytest.approx(r.algbw * bus_factor(r.op, n))
            if r.op != "reduce":
                assert r.nbytes % (4 * n) == 0


def test_a_non_root_that_gets_an_array_voids_the_figures(monkeypatch):
    real = meshcomm.gather

    def broken(x, root=0, *, group=None):
        got = real(x, root, group=group)
        return np.asarray(x) if got is None and group is not None and group.rank() == 2 else got

    monkeypatch.setattr(meshcomm, "gather", broken)
    rows = run_threaded(3, lambda g: run_sweep(g, ["gather", "reduce"], [64], iters=2, warmup=1))
    for ranks_rows in rows:
        gathered = next(r for r in ranks_rows if r.op == "gather")
        assert not gathered.ok and gathered.wrong_ranks == [2]
        assert next(r for r in ranks_rows if r.op == "reduce").ok
    assert "non-root" in next(r for r in rows[2] if r.op == "gather").error


def test_cli_exits_1_and_marks_wrong_rows(monkeypatch, capsys, tmp_path, fresh_registry):
    monkeypatch.setattr(meshcomm, "all_sum", lambda x, *, group=None: np.zeros_like(np.asarray(x)) - 1)
    out = tmp_path / "wrong.json"
    assert main(["bench", "--sizes", "8B:32B", "--iters", "2", "--json", str(out)]) == 1
    captured = capsys.readouterr()
    assert captured.out.count("WRONG") == 3
    assert "returned wrong results" in captured.err
    doc = json.loads(out.read_text())
    assert doc["ok"] is False
    assert all(r["ok"] is False and r["time"] is None and r["busbw"] is None for r in doc["results"])


def test_cli_bad_arguments(capsys):
    assert main(["bench", "--op", "all_prod"]) == 2
    assert "unknown operation all_prod" in capsys.readouterr().err
    assert main(["bench", "--sizes", "64MiB:8B"]) == 2
    assert main(["bench", "--dtype", "float99"]) == 2
    assert main(["bench", "--iters", "0"]) == 2


def test_nccl_tests_flags_and_summary_lines(capsys, fresh_registry):
    assert main(["bench", "-b", "8", "-e", "1KiB", "-f", "4", "-n", "2", "-w", "0"]) == 0
    out = capsys.readouterr().out.rstrip("\n").splitlines()
    rows = [line.split()[0:2] for line in out if not line.startswith("#")]
    assert rows == [["8", "B"], ["32", "B"], ["128", "B"], ["512", "B"], ["1", "KiB"]]
    assert all(line.split()[-2] == "2" for line in out if not line.startswith("#"))  # -n 2: two iterations
    assert out[-2] == "# Out of bounds values : 0 OK"
    assert out[-1].startswith("# Avg bus bandwidth    : ") and out[-1].endswith(" GB/s")
    assert main(["bench", "--warmup_iters", "1", "--maxbytes", "16", "--iters", "1"]) == 0
    assert [
        line.split()[0] for line in capsys.readouterr().out.splitlines() if not line.startswith("#") and line.strip()
    ] == ["8", "16"]


def test_nccl_flags_and_sizes_together_are_refused(capsys):
    assert main(["bench", "--sizes", "8B", "-e", "1KiB"]) == 2
    assert "either --sizes or -b/-e/-f" in capsys.readouterr().err


def test_compare_refuses_what_it_does_not_measure(capsys):
    assert main(["bench", "--compare", "--op", "all"]) == 2
    assert "float32 all_sum" in capsys.readouterr().err
    assert main(["bench", "--compare", "--json", "x.json"]) == 2
    assert main(["bench", "--compare", "--ranks", "0"]) == 2


def test_compare_runs_the_side_by_side_table(tmp_path):
    import subprocess

    out_dir = tmp_path / "cmp"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshcomm",
            "bench",
            "--compare",
            "--ranks",
            "2",
            "--sizes",
            "8B:1KiB:4",
            "--min-time",
            "0.02",
            "--systems",
            "meshcomm-sockets",
            "--no-plot",
            "--out-dir",
            str(out_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "### 2 ranks" in proc.stdout and "| 1 KiB |" in proc.stdout
    doc = json.loads((out_dir / "compare.json").read_text())
    assert sorted(int(b) for b in doc["runs"]["2"]["meshcomm-sockets"]["rows"]) == [8, 32, 128, 512, 1024]
    assert (out_dir / "compare.md").read_text() in proc.stdout


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    from meshcomm.bench.plot import MissingMatplotlib, pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingMatplotlib, match=r"meshcomm\[bench\]"):
        pyplot()


def test_single_rank_sweep_with_plot(tmp_path, capsys, fresh_registry):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    assert main(["bench", "--op", "all", "--sizes", "8B:1KiB:4", "--iters", "2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "# all_sum: 1 ranks" in out and "# sendrecv" not in out  # sendrecv needs 2 ranks


# -- a real job ----------------------------------------------------------------------------


def test_launched_sweep_writes_checked_json(tmp_path):
    out = tmp_path / "out.json"
    proc = launch(2, "-m", "meshcomm", "bench", "--sizes", "8B:64KiB", "--iters", "3", "--json", str(out), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# all_sum: 2 ranks, backend sockets, float32" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["ok"] is True and doc["ranks"] == 2 and doc["backend"] == "sockets"
    rows = doc["results"]
    assert [r["bytes"] for r in rows] == [8 << i for i in range(14)]
    for r in rows:
        assert r["op"] == "all_sum" and r["ok"] and r["time"]["iters"] == 3
        t = r["time"]
        assert 0 < t["min"] <= t["median"] <= t["max"]
        assert r["algbw"] == pytest.approx(r["bytes"] / t["median"])
        assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (2 - 1) / 2)


def test_launched_all_ops_on_three_ranks(tmp_path):
    out = tmp_path / "all.json"
    proc = launch(
        3,
        "-m",
        "meshcomm",
        "bench",
        "--op",
        "all",
        "--sizes",
        "8B:4KiB:8",
        "--iters",
        "2",
        "--json",
        str(out),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert doc["ok"] and {r["op"] for r in doc["results"]} == set(OPS)


def test_busy_machine_spins_n_processes_and_ends_them() -> None:
    """``--compare --busy N``: N foreign processes burn CPU inside the block, none after it."""
    import os

    from meshcomm.bench.compare import busy_machine

    def spinners() -> list[int]:
        mine = []
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmd = open(f"/proc/{pid}/cmdline", "rb").read()
                except OSError:
                    continue
                if b"while True: pass" in cmd and int(pid) != os.getpid():
                    mine.append(int(pid))
        return mine

    import time

    before = set(spinners())
    with busy_machine(2):
        deadline = time.monotonic() + 30  # a child shows its own command line once it has exec'd
        while len(set(spinners()) - before) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        during = set(spinners()) - before
        assert len(during) == 2, during
    assert not (set(spinners()) & during), "the spinners must be gone after the block"


def test_the_machine_limits_measure_loopback_tcp_one_way_and_both_ways():
    """The limits `meshcomm bench --compare` prints: a stream, two streams at once and three
    connections both ways between two processes each report a positive rate (every byte
    arrived), and the helper process exits cleanly."""
    from meshcomm.bench import limits

    one = limits.tcp_bw(nbytes=8 << 20, reps=1)
    both = limits.tcp_duplex_bw(nbytes=8 << 20, reps=1)
    several = limits.tcp_duplex_bw(nbytes=8 << 20, reps=1, streams=3)
    assert all(0 < rate < float("inf") for rate in (one, both, several))


def test_a_tcp_limit_whose_helper_dies_before_connecting_fails_at_once_instead_of_hanging():
    """The loopback figures wait for a helper process: one that exits before it connects
    is an error naming its exit status (not an accept() that never returns)."""
    import socket
    import subprocess
    import sys
    import time

    from meshcomm.bench import limits

    with socket.create_server(("127.0.0.1", 0)) as srv, limits._helper("raise SystemExit(7)") as child:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="exited with 7 before connecting"):
            limits._accept(srv, child, timeout=30)
        assert time.monotonic() - t0 < 25, "noticed by the exit, not by the timeout"
    with socket.create_server(("127.0.0.1", 0)) as srv:
        silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            with pytest.raises(RuntimeError, match="did not connect within 0.5 s"):
                limits._accept(srv, silent, timeout=0.5)
        finally:
            silent.kill()
            silent.wait()


def test_a_tcp_limit_whose_helper_goes_silent_or_closes_fails_instead_of_hanging(monkeypatch):
    """A helper that connects and then never answers: the round-trip receive raises after
    HELPER_TIMEOUT, both sleeping in recv and polling; one that closes early is an error at once."""
    import socket
    import time

    from meshcomm.bench import limits

    monkeypatch.setattr(limits, "HELPER_TIMEOUT", 0.5)
    silent = "import socket, sys, time; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); time.sleep(60)"
    closing = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1]))).close()"
    for spin in (False, True):
        with socket.create_server(("127.0.0.1", 0)) as srv, limits._helper(silent, srv.getsockname()[1]) as child:
            # the helper's start may take seconds on a loaded machine: only its silence is timed
            conn = limits._accept(srv, child, timeout=60)
            conn.settimeout(limits.HELPER_TIMEOUT)  # what _accept gives a blocking connection
            with conn:
                if spin:
                    conn.setblocking(False)
                t0 = time.monotonic()
                with pytest.raises((RuntimeError, TimeoutError)):
                    limits._recv_exact(conn, 8)
                assert time.monotonic() - t0 < 20
        assert child.returncode is not None, "the helper is killed on the way out"
    with socket.create_server(("127.0.0.1", 0)) as srv, limits._helper(closing, srv.getsockname()[1]) as child:
        with (
            limits._accept(srv, child, timeout=60) as conn,
            pytest.raises(RuntimeError, match="closed its connection early"),
        ):
            limits._recv_exact(conn, 8)

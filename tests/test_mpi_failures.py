"""The mpi backend keeps meshcomm's failure promise, on real jobs of the venv's MPI.

For a rank (rank 1 of 3) that raises, calls ``sys.exit(3)``, exits 0 early, is SIGKILLed or
SIGSTOPped while the others wait, and for mismatched calls (send/recv dtype or count, a
collective met by a send): the job ends, the survivors' output names rank 1 with the
right error class, within ``MLX_TIMEOUT`` + 5 s of the failure, with the failing rank's
exit code where the contract says so, no wrong result is printed and no process is left.

The module is also the rank side: ``python tests/test_mpi_failures.py SCENARIO MARKER``
(the marker makes the job's processes findable with ``pgrep -f``).
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
TIMEOUT = 5  # MLX_TIMEOUT of the jobs

# -- rank side ----------------------------------------------------------------------------------


def _fail_rank1(scenario: str) -> None:
    print(f"FAILPOINT {time.time():.3f}", flush=True)
    if scenario == "raise":
        raise KeyError("boom on rank 1")
    if scenario == "exit3":
        sys.exit(3)
    if scenario == "exit0":
        sys.exit(0)
    if scenario == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if scenario == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # continued by the test's cleanup only to be killed


def _rank_main(scenario: str) -> int:
    import meshcomm as mc

    g = mc.init(strict=True, backend="mpi")
    r = g.rank()
    x = np.arange(4, dtype=np.float32) + r
    for _ in range(3):
        mc.all_sum(x)
    g.barrier()
    try:
        if scenario in ("raise", "exit3", "exit0", "sigkill", "sigstop"):
            if r == 1:
                _fail_rank1(scenario)
            got = mc.all_sum(x)
            print(f"WRONGRESULT rank {r} all_sum returned {got.tolist()} without rank 1", flush=True)
        elif scenario in ("dtype", "count"):
            if r == 0:
                print(f"FAILPOINT {time.time():.3f}", flush=True)
                mc.send(np.arange(4, dtype=np.float64), 1)  # 32 bytes either way in "dtype"
            elif r == 1:
                shape, dt = ((8,), np.float32) if scenario == "dtype" else ((6,), np.float64)
                got = mc.recv(shape, dt, 0)
                print(f"WRONGRESULT rank 1 recv returned {got.tolist()}", flush=True)
            g.barrier()
        elif scenario == "collsend":
            if r == 1:
                print(f"FAILPOINT {time.time():.3f}", flush=True)
                mc.send(x, 0)
                got = mc.recv_like(x, 0)
            else:
                got = mc.all_sum(x)
            print(f"WRONGRESULT rank {r} returned {got.tolist()}", flush=True)
        else:
            raise SystemExit(f"unknown scenario {scenario}")
    except mc.DistributedError as exc:
        # on stderr, like the traceback that follows (MPICH's Hydra may drop a killed rank's stdout)
        print(
            f"CAUGHT rank {r} {type(exc).__name__} peer={getattr(exc, 'peer', None)}: {exc}",
            file=sys.stderr,
            flush=True,
        )
        raise
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1]))


# -- pytest side ----------------------------------------------------------------------------------
import pytest  # noqa: E402

pytest.importorskip("mpi4py")
from meshcomm_mpi.environment import unavailable_reason  # noqa: E402

if unavailable_reason() is not None:  # pragma: no cover - depends on the machine
    pytest.skip(f"mpi backend unavailable: {unavailable_reason()}", allow_module_level=True)

from jobs import MPI_RUNTIME_NOT_STARTED, without_launch_vars  # noqa: E402
from meshcomm_mpi.launcher import mpiexec_command, resolve_mpiexec  # noqa: E402

FLAVOR = resolve_mpiexec()[1]


def _env() -> dict[str, str]:
    return without_launch_vars(PYTHONUNBUFFERED="1", MLX_TIMEOUT=str(TIMEOUT), MLX_BACKEND="mpi")


def _start_job(n: int, code: str, *, mlx_timeout: int) -> subprocess.Popen[str]:
    """An ``n``-rank mpiexec job of ``python -c code``, its output on one pipe."""
    return subprocess.Popen(
        mpiexec_command(n, [sys.executable, "-c", code]),
        env={**_env(), "MLX_TIMEOUT": str(mlx_timeout)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _leftovers(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]


def _cleanup(marker: str) -> None:
    for sig in ("-CONT", "-KILL"):
        subprocess.run(["pkill", sig, "-f", marker], capture_output=True)


def _run(scenario: str, via: str) -> tuple[int, str, float]:
    """Run a 3-rank job; (exit code, output, seconds from the failure to the job's end).
    A job whose MPI runtime did not start (no rank ran) is started once more."""
    code, out, end = _run_once(scenario, via)
    if MPI_RUNTIME_NOT_STARTED in out and "FAILPOINT" not in out:
        code, out, end = _run_once(scenario, via)
    points = [float(line.split("FAILPOINT", 1)[1].split()[0]) for line in out.splitlines() if "FAILPOINT" in line]
    assert points, f"{scenario} via {via}: the failing rank never reached its failure point:\n{out[-4000:]}"
    return code, out, end - min(points)


def _run_once(scenario: str, via: str) -> tuple[int, str, float]:
    """One 3-rank job: (exit code, output, when it ended); fails if it left processes behind."""
    marker = f"mpifail-{uuid.uuid4().hex[:12]}"
    prog = [sys.executable, str(HERE), scenario, marker]
    if via == "mpiexec":
        cmd = mpiexec_command(3, prog)
    else:
        cmd = [sys.executable, "-m", "meshcomm", "launch", "-n", "3", "--backend", "mpi", "--", *prog[1:]]
    try:
        res = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=120, cwd=HERE.parent.parent)
        end = time.time()
    except subprocess.TimeoutExpired as exc:
        _cleanup(marker)
        raise AssertionError(f"{scenario} via {via}: the job did not end in 120 s:\n{exc.stdout}{exc.stderr}") from None
    finally:
        deadline = time.monotonic() + 5
        while _leftovers(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _leftovers(marker)
        _cleanup(marker)
    out = res.stdout + res.stderr
    assert not left, f"{scenario} via {via}: processes left behind:\n{left}\n{out[-3000:]}"
    return res.returncode, out, end


def _caught(out: str) -> dict[int, str]:
    """rank -> 'ErrorClass peer=P: message' from the CAUGHT lines (Hydra may glue two ranks' lines)."""
    found: dict[int, str] = {}
    for m in re.finditer(r"CAUGHT rank (\d+) (.*?)(?=CAUGHT rank |\n|$)", out):
        found.setdefault(int(m.group(1)), m.group(2))
    return found


def _check(
    scenario: str,
    via: str,
    code: int,
    out: str,
    took: float,
    *,
    cls: str,
    ranks: tuple[int, ...],
    peer: str | None = "1",
    want_code: int | None = None,
    names: str = "rank 1",
) -> None:
    where = f"{scenario} via {via}"
    assert "WRONGRESULT" not in out, f"{where}: a wrong result was printed:\n{out[-4000:]}"
    assert took < TIMEOUT + 5, (
        f"{where}: the job ended {took:.1f} s after the failure (MLX_TIMEOUT={TIMEOUT})\n{out[-3000:]}"
    )
    assert code != 0, f"{where}: the job exited 0:\n{out[-4000:]}"
    if want_code is not None:
        assert code == want_code, f"{where}: exit code {code}, want {want_code}:\n{out[-4000:]}"
    caught = _caught(out)
    for r in ranks:
        assert r in caught, f"{where}: rank {r} did not raise a DistributedError:\n{out[-5000:]}"
        text = caught[r]
        assert text.startswith(cls), f"{where}: rank {r} raised {text[:300]}, want {cls}"
        if peer is not None:
            assert text.startswith(f"{cls} peer={peer}:"), f"{where}: rank {r}: {text[:300]}"
        assert names in text, f"{where}: rank {r}'s error does not name {names}: {text[:400]}"


@pytest.mark.parametrize("via", ["mpiexec", "launch"])
def test_rank_raises(via: str) -> None:
    code, out, took = _run("raise", via)
    _check("raise", via, code, out, took, cls="PeerLostError", ranks=(0, 2), want_code=1)
    assert "KeyError" in _caught(out)[0], out[-3000:]


@pytest.mark.parametrize("via", ["mpiexec", "launch"])
def test_rank_exits_3(via: str) -> None:
    code, out, took = _run("exit3", via)
    # the launcher's rank runner aborts with the program's code; under a bare mpiexec the
    # survivors end the job (code 1) after rank 1's exit notice
    _check("exit3", via, code, out, took, cls="PeerLostError", ranks=(0, 2), want_code=3 if via == "launch" else None)


def test_rank_exits_0_early() -> None:
    code, out, took = _run("exit0", "mpiexec")
    _check("exit0", "mpiexec", code, out, took, cls="PeerLostError", ranks=(0, 2))
    assert "exited (its program ended)" in _caught(out)[0], out[-3000:]


@pytest.mark.exclusive
def test_rank_sigkilled() -> None:
    """mpiexec itself ends the job when a rank dies. Open MPI's sends the survivors SIGTERM
    0.25 s after the death and SIGKILL 0.25 s later: a survivor that has not looked at rank 1
    yet looks then, so both name rank 1 (on a machine this busy with other tests a survivor
    may not run at all in that half second: the test has the machine to itself). MPICH's
    Hydra kills them at once: those that print name rank 1."""
    code, out, took = _run("sigkill", "mpiexec")
    survivors = (0, 2) if FLAVOR == "openmpi" else ()
    _check("sigkill", "mpiexec", code, out, took, cls="PeerLostError", ranks=survivors)
    for r, text in _caught(out).items():
        assert text.startswith("PeerLostError peer=1:"), f"rank {r}: {text[:300]}"


def test_sigterm_to_a_waiting_rank_with_live_peers_still_ends_it() -> None:
    """A SIGTERM from anyone but a teardown after a death (a user, a batch system) still ends
    a waiting rank: its own handler, installed before init, runs as before; no meshcomm error on it."""
    code = (
        "import os, signal, sys, time, numpy as np\n"
        "def mine(signum, frame):\n"
        "    print('USER HANDLER', signum, flush=True); os._exit(7)\n"
        "signal.signal(signal.SIGTERM, mine)\n"
        "import meshcomm as mc\n"
        "g = mc.init(strict=True, backend='mpi')\n"
        "g.barrier()\n"
        "if g.rank() == 0:\n"
        "    print('WAITING', os.getpid(), flush=True)\n"
        "    mc.recv((2,), np.float64, 1)\n"
        "    print('WRONGRESULT', flush=True)\n"
        "else:\n"
        "    time.sleep(60)\n"
    )
    proc = _start_job(2, code, mlx_timeout=60)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "WAITING" in line:
                time.sleep(0.3)  # inside the wait loop
                os.kill(int(line.split("WAITING", 1)[1].split()[0]), signal.SIGTERM)
                break
        out = "".join(lines) + proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
        proc.wait()
    assert "USER HANDLER 15" in out, out[-3000:]
    # rank 1, asleep outside meshcomm, may be sent mpiexec's SIGTERM after rank 0 is gone: it
    # then raises PeerLostError naming rank 0 (a teardown after a death), which is not rank 0's
    assert proc.returncode != 0 and "WRONGRESULT" not in out and "Error: [mpi] rank 0:" not in out, out[-3000:]


def test_teardown_watch_passes_an_unclaimed_sigterm_on() -> None:
    """Outside a wait (or with nobody dead) the watch does what SIGTERM did before it: the
    default action ends the process by the signal."""
    code = (
        "import os, signal\n"
        "from meshcomm_mpi.teardown import TermWatch\n"
        "w = TermWatch(); w.install(lambda: True, lambda: None)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('HEARD', w.heard, flush=True)\n"
        "w.pass_on()\n"
        "print('STILL HERE', flush=True)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout == "HEARD True\n" and res.returncode == -signal.SIGTERM, (res.returncode, res.stdout, res.stderr)


@pytest.mark.parametrize("dead", [True, False])
def test_teardown_watch_outside_a_wait_raises_a_dead_peer_or_ends(dead: bool) -> None:
    """Outside a wait, a SIGTERM with a dead local peer raises its error where the program
    is (as SIGINT raises KeyboardInterrupt), and the next SIGTERM ends the process; with
    nobody dead the first one ends it."""
    lost = "KeyError('rank 1 died')" if dead else "None"
    code = (
        "import os, signal, time\n"
        "from meshcomm_mpi.teardown import TermWatch\n"
        f"w = TermWatch(); w.install(lambda: False, lambda: {lost})\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
        "except KeyError as exc:\n"
        "    print('RAISED', exc, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
        "print('STILL HERE', flush=True)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    want = "RAISED 'rank 1 died'\n" if dead else ""
    assert res.stdout == want and res.returncode == -signal.SIGTERM, (res.returncode, res.stdout, res.stderr)


@pytest.mark.parametrize("via", ["mpiexec", "launch"])
def test_rank_sigstopped(via: str) -> None:
    code, out, took = _run("sigstop", via)
    _check("sigstop", via, code, out, took, cls="CommTimeoutError", ranks=(0, 2))
    assert "stopped" in _caught(out)[0] + _caught(out)[2], out[-3000:]


@pytest.mark.parametrize("scenario", ["dtype", "count"])
def test_send_recv_mismatch(scenario: str) -> None:
    code, out, took = _run(scenario, "mpiexec")
    _check(
        scenario,
        "mpiexec",
        code,
        out,
        took,
        cls="CollectiveMismatchError",
        ranks=(1,),
        peer=None,
        names="rank 0's send carries 4 elements of float64",
    )
    for r, text in _caught(out).items():
        assert text.startswith("CollectiveMismatchError"), f"rank {r}: {text[:300]}"


def test_collective_met_by_send() -> None:
    code, out, took = _run("collsend", "mpiexec")
    _check(
        "collsend", "mpiexec", code, out, took, cls="CollectiveMismatchError", ranks=(0, 2), peer=None, names="rank 1"
    )
    # rank 1 sends to rank 0, then receives from it: asked at rank 0's deadline, it is in one of
    # the two (on a loaded machine MPICH may not have completed the small send yet); when rank 1
    # reached its receive before rank 0 reached the all_sum, rank 1's own deadline comes first
    # and rank 0 is told what rank 1 waited in when it gave up
    said = _caught(out)[0]
    assert re.search(r"rank 1 (is|waited \S+ s \(MLX_TIMEOUT\)) in (recv #1 from|send #1 to) rank 0", said), said


def test_normal_job_is_not_disturbed() -> None:
    """Every rank ends normally: no false alarm, no hang in MPI_Finalize, exit 0."""
    code = (
        "import meshcomm as mc, numpy as np\n"
        "g = mc.init(strict=True, backend='mpi')\n"
        "for i in range(50):\n"
        "    mc.all_sum(np.ones(3))\n"
        "    if g.rank() == 0: mc.send(np.ones(2), 1)\n"
        "    if g.rank() == 1: mc.recv((2,), np.float64, 0)\n"
        "sub = g.split(g.rank() % 2)\n"
        "mc.all_sum(np.ones(2), group=sub)\n"
        "print('DONE', g.rank(), flush=True)\n"
    )
    res = subprocess.run(
        mpiexec_command(3, [sys.executable, "-c", code]), env=_env(), capture_output=True, text=True, timeout=120
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0 and out.count("DONE") == 3, out[-3000:]
    assert "Error" not in out, out[-3000:]


def test_mpiexec_killed_leaves_no_rank() -> None:
    """SIGKILL of mpiexec: every rank dies with it (parent-death signal), none spins on."""
    marker = f"mpifail-{uuid.uuid4().hex[:12]}"
    code = (
        f"# {marker}\nimport meshcomm as mc, numpy as np, time\ng = mc.init(strict=True, backend='mpi')\n"
        "g.barrier()\nprint('READY', flush=True)\nmc.recv((2,), np.float64, (g.rank() + 1) % g.size())\n"
    )
    proc = _start_job(3, code, mlx_timeout=600)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        seen, text = 0, ""
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while seen < 3 and time.monotonic() < deadline:
                if not sel.select(timeout=1):
                    continue
                chunk = os.read(proc.stdout.fileno(), 65536).decode(errors="replace")
                if not chunk:
                    break
                text += chunk
                seen = text.count("READY")
        assert seen == 3, f"the job did not start:\n{text[-3000:]}"
        assert len(_leftovers(marker)) >= 3
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while _leftovers(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _leftovers(marker)
        assert not left, f"ranks outlived their mpiexec: {left}"
    finally:
        proc.kill()
        _cleanup(marker)

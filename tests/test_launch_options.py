"""``meshcomm launch`` options of issue 15, with real local jobs on sockets, mpi and gloo.

* ``--hosts a:2,b:2`` / ``--ranks-per-host N`` / hostfile ``slots`` (and ``-n`` left out);
* ``--backend=X`` and ``--backend X`` both override a hostfile's ``backend``; without the
  option the hostfile's is used;
* ``MLX_RANK``, ``MLX_WORLD_SIZE``, ``MLX_LOCAL_RANK``, ``MLX_LOCAL_SIZE`` and the ``[rank R] ``
  prefix on every backend (mpi too, also for a program that is not Python);
* ``--log-dir DIR``: one file per rank with exactly that rank's lines;
* ``--launcher``: local refuses other hosts, slurm without its module is a clear error,
  auto's choice;
* ``launch(LaunchOptions(...))`` called from Python.

The ssh side (one ssh session per host) is in ``test_launch_multihost.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from meshcomm.launch.hosts import Host, job_size, parse_hosts_arg, place_ranks
from meshcomm.launch.run import THREAD_VARS
from meshcomm.launch.starters import STARTERS, choose, starter_name
from meshcomm.protocol.errors import ConfigError
from test_launch import (
    RANK_PROG,
    SHOW_ENV,
    assert_no_leftovers,
    check_results,
    job_env,
    launch_cmd,
    parse_infos,
    prefixed_lines,
    recorded_pids,
    run_launch,
    show,
)

#: ``env`` prints ``ENV {json}`` (meshcomm's rank variables, and the group's rank and size
#: after mc.init()), then two lines on stdout and one on stderr, all naming the rank
PROG = """
import json, os, sys
d = os.environ.get("MC_TEST_PIDDIR")
if d:
    with open(os.path.join(d, f"rank-{os.environ.get('MLX_RANK', 'x')}-{os.getpid()}.pid"), "w") as f:
        f.write(str(os.getpid()))
import meshcomm as mc
g = mc.init(strict=True)
names = ("MLX_RANK", "MLX_WORLD_SIZE", "MLX_LOCAL_RANK", "MLX_LOCAL_SIZE", "MLX_BACKEND")
info = {k: os.environ.get(k) for k in names}
info.update(rank=g.rank(), size=g.size(), backend=g.backend)
print("ENV " + json.dumps(info), flush=True)
for i in range(2):
    print(f"OUT rank={g.rank()} line={i}", flush=True)
print(f"ERR rank={g.rank()}", file=sys.stderr, flush=True)
g.barrier()
"""


def prog(folder: Path) -> str:
    path = folder / "env_prog.py"
    path.write_text(PROG)
    return str(path)


def envs(stdout: bytes, n: int) -> dict[int, dict]:
    """Each rank's ENV line (the prefix must be that rank's)."""
    got: dict[int, dict] = {}
    for tag, rest in prefixed_lines(stdout):
        if rest.startswith(b"ENV "):
            info = json.loads(rest[4:])
            assert info["rank"] == tag, f"rank {info['rank']}'s line is prefixed [rank {tag}]"
            got[tag] = info
    assert sorted(got) == list(range(n)), f"ENV lines from ranks {sorted(got)}"
    return got


def _reason(backend: str) -> str | None:
    from meshcomm.runtime.registry import get_registry

    spec = get_registry().specs.get(backend)
    return f"backend {backend} is not installed" if spec is None else spec.unavailable_reason()


BACKENDS = [
    pytest.param(b, marks=pytest.mark.skipif(bool(_reason(b)), reason=str(_reason(b))))
    for b in ("sockets", "mpi", "gloo")
]


# -- ranks per host ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,n,local_size",
    [
        (["--hosts", "localhost:3"], 3, 3),
        (["--ranks-per-host", "2"], 2, 2),
        (["--hosts", "localhost", "--ranks-per-host", "3"], 3, 3),
        (["--hosts", "localhost:2,127.0.0.1:2"], 4, 4),  # one machine named twice: one local numbering
        (["-n", "2", "--hosts", "localhost:3"], 2, 2),  # -n may use fewer ranks than the slots
    ],
    ids=["hosts:count", "ranks-per-host", "hosts+ranks-per-host", "same-machine-twice", "n-below-slots"],
)
def test_ranks_per_host_without_n(args: list[str], n: int, local_size: int, tmp_path: Path) -> None:
    p = run_launch(*args, "--timeout", "60", prog(tmp_path), piddir=tmp_path)
    assert p.returncode == 0, show(p)
    got = envs(p.stdout, n)
    for r, info in got.items():
        assert info["size"] == n and info["MLX_WORLD_SIZE"] == str(n), info
        assert (info["MLX_RANK"], info["MLX_LOCAL_RANK"], info["MLX_LOCAL_SIZE"]) == (str(r), str(r), str(local_size))
    assert_no_leftovers(tmp_path, n)


def test_hostfile_slots_give_the_job_size(tmp_path: Path) -> None:
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps([{"ssh": "localhost", "slots": 3}]))
    p = run_launch("--hostfile", str(hf), prog(tmp_path), piddir=tmp_path)
    assert p.returncode == 0, show(p)
    assert len(envs(p.stdout, 3)) == 3


@pytest.mark.parametrize(
    "args,words",
    [
        (["--hosts", "localhost"], ["-n is missing", "--ranks-per-host"]),
        (["-n", "5", "--hosts", "localhost:2"], ["-n 5", "2 slots"]),
        (["-n", "2", "--hosts", "localhost:0"], ["at least 1"]),
        (["-n", "2", "--ranks-per-host", "0"], ["--ranks-per-host 0"]),
        (["-n", "2", "--launcher", "local", "--hosts", "node-a,node-b"], ["--launcher local", "node-a"]),
    ],
    ids=["no-n-no-counts", "n-above-slots", "zero-count", "zero-per-host", "local-with-remote-hosts"],
)
def test_bad_counts_exit_2(args: list[str], words: list[str], tmp_path: Path) -> None:
    p = run_launch(*args, prog(tmp_path), piddir=tmp_path)
    assert p.returncode == 2, show(p)
    err = p.stderr.decode().strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshcomm launch: error: "), show(p)
    for w in words:
        assert w in err[0], f"{w!r} not in {err[0]!r}"
    assert not recorded_pids(tmp_path) and p.stdout == b""


def test_hosts_parsing_and_placement() -> None:
    hf = parse_hosts_arg("a:2, user@b ,[fe80::1]:3,fe80::2")
    assert [(h.ssh, h.slots) for h in hf.hosts] == [("a", 2), ("user@b", None), ("[fe80::1]", 3), ("fe80::2", None)]
    with pytest.raises(ConfigError, match="at least 1"):
        parse_hosts_arg("a:0")
    hosts = [Host(ssh="a", slots=2), Host(ssh="b"), Host(ssh="a")]
    assert job_size(None, hosts, ranks_per_host=3) == 8
    assert job_size(6, hosts) == 6
    places = place_ranks(8, hosts, ranks_per_host=3)
    assert [(p.host, p.local_index) for p in places] == [
        ("a", 0),
        ("a", 1),
        ("b", 0),
        ("b", 1),
        ("b", 2),
        ("a", 2),
        ("a", 3),
        ("a", 4),
    ]
    # a starter that starts even this machine's ranks itself: no place is "this machine"
    assert [p.host for p in place_ranks(2, [Host(ssh="localhost")], local_ranks=False)] == ["localhost"] * 2


# -- --backend --------------------------------------------------------------------------------------


@pytest.mark.skipif(bool(_reason("gloo")), reason=str(_reason("gloo")))
@pytest.mark.parametrize(
    "how,want",
    [([], "gloo"), (["--backend=sockets"], "sockets"), (["--backend", "sockets"], "sockets")],
    ids=["hostfile's", "--backend=X", "--backend X"],
)
def test_backend_option_overrides_the_hostfile(how: list[str], want: str, tmp_path: Path) -> None:
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps({"backend": "gloo", "hosts": [{"ssh": "localhost", "slots": 2}]}))
    p = run_launch(*how, "--hostfile", str(hf), prog(tmp_path), piddir=tmp_path)
    assert p.returncode == 0, show(p)
    for info in envs(p.stdout, 2).values():
        assert info["backend"] == want and info["MLX_BACKEND"] == want, info


@pytest.mark.skipif(bool(_reason("gloo")), reason=str(_reason("gloo")))
@pytest.mark.parametrize(
    "env,how,want",
    [
        ({"MLX_BACKEND": "gloo"}, [], "gloo"),
        ({"MLX_BACKEND": " GLOO "}, [], "gloo"),  # normalised as init() normalises it
        ({"MLX_BACKEND": "gloo"}, ["--backend", "sockets"], "sockets"),
        ({"MLX_BACKEND": "any"}, [], "sockets"),  # MLX_BACKEND's default names no backend
        ({"MLX_BACKEND": "sockets"}, ["--env", "MLX_BACKEND=gloo"], "gloo"),
    ],
    ids=["exported", "exported-spaced-upper", "--backend-overrides", "any-is-the-default", "--env-overrides"],
)
def test_exported_mlx_backend_chooses_the_backend(
    env: dict[str, str], how: list[str], want: str, tmp_path: Path
) -> None:
    p = run_launch("-n", "2", *how, prog(tmp_path), piddir=tmp_path, env=env)
    assert p.returncode == 0, show(p)
    for info in envs(p.stdout, 2).values():
        assert info["backend"] == want and info["MLX_BACKEND"] == want, info


# -- rank variables and prefix on every backend -------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_rank_variables_and_prefix_on_every_backend(backend: str, tmp_path: Path) -> None:
    n = 3
    p = run_launch(
        "-n", str(n), f"--backend={backend}", "--timeout", "60", prog(tmp_path), piddir=tmp_path, timeout=120
    )
    assert p.returncode == 0, show(p)
    got = envs(p.stdout, n)  # every stdout line is "[rank R] ..." (no "[1,2]<stdout>:")
    for r, info in got.items():
        assert info["backend"] == backend and info["size"] == n, info
        assert info["MLX_RANK"] == str(r) and info["MLX_WORLD_SIZE"] == str(n), info
        assert info["MLX_LOCAL_SIZE"] == str(n), info
        if backend != "mpi":
            assert info["MLX_LOCAL_RANK"] == str(r), info
    # under mpiexec the local rank is MPI's (Open MPI 5 may number a host's ranks out of order)
    assert sorted(info["MLX_LOCAL_RANK"] for info in got.values()) == [str(r) for r in range(n)], got
    out = sorted(rest for _, rest in prefixed_lines(p.stdout) if rest.startswith(b"OUT"))
    assert out == sorted(f"OUT rank={r} line={i}".encode() for r in range(n) for i in range(2)), show(p)
    err = [(tag, rest) for tag, rest in prefixed_lines(p.stderr)]  # stderr prefixed as well
    assert sorted(err) == [(r, f"ERR rank={r}".encode()) for r in range(n)], show(p)
    assert_no_leftovers(tmp_path, n)


@pytest.mark.skipif(bool(_reason("mpi")), reason=str(_reason("mpi")))
def test_non_python_program_under_mpi_gets_rank_variables_and_prefix() -> None:
    p = run_launch("-n", "2", "--backend", "mpi", str(SHOW_ENV), "a b")
    assert p.returncode == 0, show(p)
    by_rank: dict[int, list[bytes]] = {0: [], 1: []}
    for r, rest in prefixed_lines(p.stdout):
        by_rank[r].append(rest)
    for r in (0, 1):
        assert by_rank[r] == [f"SHELL_RANK rank={r} size=2 bash=yes nargs=1".encode(), b"ARG <a b>"], show(p)


# -- --log-dir --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_log_dir_has_one_file_per_rank(backend: str, tmp_path: Path) -> None:
    n = 3
    logs = tmp_path / "logs" / "new"  # made by the launcher
    p = run_launch(
        "-n",
        str(n),
        "--backend",
        backend,
        "--log-dir",
        str(logs),
        "--timeout",
        "60",
        prog(tmp_path),
        piddir=tmp_path,
        timeout=120,
    )
    assert p.returncode == 0, show(p)
    envs(p.stdout, n)  # the terminal still gets every line, prefixed
    assert sorted(f.name for f in logs.iterdir()) == [f"rank-{r}.log" for r in range(n)]
    for r in range(n):
        lines = (logs / f"rank-{r}.log").read_bytes().splitlines()
        assert not any(line.startswith(b"[rank") for line in lines), lines  # unprefixed
        assert [x for x in lines if x.startswith(b"OUT")] == [f"OUT rank={r} line={i}".encode() for i in range(2)]
        assert [x for x in lines if x.startswith(b"ERR")] == [f"ERR rank={r}".encode()], lines
        assert len([x for x in lines if x.startswith(b"ENV ")]) == 1, lines
        assert all(f"rank={r}".encode() in x or x.startswith(b"ENV ") for x in lines), lines
    assert_no_leftovers(tmp_path, n)


def test_log_dir_that_cannot_be_made_is_an_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    p = run_launch("-n", "1", "--log-dir", str(blocker / "logs"), prog(tmp_path), piddir=tmp_path)
    assert p.returncode == 2, show(p)
    assert b"--log-dir" in p.stderr and not recorded_pids(tmp_path), show(p)


# -- --launcher ---------------------------------------------------------------------------------------


def test_launcher_choice() -> None:
    assert starter_name("ssh", {}) == "ssh" and starter_name("local", {"SLURM_JOB_ID": "7"}) == "local"
    assert starter_name("auto", {}) == "ssh"
    slurm_present = (
        Path(__file__).resolve().parent.parent / "core" / "meshcomm" / "launch" / "starters" / f"{STARTERS['slurm']}.py"
    ).exists()
    assert starter_name("auto", {"SLURM_JOB_ID": "7"}) == ("slurm" if slurm_present else "ssh")


def test_local_launcher_runs_local_ranks(tmp_path: Path) -> None:
    p = run_launch("-n", "2", "--launcher", "local", str(RANK_PROG), "info", piddir=tmp_path)
    assert p.returncode == 0, show(p)
    check_results(parse_infos(p.stdout, 2), 2)


def test_slurm_launcher_without_its_module_is_a_clear_error(tmp_path: Path) -> None:
    from meshcomm.launch.options import LaunchOptions
    from meshcomm.launch.starters import _module_present

    if _module_present("slurm"):
        pytest.skip("the slurm starter is installed (its own tests cover it)")
    with pytest.raises(ConfigError, match="slurm"):
        choose(LaunchOptions(program=["x.py"], launcher="slurm"))
    p = run_launch("-n", "1", "--launcher", "slurm", prog(tmp_path), piddir=tmp_path)
    assert p.returncode == 2, show(p)
    assert b"meshcomm.launch.starters.slurm" in p.stderr and not recorded_pids(tmp_path), show(p)


def test_unknown_launcher_is_refused() -> None:
    p = run_launch("-n", "1", "--launcher", "pbs", "x.py")
    assert p.returncode == 2 and b"--launcher" in p.stderr, show(p)


# -- the Python entry point ---------------------------------------------------------------------------


def test_launch_takes_one_options_object(
    capfdbinary: pytest.CaptureFixture[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    from meshcomm.launch import LaunchOptions, launch

    for k in [k for k in os.environ if k.startswith(("MLX_", "MESHCOMM_"))]:
        monkeypatch.delenv(k)
    status = launch(LaunchOptions(program=[str(SHOW_ENV), "x"], nranks=2, env={"MC_TEST_A": "1"}))
    out = capfdbinary.readouterr().out
    assert status == 0, out
    assert sorted(rest for _, rest in prefixed_lines(out)) == sorted(
        [
            b"SHELL_RANK rank=0 size=2 bash=yes nargs=1",
            b"SHELL_RANK rank=1 size=2 bash=yes nargs=1",
            b"ARG <x>",
            b"ARG <x>",
        ]
    )


def test_only_this_very_interpreter_is_run_through_the_rank_runner(tmp_path: Path) -> None:
    """'-- python prog.py' runs in-process through the rank runner only when 'python' is the
    launcher's own interpreter: another version beside it, or the base interpreter a venv
    links to, is run as the command it is."""
    import os
    import sys

    from meshcomm.launch.run import own_python_program

    here = Path(sys.executable)
    assert own_python_program([str(here), "x.py", "a"], str(here)) == ["x.py", "a"]
    assert own_python_program([str(here), "-m", "pkg"], str(here)) == ["-m", "pkg"]
    other = tmp_path / "python3.9"
    other.symlink_to("/bin/true")
    mine = tmp_path / "python3.11"
    mine.symlink_to(os.path.realpath(sys.executable))
    assert own_python_program([str(other), "x.py"], str(mine)) == [str(other), "x.py"]  # another version
    assert own_python_program([str(mine), "x.py"], str(here)) == [str(mine), "x.py"]  # same binary elsewhere
    assert own_python_program(["bash", "x.py"], str(here)) == ["bash", "x.py"]


@pytest.mark.parametrize(
    ("nranks", "user"), [(2, {}), (2, {"OMP_NUM_THREADS": "3"}), (1, {})], ids=["shared-host", "user-set", "one-rank"]
)
def test_ranks_sharing_a_host_split_its_cores_between_their_thread_pools(
    tmp_path: Path, nranks: int, user: dict[str, str]
) -> None:
    """As torchrun does: R ranks on one host get cores // R BLAS/OpenMP threads each (at least
    one), a variable the user set is passed as it is, and a rank alone on its host is left alone."""
    import subprocess

    prog = tmp_path / "threads.sh"
    prog.write_text(
        'printf "THREADS %s %s %s\\n" "${OMP_NUM_THREADS-unset}" "${OPENBLAS_NUM_THREADS-unset}" '
        '"${MKL_NUM_THREADS-unset}"\n'
    )
    env = {k: v for k, v in job_env().items() if k not in THREAD_VARS} | user
    p = subprocess.run(
        launch_cmd("-n", str(nranks), "bash", str(prog)),
        capture_output=True,
        timeout=60,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert p.returncode == 0, show(p)
    split = str(max(1, (os.cpu_count() or 1) // nranks)) if nranks > 1 else "unset"
    want = [user.get(k, split) for k in THREAD_VARS]
    assert [rest.split()[1:] for _, rest in prefixed_lines(p.stdout)] == [[w.encode() for w in want]] * nranks, show(p)

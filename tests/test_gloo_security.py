"""The gloo backend's rendezvous store proves the job secret (issue 14): sealed values, strangers, wrong secrets;
and every value belongs to one start-up (issue 33): an earlier job's values replayed into a new one are refused.

A "stranger" here is a plain TCPStore client in the test process: it knows the store's
address and the key names (they are deterministic) but not the secret. Where a test
needs a rank that never writes its own record, the test process plays that rank's
store connection itself (:func:`_fake_rank`; with rank 1's side of the start-up handshake,
:func:`_rank_1_session`, where rank 0 must get past it), so the forged value is the only one
there is and the outcome does not depend on timing. Rank programs are the ``_w_*`` functions
below (``python this_file.py NAME``).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jobs import connect_when_listening, finish

pytest.importorskip("torch")

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
OURS = (
    "MLX_",
    "MESHCOMM_",
    "GLOO_",
    "MASTER_",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_",
    "SLURM_",
    "OMPI_",
    "PMI",
    "TORCHELASTIC_",
)
PHRASE = "a process without the job secret wrote to the rendezvous store"
SECRET = "s3cret-for-tests"


# -- processes ------------------------------------------------------------------------------
def _free_port() -> int:
    from jobs import free_ports

    return free_ports(1)[0]


def _env(rank: int, n: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(OURS)}
    env.update(
        MLX_BACKEND="gloo",
        MLX_RANK=str(rank),
        MLX_WORLD_SIZE=str(n),
        MLX_TIMEOUT="20",
        PYTHONUNBUFFERED="1",
        MESHCOMM_GLOO_ADDR="127.0.0.1",
        MESHCOMM_GLOO_PORT=str(port),
        MESHCOMM_JOB_SECRET=SECRET,
    )
    env.update(extra or {})
    return {k: v for k, v in env.items() if v != ""}


@contextmanager
def ranks(
    n: int,
    port: int,
    *,
    only: list[int] | None = None,
    worker: str = "_w_sum",
    rank_env: dict[int, dict[str, str]] | None = None,
) -> Iterator[dict[int, subprocess.Popen[str]]]:
    """Start ranks (all, or ``only`` these) of a gloo job; every one is killed on the way out."""
    procs: dict[int, subprocess.Popen[str]] = {}
    try:
        for r in range(n) if only is None else only:
            procs[r] = subprocess.Popen(
                [sys.executable, str(HERE), worker],
                env=_env(r, n, port, (rank_env or {}).get(r)),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
        yield procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.communicate()


def _last_error(err: str) -> str:
    lines = [ln for ln in err.splitlines() if "Error" in ln and ":" in ln and not ln.startswith((" ", "["))]
    return lines[-1] if lines else err[-1500:]


# -- the test process as a store client ------------------------------------------------------
def _client(port: int, n: int, *, counts: bool, timeout: float = 30) -> Any:
    """A TCPStore client of rank 0's store (``counts``: it is one of the ``n`` workers rank 0
    waits for); the client tries to connect for up to ``timeout`` seconds."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", port, n, False, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=counts
    )


def _fake_rank(port: int, n: int) -> Any:
    """Rank 0's store sees a worker connect; that worker writes nothing itself."""
    return _client(port, n, counts=True)


def _sealed(store: Any, secret: str) -> Any:
    from meshcomm_gloo.authstore import AuthStore
    from meshcomm_gloo.sealing import Sealer

    return AuthStore(store, Sealer(secret.encode(), ""))


def _rank_1_session(fake: Any) -> Any:
    """Go through rank 0's start-up handshake as a genuine rank 1 (with the secret) over ``fake``'s
    connection; the sealed store it returns writes what that rank 1 would."""
    from meshcomm_gloo.session import open_session

    store = _sealed(fake, SECRET)
    session = open_session(store, 1, 2)
    assert session.nonce and session.refused is None and session.doubt is None, session
    return store


# -- sealing (no processes) --------------------------------------------------------------------
def test_sealed_value_round_trips_and_binds_key_job_and_value() -> None:
    from meshcomm_gloo.sealing import BadSeal, Sealer

    s = Sealer(b"k", "job1")
    raw = s.seal("meshcomm/proc/1", b"host 42")
    assert s.unseal("meshcomm/proc/1", raw) == b"host 42"
    with pytest.raises(BadSeal, match="tag is wrong"):
        s.unseal("meshcomm/proc/2", raw)  # moved to another key
    with pytest.raises(BadSeal, match="tag is wrong"):
        Sealer(b"k", "job2").unseal("meshcomm/proc/1", raw)  # another job
    with pytest.raises(BadSeal, match="tag is wrong"):
        Sealer(b"other", "job1").unseal("meshcomm/proc/1", raw)  # another secret
    with pytest.raises(BadSeal, match="tag is wrong"):
        s.unseal("meshcomm/proc/1", raw[:-1] + b"3")  # value changed
    with pytest.raises(BadSeal, match="no meshcomm tag"):
        s.unseal("meshcomm/proc/1", b"host 42")
    with pytest.raises(BadSeal, match="writer had no job secret"):
        s.unseal("k", Sealer(b"", "job1").seal("k", b"v"))
    with pytest.raises(BadSeal, match="this rank has none"):
        Sealer(b"", "job1").unseal("k", raw)
    # without a secret the format is the same and values round-trip
    assert Sealer(b"", "").unseal("k", Sealer(b"", "").seal("k", b"v")) == b"v"
    # bound to the start-up's nonce: the same secret, job id, key and value of another start-up fail
    a, b = s.bound(b"n" * 16), s.bound(b"m" * 16)
    assert a.unseal("k", a.seal("k", b"v")) == b"v"
    with pytest.raises(BadSeal, match="for another start-up .*replayed here") as info:
        b.unseal("k", a.seal("k", b"v"))
    assert info.value.replayed
    with pytest.raises(BadSeal, match="tag is wrong") as info:
        Sealer(b"other", "job1", b"m" * 16).unseal("k", a.seal("k", b"v"))  # another secret: not a replay
    assert not info.value.replayed
    with pytest.raises(BadSeal, match="older meshcomm"):
        s.unseal("k", b"mcg1" + bytes(33) + b"v")


def test_auth_store_refuses_forged_values_counters_and_swaps() -> None:
    import torch.distributed as dist
    from meshcomm_gloo.errors import StoreAuthError

    inner = dist.HashStore()
    store = _sealed(inner, SECRET)
    store.set("meshcomm/proc/0", "h 1")
    assert store.get("meshcomm/proc/0") == b"h 1"
    assert store.add("counter", 2) == 2 and store.add("counter", 5) == 7
    assert store.compare_set("meshcomm/proc/0", "h 1", "h 2") == b"h 2"
    assert store.compare_set("meshcomm/proc/0", "wrong", "h 3") == b"h 2"
    assert store.multi_get(["meshcomm/proc/0", "counter"]) == [b"h 2", b"7"]
    inner.set("meshcomm/proc/3", "evil 1")
    with pytest.raises(StoreAuthError, match=PHRASE) as info:
        store.get("meshcomm/proc/3")
    assert info.value.key == "meshcomm/proc/3" and info.value.peer == 3 and "rank 3's record" in str(info.value)
    with pytest.raises(ValueError):  # the store cannot add to a sealed counter: it is not a number
        inner.add("counter", 1)
    inner.set("counter", "8")  # a stranger replaces it with a plain number
    with pytest.raises(StoreAuthError, match="counter"):
        store.add("counter", 1)
    inner.add("fresh", 1)  # or starts one the job will use
    with pytest.raises(StoreAuthError, match="fresh"):
        store.add("fresh", 1)
    inner.set("swap", "evil")
    with pytest.raises(StoreAuthError, match="swap"):
        store.compare_set("swap", "evil", "mine")
    assert store.rejected is not None and store.rejected.key == "meshcomm/proc/3"


def test_auth_store_namespace_is_part_of_the_sealed_key() -> None:
    import torch.distributed as dist
    from meshcomm_gloo.authstore import AuthStore
    from meshcomm_gloo.errors import StoreAuthError
    from meshcomm_gloo.sealing import Sealer

    inner = dist.HashStore()
    a = AuthStore(inner, Sealer(b"k", "j"), namespace="run/restart0/")
    b = AuthStore(inner, Sealer(b"k", "j"), namespace="run/restart1/")
    a.set("x", "1")
    inner.set("run/restart1/x", inner.get("run/restart0/x"))  # replay into the next restart's namespace
    with pytest.raises(StoreAuthError, match="run/restart1/x"):
        b.get("x")


def test_job_id_names_the_scheduler_that_placed_the_rank() -> None:
    from meshcomm.runtime.config import Config, load_settings
    from meshcomm_gloo.placing import job_id, resolve
    from meshcomm_gloo.settings import GlooSettings

    slurm = {"SLURM_JOB_ID": "812", "SLURM_STEP_ID": "3"}
    pmix = {"PMIX_NAMESPACE": "prterun-vm-25306@1"}  # what Open MPI 5's mpirun sets (and srun --mpi=pmix)
    assert job_id(slurm, "Slurm") == job_id(slurm) == "slurm 812.3"
    assert job_id({**slurm, "SLURM_HET_JOB_ID": "810"}, "Slurm") == "slurm 810.3"  # every component alike
    assert job_id({"SLURM_JOB_ID": "812"}) == ""  # a batch script, not a task of a step
    assert job_id(pmix, "Open MPI") == job_id(pmix, "PMIx") == job_id(pmix) == "pmix prterun-vm-25306@1"
    assert job_id({"OMPI_MCA_ess_base_jobid": "1234"}, "Open MPI") == "openmpi 1234"  # Open MPI 4
    assert job_id({"OMPI_MCA_orte_ess_jobid": "99"}) == "openmpi 99"
    # meshcomm launch's and torchrun's ids first; a scheduler's only from the scheduler that placed the rank
    assert job_id({**slurm, **pmix, "MESHCOMM_JOB_ID": "abc"}, "Slurm") == "abc"
    assert job_id({**slurm, "TORCHELASTIC_RUN_ID": "run1"}, "torchrun") == "run1"
    assert job_id({**slurm, **pmix}, "Open MPI") == "pmix prterun-vm-25306@1"
    assert job_id({**slurm, **pmix}, "MLX_RANK") == job_id(pmix, "MPICH (PMI)") == ""

    def rdv(env: dict[str, str]) -> Any:
        return resolve(Config.load(env), load_settings(GlooSettings, environ=env), env)

    step = {**slurm, "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "MLX_COORDINATOR": "node1:2000"}
    assert rdv(step).job == "slurm 812.3"
    assert rdv({**step, "MLX_RANK": "1", "MLX_WORLD_SIZE": "2"}).job == ""  # placed by hand: no scheduler id


def _pair(inner: Any) -> tuple[Any, Any]:
    """Rank 0's and rank 1's sealed stores over one inner store (no job id: ranks started by hand)."""
    return _sealed(inner, SECRET), _sealed(inner, SECRET)


def _in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    got: list[Any] = []

    def run() -> None:
        try:
            got.append(fn(*args))
        except Exception as exc:  # noqa: BLE001 - handed to the test
            got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, got


def test_session_nonce_is_rank_0s_and_an_earlier_jobs_values_fail() -> None:
    import torch.distributed as dist
    from meshcomm_gloo.admission import admit
    from meshcomm_gloo.errors import StoreAuthError
    from meshcomm_gloo.session import open_session

    # job A: both ranks agree on rank 0's nonce; their records pass
    a = dist.HashStore()
    a.set_timeout(datetime.timedelta(seconds=10))
    a0, a1 = _pair(a)
    t, got1 = _in_thread(open_session, a1, 1, 2)
    s0 = open_session(a0, 0, 2)
    t.join(10)
    s1 = got1[0]
    assert s0.nonce == s1.nonce and len(s0.nonce) == 16 and s0.challenges[1]
    t, peers1 = _in_thread(admit, a1, 1, 2, s1)
    assert len(admit(a0, 0, 2, s0)) == 2
    t.join(10)
    assert len(peers1[0]) == 2
    recorded = {
        k: bytes(a.get(k))
        for k in ("meshcomm/session/hello/1", "meshcomm/session/nonce/1", "meshcomm/proc/0", "meshcomm/proc/1")
    }

    # job B, rank 0: A's challenge and A's rank-1 record replayed in rank 1's place
    b = dist.HashStore()
    b.set_timeout(datetime.timedelta(seconds=10))
    b0, _ = _pair(b)
    b.set("meshcomm/session/hello/1", recorded["meshcomm/session/hello/1"])
    sb = open_session(b0, 0, 2)
    assert sb.nonce != s0.nonce
    b.set("meshcomm/proc/1", recorded["meshcomm/proc/1"])
    with pytest.raises(StoreAuthError, match="records of rank 1 belong to another start-up") as info:
        admit(b0, 0, 2, sb)
    assert info.value.replayed and "replayed here" in str(info.value)

    # job C, rank 1: A's answer replayed before rank 0 answers; rank 1 refuses it and rank 0 learns why
    c = dist.HashStore()
    c.set_timeout(datetime.timedelta(seconds=10))
    c0, c1 = _pair(c)
    c.set("meshcomm/session/nonce/1", recorded["meshcomm/session/nonce/1"])
    sc1 = open_session(c1, 1, 2)
    assert sc1.refused is not None and not sc1.nonce and "replayed here" in str(sc1.refused)
    with pytest.raises(StoreAuthError, match="refused the start-up nonce"):
        admit(c1, 1, 2, sc1)  # publishes its refusal as its record
    sc0 = open_session(c0, 0, 2)
    with pytest.raises(StoreAuthError, match="rank 1 did not take this start-up's nonce.*replayed here"):
        admit(c0, 0, 2, sc0)


# -- strangers during start-up ------------------------------------------------------------------
def _forge(mode: str, stranger: Any, port: int) -> str:
    """Write a forged rank-1 record the way ``mode`` says; the key rank 0 must refuse."""
    key = "meshcomm/proc/1"
    if mode == "plain":
        stranger.set(key, "evil-host 1")
    elif mode == "sealed-without-secret":
        from meshcomm_gloo.sealing import Sealer

        stranger.set(key, Sealer(b"", "").seal(key, b"evil-host 1"))
    elif mode == "replayed-from-rank-0":
        stranger.wait(["meshcomm/proc/0"])
        stranger.set(key, stranger.get("meshcomm/proc/0"))
    elif mode == "add":
        stranger.add(key, 7)
    else:
        raise AssertionError(mode)
    return key


@pytest.mark.parametrize("mode", ["plain", "sealed-without-secret", "replayed-from-rank-0", "add"])
def test_stranger_writing_a_rank_record_is_refused(mode: str) -> None:
    port = _free_port()
    with ranks(2, port, only=[0]) as procs:
        stranger = _client(port, 2, counts=False)
        fake = _fake_rank(port, 2)
        _rank_1_session(fake)  # rank 1 takes the nonce; its record is the stranger's
        key = _forge(mode, stranger, port)
        rc, out, err = finish(procs)[0]
        del stranger, fake
    assert rc != 0 and "SUM" not in out, (out, err[-3000:])
    last = _last_error(err)
    assert "StoreAuthError" in last and PHRASE in last and repr(key) in last and "rank 1" in last, err[-3000:]


def test_stranger_forging_gloo_address_is_refused() -> None:
    """Rank 1's start-up record is genuine (written with the secret); its gloo address is a stranger's."""
    import json

    from meshcomm_gloo.liveness import RankProcess

    port = _free_port()
    with ranks(2, port, only=[0]) as procs:
        stranger = _client(port, 2, counts=False)
        fake = _fake_rank(port, 2)
        _rank_1_session(fake).set("meshcomm/proc/1", json.dumps(RankProcess.here().encode()))
        stranger.set("meshcomm/world/0/1", b"\x00" * 64)
        rc, out, err = finish(procs)[0]
        del stranger, fake
    assert rc != 0 and "SUM" not in out, (out, err[-3000:])
    last = _last_error(err)
    assert "StoreAuthError" in last and PHRASE in last and "'meshcomm/world/0/1'" in last, err[-3000:]


def test_stranger_hammering_every_key_never_gives_wrong_data() -> None:
    """A stranger overwrites and bumps every start-up key in a loop while two real ranks start:
    each rank either computes the right sum or fails; a refusal names the phrase."""
    port = _free_port()
    keys = [
        "meshcomm/session/hello/1",
        "meshcomm/session/nonce/1",
        "meshcomm/proc/0",
        "meshcomm/proc/1",
        "meshcomm/world/0/0",
        "meshcomm/world/0/1",
    ]
    stop = threading.Event()
    done: list[int] = []  # writes the stranger got through

    def hammer() -> None:
        try:  # as soon as rank 0's store listens (a TCPStore client that finds no listener
            # backs off for tens of seconds, long after the job ended: nothing would be hammered)
            connect_when_listening(port).close()
            s = _client(port, 2, counts=False)
        except Exception:  # noqa: BLE001 - the job ended before the stranger got in
            return
        i = 0
        while not stop.is_set():
            try:
                if i % 5 == 4:
                    s.add(keys[i % len(keys)], 1)
                else:
                    s.set(keys[i % len(keys)], f"evil {i}")
                done.append(i)
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 ended) or refused an add
                try:  # briefly: once rank 0 has ended, no store comes back
                    s = _client(port, 2, counts=False, timeout=1)
                except Exception:  # noqa: BLE001
                    return
            i += 1

    with ranks(2, port, rank_env={r: {"MLX_TIMEOUT": "10"} for r in range(2)}) as procs:
        t = threading.Thread(target=hammer, daemon=True)
        t.start()
        try:
            res = finish(procs)
        finally:
            stop.set()
            t.join(timeout=60)
    refused = 0
    for r, (rc, out, err) in res.items():
        if rc == 0:
            assert out.strip() == f"SUM {r} 2 3.0", (r, out, err[-2000:])
        else:
            assert "SUM" not in out, (r, out)
            refused += PHRASE in err
    assert refused or all(rc == 0 for rc, _, _ in res.values()), res
    assert done, "the stranger never got a write through: the test hammered nothing"


# -- an earlier job's records replayed into a new job (issue 33, item 6) -------------------------
# Job A and job B share the secret and have no job id (nothing in their environment names one:
# started by hand, as under srun or mpirun without meshcomm launch). A replayer that could reach
# A's store recorded its start-up values and writes them into B's store.
JOB_ID_VARS = ("MESHCOMM_JOB_ID", "TORCHELASTIC_", "SLURM_", "PMIX_", "OMPI_")
#: MLX_TIMEOUT of job B's ranks: a replay must end them well before it
REPLAY_TIMEOUT = 8.0


def _written_by(q: int, n: int = 2) -> list[str]:
    """The start-up keys rank ``q`` of an ``n``-rank job writes (session keys: rank 0 answers every other rank)."""
    if q == 0:
        mine = [f"meshcomm/session/nonce/{p}" for p in range(1, n)]
    else:
        mine = [f"meshcomm/session/hello/{q}"]
    return [*mine, f"meshcomm/proc/{q}", f"meshcomm/world/0/{q}", f"meshcomm/world/meshcomm-ends/{q}"]


@pytest.fixture(scope="module")
def job_a(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Run job A (2 ranks, the secret, no job id) to its sum and record every start-up value of its store."""
    port, release = _free_port(), tmp_path_factory.mktemp("job-a") / "release"
    hold = {r: {"TEST_RELEASE_FILE": str(release)} for r in range(2)}
    with ranks(2, port, worker="_w_sum_hold", rank_env=hold) as procs:
        for r, p in procs.items():
            assert not any(k.startswith(JOB_ID_VARS) for k in _env(r, 2, port, hold[r])), "job A has a job id"
            assert p.stdout is not None
            line = p.stdout.readline()  # the sum: every start-up value is in the store now
            assert line.startswith(f"SUM {r} 2 3.0"), (r, line, p.stderr.read() if p.stderr else "")
        recorder = _client(port, 2, counts=False)
        keys = [k for q in range(2) for k in _written_by(q)]
        recorded = {k: bytes(recorder.get(k)) for k in keys if recorder.check([k])}
        del recorder
        release.touch()
        res = finish(procs)
    assert all(rc == 0 for rc, _, _ in res.values()), res
    assert {f"meshcomm/proc/{q}" for q in range(2)} <= set(recorded), recorded
    return recorded


def _replay(store: Any, recorded: dict[str, bytes], writer: int) -> list[str]:
    """Write job A's values of the keys rank ``writer`` writes into ``store``; the keys replayed."""
    keys = [k for k in _written_by(writer) if k in recorded]
    for k in keys:
        store.set(k, recorded[k])
    return keys


def _ended_by_replay(rc: int, out: str, err: str, elapsed: float) -> None:
    assert rc != 0 and "SUM" not in out, (out, err[-3000:])
    last = _last_error(err)
    assert "StoreAuthError" in last and "replayed" in last, err[-3000:]
    assert elapsed < REPLAY_TIMEOUT, f"the rank took {elapsed:.1f} s, MLX_TIMEOUT is {REPLAY_TIMEOUT:g}: {last}"


def test_rank_0_refuses_an_earlier_jobs_records(job_a: dict[str, bytes]) -> None:
    """Job B's rank 0 runs; all that plays rank 1 is a replayer writing job A's rank-1 values."""
    port = _free_port()
    with ranks(2, port, only=[0], rank_env={0: {"MLX_TIMEOUT": str(REPLAY_TIMEOUT)}}) as procs:
        replayer = _fake_rank(port, 2)  # rank 0's store sees a worker connect: the replayer
        t0 = time.monotonic()
        assert _replay(replayer, job_a, writer=1)
        rc, out, err = finish(procs, timeout=60)[0]
        elapsed = time.monotonic() - t0
        del replayer
    _ended_by_replay(rc, out, err, elapsed)


def test_rank_1_refuses_an_earlier_jobs_records(job_a: dict[str, bytes]) -> None:
    """Job B's rank 1 runs; the replayer hosts B's store in rank 0's place and writes job A's rank-0 values."""
    import torch.distributed as dist

    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    assert _replay(store, job_a, writer=0)
    with ranks(2, port, only=[1], rank_env={1: {"MLX_TIMEOUT": str(REPLAY_TIMEOUT)}}) as procs:
        first = ["meshcomm/session/hello/1", "meshcomm/proc/1"]  # rank 1's first write (before this fix: proc)
        while not any(store.check([k]) for k in first) and procs[1].poll() is None:
            time.sleep(0.02)
        t0 = time.monotonic()
        rc, out, err = finish(procs, timeout=60)[1]
        elapsed = time.monotonic() - t0
    del store
    _ended_by_replay(rc, out, err, elapsed)


def test_replaying_an_earlier_job_into_a_running_start_up_never_hangs(job_a: dict[str, bytes]) -> None:
    """Both ranks of job B run while the replayer writes all of job A's values into B's store again and
    again from the moment it listens: each rank computes the right sum or raises StoreAuthError, and
    none waits past MLX_TIMEOUT."""
    import torch.distributed as dist

    port, stop, listening = _free_port(), threading.Event(), threading.Event()
    writes = [0]

    def replay() -> None:
        try:
            connect_when_listening(port, timeout=60).close()
            listening.set()
            s = dist.TCPStore(
                "127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=5), wait_for_workers=False
            )
            while not stop.is_set():
                for q in range(2):
                    writes[0] += len(_replay(s, job_a, writer=q))
        except Exception:  # noqa: BLE001 - the store is gone: job B ended
            return

    with ranks(2, port, rank_env={r: {"MLX_TIMEOUT": str(REPLAY_TIMEOUT)} for r in range(2)}) as procs:
        t = threading.Thread(target=replay, daemon=True)
        t.start()
        assert listening.wait(60), "job B's store never listened"
        t0 = time.monotonic()
        try:
            res = finish(procs, timeout=60)
            elapsed = time.monotonic() - t0
        finally:
            stop.set()
            t.join(timeout=30)
    assert writes[0], "the replayer wrote nothing into job B's store"
    for r, (rc, out, err) in res.items():
        if rc == 0:
            assert out.strip() == f"SUM {r} 2 3.0", (r, out, err[-2000:])
        else:
            assert "SUM" not in out and "StoreAuthError" in _last_error(err), (r, out, err[-3000:])
    # MLX_TIMEOUT, then a rank's exit (a rank that got past the check waits at most that long in gloo)
    assert elapsed < REPLAY_TIMEOUT + 5, (elapsed, {r: _last_error(e) for r, (_, _, e) in res.items()})


# -- secrets on real ranks ----------------------------------------------------------------------
def test_wrong_secret_on_one_rank_is_named() -> None:
    port = _free_port()
    with ranks(3, port, rank_env={1: {"MESHCOMM_JOB_SECRET": "not-the-secret"}}) as procs:
        res = finish(procs)
    for r, (rc, out, err) in res.items():
        assert rc != 0 and "SUM" not in out, (r, out, err[-2000:])
        last = _last_error(err)
        assert "StoreAuthError" in last, (r, err[-3000:])
        if r == 1:
            assert "this rank (rank 1) has a different MESHCOMM_JOB_SECRET" in last, last
        else:
            assert "the records of rank 1 failed the check" in last and "MESHCOMM_JOB_SECRET" in last, last


def test_rank_without_secret_is_named_as_such() -> None:
    port = _free_port()
    with ranks(2, port, rank_env={1: {"MESHCOMM_JOB_SECRET": ""}}) as procs:
        res = finish(procs)
    rc, _, err = res[0]
    assert rc != 0 and "records of rank 1" in _last_error(err) and "writer had no job secret" in err, err[-3000:]
    rc, _, err = res[1]
    assert rc != 0 and "this rank has none" in err, err[-3000:]


def test_without_secret_it_works_and_rank_0_warns_once() -> None:
    port = _free_port()
    with ranks(3, port, rank_env={r: {"MESHCOMM_JOB_SECRET": ""} for r in range(3)}) as procs:
        res = finish(procs)
    for r, (rc, out, err) in res.items():
        assert rc == 0 and out.split() == ["SUM", str(r), "3", "6.0"], (r, out, err[-2000:])
        assert err.count("MESHCOMM_JOB_SECRET is not set") == (1 if r == 0 else 0), (r, err[-3000:])


def test_require_secret_makes_a_missing_secret_an_error() -> None:
    port = _free_port()
    extra = {"MESHCOMM_JOB_SECRET": "", "MESHCOMM_REQUIRE_SECRET": "1"}
    with ranks(1, port, rank_env={0: extra}) as procs:
        rc, out, err = finish(procs)[0]
    assert rc != 0 and "ConfigError" in err and "MESHCOMM_REQUIRE_SECRET is set" in err, err[-2000:]


def test_with_the_secret_split_groups_work() -> None:
    port = _free_port()
    with ranks(3, port, worker="_w_split") as procs:
        res = finish(procs)
    for r, (rc, out, err) in res.items():
        assert rc == 0 and out.strip() == "SPLIT OK", (r, out, err[-2000:])


# -- rank programs ---------------------------------------------------------------------------
def _w_sum() -> None:
    import meshcomm as mc

    g = mc.init(strict=True)
    total = mc.all_sum(np.array([g.rank() + 1.0]), group=g)
    print(f"SUM {g.rank()} {g.size()} {float(total[0])}")


def _w_sum_hold() -> None:
    """``_w_sum``, then stay (the store with it, on rank 0) until the test creates TEST_RELEASE_FILE."""
    _w_sum()
    release, deadline = Path(os.environ["TEST_RELEASE_FILE"]), time.monotonic() + 60
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _w_split() -> None:
    import meshcomm as mc

    g = mc.init(strict=True)
    sub = g.split(g.rank() % 2)
    got = mc.all_sum(np.array([g.rank()]), group=sub)
    want = sum(q for q in range(g.size()) if q % 2 == g.rank() % 2)
    assert int(got[0]) == want, (got, want)
    print("SPLIT OK")


if __name__ == "__main__":
    globals()[sys.argv[1]]()

"""The gloo backend's rendezvous store proves the job secret (issue 14): sealed values, strangers, wrong secrets.

A "stranger" here is a plain TCPStore client in the test process: it knows the store's
address and the key names (they are deterministic) but not the secret. Where a test
needs a rank that never writes its own record, the test process plays that rank's
store connection itself (:func:`_fake_rank`), so the forged value is the only one there
is and the outcome does not depend on timing. Rank programs are the ``_w_*`` functions
below (``python this_file.py NAME``).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jobs import finish

pytest.importorskip("torch")

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
OURS = ("MLX_", "MESHCOMM_", "GLOO_", "MASTER_", "WORLD_SIZE", "RANK", "LOCAL_", "SLURM_", "OMPI_", "PMI",
        "TORCHELASTIC_")
PHRASE = "a process without the job secret wrote to the rendezvous store"
SECRET = "s3cret-for-tests"


# -- processes ------------------------------------------------------------------------------
def _free_port() -> int:
    from jobs import free_ports

    return free_ports(1)[0]


def _env(rank: int, n: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(OURS)}
    env.update(MLX_BACKEND="gloo", MLX_RANK=str(rank), MLX_WORLD_SIZE=str(n), MLX_TIMEOUT="20",
               PYTHONUNBUFFERED="1", MESHCOMM_GLOO_ADDR="127.0.0.1", MESHCOMM_GLOO_PORT=str(port),
               MESHCOMM_JOB_SECRET=SECRET)
    env.update(extra or {})
    return {k: v for k, v in env.items() if v != ""}


@contextmanager
def ranks(n: int, port: int, *, only: list[int] | None = None, worker: str = "_w_sum",
          rank_env: dict[int, dict[str, str]] | None = None) -> Iterator[dict[int, subprocess.Popen[str]]]:
    """Start ranks (all, or ``only`` these) of a gloo job; every one is killed on the way out."""
    procs: dict[int, subprocess.Popen[str]] = {}
    try:
        for r in (range(n) if only is None else only):
            procs[r] = subprocess.Popen([sys.executable, str(HERE), worker],
                                        env=_env(r, n, port, (rank_env or {}).get(r)), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, cwd=ROOT)
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
def _client(port: int, n: int, *, counts: bool) -> Any:
    """A TCPStore client of rank 0's store (``counts``: it is one of the ``n`` workers rank 0 waits for)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, n, False, timeout=datetime.timedelta(seconds=30),
                         wait_for_workers=counts)


def _fake_rank(port: int, n: int) -> Any:
    """Rank 0's store sees a worker connect; that worker writes nothing itself."""
    return _client(port, n, counts=True)


def _sealed(store: Any, secret: str) -> Any:
    from meshcomm_gloo.authstore import AuthStore
    from meshcomm_gloo.sealing import Sealer

    return AuthStore(store, Sealer(secret.encode(), ""))


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
        key = _forge(mode, stranger, port)
        rc, out, err = finish(procs)[0]
        del stranger, fake
    assert rc != 0 and "SUM" not in out, (out, err[-3000:])
    last = _last_error(err)
    assert "StoreAuthError" in last and PHRASE in last and repr(key) in last and "rank 1" in last, err[-3000:]


def test_stranger_forging_gloo_address_is_refused() -> None:
    """Rank 1's start-up record is genuine (written with the secret); its gloo address is a stranger's."""
    port = _free_port()
    with ranks(2, port, only=[0]) as procs:
        stranger = _client(port, 2, counts=False)
        fake = _fake_rank(port, 2)
        _sealed(fake, SECRET).set("meshcomm/proc/1", f"{os.uname().nodename} {os.getpid()}")
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
    keys = ["meshcomm/proc/0", "meshcomm/proc/1", "meshcomm/world/0/0", "meshcomm/world/0/1"]
    stop = threading.Event()

    def hammer() -> None:
        try:
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
            except Exception:  # noqa: BLE001 - the store is gone (rank 0 ended) or refused an add
                try:
                    s = _client(port, 2, counts=False)
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

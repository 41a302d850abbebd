"""Shared helpers: run real jobs through `meshcomm launch`, and a clean registry per test."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator

import pytest
from meshcomm.launch.run import THREAD_VARS

# One BLAS/OpenMP thread in every process the tests start (unless the developer chose): the
# suite runs several jobs at once on few cores, and each NumPy or torch import otherwise starts
# a pool per core whose spinning costs ~0.1 s of CPU in each of ~1700 processes. Jobs through
# `meshcomm launch` split the cores themselves (test_launch_options checks that, without these).
for _name in THREAD_VARS:
    os.environ.setdefault(_name, "1")


@pytest.fixture
def fresh_registry():
    """Forget loaded plugins and worlds before and after the test."""
    from meshcomm.api import world
    from meshcomm.runtime import registry

    registry.reset_registry()
    world.shutdown()
    yield
    registry.reset_registry()
    world.shutdown()


@pytest.fixture(scope="session", autouse=True)
def _no_mpi_shared_memory_left():
    """Jobs this suite ends by MPI_Abort or a kill leave the MPI library's files in /dev/shm:
    remove the ones created during the session (tests/shm_leftovers.py). The session
    directories of the mpiexec the tests start themselves (meshcomm launch puts its own in
    the job's directory) go to one directory of the session, removed at its end. The per-user
    key file of jobs without a secret goes to a config directory of the session, never the
    real home."""
    import os
    import shutil
    import tempfile

    from shm_leftovers import remove_new, snapshot

    before = snapshot()
    # Open MPI's libfabric transport (btl ofi) spends ~1 s of every MPI_Init probing for a
    # fabric this machine does not have; shared memory and TCP carry every test's traffic
    os.environ.setdefault("OMPI_MCA_btl", "^ofi")
    sessions = tempfile.mkdtemp(prefix="meshcomm-tests-mpi-")
    os.environ.setdefault("PRTE_MCA_prte_tmpdir_base", sessions)
    config = tempfile.mkdtemp(prefix="meshcomm-tests-config-")
    os.environ["XDG_CONFIG_HOME"] = config
    yield
    remove_new(before)
    shutil.rmtree(sessions, ignore_errors=True)
    shutil.rmtree(config, ignore_errors=True)


#: tests that take a minute or more of the parallel run: started first, so that none of them
#: begins near the end and holds one process while the others have nothing left to do
#: (node-id prefixes; the order of every other test is kept)
LONG_FIRST = (
    "tests/test_packaging.py::",
    "tests/test_sockets_push.py::test_kept_results_stay",
    "tests/test_gloo_backend.py::test_contract[",
    "tests/test_bench.py::test_compare_runs",
    "tests/test_conformance_kit.py::test_kit_passes_on_a_correct_backend",
    "tests/test_sockets_shm.py::test_whole_contract",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))  # a stable sort


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-log",
        metavar="FILE",
        help="append each test's node id, wall seconds, and the CPU seconds of its pytest process and "
        "of the child processes it reaped (its jobs), tab-separated, to FILE: where the suite's time goes",
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """With --cpu-log: one line per test (the suite is CPU-bound on few cores, so its CPU,
    mostly the processes its jobs start, is what its time is made of)."""
    path = item.config.getoption("--cpu-log")
    if not path:
        yield
        return

    def cpu(who: int) -> float:
        r = resource.getrusage(who)
        return r.ru_utime + r.ru_stime

    own, children, start = cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN), time.monotonic()
    yield
    line = (
        f"{item.nodeid}\t{time.monotonic() - start:.2f}\t{cpu(resource.RUSAGE_SELF) - own:.2f}"
        f"\t{cpu(resource.RUSAGE_CHILDREN) - children:.2f}\n"
    )
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line)

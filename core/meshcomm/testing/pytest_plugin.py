"""The conformance kit as a pytest plugin: run the API contract on a backend, one item per check.

For a third-party backend author::

    pytest --pyargs meshcomm.testing \\
        --meshcomm-backend mybackend [--meshcomm-ranks 1,2,4]

For each rank count, one real job runs through ``meshcomm launch -n N --backend NAME --
-m meshcomm.testing.contract --json``; every check of the contract becomes its own item
(``test_contract[4-check_reductions]``) that fails with each rank's error, plus one item
per job (``test_job[4]``) for the launcher's exit status. pytest loads this plugin through
the ``pytest11`` entry point of the meshcomm distribution (``-p meshcomm`` when plugin
autoloading is off). Settings can also come from the environment
(``MESHCOMM_CONFORMANCE_BACKEND``, ``MESHCOMM_CONFORMANCE_RANKS``). ``--meshcomm-more``
(``MESHCOMM_CONFORMANCE_MORE=1``) adds the second round's checks
(:mod:`meshcomm.testing.contract_more`: all_to_all, gather, scatter, reduce, object
collectives, ``out=``, ``async_op``, ``close``). ``test_survivors`` runs
:mod:`meshcomm.testing.survivors` once (3 ranks, ``--keep-going``, one killed): it passes for
a backend whose survivors agree and shrink, and is skipped for one that says it cannot.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from .contract import CHECKS, JSON_MARK
from .contract_more import ALL_CHECKS
from .survivors import MARK as SURVIVORS_MARK

#: MLX_TIMEOUT of the survivors' job (at most --meshcomm-timeout)
SURVIVORS_TIMEOUT = 10.0

__all__ = ["ContractJob", "ContractRunner", "check_names"]

_DEFAULT_RANKS = "1,2,4"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("meshcomm", "meshcomm conformance kit (meshcomm.testing)")
    group.addoption(
        "--meshcomm-backend", default=None, metavar="NAME", help="backend to check (env MESHCOMM_CONFORMANCE_BACKEND)"
    )
    group.addoption(
        "--meshcomm-ranks",
        default=None,
        metavar="N,N,...",
        help=f"rank counts, one job each (env MESHCOMM_CONFORMANCE_RANKS; default {_DEFAULT_RANKS})",
    )
    group.addoption(
        "--meshcomm-launch-args",
        default=None,
        metavar="ARGS",
        help="extra arguments for meshcomm launch, e.g. '--hosts a,b' (env MESHCOMM_CONFORMANCE_LAUNCH_ARGS)",
    )
    group.addoption(
        "--meshcomm-more",
        action="store_true",
        default=None,
        help="also check the second round's operations (all_to_all, gather, scatter, reduce, "
        "object collectives, out=, async_op, close; env MESHCOMM_CONFORMANCE_MORE=1)",
    )
    group.addoption(
        "--meshcomm-timeout",
        default=None,
        type=float,
        metavar="S",
        help="MLX_TIMEOUT of the jobs, seconds (default 120)",
    )
    group.addoption(
        "--meshcomm-job-timeout",
        default=None,
        type=float,
        metavar="S",
        help="give up on a job after this long, seconds (default 900)",
    )


def _setting(config: pytest.Config, opt: str, env: str, default: Any = None) -> Any:
    value = config.getoption(opt, default=None)  # None as well when the plugin came late
    if value is None:
        value = os.environ.get(env) or None
    return default if value is None else value


def _more(config: pytest.Config | None) -> bool:
    if config is not None and config.getoption("meshcomm_more", default=None):
        return True
    return os.environ.get("MESHCOMM_CONFORMANCE_MORE", "").strip().lower() in ("1", "true", "yes", "on")


def check_names(more: bool = False) -> list[str]:
    """The names of the contract's checks (``more``: both rounds)."""
    if more:
        return [c.__name__ for c in ALL_CHECKS]
    return [c.__name__ for c in CHECKS]


def _ranks(config: pytest.Config) -> list[int]:
    text = str(_setting(config, "meshcomm_ranks", "MESHCOMM_CONFORMANCE_RANKS", _DEFAULT_RANKS))
    try:
        ranks = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise pytest.UsageError(
            f"--meshcomm-ranks={text!r}: expected a comma list of rank counts, e.g. 1,2,4"
        ) from None
    if not ranks or min(ranks) < 1:
        raise pytest.UsageError(f"--meshcomm-ranks={text!r}: rank counts must be >= 1")
    return ranks


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.fixturenames
    if "meshcomm_ranks" not in names:
        return
    ranks = _ranks(metafunc.config)
    if "meshcomm_check" in names:
        metafunc.parametrize(
            ("meshcomm_ranks", "meshcomm_check"),
            [(n, c) for n in ranks for c in check_names(_more(metafunc.config))],
            ids=[f"{n}-{c}" for n in ranks for c in check_names(_more(metafunc.config))],
        )
    else:
        metafunc.parametrize("meshcomm_ranks", ranks, ids=[str(n) for n in ranks])


@dataclass
class ContractJob:
    """One finished contract job: the launcher's result and each rank's report."""

    backend: str
    ranks: int
    command: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)

    def output_tail(self, chars: int = 4000) -> str:
        out = self.stdout[-chars:].rstrip()
        err = self.stderr[-chars:].rstrip()
        return f"--- stdout (tail) ---\n{out}\n--- stderr (tail) ---\n{err}"

    def describe(self) -> str:
        code = "timed out" if self.returncode is None else f"exit code {self.returncode}"
        return f"`{shlex.join(self.command)}` ({code}, {self.seconds:.1f} s)"

    def check_problems(self, name: str) -> list[str]:
        """Why check ``name`` did not pass on every rank (empty: it passed)."""
        problems = []
        for r in range(self.ranks):
            report = self.reports.get(r)
            if report is None:
                problems.append(f"rank {r}: no report (the rank failed to start, crashed or was stopped)")
                continue
            entry = next((c for c in report["checks"] if c["name"] == name), None)
            if entry is None:
                problems.append(f"rank {r}: the check is missing from its report")
            elif entry["status"] == "not run":
                problems.append(f"rank {r}: not run (an earlier check raised and stopped the contract)")
            elif entry["status"] != "passed":
                problems.append(f"rank {r}: {entry['error']}".rstrip())
        return problems


class ContractRunner:
    """Runs (once per rank count, cached for the session) the contract job of a backend."""

    def __init__(self, config: pytest.Config) -> None:
        self.backend: str | None = _setting(config, "meshcomm_backend", "MESHCOMM_CONFORMANCE_BACKEND")
        self.launch_args = shlex.split(
            str(_setting(config, "meshcomm_launch_args", "MESHCOMM_CONFORMANCE_LAUNCH_ARGS", ""))
        )
        self.timeout = float(_setting(config, "meshcomm_timeout", "MESHCOMM_CONFORMANCE_TIMEOUT", 120))
        self.job_timeout = float(_setting(config, "meshcomm_job_timeout", "MESHCOMM_CONFORMANCE_JOB_TIMEOUT", 900))
        self.jobs: dict[int, ContractJob] = {}
        self.survivors: ContractJob | None = None
        self.more = _more(config)

    def job(self, n: int) -> ContractJob:
        if self.backend is None:
            pytest.skip(
                "no backend to check: pass --meshcomm-backend NAME "
                "(the plugin comes with meshcomm: pytest11 entry point) "
                "or set MESHCOMM_CONFORMANCE_BACKEND"
            )
        if n not in self.jobs:
            self.jobs[n] = self._run(self.backend, n)
        return self.jobs[n]

    def assert_job_passed(self, n: int) -> None:
        assert_job_passed(self.job(n))

    def assert_check_passed(self, n: int, name: str) -> None:
        assert_check_passed(self.job(n), name)

    def assert_survivors(self) -> None:
        """The survivors' job (:mod:`meshcomm.testing.survivors`, 3 ranks, ``--keep-going``):
        skipped when every rank says the backend does not offer it, else every survivor ok."""
        if self.backend is None:
            self.job(1)  # skips with the reason
        if self.survivors is None:
            program = ["-m", "meshcomm.testing.survivors"]
            # a short MLX_TIMEOUT: a transport may notice a killed peer only when it runs out
            self.survivors = self._run(str(self.backend), 3, program, ["--keep-going"], timeout=SURVIVORS_TIMEOUT)
        job = self.survivors
        said = {int(m.group(1)): m.group(2) for m in re.finditer(rf"{SURVIVORS_MARK} rank (\d+) (.*)", job.stdout)}
        if len(said) == 3 and all(v.startswith("not offered") for v in said.values()):
            pytest.skip(f"{job.backend} does not offer agree/shrink: {said[0]}")
        if job.returncode != 0 or any(said.get(r) != "ok" for r in (0, 1)):
            got = "; ".join(f"rank {r}: {v}" for r, v in sorted(said.items())) or "nothing"
            pytest.fail(f"{job.describe()}: the survivors said {got}\n{job.output_tail()}", pytrace=False)

    def _run(
        self,
        backend: str,
        n: int,
        program: list[str] | None = None,
        launch_args: list[str] | None = None,
        timeout: float | None = None,
    ) -> ContractJob:
        program = program or ["-m", "meshcomm.testing.contract", "--json", *(["--more"] if self.more else [])]
        cmd = [
            sys.executable,
            "-m",
            "meshcomm",
            "launch",
            "-n",
            str(n),
            "--backend",
            backend,
            "--timeout",
            f"{min(self.timeout, timeout or self.timeout):g}",
            *self.launch_args,
            *(launch_args or []),
            "--",
            *program,
        ]
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="meshcomm-conformance-") as shared:
            env = {**os.environ, "MESHCOMM_TEST_DIR": shared}  # ranks on this machine share it
            try:
                p = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=self.job_timeout, env=env, stdin=subprocess.DEVNULL
                )
                code, out, err = p.returncode, p.stdout, p.stderr
            except subprocess.TimeoutExpired as exc:
                code = None
                out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
                err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
                err += f"\n[meshcomm conformance] the job ran longer than {self.job_timeout:g} s and was stopped"
        job = ContractJob(backend, n, cmd, code, out, err, time.monotonic() - t0)
        for line in out.splitlines():
            i = line.find(JSON_MARK)
            if i < 0:
                continue
            try:
                report = json.loads(line[i + len(JSON_MARK) :])
                job.reports[int(report["rank"])] = report
            except (ValueError, KeyError, TypeError):
                continue
        return job


@pytest.fixture(scope="session")
def meshcomm_contract(request: pytest.FixtureRequest) -> ContractRunner:
    """The session's contract runner: ``meshcomm_contract.job(n)`` is the job on ``n`` ranks."""
    key = "_meshcomm_contract_runner"
    runner = getattr(request.config, key, None)
    if runner is None:
        runner = ContractRunner(request.config)
        setattr(request.config, key, runner)
    return runner


def assert_check_passed(job: ContractJob, name: str) -> None:
    """Fail (without a Python traceback) unless ``name`` passed on every rank of ``job``."""
    if not job.reports:
        pytest.fail(f"{job.describe()} reported no results on any rank.\n{job.output_tail()}", pytrace=False)
    problems = job.check_problems(name)
    if problems:
        pytest.fail(f"{name} on {job.ranks} ranks of {job.backend}:\n" + "\n".join(problems), pytrace=False)


def assert_job_passed(job: ContractJob) -> None:
    """The job as a whole: every rank reported, and the launcher exited with 0."""
    missing = [r for r in range(job.ranks) if r not in job.reports]
    wrong_size = [r for r, rep in job.reports.items() if rep.get("size") != job.ranks]
    if job.returncode != 0 or missing or wrong_size:
        why = []
        if missing:
            why.append(f"no report from ranks {missing}")
        if wrong_size:
            why.append(f"ranks {wrong_size} saw a world of another size")
        pytest.fail(f"{job.describe()}: {', '.join(why) or 'failed'}\n{job.output_tail()}", pytrace=False)

"""The conformance kit's tests, collected by ``pytest --pyargs meshcomm.testing``.

Run them against a backend with::

    pytest --pyargs meshcomm.testing --meshcomm-backend NAME

Each contract check on each rank count is one item; see :mod:`meshcomm.testing.pytest_plugin`.
"""

from __future__ import annotations

from typing import Any

# the fixtures come from meshcomm.testing.pytest_plugin, which pytest loads through the
# pytest11 entry point of the meshcomm distribution (-p meshcomm when autoload is off)


def test_job(meshcomm_contract: Any, meshcomm_ranks: int) -> None:
    """The launcher ran the job on ``meshcomm_ranks`` ranks, each reported, exit status 0."""
    meshcomm_contract.assert_job_passed(meshcomm_ranks)


def test_contract(meshcomm_contract: Any, meshcomm_ranks: int, meshcomm_check: str) -> None:
    """One check of :mod:`meshcomm.testing.contract` passed on every rank."""
    meshcomm_contract.assert_check_passed(meshcomm_ranks, meshcomm_check)


def test_survivors(meshcomm_contract: Any) -> None:
    """``Group.agree`` and ``Group.shrink`` on 3 ranks, one killed (:mod:`meshcomm.testing.survivors`);
    skipped when the backend does not offer them (``Backend.survives_failures``)."""
    meshcomm_contract.assert_survivors()

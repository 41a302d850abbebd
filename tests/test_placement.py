"""Where a process sits in a job, from each starter's variables (core/meshcomm/runtime/placement.py)."""

from __future__ import annotations

import pytest
from meshcomm.protocol.errors import ConfigError
from meshcomm.runtime.placement import Placement, coordinator, expand_hostlist, placement

SLURM_TASK = {
    "SLURM_JOB_ID": "12",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "2",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "h[2-3]",
}


@pytest.mark.parametrize(
    "env, want",
    [
        ({"MLX_RANK": "1", "MLX_WORLD_SIZE": "3"}, Placement(1, 3, None, None, "meshcomm")),
        (SLURM_TASK, Placement(2, 4, 0, 2, "Slurm")),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            Placement(1, 2, 1, 2, "Open MPI"),
        ),
        ({"PMI_RANK": "0", "PMI_SIZE": "5"}, Placement(0, 5, None, None, "MPICH (PMI)")),
        (
            {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
            Placement(3, 4, 1, 2, "torchrun"),
        ),
        ({}, None),
    ],
)
def test_each_starter_family(env, want):
    assert placement(env) == want


def test_families_are_never_mixed_and_meshcomm_comes_first():
    env = {**SLURM_TASK, "MLX_RANK": "0", "WORLD_SIZE": "9"}
    assert placement(env) == Placement(0, None, None, None, "meshcomm")


def test_a_slurm_batch_script_is_not_rank_0_of_the_job():
    """sbatch's script sees SLURM_PROCID=0 and SLURM_NTASKS=N but no step id (Slurm 22.05):
    a program run there directly must not wait for N-1 ranks that srun never started."""
    batch = {k: v for k, v in SLURM_TASK.items() if k != "SLURM_STEP_ID"} | {"SLURM_PROCID": "0"}
    assert placement(batch) is None
    assert coordinator(batch) is None


def test_coordinator_sources():
    assert str(coordinator({"MLX_COORDINATOR": "node1:29400"})) == "node1:29400"
    assert coordinator({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}).port == 29501  # 29500 is torch's
    slurm = coordinator(SLURM_TASK)
    assert slurm is not None and slurm.host == "h2" and 20000 <= slurm.port < 30000
    assert coordinator({**SLURM_TASK, "SLURM_STEP_ID": "1"}).port != slurm.port


@pytest.mark.parametrize(
    "env, names",
    [
        ({"MLX_RANK": "x"}, "MLX_RANK"),
        ({"MLX_RANK": "3", "MLX_WORLD_SIZE": "3"}, "MLX_RANK=3"),
        ({"MLX_COORDINATOR": "node1"}, "MLX_COORDINATOR"),
        ({"MASTER_ADDR": "node1"}, "MASTER_PORT"),
    ],
)
def test_bad_values_are_config_errors_naming_the_variable(env, names):
    with pytest.raises(ConfigError, match=names):
        placement(env)
        coordinator(env)


def test_slurm_host_lists():
    assert expand_hostlist("node[1-3,07],gpu-a[01-02],solo") == [
        "node1",
        "node2",
        "node3",
        "node07",
        "gpu-a01",
        "gpu-a02",
        "solo",
    ]

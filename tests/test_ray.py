"""meshcomm groups among Ray actors (docs/engines.md#ray), on a real Ray cluster: a head and
a worker node, each in its own network namespace, started with ``ray start``.

One cluster serves the module's tests (starting Ray costs seconds); every test's driver
runs in the head's namespace (tests/programs/ray_group.py). The actors are spread over both
nodes, or all put on one; every collective of the contract is checked on every rank; an
actor killed with ``ray.kill`` is named by every survivor within the deadline; and when
the cluster stops, no process or file of it is left.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.ray_cluster

from netns import NetnsHosts, NetnsUnavailable  # noqa: E402
from ray_cluster import RayCluster  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "programs" / "ray_group.py"
#: MLX_TIMEOUT of the groups: it bounds start-up, where 4 actors import torch (gloo) on 2
#: cores, and a test that would otherwise hang
TIMEOUT = 60
#: MLX_TIMEOUT of the groups in which an actor is killed: on sockets every survivor sees the
#: loss at once (the dead rank's connections close, and ABORT notices follow); on gloo a
#: survivor waiting on a live peer learns of it only when its own operation times out, so
#: there the deadline is the time to the error (the Ray tests run with the machine to themselves)
KILL_TIMEOUT = {"sockets": 60, "gloo": 20}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RayCluster]:
    try:
        hosts = NetnsHosts(2)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    c = None
    try:
        c = RayCluster(hosts)
        yield c
    finally:
        if c is not None:
            c.close()
        left = hosts.running()
        hosts.close()
        assert not left, f"processes of the Ray cluster were left running: {left}"
        assert not Path(f"/tmp/mcray-{hosts.id}").exists()


def _results(out: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("RESULT ")]


@pytest.mark.parametrize(
    "backend,how,spread",
    [
        ("sockets", "create_group", True),
        ("sockets", "init", False),
        ("gloo", "create_group", True),
    ],
)
def test_every_collective_on_ray_actors(cluster: RayCluster, backend: str, how: str, spread: bool) -> None:
    nodes = cluster.hosts.ips if spread else cluster.hosts.ips[1:]
    args = ["--actors", "4", "--backend", backend, "--how", how, "--nodes", ",".join(nodes)]
    p = cluster.python(0, [str(PROGRAM), "--address", cluster.head, "--timeout", str(TIMEOUT), *args])
    shown = p.stdout[-4000:] + p.stderr[-4000:]
    assert p.returncode == 0, shown
    assert f"NODES {2 if spread else 1}" in p.stdout, shown
    results = _results(p.stdout)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3], shown
    for r in results:
        assert r["size"] == 4 and r["checks"] > 10 and r["failed"] == [], (r, shown)


@pytest.mark.parametrize("backend", ["sockets", "gloo"])
def test_a_killed_actor_is_named_by_every_survivor(cluster: RayCluster, backend: str) -> None:
    args = ["--actors", "4", "--backend", backend, "--kill", "2", "--nodes", ",".join(cluster.hosts.ips)]
    timeout = KILL_TIMEOUT[backend]
    p = cluster.python(0, [str(PROGRAM), "--address", cluster.head, "--timeout", str(timeout), *args])
    shown = p.stdout[-4000:] + p.stderr[-4000:]
    assert p.returncode == 0, shown
    said = dict(re.findall(r"^SURVIVOR (\d) (.*)$", p.stdout, re.M))
    assert sorted(said) == ["0", "1", "3"], shown
    for r, text in said.items():
        assert text.startswith(("PeerLostError peer=2", "CommTimeoutError peer=2")), (r, shown)
        seconds = float(re.search(r"after ([\d.]+)s", text).group(1))  # type: ignore[union-attr]
        assert seconds < timeout + 2, (r, shown)

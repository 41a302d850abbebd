"""The public API on the size-1 group: the contract, argument errors, init semantics."""

from __future__ import annotations

import os
import subprocess
import sys

import meshcomm as mc
import numpy as np
import pytest
from meshcomm.testing.contract import run_checks


@pytest.fixture
def solo(fresh_registry, monkeypatch):
    for var in (
        "MLX_BACKEND",
        "MLX_RANK",
        "MLX_HOSTFILE",
        "MLX_WORLD_SIZE",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "PMI_RANK",
        "MESHCOMM_GLOO_ADDR",
        "MESHCOMM_GLOO_FILE",
    ):
        monkeypatch.delenv(var, raising=False)
    return mc.init()


def test_contract_holds_on_size_one(solo):
    assert solo.size() == 1 and solo.rank() == 0 and solo.backend == "single"
    assert run_checks(solo) == []


def test_results_are_new_arrays(solo):
    x = np.arange(6.0).reshape(2, 3)
    for fn in (mc.all_sum, mc.all_max, mc.all_min, mc.all_gather, mc.sum_scatter, mc.broadcast):
        y = fn(x)
        assert y is not x and not np.shares_memory(x, y), fn.__name__
        y[...] = -1
        assert x[0, 1] == 1.0


def test_zero_d_inputs(solo):
    assert mc.all_sum(np.float32(2)).shape == ()
    assert mc.all_sum(np.float32(2)).dtype == np.float32
    assert mc.all_gather(np.int16(5)).shape == (1,)
    assert mc.broadcast(3.5).shape == ()


def test_unsupported_dtypes_are_rejected_before_communication(solo):
    with pytest.raises(ValueError, match="unsupported dtype"):
        mc.all_sum(np.array(["a", "b"]))
    with pytest.raises(ValueError, match="object array"):
        mc.all_sum(np.array([1, "x", None], dtype=object))
    with pytest.raises(ValueError, match="byte-swapped"):
        mc.all_sum(np.arange(3, dtype=">f4"))
    with pytest.raises(ValueError, match="unsupported dtype"):
        mc.recv((2,), np.dtype("U3"), 0)


def test_point_to_point_needs_a_peer(solo):
    # a process started without a launcher is alone: the error says how to start more ranks
    with pytest.raises(
        ValueError, match=r"size 1: there is no other rank\. This process runs alone.*meshcomm launch -n N"
    ):
        mc.send(np.zeros(2), 1)
    with pytest.raises(ValueError, match="size 1"):
        mc.send(np.zeros(2), 0)
    with pytest.raises(ValueError, match="size 1"):
        mc.recv((2,), np.float32, 0)
    with pytest.raises(TypeError, match="dst must be an integer"):
        mc.send(np.zeros(2), 0.5)  # type: ignore[arg-type]


def test_sum_scatter_shape_rule(solo):
    assert mc.sum_scatter(np.arange(3)).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="axis 0 must be divisible"):
        mc.sum_scatter(np.float64(1.0))


def test_init_twice_returns_a_world_and_ops_default_to_it(solo):
    again = mc.init()
    assert again.size() == 1
    assert mc.all_sum([1, 2]).tolist() == [1, 2]


def test_unknown_backend_lists_installed(fresh_registry):
    with pytest.raises(ValueError, match=r"unknown backend 'nosuch'.*installed backends: .*single"):
        mc.init(backend="nosuch")
    with pytest.raises(ValueError, match="unknown backend"):
        mc.init(strict=True, backend="nosuch")
    assert mc.is_available("nosuch") is False


def test_bfloat16_when_installed(solo):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    y = mc.all_sum(x)
    assert y.dtype == x.dtype and y.tolist() == x.tolist()


# -- start-up: import meshcomm imports what a call needs only when it needs it -----------------

_FRESH = """
import sys
import meshcomm as mc
heavy = [m for m in ("ml_dtypes", "pydantic") if m in sys.modules]
assert not heavy, "import meshcomm imported " + str(heavy)
{body}
print("ok")
"""


def _fresh(body: str) -> None:
    """Run ``body`` after ``import meshcomm`` in a new interpreter (the imports of this one
    are not those of a user's)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_", "MESHCOMM_"))}
    p = subprocess.run(
        [sys.executable, "-c", _FRESH.replace("{body}", body)], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr


def test_import_meshcomm_pulls_neither_ml_dtypes_nor_pydantic() -> None:
    _fresh(
        "import numpy as np\n"
        "assert mc.init().size() == 1 and 'pydantic' in sys.modules  # init reads the settings\n"
        "assert 'ml_dtypes' not in sys.modules, 'a float32 call imported ml_dtypes'\n"
        "assert mc.all_sum(np.ones(2, np.float32)).tolist() == [1.0, 1.0]\n"
        "assert 'ml_dtypes' not in sys.modules and mc.Config().timeout > 0"
    )


def test_the_launcher_runs_a_job_without_importing_numpy_or_the_api(tmp_path) -> None:
    """``meshcomm launch`` loads the registry, the plugins' entry points and the settings
    model, but not NumPy or the API: every job pays its launcher's start-up."""
    prog = tmp_path / "prog.py"
    prog.write_text("import numpy as np, meshcomm as mc\nassert mc.all_sum(np.ones(2), group=mc.init())[0] == 2\n")
    _fresh(
        "from meshcomm.cli import main\n"
        f"assert main(['launch', '-n', '2', '--backend', 'sockets', '--', {str(prog)!r}]) == 0\n"
        "loaded = [m for m in ('numpy', 'meshcomm.api.group', 'meshcomm.bench.collectives') if m in sys.modules]\n"
        "assert not loaded, 'the launcher imported ' + str(loaded)"
    )


def test_bfloat16_is_admitted_on_first_sight_and_by_its_wire_code() -> None:
    pytest.importorskip("ml_dtypes")
    _fresh(
        "import ml_dtypes, numpy as np\n"
        "from meshcomm.protocol import dtypes\n"
        "x = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)\n"
        "y = mc.all_sum(x)\n"
        "assert y.dtype == x.dtype and y.tolist() == x.tolist()\n"
        "code = dtypes.dtype_code(x.dtype)\n"
        "assert code == dtypes.BFLOAT16_CODE and dtypes.dtype_from_code(code) == x.dtype\n"
        "assert dtypes.bfloat16 == x.dtype and x.dtype in dtypes.SUPPORTED\n"
        "from meshcomm import plugin\n"
        "assert plugin.bfloat16 == x.dtype and plugin.SUPPORTED == dtypes.SUPPORTED\n"
        "try:\n"
        "    dtypes.check_dtype(x.dtype.newbyteorder('>'))\n"
        "    raise SystemExit('a byte-swapped bfloat16 was admitted')\n"
        "except ValueError as exc:\n"
        "    assert 'byte-swapped' in str(exc), exc"
    )


def test_shape_keys_tell_shapes_of_one_count_apart() -> None:
    """Backend.shape_key: 0 for 1-D, never 0 otherwise, different for the reshapes of one
    count, fixed numbers (every rank and Python version must compute the same key)."""
    from meshcomm.protocol.backend import SHAPE_KEYS, shape_key

    assert shape_key((6,)) == 0 and shape_key((0,)) == 0
    assert shape_key((2, 3)) == 2504155 and shape_key((3, 2)) == 4638221 and shape_key(()) == 3635637
    reshapes = [
        (24,),
        (2, 12),
        (12, 2),
        (3, 8),
        (8, 3),
        (4, 6),
        (6, 4),
        (2, 3, 4),
        (4, 3, 2),
        (1, 24),
        (24, 1),
        (2, 2, 6),
        (1, 1, 24),
        (24, 1, 1),
    ]
    keys = [shape_key(s) for s in reshapes]
    assert len(set(keys)) == len(keys) and all(0 <= k < 2**23 for k in keys), keys
    assert shape_key(()) != shape_key((1, 1)) != 0
    for s in reshapes:
        assert SHAPE_KEYS[s] == shape_key(s)
    for i in range(5000):  # the cache never grows past its bound
        SHAPE_KEYS[(i, 2)]
    assert len(SHAPE_KEYS) <= 4096

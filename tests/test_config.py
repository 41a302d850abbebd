"""Config: arguments beat environment beat defaults; bad values name the variable."""

from __future__ import annotations

from pathlib import Path

import meshcomm as mc
import pytest
from meshcomm import Config, ConfigError


def test_defaults():
    c = Config.load(environ={})
    assert (c.backend, c.rank, c.hostfile, c.timeout, c.debug) == ("any", None, None, 300.0, False)


def test_environment_fills_fields():
    env = {
        "MLX_BACKEND": "Sockets",
        "MLX_RANK": "3",
        "MLX_HOSTFILE": "/tmp/h.json",
        "MLX_TIMEOUT": "12.5",
        "MLX_DEBUG": "1",
    }
    c = Config.load(environ=env)
    assert (c.backend, c.rank, c.hostfile, c.timeout, c.debug) == ("sockets", 3, Path("/tmp/h.json"), 12.5, True)


def test_arguments_beat_environment():
    c = Config.load(environ={"MLX_TIMEOUT": "12", "MLX_BACKEND": "mpi"}, timeout=3, backend="gloo")
    assert c.timeout == 3 and c.backend == "gloo"


def test_empty_variables_count_as_unset():
    assert Config.load(environ={"MLX_RANK": "", "MLX_TIMEOUT": " "}).timeout == 300.0


@pytest.mark.parametrize(
    "var,value,accepted",
    [
        ("MLX_TIMEOUT", "soon", "a number of seconds > 0"),
        ("MLX_TIMEOUT", "-1", "a number of seconds > 0"),
        ("MLX_RANK", "-2", "an integer from 0 to"),
        ("MLX_RANK", "one", "an integer from 0 to"),
        ("MLX_DEBUG", "maybe", "1/0, true/false"),
        # numbers that would overflow later (mid-call, in a 64-bit field or a C int) are refused now
        ("MESHCOMM_MAX_OBJECT_BYTES", str(2**63), "from 1 to 2**63 - 1"),
        ("MLX_WORLD_SIZE", str(2**31), "an integer from 1 to 2147483647"),
        ("MLX_RANK", str(2**31), "an integer from 0 to 2147483646"),
        ("MESHCOMM_TRACE_EVENTS", str(2**40), "from 1 to 2**31 - 1"),
        ("MESHCOMM_STALL_AFTER", "1e12", "from 0 to 2147483"),
        ("MESHCOMM_STALL_AFTER", "inf", "from 0 to 2147483"),
    ],
)
def test_invalid_values_name_the_variable_and_the_accepted_values(var, value, accepted):
    with pytest.raises(ConfigError) as err:
        Config.load(environ={var: value})
    assert f"{var}={value!r}" in str(err.value) and accepted in str(err.value)


def test_invalid_argument_names_the_argument():
    with pytest.raises(ConfigError, match="argument timeout=0"):
        Config.load(environ={}, timeout=0)


def test_unknown_setting_is_an_error():
    with pytest.raises(ConfigError, match="unknown setting"):
        Config.load(environ={}, colour="red")


def test_invalid_environment_fails_init(fresh_registry, monkeypatch):
    import meshcomm as mc

    monkeypatch.setenv("MLX_TIMEOUT", "never")
    with pytest.raises(ConfigError, match="MLX_TIMEOUT='never'"):
        mc.init()


def test_constructing_config_reads_the_environment(monkeypatch):
    monkeypatch.setenv("MLX_TIMEOUT", "12.5")
    monkeypatch.setenv("MLX_DEBUG", "yes")
    c = mc.Config()
    assert (c.timeout, c.debug) == (12.5, True)
    assert mc.Config(timeout=3).timeout == 3  # an argument wins over the variable
    monkeypatch.setenv("MLX_TIMEOUT", "soon")
    with pytest.raises(mc.ConfigError, match=r"MLX_TIMEOUT='soon' is invalid.*accepted: a number of seconds"):
        mc.Config()
    assert mc.Config.load({}).timeout == 300.0  # an explicit mapping replaces os.environ


@pytest.mark.parametrize("value", ["3e6", "1e10", "inf", "nan", "-inf"])
def test_timeouts_beyond_what_a_wait_can_take_are_config_errors(monkeypatch, value):
    monkeypatch.setenv("MLX_TIMEOUT", value)
    with pytest.raises(mc.ConfigError, match=rf"MLX_TIMEOUT='{value}' is invalid.*<= 2147483"):
        mc.Config()


def test_the_largest_timeout_is_accepted(monkeypatch):
    monkeypatch.setenv("MLX_TIMEOUT", "2147483")
    assert mc.Config().timeout == 2147483


def test_unknown_backend_is_a_config_error(monkeypatch):
    monkeypatch.setenv("MLX_BACKEND", "sockts")
    with pytest.raises(mc.ConfigError, match=r"unknown backend 'sockts'.*MLX_BACKEND.*installed backends"):
        mc.init()


@pytest.mark.parametrize(
    "var,value",
    [
        ("MESHCOMM_SOCKETS_LISTEN_FD", str(2**31)),
        ("MESHCOMM_MPI_SPIN_US", "inf"),
        ("MESHCOMM_MPI_SPIN_US", "1e300"),
        ("MESHCOMM_GLOO_PORT", "65536"),
        ("MESHCOMM_SOCKETS_CHUNK_KIB", str(2**40)),
    ],
)
def test_backend_settings_out_of_range_are_refused_at_start_up(var, value):
    """Every backend's numeric settings have both ends checked, so a value is refused at
    start-up (and by meshcomm launch before any rank starts), never overflows mid-call."""
    from meshcomm.runtime.registry import get_registry

    specs = [
        s
        for s in get_registry().specs.values()
        if s.settings is not None
        and any(
            f.json_schema_extra and f.json_schema_extra.get("env") == var  # type: ignore[union-attr]
            for f in s.settings.model_fields.values()
        )
    ]
    if not specs:
        pytest.skip(f"no installed backend reads {var}")
    with pytest.raises(ConfigError, match=var):
        from meshcomm.runtime.config import load_settings

        load_settings(specs[0].settings, None, {var: value})

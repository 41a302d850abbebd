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
    env = {"MLX_BACKEND": "Sockets", "MLX_RANK": "3", "MLX_HOSTFILE": "/tmp/h.json", "MLX_TIMEOUT": "12.5", "MLX_DEBUG": "1"}
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
        ("MLX_RANK", "-2", "an integer >= 0"),
        ("MLX_RANK", "one", "an integer >= 0"),
        ("MLX_DEBUG", "maybe", "1/0, true/false"),
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
    assert mc.Config(timeout=3).timeout == 3           # an argument wins over the variable
    monkeypatch.setenv("MLX_TIMEOUT", "soon")
    with pytest.raises(mc.ConfigError, match=r"MLX_TIMEOUT='soon' is invalid.*accepted: a number of seconds"):
        mc.Config()
    assert mc.Config.load({}).timeout == 300.0          # an explicit mapping replaces os.environ


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

"""The registry: plugins register through the hook, broken ones are reported, selection rules."""

from __future__ import annotations

import numpy as np
import pytest
from meshcomm import BackendUnavailableError, Config
from meshcomm.runtime.hookspecs import hookimpl
from meshcomm.runtime.registry import Registry
from meshcomm.runtime.single_backend import SingleBackend


class _Plugin:
    def __init__(self, name, *, configured=True, available=None, fails=False, priority=100):
        self.name, self.configured, self.available, self.fails, self.priority = (
            name,
            configured,
            available,
            fails,
            priority,
        )
        self.started = 0

    @hookimpl
    def meshcomm_register_backends(self, register):
        def factory(config, settings):
            self.started += 1
            if self.fails:
                raise BackendUnavailableError(f"{self.name}: peer 10.0.0.9 refused")
            return SingleBackend()

        register(
            self.name,
            factory=factory,
            priority=self.priority,
            environment=lambda c, s: None if self.configured else f"{self.name} variables not set",
            available=(lambda: self.available),
        )


class _Exploding:
    @hookimpl
    def meshcomm_register_backends(self, register):
        raise RuntimeError("boom while registering")


def _registry(*plugins) -> Registry:
    reg = Registry()
    for i, p in enumerate(plugins):
        reg.pm.register(p, name=f"test-plugin-{i}")
    return reg.load(environ={}, entry_points=False)


def test_builtin_single_is_registered_through_the_same_hook():
    reg = _registry()
    assert reg.names() == ["single"]
    assert reg.specs["single"].multiprocess is False


def test_a_plugin_failing_to_register_is_reported_and_others_work():
    good = _Plugin("good")
    reg = _registry(_Exploding(), good)
    infos = {i.name: i for i in reg.info(Config())}
    assert infos["good"].available
    broken = [i for i in infos.values() if not i.available and "boom" in (i.reason or "")]
    assert broken, infos
    backend, name = reg.start("any", Config(), strict=True)
    assert name == "good" and good.started == 1


def test_any_picks_the_first_configured_backend_by_priority():
    a = _Plugin("late", priority=90)
    b = _Plugin("early", priority=5, configured=False)
    c = _Plugin("middle", priority=20)
    reg = _registry(a, b, c)
    assert reg.start("any", Config(), strict=False)[1] == "middle"
    assert b.started == 0 and a.started == 0


def test_any_falls_back_to_single_only_when_nothing_is_configured():
    reg = _registry(_Plugin("x", configured=False), _Plugin("y", available="libfoo missing"))
    assert reg.start("any", Config(), strict=False)[1] == "single"
    with pytest.raises(BackendUnavailableError) as err:
        reg.start("any", Config(), strict=True)
    text = str(err.value)
    assert "x: x variables not set" in text and "y: libfoo missing" in text


def test_configured_backend_that_fails_to_start_raises_instead_of_falling_back():
    reg = _registry(_Plugin("flaky", fails=True))
    with pytest.raises(BackendUnavailableError, match="refused"):
        reg.start("any", Config(), strict=False)


def test_named_backend_not_configured_warns_and_runs_alone_unless_strict():
    reg = _registry(_Plugin("named", configured=False))
    with pytest.warns(RuntimeWarning, match="named.*running as a single process"):
        assert reg.start("named", Config(), strict=False)[1] == "single"
    with pytest.raises(BackendUnavailableError, match="named variables not set"):
        reg.start("named", Config(), strict=True)


def test_duplicate_names_are_rejected_and_reported():
    reg = _registry(_Plugin("twin"), _Plugin("twin"))
    reasons = [i.reason for i in reg.info(Config()) if not i.available]
    assert any("registered twice" in (r or "") for r in reasons)


def test_unknown_name_lists_installed_backends():
    reg = _registry(_Plugin("alpha"))
    with pytest.raises(ValueError, match="installed backends: alpha, single"):
        reg.spec("beta")


def test_factory_must_return_a_backend():
    class Bad:
        @hookimpl
        def meshcomm_register_backends(self, register):
            register("bad", factory=lambda c, s: np.zeros(1))

    reg = _registry(Bad())
    with pytest.raises(TypeError, match="not a meshcomm.protocol.backend.Backend"):
        reg.start("bad", Config(), strict=True)


def test_tools_load_whichever_backend_plugins_are_chosen():
    """The tracer is a tool of the group meshcomm.tools: MESHCOMM_PLUGINS (backend plugins)
    leaves it in place; MESHCOMM_DISABLE_PLUGINS can turn it off like any plugin."""
    chosen = Registry().load(environ={"MESHCOMM_PLUGINS": "sockets"})
    assert chosen.names() == ["single", "sockets"] and chosen.pm.get_plugin("trace") is not None
    assert Registry().load(environ={"MESHCOMM_DISABLE_PLUGINS": "trace"}).pm.get_plugin("trace") is None


def test_a_world_start_reaches_every_tool():
    seen = []

    class _Tool:
        @hookimpl
        def meshcomm_world_started(self, config, world):
            seen.append((config.backend, world))

    reg = _registry()
    reg.pm.register(_Tool())
    reg.world_started(Config(backend="single"), "the world")
    assert seen == [("single", "the world")]

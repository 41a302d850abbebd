"""Shared helpers: run real jobs through `meshcomm launch`, and a clean registry per test."""

from __future__ import annotations

import pytest


@pytest.fixture
def fresh_registry():
    """Forget loaded plugins and worlds before and after the test."""
    from meshcomm import registry, world

    registry.reset_registry()
    world.shutdown()
    yield
    registry.reset_registry()
    world.shutdown()

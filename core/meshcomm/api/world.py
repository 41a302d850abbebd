"""``init``, ``is_available`` and ``backends``: starting the world group once per process."""

from __future__ import annotations

import atexit
import threading
from typing import TYPE_CHECKING, Any

from ..protocol.backend import Backend
from ..protocol.memory import keep_freed_memory
from ..runtime import exits
from ..runtime.registry import BackendInfo, get_registry
from .group import Group, world_ident
from .guard import new_guard

if TYPE_CHECKING:
    from ..runtime.config import Config

__all__ = ["init", "is_available", "backends", "default_group", "started_backends", "shutdown"]

_lock = threading.RLock()
_worlds: dict[str, Group] = {}
_default: Group | None = None
#: worlds started by this process so far (names each world apart, for sealed object payloads)
_started = 0


def init(strict: bool = False, backend: str | None = None, *, config: Config | None = None, **settings: Any) -> Group:
    """The world group.

    Args:
        strict: raise instead of falling back to a size-1 group when no backend can start.
        backend: a backend name or ``"any"``; ``None`` reads ``MLX_BACKEND`` (default ``any``).
        config: settings to use instead of reading the environment.
        **settings: overrides of :class:`meshcomm.Config` fields (``timeout=30``, ``debug=True``).

    Calling it again with the same backend returns the same group.
    """
    global _default
    with _lock:
        if config is None:
            overrides: dict[str, Any] = dict(settings)
            if backend:
                overrides["backend"] = backend
            from ..runtime.config import (
                Config,  # pydantic: imported by the first init(), not by import meshcomm
            )

            config = Config.load(None, **overrides)
        elif backend or settings:
            config = config.model_copy(update={**settings, **({"backend": backend.strip().lower()} if backend else {})})
        name = config.backend
        if name in _worlds and not _worlds[name].closed:
            return _worlds[name]
        registry = get_registry()
        transport, started = registry.start(name, config, strict)
        if started != "single":
            # An uncaught exception on this rank tells its peers and the launcher (exits.py).
            exits.install(started_backends)
            exits.install_stack_dump(transport.rank())
            if config.keep_memory:
                keep_freed_memory()
        global _started
        _started += 1  # the ranks of a job start their worlds in the same order
        group = Group(
            transport,
            started,
            debug=config.debug,
            check_calls=config.check_calls,
            max_object_bytes=config.max_object_bytes,
            guard=new_guard(config.compiled),
            _ident=world_ident(f"{started}/world{_started}", transport),
        )
        if started != "single":
            registry.world_started(config, group)  # the tracer and the stall inspector attach here
        _on_shrink(group)
        _worlds[name] = group
        if started not in _worlds or _worlds[started].closed:
            _worlds[started] = group
        if _default is None or _default.backend == "single" or _default.closed:
            _default = group
        return group


def _on_shrink(group: Group) -> None:
    """Let ``group``'s shrink() put the new world where the old one was (the default group,
    ``init()``'s answer, the worlds told of an uncaught exception)."""

    def replaced(old: Group, new: Group) -> None:
        global _default
        with _lock:
            for name, g in list(_worlds.items()):
                if g is old:
                    _worlds[name] = new
            if _default is old:
                _default = new
        _on_shrink(new)

    group._world.replaced = replaced


def default_group() -> Group:
    """The group operations use when none is passed: the first world ``init()`` made."""
    return _default if _default is not None else init()


def started_backends() -> list[tuple[str, Backend]]:
    """``(name, backend)`` of every multi-process world this process started, once each."""
    with _lock:
        seen: set[int] = set()
        out = []
        for group in _worlds.values():
            if group.backend != "single" and id(group) not in seen and not group.closed:
                seen.add(id(group))
                out.append((group.backend, group.transport))
        return out


def is_available(backend: str | None = None) -> bool:
    """True if a multi-process backend (or the named one) is installed and its libraries load."""
    registry = get_registry()
    if backend is None:
        return any(s.multiprocess and s.unavailable_reason() is None for s in registry.specs.values())
    spec = registry.specs.get(backend.strip().lower())
    return spec is not None and spec.unavailable_reason() is None


def backends() -> list[BackendInfo]:
    """Every registered backend with its distribution, version, availability and reason."""
    return get_registry().info()


def shutdown() -> None:
    """Close every world (registered with atexit; safe to call twice): each first lets its
    queued asynchronous operations finish, for up to its timeout."""
    global _default
    with _lock:
        seen = set()
        for group in _worlds.values():
            if id(group) not in seen:
                seen.add(id(group))
                try:
                    group.close()
                except Exception:
                    pass
        _worlds.clear()
        _default = None


atexit.register(shutdown)

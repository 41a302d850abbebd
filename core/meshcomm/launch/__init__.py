"""``meshcomm launch``: start a job's ranks locally or over ssh, for any backend.

``launch(LaunchOptions(...))`` is what the command line runs (imported lazily: the rank
runner, ``python -m meshcomm.launch.rank``, must not pay for the launcher).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LaunchOptions", "launch"]


def __getattr__(name: str) -> Any:
    if name == "LaunchOptions":
        from .options import LaunchOptions

        return LaunchOptions
    if name == "launch":
        from .run import launch

        return launch
    raise AttributeError(name)

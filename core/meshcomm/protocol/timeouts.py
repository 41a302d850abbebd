"""How long a rank waits on a peer unless told otherwise (a module of its own: the settings
model and the launcher read it without importing NumPy)."""

from __future__ import annotations

__all__ = ["DEFAULT_TIMEOUT"]

#: seconds a rank waits on a peer unless told otherwise: the default of ``MLX_TIMEOUT``
#: (:attr:`meshcomm.runtime.config.Config.timeout`) and of :attr:`Backend.timeout`
DEFAULT_TIMEOUT: float = 300.0

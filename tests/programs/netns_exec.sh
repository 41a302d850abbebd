#!/usr/bin/env bash
# An "ssh" for the launcher tests: netns_exec.sh HOST COMMAND... runs COMMAND with bash in
# the network namespace that stands for HOST. $MC_TEST_NETNS_MAP maps hosts to namespaces:
# "10.213.7.1=mc-ab12-0 10.213.7.2=mc-ab12-1" (tests/netns.py writes it).
set -euo pipefail
host=${1:?usage: netns_exec.sh HOST COMMAND...}
shift
host=${host##*@}
ns=
for pair in ${MC_TEST_NETNS_MAP:-}; do
  if [ "${pair%%=*}" = "$host" ]; then ns=${pair#*=}; fi
done
if [ -z "$ns" ]; then
  echo "netns_exec.sh: no namespace for host $host in MC_TEST_NETNS_MAP" >&2
  exit 255
fi
exec ip netns exec "$ns" bash -c "$*"

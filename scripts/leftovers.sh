# Sourced by the test scripts: MPICH's Hydra proxy writes the node's topology to
# /tmp/hydra_hwloc_xmlfile_* (a fixed path, not $TMPDIR) and deletes it when it ends normally,
# but not when a rank calls MPI_Abort -- which the mpi backend does on every failure, and the
# failure tests cause on purpose. The same goes for the MPI libraries' files in /dev/shm
# (tests/shm_leftovers.py), which each pytest session also removes, except one a process still
# mapped when the session ended. `leftovers_mark` notes the files that exist; `leftovers_remove`,
# called when no test job runs any more, deletes the ones made since.
leftovers_mark() {
  _leftovers_before=$(mktemp)
  ls -1 /tmp 2>/dev/null | grep '^hydra_hwloc_xmlfile_' > "$_leftovers_before" || true
  _leftovers_shm=$(mktemp)
  python3 tests/shm_leftovers.py mark "$_leftovers_shm" || true
}
leftovers_remove() {
  [ -n "${_leftovers_before:-}" ] || return 0
  local f
  for f in /tmp/hydra_hwloc_xmlfile_*; do
    [ -O "$f" ] || continue
    grep -qxF "${f#/tmp/}" "$_leftovers_before" || rm -f "$f"
  done
  rm -f "$_leftovers_before"
  _leftovers_before=
  python3 tests/shm_leftovers.py remove "$_leftovers_shm" || true
  rm -f "$_leftovers_shm"
}

# ---- slipway job library: the bad nodes a cluster remembers across jobs (jobs/slurm/bad_nodes_lib.sh) ----
# Pinned and sourced beside job_lib.sh (whose `event` and `line_field` it uses, and which calls these
# where it blames a node or a preflight clears one); jobs/slurm/bad_nodes.py reads the records at
# submission.

declare -gA BLAME=()  # why each node is blamed: set where a node is named, read by remember_bad_nodes

# remember_bad_nodes KIND NODE...: later jobs of CLUSTER exclude each NODE until its record expires,
# a clean preflight clears it, or `slipway nodes --forget`. A record not written is said, not fatal.
remember_bad_nodes() {
  local kind=$1 node done=""; shift
  [ -n "${BAD_NODES_DIR:-}" ] || return 0
  for node in "$@"; do
    if remember_bad_node "$node" "$kind" "${BLAME[$node]:-$kind}"; then done+="$node "
    else event "could not remember $node as a bad node of cluster $CLUSTER (in $BAD_NODES_DIR)"; fi
  done
  [ -z "$done" ] || event "bad nodes remembered for cluster $CLUSTER: ${done% } (its later jobs exclude them)"
}

# bad_node_record NODE: the first line of NODE's record (at most 4 KiB; nothing for a missing,
# foreign or special file: a FIFO is never opened).
bad_node_record() { [ -f "$BAD_NODES_DIR/$1" ] && head -c 4096 -- "$BAD_NODES_DIR/$1" 2>/dev/null | head -n 1 || true; }

# remember_bad_node NODE KIND REASON: NODE's record (jobs/slurm/bad_nodes.py BadNode), renamed into
# place whole so jobs blaming nodes at once never tear one; `since` kept from the one it replaces.
remember_bad_node() {
  local node=$1 kind=${2// /-} reason=$3 now since tmp
  [[ $node =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$ ]] || return 1
  now=$(date --iso-8601=seconds)
  since=$(line_field since "$(bad_node_record "$node" | sed 's/ reason: .*//')")
  [[ $since =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:]{8}[-+][0-9:]{5}$ ]] || since=$now
  mkdir -p -- "$BAD_NODES_DIR" 2>/dev/null && tmp=$(mktemp "$BAD_NODES_DIR/.$node.XXXXXX" 2>/dev/null) || return 1
  if printf 'slipway-bad-node node=%s since=%s at=%s run=%s job=%s kind=%s reason: %s\n' "$node" "$since" "$now" \
       "${RUN_DIR##*/}" "${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID}" "$kind" "${reason//[$'\n\r']/ }" > "$tmp" \
     && mv -f -- "$tmp" "$BAD_NODES_DIR/$node"; then
    return 0
  fi
  rm -f -- "$tmp"; return 1
}

# clear_bad_node NODE: after a clean preflight on NODE.
clear_bad_node() {
  local since
  [ -n "${BAD_NODES_DIR:-}" ] && [ -f "$BAD_NODES_DIR/$1" ] || return 0
  since=$(line_field since "$(bad_node_record "$1" | sed 's/ reason: .*//')")
  rm -f -- "$BAD_NODES_DIR/$1" 2>/dev/null || return 0
  event "bad node $1 cleared for cluster $CLUSTER: a clean preflight (remembered since $since)"
}

# ---- end of the bad nodes library ----

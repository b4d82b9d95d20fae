# ---- slipway job library: what the job runs, checked on every node before anything starts there (jobs/slurm/verify_lib.sh) ----
# Pinned and sourced beside job_lib.sh (whose `event`, `end_with`, `waited`, `blame_preflight` and
# `retry_preflight` it uses), before the pyxis part, which defines ensure_container and uses on_every_node.

# verify_code DIR SHA256 (on a node): the code snapshot DIR is the one submitted: its listing
# (.slipway-files, jobs/runs/code.py) hashes to SHA256, every file and link matches it, and nothing
# is added but __pycache__/*.pyc (a snapshot holds none; the ranks write them, each through a
# NAME.pyc.ID renamed into place: another node's rank may be writing one). Prints what differs,
# returning 1. One sha256sum for every file: well under a second for the trainer.
verify_code() {
  local dir=$1 want=$2 got kind sum path sums="" out name
  local -A listed=()
  if [ ! -r "$dir/.slipway-files" ]; then echo "the code snapshot $dir is not there (removed after submission, or this node does not see its filesystem)"; return 1; fi
  got=$( { printf 'slipway-code-v2\n'; cat "$dir/.slipway-files"; } | sha256sum) || got=""
  if [ "${got%% *}" != "$want" ]; then echo "$dir/.slipway-files is not the listing recorded at submission"; return 1; fi
  while read -r kind sum path; do
    listed[$path]=1
    case $kind in
      l) got=$(readlink "$dir/$path" 2>/dev/null) && got=$(printf %s "$got" | sha256sum) || got=""
         if [ "${got%% *}" != "$sum" ]; then echo "$dir/$path differs from the link submitted"; return 1; fi ;;
      x) if [ ! -x "$dir/$path" ] || [ -L "$dir/$path" ]; then echo "$dir/$path is missing or no longer executable"; return 1; fi
         sums+="$sum  $path"$'\n' ;;
      *) if [ -L "$dir/$path" ]; then echo "$dir/$path was replaced by a link"; return 1; fi
         sums+="$sum  $path"$'\n' ;;
    esac
  done < "$dir/.slipway-files"
  if ! out=$(cd "$dir" && printf %s "$sums" | sha256sum --check --quiet 2>&1); then
    name=$(grep -m1 -E ': FAILED' <<< "$out") || name=""
    case "$name" in
      *": FAILED open or read") echo "$dir/${name%: FAILED open or read} is missing" ;;
      *": FAILED") echo "$dir/${name%: FAILED} differs from the file submitted" ;;
      *) echo "the code snapshot $dir cannot be read ($(head -n1 <<< "$out"))" ;;
    esac
    return 1
  fi
  while IFS= read -r -d '' path; do
    [[ ! $path =~ (^|/)__pycache__/[^/]+\.pyc(\.[0-9]+)?$ ]] || [ -L "$dir/$path" ] || continue
    [ "$path" = .slipway-files ] || [ -n "${listed[$path]:-}" ] || { echo "$dir/$path was added after submission"; return 1; }
  done < <(find "$dir" -mindepth 1 \( -type f -o -type l \) -printf '%P\0')
}

# verify_image FILE SHA256 SIZE MTIME (on a node): the squashfs FILE (none: a registry image) is the
# one submitted: its size and mtime unchanged, else its bytes hash to SHA256 (where one was known).
verify_image() {
  local file=$1 want=$2 size=$3 mtime=$4 st got
  [ -n "$file" ] || return 0
  if ! st=$(stat -L -c '%s %Y' -- "$file" 2>/dev/null); then
    echo "the image $file is not there (removed or moved after submission, or this node does not see its filesystem): restore it, or build the image again and submit again"
    return 1
  fi
  [ "$st" != "$size $mtime" ] || return 0
  if [ -n "$want" ]; then
    got=$(sha256sum < "$file" 2>/dev/null) || got=""
    [ "${got%% *}" != "$want" ] || return 0
  fi
  echo "the image $file changed after submission (size ${st% *} bytes, submitted ${size} bytes${want:+; its bytes differ}): build the image again and submit again"
  return 1
}

# on_every_node SECONDS NAME FUNCTIONS CALL [ARG...]: CALL ARG... in one task per node (--overlap),
# bounded by SECONDS, with FUNCTIONS' text carried in the step (nothing is sourced on the node). The
# job library's one srun: script.py renders the others.
on_every_node() {
  local limit=$1 name=$2 functions=$3; shift 3
  # shellcheck disable=SC2086  # FUNCTIONS is a list of names
  timeout -k 5 "$limit" srun --nodes="$NODES_NEEDED" --ntasks="$NODES_NEEDED" --ntasks-per-node=1 --cpus-per-task=1 --overlap \
    --kill-on-bad-exit=0 bash -c "$(declare -f $functions)"'; "$@"' "$name" "$@"
}

# ensure_container (on a node): the pyxis library's; other runs keep nothing on the nodes.
ensure_container() { :; }

# node_check CODE_DIR CODE_SHA256 IMAGE_FILE IMAGE_SHA256 IMAGE_SIZE IMAGE_MTIME [KEPT IDENTITY
# [WARM_SOCKET [LIMIT PYTHON FALLBACK ARG...]]] (on a node): one line, `slipway-verify NODE ok` (`ok
# warm`: the user's warm process listens on WARM_SOCKET, and the lines of its client's check follow,
# run for at most LIMIT s by PYTHON, else by FALLBACK where this node has no PYTHON; `ok cgroup`:
# Slurm tracks the job's processes by cgroup), `... differs: WHAT` (not what was submitted) or `...
# node: WHAT` (the kept container KEPT could not be readied).
node_check() {
  local n=${SLURMD_NODENAME:-$(hostname)} why="" w py
  w="${9:-}-$n.sock"
  if [ -n "$1" ] && ! why=$(verify_code "$1" "$2"); then echo "slipway-verify $n differs: $why"; return 0; fi
  if ! why=$(verify_image "$3" "$4" "$5" "$6"); then echo "slipway-verify $n differs: $why"; return 0; fi
  if [ -n "${7:-}" ] && ! why=$(ensure_container "$7" "$3" "$8" 2>&1); then echo "slipway-verify $n node: $why"; return 0; fi
  if [ -n "${9:-}" ] && grep -qs "/job_$SLURM_JOB_ID/" /proc/self/cgroup; then echo "slipway-verify $n ok cgroup${why:+, $why}"; return 0; fi
  if [ -n "${9:-}" ] && [ ! -L "${w%/*}" ] && [ -O "${w%/*}" ] && [ -O "$w" ] && [ -S "$w" ] &&
    awk -v w="$w" '$NF == w { found = 1 } END { exit !found }' /proc/net/unix; then
    echo "slipway-verify $n ok warm${why:+, $why}"
    if [ $# -gt 9 ]; then
      shift 9; py=$2; [ -x "$py" ] || py=$3
      timeout -k 5 "$1" "$py" "${@:4}" 2>&1 || true
    fi
    return 0
  fi
  echo "slipway-verify $n ok${why:+, $why}"
}

# verify_nodes: before anything else starts there, every node runs node_check. What differs on
# every node (or the job's one) ends the job with BAD_INPUT_EXIT: the same files are wrong on every
# retry, so no retry and no node blamed. A node where only it differs (it does not see the shared
# filesystem), that could not ready the container, or that sent no report, is left out of a retry.
verify_nodes() {
  local out rc node line why="" differ="" bad="" unpacked="" t=$SECONDS
  local -A said=()
  set +e
  out=$(on_every_node "$PREFLIGHT_TIMEOUT" slipway-verify "verify_code verify_image ensure_container enroot_data node_check" \
    node_check "$CODE_DIR" "$CODE_SHA256" "${IMAGE_FILE:-}" "${IMAGE_SHA256:-}" "${IMAGE_SIZE:-}" "${IMAGE_MTIME:-}" \
    "${KEPT_CONTAINER:-}" "${IMAGE_IDENTITY:-}" "${WARM_SOCKET:-}" "${WARM_CHECK[@]}" 2>&1)
  rc=$?
  set -e
  for node in $NODES; do
    line=$(grep -F -m1 "slipway-verify $node " <<< "$out") || line=""
    [[ $line != "slipway-verify $node ok"*", unpacked in "* ]] || unpacked+=", $node ${line##*, unpacked }"
    case "$line" in
      "slipway-verify $node ok warm"*) ;;
      "slipway-verify $node ok cgroup"*) WARM_OFF=$node ;;
      "slipway-verify $node ok"*) WARM_COLD+="$node " ;;
      "slipway-verify $node differs: "*) differ+="$node "; said[$node]=${line#*differs: }
        [ -n "$why" ] || why="${line#*differs: } (on $node)" ;;
      "slipway-verify $node node: "*) blame_preflight "$node" "${line#*node: }" ;;
      *) bad+="$node "; BLAME[$node]="no verification report$(waited $((SECONDS - t)) "$rc")"
         event "preflight failed on $node: ${BLAME[$node]}" ;;
    esac
  done
  [ -z "$unpacked" ] || event "unpacked the image into the kept container $KEPT_CONTAINER:${unpacked#,}"
  WARM_CHECKED=$(grep -E '^slipway-(preflight|warm) ' <<< "$out" || true)
  if [ -n "$differ" ] && { [ "${differ% }" = "$NODES" ] || [ "$NODES_NEEDED" -eq 1 ]; }; then
    end_with "$BAD_INPUT_EXIT" "verification failed: $why"
  fi
  for node in $differ; do blame_preflight "$node" "${said[$node]}"; done
  retry_preflight $bad
}
# checked_warm: where every node's warm process ran the preflight's node check with its
# verification (node_check's CHECK), its lines are PREFLIGHT_LOG and no node step runs; else
# (why said in events.log) fails, and the node step runs.
checked_warm() {
  local node why
  for node in $NODES; do
    if [[ $WARM_CHECKED != *"slipway-preflight $node "* ]]; then
      if why=$(grep -m1 -F "slipway-warm $node: the node step runs in a step of its own: " <<< "$WARM_CHECKED"); then
        event "warm: on $node, ${why#*: }"
      fi
      return 1
    fi
  done
  printf '%s\n' "$WARM_CHECKED" > "$PREFLIGHT_LOG"
}
# ---- end of the slipway job library: verification ----

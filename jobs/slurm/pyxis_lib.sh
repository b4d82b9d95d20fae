# ---- slipway pyxis library (jobs/slurm/pyxis_lib.sh): the named containers of pyxis jobs ----
# Sourced after the job library by pyxis jobs alone, pinned the same way (see job_lib.sh).
# Deleting an unpacked container takes 16 s on a quiet disk and over a minute under load (tens of
# thousands of files): the job's end gives it a few seconds, else the next slipway job on the node
# removes it in the background.

# container_name: the steps' named container, CONTAINER_NAME (none without CONTAINER_PREFIX): the
# image build's (CONTAINER_BUILD, container.keep_builds), kept on the nodes for its later jobs, else
# this attempt's own. pyxis names it pyxis_NAME (container_scope=global, its default) or
# pyxis_JOBID_NAME (container_scope=job: its epilog removes it at the job's end, nothing is kept).
container_name() { [ -z "$CONTAINER_PREFIX" ] || echo "$CONTAINER_PREFIX${CONTAINER_BUILD:-$JOB_TAG}"; }

# pyxis_scope: "job", "global" (pyxis's default) or "" (none readable here), from pyxis's line in
# Slurm's plugstack configuration, includes followed.
pyxis_scope() {
  local conf dir kw rest f scope="" words w files=()
  conf=$(scontrol show config 2>/dev/null | sed -n 's/^PlugStackConfig *= *//p') || conf=""
  case "$conf" in ""|"(null)") conf=/etc/slurm/plugstack.conf ;; esac
  dir=${conf%/*}
  files=("$conf")
  while read -r kw rest; do
    [ "$kw" = include ] || continue
    [[ $rest = /* ]] || rest="$dir/$rest"
    for f in $rest; do files+=("$f"); done
  done < <(cat "$conf" 2>/dev/null)
  for f in "${files[@]}"; do
    while read -r -a words; do
      case "${words[0]:-}" in required|optional) ;; *) continue ;; esac
      [[ ${words[1]:-} == *pyxis* ]] || continue
      scope=global
      for w in "${words[@]:2}"; do [ "$w" != container_scope=job ] || scope=job; done
    done < <(cat "$f" 2>/dev/null)
  done
  echo "$scope"
}

# keep_container: KEPT_CONTAINER, the build's container this job readies on every node
# (ensure_container), or none: under container_scope=job there is none to keep, said once per run.
keep_container() {
  local text="containers: this cluster's pyxis removes named containers at each job's end (container_scope=job), so every job unpacks the image and container.keep_builds has no effect"
  KEPT_CONTAINER=""
  [ -n "$CONTAINER_BUILD" ] || return 0
  if [ "$(pyxis_scope)" = job ]; then
    grep -qF "$text" "$EVENTS_LOG" 2>/dev/null || event "$text"
    return 0
  fi
  KEPT_CONTAINER="pyxis_$CONTAINER_NAME"
}

# remove_named NAME (on a node): the container pyxis made for NAME, whichever scope named it.
remove_named() { local n; for n in "pyxis_$1" "pyxis_${SLURM_JOB_ID}_$1"; do enroot remove --force "$n"; done >/dev/null 2>&1; true; }

# remove_container SECONDS: this attempt's own container (never a build's) removed on every node, for
# at most SECONDS (a removal cut short is finished by the next job's sweep_containers).
remove_container() {
  [ -n "$CONTAINER_NAME" ] && [ -z "$CONTAINER_BUILD" ] || return 0
  on_every_node "$1" slipway-rm remove_named remove_named "$CONTAINER_NAME" > /dev/null 2>&1 || true
}

# enroot_data (on a node): where enroot unpacks containers, by the enroot script's own configuration
# part (above its END CONFIG line: the files and variables enroot reads); empty where unreadable.
enroot_data() {
  local e
  e=$(command -v enroot) && grep -q '^# ----- END CONFIG -----' "$e" 2>/dev/null || return 0
  bash -c "$(sed '/^# ----- END CONFIG -----/q' "$e")"$'\n''printf %s "$ENROOT_DATA_PATH"' 2>/dev/null || true
}

job_over() {
  local state
  state=$(squeue -h -j "$1" -o %T 2>/dev/null) || state=""
  case "$state" in ""|COMPLETED|CANCELLED|FAILED|TIMEOUT|NODE_FAIL|PREEMPTED|BOOT_FAIL|DEADLINE|OUT_OF_MEMORY) return 0 ;; esac
  return 1
}

# sweep_containers JOB_ID JOB_TAG BUILD KEEP [LIST] [PREFIX] (on a node): records that this job uses
# BUILD's kept container, then removes, a line each (`removed NAME`, `kept NAME: WHY`; LIST: `would
# remove NAME`, nothing removed), each attempt's own container once its job is over (this job's
# earlier ones too), and the builds' beyond the KEEP most recently used (no KEEP: none), never one a
# queued or running job used. Only
# this project's (named PREFIX..., containers/project.py); others are left alone. The jobs that used
# a kept container are in DATA/.slipway/NAME (hidden from `enroot list`). A kept container is renamed
# before it is deleted, so no job starts in a half-deleted one; the deleting (minutes) goes to stderr.
sweep_containers() {
  local job=$1 tag=$2 build=$3 keep=$4 list=${5:-} prefix=${6:-slipway-} data uses name id tag_of used=() n=0 j busy t
  data=$(enroot_data)
  uses=${data:+$data/.slipway}
  if [ -n "$build" ] && [ -n "$uses" ] && mkdir -p "$uses"; then
    { grep -vx -- "$job" "$uses/pyxis_slipway-$build" 2>/dev/null | tail -n 19; echo "$job"; } > "$uses/.new.$$" &&
      mv -f "$uses/.new.$$" "$uses/pyxis_slipway-$build"
  fi
  while read -r name; do
    case "$name" in
      "pyxis_${prefix}i"*) used+=("$name"); continue ;;
      "pyxis_$prefix"*) tag_of=${name#"pyxis_$prefix"} ;;
      pyxis_*_"$prefix"*) tag_of=${name#pyxis_*_"$prefix"} ;;
      pyxis_slipway-*|pyxis_*_slipway-*) [ -z "$list" ] || echo "left alone $name: not this project's"; continue ;;
      *) continue ;;
    esac
    id=${tag_of%%[!0-9]*}
    [[ $id =~ ^[0-9]+$ ]] || continue
    if [ "$id" = "$job" ]; then
      [ "$tag_of" != "$tag" ] && [ "$tag_of" != "$build" ] || continue
    else
      job_over "$id" || { echo "kept $name: job $id is not over"; continue; }
    fi
    if [ -n "$list" ]; then echo "would remove $name"; continue; fi
    echo "removing $name" >&2
    enroot remove --force "$name" >/dev/null 2>&1 && echo "removed $name"
  done < <(enroot list 2>/dev/null)
  # Most recently used first (no record of use: the oldest); this job's build counts as the most
  # recent. No KEEP (a job that keeps no container): the kept ones are not this job's to bound.
  [ -z "$build" ] || n=1
  [ -n "$keep" ] || used=()
  while read -r name; do
    if [ "$name" = "pyxis_slipway-$build" ]; then echo "kept $name: this job's build"; continue; fi
    n=$((n + 1))
    if [ "$n" -le "$keep" ]; then echo "kept $name: among the $keep most recently used builds"; continue; fi
    busy=""
    for j in $(cat "$uses/$name" 2>/dev/null); do job_over "$j" || { busy=$j; break; }; done
    if [ -n "$busy" ]; then echo "kept $name: used by job $busy, which is not over"; continue; fi
    if [ -n "$list" ]; then echo "would remove $name"; continue; fi
    if [ -z "$data" ]; then echo "kept $name: enroot's data path is unknown here"; continue; fi
    # Never while a job readies it (ensure_container holds its lock).
    if ! ( flock -n 9 && mv "$data/$name" "$data/.slipway-removing-$name" ) 9>>"$uses/$name.lock" 2>/dev/null; then
      echo "kept $name: a job is unpacking it"
      continue
    fi
    rm -f "$uses/$name" "$uses/$name.ready"
    echo "removed $name"
  done < <(for name in "${used[@]+"${used[@]}"}"; do
             printf '%s %s\n' "$(stat -c %Y "$uses/$name" 2>/dev/null || echo 0)" "$name"
           done | sort -rn | cut -d' ' -f2)
  # Renamed containers (this sweep's, or one cut short) are deleted last: enroot remove takes
  # the hidden name like any other.
  [ -z "$list" ] || return 0
  for name in "$data"/.slipway-removing-pyxis_"$prefix"*; do
    [ -e "$name" ] || continue
    name=${name##*/} t=$SECONDS
    echo "deleting the files of ${name#.slipway-removing-}" >&2
    enroot remove --force "$name" >/dev/null 2>&1 || true
    echo "deleted the files of ${name#.slipway-removing-} in $((SECONDS - t)) s" >&2
  done
  # An unpack cut short (its job died) is no job's while nobody holds its container's lock.
  for name in "$data"/.slipway-unpacking-pyxis_"$prefix"*; do
    [ -e "$name" ] || continue
    name=${name##*/} used=${name#.slipway-unpacking-}
    ( flock -n 9 && enroot remove --force "$name" >/dev/null 2>&1 ) 9>>"$uses/${used%.*}.lock" 2>/dev/null || true
  done
}

# remove_stale_containers: sweep_containers on every node in the background, bounded by
# STALE_REMOVE_TIMEOUT s (never delaying training; the trap ends it with the other helpers).
remove_stale_containers() {
  [ -n "$CONTAINER_NAME" ] || return 0
  on_every_node "$STALE_REMOVE_TIMEOUT" slipway-sweep "enroot_data job_over sweep_containers" \
    sweep_containers "$SLURM_JOB_ID" "$JOB_TAG" "$CONTAINER_BUILD" "${CONTAINER_BUILD:+$KEEP_BUILDS}" "" \
    "$CONTAINER_PREFIX" > /dev/null 2>&1 &
  HELPER_PIDS+=("$!")
}

# ensure_container NAME IMAGE IDENTITY (on a node): the build's kept container NAME (which pyxis then
# reuses instead of unpacking IMAGE) unpacked whole, once. Two jobs of one build starting together
# must not both unpack it (one dies on "File exists", the other starts in a half-unpacked root): it
# is made under the node's lock (DATA/.slipway/NAME.lock) under a hidden name, renamed into place,
# then marked complete (NAME.ready holds IDENTITY); one without its mark is removed and unpacked
# again. Prints `unpacked in N s`, or why not (returning 1); without enroot's data path, leaves it to pyxis.
ensure_container() {
  local name=$1 image=$2 id=$3 data uses tmp out old t
  data=$(enroot_data)
  [ -n "$data" ] || return 0
  uses=$data/.slipway
  mkdir -p "$uses" || { echo "cannot create $uses"; return 1; }
  (
    flock -w "${PREFLIGHT_TIMEOUT:-300}" 9 || { echo "the unpack of $name by another job did not end within ${PREFLIGHT_TIMEOUT:-300} s"; exit 1; }
    t=$SECONDS
    if [ -d "$data/$name" ] && [ "$(cat "$uses/$name.ready" 2>/dev/null)" = "$id" ]; then
      touch "$uses/$name.ready"
      exit 0
    fi
    rm -f "$uses/$name.ready"
    if [ -e "$data/$name" ]; then  # incomplete, or of another image: out of pyxis's sight first
      mv "$data/$name" "$data/.slipway-removing-$name.$$" && enroot remove --force ".slipway-removing-$name.$$" >/dev/null 2>&1
    fi
    for old in "$data/.slipway-unpacking-$name."*; do  # an unpack cut short (this lock was free)
      [ -e "$old" ] && enroot remove --force "${old##*/}" >/dev/null 2>&1
    done
    tmp=".slipway-unpacking-$name.$$"
    if ! out=$(enroot create --name "$tmp" "$image" 2>&1); then
      enroot remove --force "$tmp" >/dev/null 2>&1
      echo "enroot could not unpack $image: $(tail -n 1 <<< "$out")"
      exit 1
    fi
    mv "$data/$tmp" "$data/$name" || { echo "could not rename the unpacked container into $data/$name"; exit 1; }
    printf '%s\n' "$id" > "$uses/$name.ready.$$" && mv -f "$uses/$name.ready.$$" "$uses/$name.ready"
    echo "unpacked in $((SECONDS - t)) s"
  ) 9>>"$uses/$name.lock"
}
# ---- end of the slipway pyxis library ----

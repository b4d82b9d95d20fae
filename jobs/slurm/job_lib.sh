# ---- slipway job library (jobs/slurm/job_lib.sh, inlined verbatim by jobs/slurm/script.py) ----
# Why a static bash file: the job's decisions (preflight outcome, retry or not, which nodes to
# exclude, requeue counting, hang classification, how the job ends, cleanup) must be testable
# without Slurm (tests/test_job_lib.py sources this file with stand-in scontrol/sinfo/srun), and
# a user must be able to read their job.sbatch and follow it. What runs on the batch host outside
# the container depends only on what compute nodes have: bash and the Slurm client commands, no
# Python. It is inlined, not sourced, so that runs/RUN/job.sbatch alone says what ran, through
# every requeue. The functions take data: the run's values are the plain variables the settings
# block at the top of job.sbatch sets once (RUN_DIR, NODES_NEEDED, PROCS_PER_NODE, RANKS,
# MAX_RETRIES, MAX_REQUEUES, REQUEUE, PREFLIGHT_TIMEOUT, the exit codes, CHECKPOINT_DIR,
# STOP_FILE, CONTAINER_PREFIX, CONTAINER_BUILD, KEEP_BUILDS); the main part sets JOB_TAG, NODES,
# RETRIES, REQUEUES and CONTAINER_NAME.
#
# Every end is told truthfully in events.log and recorded before anything slow: the EXIT trap
# writes `end exit N` first. Nothing slow is on the path to the job's end: deleting an unpacked
# pyxis container takes 16 s on a quiet disk and over a minute under load (tens of thousands of
# files), so the trap gives it a few seconds and otherwise leaves it to the next slipway job on
# the node, which removes stale containers in the background when it starts.

# event TEXT...: one line `ISO-TIME job JOBID TEXT` in events.log.
event() { printf '%s job %s %s\n' "$(date --iso-8601=seconds)" "${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID}" "$*" >> "$RUN_DIR/events.log"; }

# count_events PREFIX: how many events of this job (its id survives requeues) start with PREFIX.
count_events() { local n; n=$(grep -F " job ${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID} $* " "$RUN_DIR/events.log" 2>/dev/null | wc -l) || true; echo "${n:-0}"; }

# job_tag: names this attempt's files (hang dumps, preflight logs, containers): the job id,
# rN after the Nth requeue.
job_tag() { if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then echo "$SLURM_JOB_ID"; else echo "${SLURM_JOB_ID}r$SLURM_RESTART_COUNT"; fi; }

# latest_checkpoint: the step of the latest complete checkpoint in CHECKPOINT_DIR (0: none), the
# trainer's layout (step-NNNNNN/ with a COMPLETE marker), as jobs.local reads it.
latest_checkpoint() {
  local f s n=0
  for f in "$CHECKPOINT_DIR"/step-*/COMPLETE; do
    s=${f%/COMPLETE}; s=${s##*/step-}
    [[ $s =~ ^[0-9]+$ ]] && [ $((10#$s)) -gt $n ] && n=$((10#$s))
  done
  echo $n
}

# retry_or_stop KIND CODE [NODE...]: requeue this job (at most MAX_RETRIES times) without the
# nodes to blame, where the partition has enough other usable nodes; else end with CODE. Each
# decision in events.log. `scontrol update` changes ExcNodeList only of a pending job, so the job
# is requeued held, updated, then released.
retry_or_stop() {
  local kind=$1 code=$2; shift 2
  local bad="$*" excluded="" usable=0 node state
  if [ "$REQUEUE" != 1 ]; then
    event "not retrying ($kind): $NO_REQUEUE"
    exit "$code"
  fi
  if [ "$RETRIES" -ge "$MAX_RETRIES" ]; then
    event "not retrying ($kind): slurm.max_retries ($MAX_RETRIES) reached"
    exit "$code"
  fi
  if [ -n "$bad" ]; then
    excluded=$(scontrol show job -o "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*' | sed 's/^ExcNodeList=//') || excluded=""
    [ "$excluded" != "(null)" ] || excluded=""
    excluded=$( { [ -z "$excluded" ] || scontrol show hostnames "$excluded"; printf '%s\n' $bad; } | sort -u | paste -sd, - )
    while read -r node state; do
      case ",$excluded," in *",$node,"*) continue ;; esac
      case "${state%[~#%]}" in idle|mix|alloc|comp|plnd) usable=$((usable + 1)) ;; esac
    done < <(sinfo -h -N ${SLURM_JOB_PARTITION:+-p "$SLURM_JOB_PARTITION"} -o '%N %t' 2>/dev/null)
    if [ "$usable" -lt "$NODES_NEEDED" ]; then
      event "not retrying ($kind): without ${bad% } partition ${SLURM_JOB_PARTITION:-(default)} has $usable usable node(s), the job needs $NODES_NEEDED"
      exit "$code"
    fi
    event "retry $((RETRIES + 1))/$MAX_RETRIES ($kind): requeueing without ${bad% } (excluded nodes: $excluded)"
    trap '' TERM  # the requeue ends this job's processes: the three calls must finish first
    scontrol requeuehold "$SLURM_JOB_ID" || { event "requeue failed"; exit "$code"; }
    scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$excluded" || event "could not exclude $excluded"
    scontrol release "$SLURM_JOB_ID"
  else
    event "retry $((RETRIES + 1))/$MAX_RETRIES ($kind): requeueing (no node to blame)"
    trap '' TERM
    scontrol requeue "$SLURM_JOB_ID" || { event "requeue failed"; exit "$code"; }
  fi
  exit 0
}

# preflight_nodes LOG STEP_EXIT: every node of NODES must have reported `ok` in LOG (the node
# step of trainer/preflight.py); a node that failed or sent no report is named, and the job
# retried without it. Every node failing alike (a full filesystem, a bad config) blames none.
preflight_nodes() {
  local log=$1 step_rc=$2 node line bad=""
  for node in $NODES; do
    line=$(grep -F -m1 "slipway-preflight $node " "$log") || line=""
    case "$line" in
      "slipway-preflight $node ok"*) ;;
      "") bad+="$node "; event "preflight failed on $node: no report within $PREFLIGHT_TIMEOUT s (its container did not start there, or the node is unreachable; step exit $step_rc)" ;;
      *) bad+="$node "; event "preflight failed on $node: ${line#*fail: }" ;;
    esac
  done
  [ -n "$bad" ] || return 0
  if [ "$NODES_NEEDED" -gt 1 ] && [ "${bad% }" = "$NODES" ]; then
    retry_or_stop preflight "$PREFLIGHT_EXIT"
  fi
  retry_or_stop preflight "$PREFLIGHT_EXIT" $bad
}

# preflight_allreduce LOG STEP_EXIT: the all-reduce step (a train.script's) gave its `ok`, or the
# job is retried on the same nodes (no node to blame).
preflight_allreduce() {
  local log=$1 step_rc=$2 line
  line=$(grep -F -m1 "slipway-preflight-allreduce " "$log") || line=""
  case "$line" in
    "slipway-preflight-allreduce ok: "*) event "preflight ok on $SLURM_JOB_NODELIST: ${line#*ok: }" ;;
    "") event "preflight failed: the all-reduce across every rank gave no result within $PREFLIGHT_TIMEOUT s (step exit $step_rc)"
        retry_or_stop preflight "$PREFLIGHT_EXIT" ;;
    *) event "preflight failed: ${line#*fail: }"; retry_or_stop preflight "$PREFLIGHT_EXIT" ;;
  esac
}

# after_preflight WHY: slipway's trainer runs the preflight's all-reduce as the training step's
# first collective (trainer/preflight.py AllReduceGate): a rank that failed it, or had no result
# within PREFLIGHT_TIMEOUT, reported WHY among the step's exit reports and ended the step before
# any training; the job is retried on the same nodes (no node to blame). A pass is rank 0's
# `preflight ok` event.
after_preflight() {
  [ -n "$1" ] || return 0
  event "preflight failed: $1"
  retry_or_stop preflight "$PREFLIGHT_EXIT"
}

# step_exit SRUN_EXIT REPORTS_DIR: the training step's exit, one code whatever node failed.
# With --kill-on-bad-exit, srun ends the other tasks with SIGTERM/SIGKILL once one fails, and its
# own exit is then the first failing task's or that of a task it killed, depending on which
# node answered first (a killed rank gave the job 1 or 143). So each task reports its own exit
# in REPORTS_DIR (the task wrapper of jobs/slurm/script.py; a task that Slurm killed reports nothing,
# its wrapper dying with it). The rule: a step that srun says succeeded exited 0; otherwise the
# oldest non-zero report decides (a rank killed by a signal: 128 + the signal; under torchrun
# the node's torchrun, which exits 1 whatever its worker died of); with no report at all (a node
# died), srun's exit stands.
step_exit() {
  local rc=$1 dir=$2 f code
  if [ "$rc" = 0 ]; then echo 0; return; fi
  while read -r f; do
    code=""; read -r code < "$dir/$f" || true
    if [[ $code =~ ^[0-9]+$ ]] && [ "$code" != 0 ]; then echo "$code"; return; fi
  done < <(ls -tr "$dir" 2>/dev/null)
  echo "$rc"
}

# after_hang: the ranks' watchdogs wrote their stacks to hangs/ (trainer/watchdog.py): a hang.
# The nodes some of whose ranks wrote none in time (frozen, dead; a frozen rank may dump `late`
# once Slurm's teardown resumes it) are the ones to blame.
after_hang() {
  local dumps node f r first dumped silent="" hung_step="?" hang_limit="?"
  shopt -s nullglob; dumps=("$HANGS/$JOB_TAG-"*.txt); shopt -u nullglob
  [ "${#dumps[@]}" -gt 0 ] || return 0
  for node in $NODES; do
    dumped=0
    for f in "$HANGS/$JOB_TAG-$node-"*.txt; do
      r=${f##*/"$JOB_TAG-$node-"}; [[ ${r%.txt} =~ ^[0-9]+$ ]] || continue
      first=""; read -r first < "$f" || true
      [[ $first == *" on-time" ]] && dumped=$((dumped + 1))
    done
    [ "$dumped" -ge "$PROCS_PER_NODE" ] || silent+="$node "
  done
  read -r _ _ _ _ _ _ _ hung_step _ _ _ _ hang_limit _ < "${dumps[0]}" || true
  event "hang: no step completed for $hang_limit s after step $hung_step; stack dumps from ${#dumps[@]} of $RANKS ranks in hangs/$JOB_TAG-*.txt${silent:+; not answering in time: the ranks on ${silent% }}"
  retry_or_stop hang "$HANG_EXIT" $silent
}

# after_stop_request STEP_EXIT: after Slurm's time-limit warning (or the trainer's REQUEUE_EXIT:
# saved, requeue me), requeue the job (at most MAX_REQUEUES times, apart from failure retries).
after_stop_request() {
  local rc=$1 saved outcome
  [ "$STOP_REQUESTED" = 1 ] || [ "$rc" = "$REQUEUE_EXIT" ] || return 0
  # torchrun exits 1 when any rank exits non-zero, the trainer's REQUEUE_EXIT included: a
  # checkpoint newer than the one at the warning says the trainer saved.
  saved=$(latest_checkpoint)
  if [ "$rc" = "$REQUEUE_EXIT" ] || [ "$saved" -gt "${STOP_CHECKPOINT:-0}" ]; then
    outcome="saved after the stop request"
    [ "$saved" = 0 ] || outcome+=" (checkpoint at step $saved)"
  else
    outcome="no checkpoint saved after the stop request (step exit $rc)"
  fi
  if [ "$REQUEUE" != 1 ]; then
    event "${STOP_WHY:-time-limit stop}: $outcome; $NO_REQUEUE"
    exit "$REQUEUE_EXIT"
  fi
  if [ "$REQUEUES" -ge "$MAX_REQUEUES" ]; then
    event "not requeueing after the time-limit warning: slurm.max_requeues ($MAX_REQUEUES) reached; $outcome"
    exit "$REQUEUE_EXIT"
  fi
  event "time-limit requeue $((REQUEUES + 1))/$MAX_REQUEUES: $outcome, requeueing"
  trap '' TERM  # the requeue ends this job's processes: not a cancellation
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}

# after_node_failure STEP_EXIT: a node that died under a failed step (not responding, down or
# drained) is retried without; one sinfo for all of them (a node in several partitions is listed
# once for each).
after_node_failure() {
  local rc=$1 node state dead=""
  [ "$rc" != 0 ] || return 0
  while read -r node state; do
    case "$state" in down*|drain*|drng*|fail*|*'*') ;; *) continue ;; esac
    case " $dead" in *" $node "*) ;; *) dead+="$node " ;; esac
  done < <(sinfo -h -N -n "$SLURM_JOB_NODELIST" -o '%N %t' 2>/dev/null)
  [ -n "$dead" ] || return 0
  event "node failure: ${dead% } not responding, down or drained after the step failed (exit $rc)"
  retry_or_stop "node failure" "$rc" $dead
}

# wait_step PID: wait for the training step, again after each trap that interrupts `wait`;
# sets STEP_RC to srun's exit.
wait_step() {
  local pid=$1 again
  while :; do
    TRAPPED=0
    wait "$pid"; STEP_RC=$?
    [ "$TRAPPED" = 1 ] || break
    kill -0 "$pid" 2>/dev/null && continue
    wait "$pid" 2>/dev/null; again=$?; [ "$again" = 127 ] || STEP_RC=$again; break
  done
}

# Signals. USR1 (#SBATCH --signal=B:USR1@...): Slurm's warning before the time limit, the
# trainer is asked to save at the step boundary. USR2: `slipway cancel` (scancel --batch
# --signal=USR2), before it cancels the job: the allocation still exists, so the trap can end
# the step and remove the container. TERM: a plain scancel (or a preemption), which Slurm sends
# to the batch shell and the steps at once. Each says so in events.log and ends the job with
# the signal's exit (128 + the signal: USR2 140, TERM 143).
on_warning() {
  STOP_REQUESTED=1 TRAPPED=1
  STOP_CHECKPOINT=$(latest_checkpoint)
  event "time limit warning: stop requested"
  touch "$STOP_FILE"
}
# INT: Ctrl-C to `slipway run` (the script runs in an allocation, SLIPWAY_IN_ALLOCATION): like
# the warning, a save at the step boundary, and the run stays resumable.
on_interrupt() {
  STOP_REQUESTED=1 TRAPPED=1 STOP_WHY="stopped on request"
  STOP_CHECKPOINT=$(latest_checkpoint)
  event "interrupted: stop requested"
  touch "$STOP_FILE"
}
# A job cancelled by `slipway cancel` is not waited on by a retry or a requeue, and cancel waits
# for it (a bounded grace): its container gets CANCEL_REMOVE_WAIT s to be removed instead of a few.
on_cancel() { trap '' TERM USR2; event "cancelled by slipway cancel"; REMOVE_WAIT=$CANCEL_REMOVE_WAIT; exit 140; }
on_term() { trap '' TERM USR2; event "cancelled (SIGTERM)"; exit 143; }

# on_exit: the end first, then the cleanup, none of it slow: background helpers stopped, a step
# still running ended (bounded by STEP_STOP_WAIT s), this attempt's own container removed if
# that takes at most CONTAINER_REMOVE_WAIT s (after `slipway cancel`, CANCEL_REMOVE_WAIT s; else
# the next job on the node removes it).
on_exit() {
  local rc=$? pid waited=0
  trap '' TERM USR1 USR2
  event "end exit $rc"
  for pid in "${HELPER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [ -n "${SRUN_PID:-}" ] && kill -0 "$SRUN_PID" 2>/dev/null; then
    kill -TERM "$SRUN_PID" 2>/dev/null || true
    while kill -0 "$SRUN_PID" 2>/dev/null && [ "$waited" -lt "$((STEP_STOP_WAIT * 5))" ]; do
      sleep 0.2; waited=$((waited + 1))
    done
  fi
  # `slipway run` keeps even a container of its own (named by the allocation's id) for the next
  # run in the same allocation; the next batch job on the node removes it once the allocation is over.
  [ -n "${SLIPWAY_IN_ALLOCATION:-}" ] || remove_container "${REMOVE_WAIT:-$CONTAINER_REMOVE_WAIT}"
  return 0
}

# The steps' named pyxis container, CONTAINER_NAME (set by the main part; empty when the steps
# name none). With an image build to reuse (CONTAINER_BUILD, from container.keep_builds) it is the
# build's own, kept on each node after the job so that later jobs of that build start in it
# without unpacking the image; else this attempt's own, removed at its end. pyxis names it
# pyxis_NAME (container_scope=global, its default) or pyxis_JOBID_NAME (container_scope=job: its
# epilog removes it at the job's end, so nothing is kept).
container_name() {
  [ -n "$CONTAINER_PREFIX" ] || return 0
  if [ -n "$CONTAINER_BUILD" ]; then echo "$CONTAINER_PREFIX$CONTAINER_BUILD"; else echo "$CONTAINER_PREFIX$JOB_TAG"; fi
}

# pyxis_scope: how pyxis scopes named containers here, from its line in Slurm's plugstack
# configuration (includes followed): "job", "global" (pyxis's default), or "" (no pyxis line
# readable on this host).
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

# note_container_scope: a kept container needs pyxis's container_scope=global; where this
# cluster's pyxis removes named containers at each job's end, say so, once per run.
note_container_scope() {
  local text="containers: this cluster's pyxis removes named containers at each job's end (container_scope=job), so every job unpacks the image and container.keep_builds has no effect"
  [ -n "$CONTAINER_BUILD" ] && [ "$(pyxis_scope)" = job ] || return 0
  grep -qF "$text" "$RUN_DIR/events.log" 2>/dev/null || event "$text"
}

REMOVE_CONTAINER='for n in "pyxis_$1" "pyxis_${SLURM_JOB_ID}_$1"; do enroot remove --force "$n"; done >/dev/null 2>&1; true'

# remove_container SECONDS: remove this attempt's own container on every node, for at most
# SECONDS (a removal cut short is finished by the next job's sweep_containers). A build's kept
# container stays.
remove_container() {
  [ -n "$CONTAINER_NAME" ] && [ -z "$CONTAINER_BUILD" ] || return 0
  timeout -k 2 "$1" srun --overlap --nodes="$NODES_NEEDED" --ntasks-per-node=1 --cpus-per-task=1 \
    bash -c "$REMOVE_CONTAINER" slipway-rm "$CONTAINER_NAME" > /dev/null 2>&1 || true
}

# enroot_data (on a node): enroot's data path, where it unpacks containers, from enroot's own
# configuration (the part of the enroot script above its END CONFIG line, which reads the same
# files and variables enroot does); empty where that cannot be read.
enroot_data() {
  local e
  e=$(command -v enroot) && grep -q '^# ----- END CONFIG -----' "$e" 2>/dev/null || return 0
  bash -c "$(sed '/^# ----- END CONFIG -----/q' "$e")"$'\n''printf %s "$ENROOT_DATA_PATH"' 2>/dev/null || true
}

# job_over JOB_ID: whether Slurm no longer queues or runs the job.
job_over() {
  local state
  state=$(squeue -h -j "$1" -o %T 2>/dev/null) || state=""
  case "$state" in ""|COMPLETED|CANCELLED|FAILED|TIMEOUT|NODE_FAIL|PREEMPTED|BOOT_FAIL|DEADLINE|OUT_OF_MEMORY) return 0 ;; esac
  return 1
}

# sweep_containers JOB_ID JOB_TAG BUILD KEEP [LIST] (on a node): records that this job uses the
# kept container of BUILD (empty: none), then removes what earlier jobs left, one line per
# container (`removed NAME`, `kept NAME: WHY`; with LIST, `would remove NAME` and nothing
# removed): each attempt's own container once its job is over (and this job's earlier attempts),
# and the kept containers of builds beyond the KEEP most recently used (oldest first; no KEEP:
# none of them), never one that a queued or running job has used. Which jobs used a kept
# container, and when last, is in DATA/.slipway/NAME (hidden from `enroot list`). A kept
# container is renamed before it is deleted, so that no job ever starts in a half-deleted one.
sweep_containers() {
  local job=$1 tag=$2 build=$3 keep=$4 list=${5:-} data uses name id tag_of used=() n=0 j busy
  data=$(enroot_data)
  uses=${data:+$data/.slipway}
  if [ -n "$build" ] && [ -n "$uses" ] && mkdir -p "$uses"; then
    { grep -vx -- "$job" "$uses/pyxis_slipway-$build" 2>/dev/null | tail -n 19; echo "$job"; } > "$uses/.new.$$" &&
      mv -f "$uses/.new.$$" "$uses/pyxis_slipway-$build"
  fi
  while read -r name; do
    case "$name" in
      pyxis_slipway-i*) used+=("$name"); continue ;;
      pyxis_slipway-*) tag_of=${name#pyxis_slipway-} ;;
      pyxis_*_slipway-*) tag_of=${name#pyxis_*_slipway-} ;;
      *) continue ;;
    esac
    id=${name#pyxis_}; id=${id#slipway-}; id=${id%%[!0-9]*}
    [[ $id =~ ^[0-9]+$ ]] || continue
    if [ "$id" = "$job" ]; then
      [ "$tag_of" != "$tag" ] && [ "$tag_of" != "$build" ] || continue
    else
      job_over "$id" || { echo "kept $name: job $id is not over"; continue; }
    fi
    if [ -n "$list" ]; then echo "would remove $name"; continue; fi
    enroot remove --force "$name" >/dev/null 2>&1 && echo "removed $name"
  done < <(enroot list 2>/dev/null)
  # Most recently used first; a kept container with no record of its use counts as the oldest.
  # This job's build is the most recent, unpacked here or about to be. No KEEP (a job that keeps
  # no container): the kept ones are not this job's to bound.
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
    mv "$data/$name" "$data/.slipway-removing-$name" 2>/dev/null || continue
    rm -f "$uses/$name"
    echo "removed $name"
  done < <(for name in "${used[@]+"${used[@]}"}"; do
             printf '%s %s\n' "$(stat -c %Y "$uses/$name" 2>/dev/null || echo 0)" "$name"
           done | sort -rn | cut -d' ' -f2)
  # Renamed containers (this sweep's, or one cut short) are deleted last: enroot remove takes
  # the hidden name like any other.
  [ -z "$list" ] || return 0
  for name in $(ls -A "$data" 2>/dev/null | grep '^\.slipway-removing-'); do
    enroot remove --force "$name" >/dev/null 2>&1 || true
  done
}

# remove_stale_containers: at the start of every job whose steps name a container, one
# background step per node runs sweep_containers, bounded by STALE_REMOVE_TIMEOUT s; it never
# delays training, and the trap ends it with the other helpers.
remove_stale_containers() {
  [ -n "$CONTAINER_NAME" ] || return 0
  timeout -k 5 "$STALE_REMOVE_TIMEOUT" srun --overlap --nodes="$NODES_NEEDED" --ntasks-per-node=1 --cpus-per-task=1 \
    bash -c "$(declare -f enroot_data job_over sweep_containers)"'; sweep_containers "$@"' \
    slipway-sweep "$SLURM_JOB_ID" "$JOB_TAG" "$CONTAINER_BUILD" "${CONTAINER_BUILD:+$KEEP_BUILDS}" > /dev/null 2>&1 &
  HELPER_PIDS+=("$!")
}
# ---- end of the slipway job library ----

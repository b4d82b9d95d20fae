# ---- slipway job library (jobs/slurm/job_lib.sh) ----
# The job's decisions (verification, preflight, retries, exclusions, requeues, hangs, its end) in
# static bash: testable without Slurm (tests/test_job_lib.py, with stand-in scontrol, sinfo, srun),
# readable in the user's job.sbatch, needing only what compute nodes have (bash, coreutils, Slurm's
# clients; no Python). Pinned, not inlined: runs/RUN/lib/ holds a copy named by its hash, checked
# by job.sbatch before it is sourced (as the other *_lib.sh parts are), so runs/RUN/ alone says what
# ran, through every requeue. The functions read the variables job.sbatch's settings set (this
# library composes no path of the run's); the main part sets JOB_TAG, NODES, RETRIES, REQUEUES and
# PREEMPTIONS. Every end is recorded before anything slow: the EXIT trap writes `end exit N` first.

# event TEXT...: `ISO-TIME job JOBID TEXT` in events.log; a control character in TEXT (a node's
# name holding a newline) is a space, so no text forges a line of its own.
event() { local t="$*"; printf '%s job %s %s\n' "$(date --iso-8601=seconds)" "${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID}" "${t//[[:cntrl:]]/ }" >> "$EVENTS_LOG"; }

end_with() { local code=$1; shift; event "$@"; exit "$code"; }

# count_events PREFIX: how many events of this job (its id survives requeues) start with PREFIX.
count_events() { local n; n=$(grep -F " job ${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID} $* " "$EVENTS_LOG" 2>/dev/null | wc -l) || true; echo "${n:-0}"; }

# job_tag: names this attempt's files and container: the job id, rN after the Nth requeue.
job_tag() { if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then echo "$SLURM_JOB_ID"; else echo "${SLURM_JOB_ID}r$SLURM_RESTART_COUNT"; fi; }

# latest_checkpoint: the step of CHECKPOINT_DIR's latest complete checkpoint (0: none), as common/rundir.py reads it.
latest_checkpoint() {
  local f s n=0
  for f in "$CHECKPOINT_DIR"/step-*/COMPLETE; do
    s=${f%/COMPLETE}; s=${s##*/step-}
    [[ $s =~ ^[0-9]+$ ]] && [ -f "${f%/COMPLETE}/.metadata" ] && [ $((10#$s)) -gt $n ] && n=$((10#$s))
  done
  echo $n
}

# retry_or_stop KIND CODE [NODE...]: requeue this job (at most MAX_RETRIES times) without NODE...
# where the partition keeps enough usable nodes; else end with CODE. `scontrol update` changes
# ExcNodeList only of a pending job, so the job is requeued held, updated, then released.
retry_or_stop() {
  local kind=$1 code=$2; shift 2
  local bad="$*" excluded="" usable=0 node state
  [ -z "$bad" ] || remember_bad_nodes "$kind" $bad
  [ "$REQUEUE" = 1 ] || end_with "$code" "not retrying ($kind): $NO_REQUEUE"
  [ "$RETRIES" -lt "$MAX_RETRIES" ] || end_with "$code" "not retrying ($kind): slurm.max_retries ($MAX_RETRIES) reached"
  if [ -n "$bad" ]; then
    excluded=$(scontrol show job -o "$SLURM_JOB_ID" | grep -o 'ExcNodeList=[^ ]*' | sed 's/^ExcNodeList=//') || excluded=""
    [ "$excluded" != "(null)" ] || excluded=""
    excluded=$( { [ -z "$excluded" ] || scontrol show hostnames "$excluded"; printf '%s\n' $bad; } | sort -u | paste -sd, - )
    while read -r node state; do
      case ",$excluded," in *",$node,"*) continue ;; esac
      case "${state%[~#%]}" in idle|mix|alloc|comp|plnd) usable=$((usable + 1)) ;; esac
    done < <(sinfo -h -N ${SLURM_JOB_PARTITION:+-p "$SLURM_JOB_PARTITION"} -o '%N %t' 2>/dev/null)
    [ "$usable" -ge "$NODES_NEEDED" ] ||
      end_with "$code" "not retrying ($kind): without ${bad% } partition ${SLURM_JOB_PARTITION:-(default)} has $usable usable node(s), the job needs $NODES_NEEDED"
    event "retry $((RETRIES + 1))/$MAX_RETRIES ($kind): requeueing without ${bad% } (excluded nodes: $excluded)"
    trap '' TERM  # the requeue ends this job's processes: the three calls must finish first
    scontrol requeuehold "$SLURM_JOB_ID" || end_with "$code" "requeue failed"
    scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$excluded" || event "could not exclude $excluded"
    scontrol release "$SLURM_JOB_ID"
  else
    event "retry $((RETRIES + 1))/$MAX_RETRIES ($kind): requeueing (no node to blame)"
    trap '' TERM
    scontrol requeue "$SLURM_JOB_ID" || end_with "$code" "requeue failed"
  fi
  exit 0
}

# waited SECONDS STEP_EXIT: how long a step that sent no report ran, as it was: out of
# PREFLIGHT_TIMEOUT, or ended sooner (a container that did not start there).
waited() {
  if [ "$1" -ge "$PREFLIGHT_TIMEOUT" ]; then echo " within $PREFLIGHT_TIMEOUT s (step exit $2)"
  else echo ": the step ended after $1 s (exit $2) without one"; fi
}

# retry_preflight NODE...: retried without the nodes that failed the preflight or verification;
# every node of a multi-node job failing alike (a full filesystem, a bad config) blames none.
retry_preflight() {
  [ $# -gt 0 ] || return 0
  if [ "$NODES_NEEDED" -gt 1 ] && [ "$*" = "$NODES" ]; then retry_or_stop preflight "$PREFLIGHT_EXIT"; fi
  retry_or_stop preflight "$PREFLIGHT_EXIT" "$@"
}

# blame_preflight NODE WHY: said in events.log, NODE added to the caller's `bad` (for retry_preflight).
blame_preflight() { bad+="$1 "; BLAME[$1]="preflight failed: $2"; event "preflight failed on $1: $2"; }

# preflight_nodes LOG STEP_EXIT SECONDS: every node of NODES reported `ok` in LOG (trainer/preflight.py's
# node step, which ran SECONDS), else the job is retried without those that did not.
preflight_nodes() {
  local log=$1 step_rc=$2 node line bad="" why
  WRITE_BPS=0
  for node in $NODES; do
    line=$(grep -F -m1 "slipway-preflight $node " "$log") || line=""
    case "$line" in
      "slipway-preflight $node ok"*) clear_bad_node "$node"  # no fork per node: a job may have thousands
        if [[ $line =~ write_bps=([0-9]{1,15}) ]]; then WRITE_BPS=$((WRITE_BPS + BASH_REMATCH[1])); fi ;;
      "") bad+="$node "; why=$(waited "${3:-$PREFLIGHT_TIMEOUT}" "$step_rc"); BLAME[$node]="no preflight report$why"
          event "preflight failed on $node: no report$why (its container did not start there, or the node is unreachable)" ;;
      *) blame_preflight "$node" "${line#*fail: }" ;;
    esac
  done
  retry_preflight $bad
}

# preflight_allreduce LOG STEP_EXIT SECONDS: a train.script's all-reduce step said `ok`, else after_preflight.
preflight_allreduce() {
  local log=$1 step_rc=$2 line
  line=$(grep -F -m1 "slipway-preflight-allreduce " "$log") || line=""
  case "$line" in
    "slipway-preflight-allreduce ok: "*) event "preflight ok on $SLURM_JOB_NODELIST: ${line#*ok: }" ;;
    "") after_preflight "the all-reduce across every rank gave no result$(waited "${3:-$PREFLIGHT_TIMEOUT}" "$step_rc")" ;;
    *) after_preflight "${line#*fail: }" ;;
  esac
}

# after_preflight WHY: the preflight's all-reduce failed for WHY (as the training step's first
# collective, trainer/preflight.py AllReduceGate, a rank reports WHY among the step's exits and
# ends the step before any training): retried on the same nodes, no node to blame.
after_preflight() {
  [ -n "$1" ] || return 0
  event "preflight failed: $1"
  retry_or_stop preflight "$PREFLIGHT_EXIT"
}

# step_exit SRUN_EXIT REPORTS_DIR: sets STEP_EXIT, the training step's one exit code, and FAILED_WHO,
# the report that decided it ("rank R on NODE", "the torchrun agent of task T on NODE", or "").
# With --kill-on-bad-exit srun's own exit is the first failing task's or that of a task it then
# killed, whichever node answered first (1 or 143). So each rank's wrapper (jobs/slurm/ranks.py
# REPORT_EXIT) reports `CODE NODE` in REPORTS_DIR: rank-R, and task-T for a torchrun agent (which
# exits 1 whatever its worker died of); a rank Slurm killed reports nothing or later. srun's 0
# stands; else the oldest non-zero report decides; with none (a node died), srun's exit stands.
step_exit() {
  local rc=$1 dir=$2 f code node
  STEP_EXIT=$rc FAILED_WHO=""
  if [ "$rc" = 0 ]; then STEP_EXIT=0; return 0; fi
  while read -r f; do
    case $f in rank-*|task-*) ;; *) continue ;; esac
    code="" node=""; read -r code node < "$dir/$f" || true
    [[ $node =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$ ]] || node=""  # a node's name as jobs/slurm/bad_nodes.py takes one, or none
    if [[ $code =~ ^[0-9]+$ ]] && [ "$code" != 0 ]; then
      STEP_EXIT=$code
      case $f in rank-*) FAILED_WHO="rank ${f#rank-} on ${node:-?}" ;; *) FAILED_WHO="the torchrun agent of task ${f#task-} on ${node:-?}" ;; esac
      return 0
    fi
  done < <(ls -tr "$dir" 2>/dev/null)
}

# how_ended CODE: what an exit code says: "was killed by SIGKILL (exit 137)", "exited 1".
how_ended() {
  local name
  if [ "$1" -gt 128 ] && [ "$1" -lt 193 ] && name=$(kill -l "$(($1 - 128))" 2>/dev/null); then
    echo "was killed by SIG$name (exit $1)"
  else
    echo "exited $1"
  fi
}

# after_rank_failure STEP_EXIT: the rank that failed the step, its node and how it ended, in
# events.log; not for ends told otherwise (a save on request, a hang, a failed preflight).
after_rank_failure() {
  [ "$1" != 0 ] && [ -n "$FAILED_WHO" ] && [ "$1" != "$REQUEUE_EXIT" ] && [ "$1" != "$HANG_EXIT" ] || return 0
  [ "$STOP_REQUESTED" != 1 ] || return 0
  event "rank failed: $FAILED_WHO $(how_ended "$1")"
}

# after_oom STEP_EXIT: a failed step while the OOM killer ran on OOM_NODES (their wrappers saw
# /proc/vmstat's oom_kill move) is said with OOM_HINT. No retry: the same batch fails the same way.
after_oom() {
  [ "$1" != 0 ] && [ -n "${OOM_NODES:-}" ] || return 0
  event "out of memory: the out-of-memory killer ended a process of the training step on $OOM_NODES (step exit $1): $OOM_HINT"
}

# line_field KEY LINE: KEY's value in a line of KEY=VALUE words (common/tagged.py's), "?" if none.
line_field() { local w; for w in $2; do case $w in "$1="*) echo "${w#*=}"; return ;; esac; done; echo "?"; }

# after_hang: stack dumps in HANGS (trainer/watchdog.py) mean a hang; the nodes some of whose
# ranks wrote none in time are blamed (a frozen rank may dump `late`, once Slurm's teardown resumes it).
after_hang() {
  local dumps node f r first dumped silent="" said=""
  shopt -s nullglob; dumps=("$HANGS/$JOB_TAG-"*.txt); shopt -u nullglob
  [ "${#dumps[@]}" -gt 0 ] || return 0
  for node in $NODES; do
    dumped=0
    for f in "$HANGS/$JOB_TAG-$node-"*.txt; do
      r=${f##*/"$JOB_TAG-$node-"}; [[ ${r%.txt} =~ ^[0-9]+$ ]] || continue
      first=""; read -r first < "$f" || true
      [ "$(line_field answered "$first")" != on-time ] || dumped=$((dumped + 1))
    done
    [ "$dumped" -lt "$PROCS_PER_NODE" ] || continue
    silent+="$node " said+="${said:+, }$((PROCS_PER_NODE - dumped)) of the $PROCS_PER_NODE ranks on $node"
    BLAME[$node]="hang: $((PROCS_PER_NODE - dumped)) of its $PROCS_PER_NODE ranks wrote no stack dump in time"
  done
  first=""; read -r first < "${dumps[0]}" || true
  event "hang: no step completed for $(line_field limit "$first") s after step $(line_field step "$first"); stack dumps from ${#dumps[@]} of $RANKS ranks in hangs/$JOB_TAG-*.txt${said:+; not answering in time: $said}"
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
  [ "$REQUEUE" = 1 ] || end_with "$REQUEUE_EXIT" "${STOP_WHY:-time-limit stop}: $outcome; $NO_REQUEUE"
  [ "$REQUEUES" -lt "$MAX_REQUEUES" ] ||
    end_with "$REQUEUE_EXIT" "not requeueing after the time-limit warning: slurm.max_requeues ($MAX_REQUEUES) reached; $outcome"
  event "time-limit requeue $((REQUEUES + 1))/$MAX_REQUEUES: $outcome, requeueing"
  trap '' TERM  # the requeue ends this job's processes: not a cancellation
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}

# after_node_failure STEP_EXIT: the nodes that died under a failed step (not responding, down or
# drained) are retried without; one sinfo lists a node once per partition it is in.
after_node_failure() {
  local rc=$1 node state dead=""
  [ "$rc" != 0 ] || return 0
  while read -r node state; do
    case "$state" in down*|drain*|drng*|fail*|*'*') ;; *) continue ;; esac
    case " $dead" in *" $node "*) ;; *) dead+="$node "; BLAME[$node]="node failure: $state after a failed step" ;; esac
  done < <(sinfo -h -N -n "$SLURM_JOB_NODELIST" -o '%N %t' 2>/dev/null)
  [ -n "$dead" ] || return 0
  event "node failure: ${dead% } not responding, down or drained after the step failed (exit $rc)"
  retry_or_stop "node failure" "$rc" $dead
}

# wait_step PID: STEP_RC, srun's exit, waited for again after each trap that interrupts `wait`.
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

# Signals. USR1 (warning_timer at the measured lead, #SBATCH --signal=B:USR1@... the floor): the
# time-limit warning; the trainer saves at the step boundary. USR2: `slipway cancel` (scancel --batch)
# before it cancels: the allocation still exists, so the trap can end the step and remove the
# container. TERM: a plain scancel or a preemption, sent to the batch shell and the steps at once.
on_warning() {
  TRAPPED=1
  [ "$STOP_REQUESTED" != 1 ] || return 0  # the timer's and Slurm's own warning: the first one asks
  request_stop "time limit warning" "the time limit is near"
}
# request_stop EVENT WHY: the ranks asked to save (STOP_FILE), said above what torchrun then reports.
request_stop() {
  STOP_REQUESTED=1 STOP_CHECKPOINT=$(latest_checkpoint)
  event "$1: stop requested"
  echo "slipway: $2: the ranks save a checkpoint at the step they agree on and exit $REQUEUE_EXIT (saved, resumable); what torch and torchrun report below about that exit is this stop, not a failure"
  touch "$STOP_FILE"
}
# INT: Ctrl-C to `slipway run` (SLIPWAY_IN_ALLOCATION): like the warning, a save at the step boundary.
on_interrupt() {
  TRAPPED=1 STOP_WHY="stopped on request"
  request_stop interrupted interrupted
}
# `slipway cancel` waits for the job (a bounded grace) and no retry will: its container gets
# CANCEL_REMOVE_WAIT s to be removed instead of a few. Each ends with 128 + the signal.
on_cancel() { trap '' TERM USR2; event "cancelled by slipway cancel"; REMOVE_WAIT=${CANCEL_REMOVE_WAIT:-0}; exit "$CANCEL_EXIT"; }
on_term() { trap '' TERM USR2; event "cancelled (SIGTERM)"; exit "$TERM_EXIT"; }

# on_exit: the end recorded first, then a bounded cleanup: helpers stopped, a running step ended
# (STEP_STOP_WAIT s), this attempt's container removed within REMOVE_WAIT (else the next job's).
on_exit() {
  local rc=$? pid waited=0 last
  trap '' TERM USR1 USR2
  last=$(grep -F " job ${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID} " "$RUN_DIR/events.log" 2>/dev/null | tail -n 1 | cut -d' ' -f4-) || last=""
  event "end exit $rc"
  [ "${TRAINED:-0}" != 1 ] || ! declare -F plot_curves > /dev/null || plot_curves
  # The log's last line: how the job ended, in events.log's words where one told it, else by its exit.
  case "$last" in
    "start on "*|"preflight ok"*) last="" ;;  # no event of an end: told by the exit below
  esac
  case "$last" in
    *requeue*|*retry*|*"not retrying"*|*"stop request"*|cancelled*|"out of memory"*|hang:*|"node failure"*|"preflight failed"*)
      last+=" (exit $rc)" ;;
    *) case "$rc" in
         0) last="completed (exit 0)" ;;
         "$REQUEUE_EXIT") last="saved a checkpoint and stopped (exit $rc)" ;;
         *) last="failed with exit $rc: the lines above say why" ;;
       esac ;;
  esac
  echo "slipway: job ${SLIPWAY_EVENT_JOB:-${SLURM_JOB_ID:-}} ended: $last"  # as status names it: ARRAY_TASK for a sweep's task
  for pid in "${HELPER_PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  if [ -n "${SRUN_PID:-}" ] && kill -0 "$SRUN_PID" 2>/dev/null; then
    kill -TERM "$SRUN_PID" 2>/dev/null || true
    while kill -0 "$SRUN_PID" 2>/dev/null && [ "$waited" -lt "$((STEP_STOP_WAIT * 5))" ]; do
      sleep 0.2; waited=$((waited + 1))
    done
  fi
  # `slipway run` keeps even a container of its own (named by the allocation's id) for the next
  # run in the same allocation; the next batch job on the node removes it once the allocation is over.
  [ -n "${SLIPWAY_IN_ALLOCATION:-}" ] || remove_container "${REMOVE_WAIT:-${CONTAINER_REMOVE_WAIT:-0}}"
  return 0
}

# warm_up: under `slipway run`, this key's warm processes on every node (jobs/slurm/warm.py): warm
# steps of another key asked to stop (SIGTERM: they end once their ranks have), one started where
# verify_nodes found none (WARM_COLD) and waited for until it has bound its socket, at most
# PREFLIGHT_TIMEOUT s (it imports after; ranks that come meanwhile wait; one that cannot start
# leaves them cold). None where Slurm tracks processes by cgroup (WARM_OFF): a forked rank would be
# the warm step's.
warm_up() {
  local step name n waited=0 bound
  [ -n "${WARM_SOCKET:-}" ] || return 0
  if [ -n "${WARM_OFF:-}" ]; then
    WARM_CLIENT=()
    event "warm: off: Slurm tracks this job's processes by cgroup (on $WARM_OFF), where a rank forked by a warm process would be the warm step's, outside its own step's accounting and limits; every rank starts cold"
    echo "slipway: warm ranks are off here: Slurm tracks this job's processes by cgroup; every rank starts cold"
    return 0
  fi
  while read -r step name; do
    case $name in
      "slipway-warm-$SLIPWAY_WARM_ID") ;;
      slipway-warm-*) if scancel --signal=TERM "$step" 2>/dev/null; then event "warm: stopping the warm processes of step $step (another key)"; fi ;;
    esac
  done < <(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null || true)
  if [ -z "${WARM_COLD// /}" ]; then event "warm: the warm processes of key $SLIPWAY_WARM_ID are up on $NODES"; return 0; fi
  n=$(wc -w <<< "$WARM_COLD")
  mkdir -p "${WARM_LOG%/*}"
  name=${WARM_COLD% }
  warm_start "${name// /,}" "$n"
  while bound=$(grep -cE '^slipway-warm [^ ]+ (bound|already served|cannot serve)' "$WARM_LOG" 2>/dev/null) || true; [ "${bound:-0}" -lt "$n" ]; do
    kill -0 "$WARM_PID" 2>/dev/null && [ "$waited" -lt $((PREFLIGHT_TIMEOUT * 10)) ] || break
    sleep 0.1; waited=$((waited + 1))
  done
  if [ "$(grep -cE '^slipway-warm [^ ]+ (bound|already served)' "$WARM_LOG" 2>/dev/null)" -ge "$n" ]; then
    event "warm: started the warm processes on ${WARM_COLD% } (key $SLIPWAY_WARM_ID, log $WARM_LOG)"
  else
    event "warm: the warm processes did not start on ${WARM_COLD% } ($(grep -m1 -o 'cannot serve: .*' "$WARM_LOG" 2>/dev/null || echo "log $WARM_LOG")): ranks start cold there"
  fi
}

# remove_container SECONDS: this attempt's own container removed at the job's end (pyxis_lib.sh).
remove_container() { :; }
# ---- end of the slipway job library ----

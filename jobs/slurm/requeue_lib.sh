# ---- slipway job library: a job stopped and back (jobs/slurm/requeue_lib.sh) ----
# Pinned and sourced beside job_lib.sh (whose `event` and `line_field` it uses): the warning lead
# before the time limit, taken from the run's own saves at every start and requeue, so the save
# before a time-limit requeue fits; and the preemptions, requeues by Slurm, counted apart from the
# job's own.

# note_preemption: an attempt after the first whose previous attempt did not requeue itself (a
# failure retry, a time-limit requeue) was requeued by Slurm: a preemption, or the site's `scontrol
# requeue` of the running job. Said once, counted apart (PREEMPTIONS): it uses up neither
# slurm.max_retries nor slurm.max_requeues. Sets PREEMPTIONS_SAID for the start event.
note_preemption() {
  local attempt
  PREEMPTIONS_SAID=""
  if [ "${SLURM_RESTART_COUNT:-0}" != 0 ]; then
    # The previous attempt's events, newest first (awk reads to the end: no SIGPIPE under pipefail).
    attempt=$( { grep -sF " job ${SLIPWAY_EVENT_JOB:-$SLURM_JOB_ID} " "$EVENTS_LOG" || true; } | tac |
               awk '/ start on /{done=1} !done') || attempt=""
    case "$attempt" in
      *" retry "[0-9]*|*" time-limit requeue "[0-9]*) ;;
      *) PREEMPTIONS=$((PREEMPTIONS + 1))
         event "preempted: requeued by Slurm (a preemption, or scontrol requeue) in its previous attempt; preemption $PREEMPTIONS, counted apart from failure retries and time-limit requeues" ;;
    esac
  fi
  [ "$PREEMPTIONS" = 0 ] || PREEMPTIONS_SAID=", preemptions $PREEMPTIONS"
}

# ---- the warning lead: the time-limit warning as early as the run's saves need ----

# warning_lead: "SECONDS WHY", how long before the time limit the trainer must be asked to save:
# the slowest of the run's last five saves (SAVES: common/rundir.py SaveLine, written by the
# trainer), plus the steps to the next point where the trainer reads a stop request (SYNC_STEPS x
# the latest step time), plus a margin (30 s and a fifth of both); before the first save, the
# checkpoint's estimated size (CHECKPOINT_BYTES) at the write speed this job's preflight measured
# where checkpoints go (WRITE_BPS, the nodes' sum, as they write their shares at once); with
# neither, LEAD_DEFAULT. Always between LEAD_MIN (Slurm's own warning) and LEAD_MAX (half the limit).
warning_lead() {
  local line ms slowest=0 n=0 step_ms=0 base why lead steps margin
  while read -r line; do
    ms=$(line_field ms "$line"); [[ $ms =~ ^[0-9]{1,12}$ ]] || continue
    n=$((n + 1)); [ "$ms" -le "$slowest" ] || slowest=$ms
    step_ms=$(line_field step_ms "$line"); [[ $step_ms =~ ^[0-9]{1,12}$ ]] || step_ms=0
  done < <([ -f "$SAVES" ] && grep -a '^slipway-save ' "$SAVES" | tail -n 5)
  if [ "$n" -gt 0 ]; then
    base=$(( (slowest + 999) / 1000 )); why="the slowest of the run's last $n save(s) took $base s"
  elif [ "${WRITE_BPS:-0}" -gt 0 ]; then
    base=$(( CHECKPOINT_BYTES / WRITE_BPS + 1 ))
    why="no save yet: about $(( (CHECKPOINT_BYTES + 1048575) >> 20 )) MiB at the $(( WRITE_BPS >> 10 )) KiB/s the preflight measured where checkpoints go take $base s"
  else
    echo "$LEAD_DEFAULT no save and no write speed measured yet: a tenth of the time limit"; return 0
  fi
  steps=$(( (step_ms * SYNC_STEPS + 999) / 1000 )); margin=$(( 30 + (base + steps) / 5 ))
  lead=$((base + steps + margin))
  why+=", + $steps s to the next stop point ($SYNC_STEPS step(s)), + $margin s margin"
  if [ "$lead" -lt "$LEAD_MIN" ]; then lead=$LEAD_MIN; why+="; at least $LEAD_MIN s, Slurm's own warning"; fi
  if [ "$lead" -gt "$LEAD_MAX" ]; then
    lead=$LEAD_MAX; why+="; at most $LEAD_MAX s, half the time limit: raise slurm.time for saves this slow"
  fi
  echo "$lead $why"
}

# job_end_time: when Slurm ends this job (its EndTime, in seconds since the epoch); fails unknown.
job_end_time() {
  local end
  end=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null) || return 1
  [[ $end =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}$ ]] || return 1
  date -d "$end" +%s
}

# warning_timer (in the background, beside the training step): asks for the stop once the time
# left is the warning lead (USR1 to this script, the same on_warning as Slurm's own warning), the
# lead recomputed from the run's saves every WARNING_POLL s (the job's end every tenth time: an
# administrator may move it) and said in events.log whenever it changes. `--signal` is fixed at
# sbatch time; this is how every job and every requeue gets the lead of the latest measurements.
warning_timer() {
  local end="" lead why said="" left polls=0 nap=""
  # Ended (on_exit) while it sleeps: its sleep goes with it, holding nothing of the job's open.
  trap '[ -z "$nap" ] || kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do
    if [ -z "$end" ] || [ $((polls % 10)) = 0 ]; then end=$(job_end_time) || end=""; fi
    polls=$((polls + 1))
    left=$WARNING_POLL
    if [ -n "$end" ]; then
      read -r lead why < <(warning_lead)
      [ "$lead" = "$said" ] || { event "warning lead $lead s: $why"; said=$lead; }
      left=$((end - $(date +%s) - lead))
      if [ "$left" -le 0 ]; then kill -USR1 $$; return 0; fi
    fi
    sleep $(( left < WARNING_POLL ? left : WARNING_POLL )) & nap=$!
    wait "$nap" || true; nap=""
  done
}

# ---- end of the requeue library ----

# ---- slipway job library: a job stopped and back (jobs/slurm/requeue_lib.sh) ----
# Pinned and sourced beside job_lib.sh (whose `event` and `line_field` it uses): the time-limit
# warning's lead, from the run's own saves, so the save before a requeue fits; and the preemptions.

# note_preemption: an attempt whose previous one did not requeue itself was requeued by Slurm (a
# preemption, or the site's `scontrol requeue`): counted in PREEMPTIONS, using up neither
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

# warning_lead: "SECONDS WHY", how long before the time limit the trainer must be asked to save:
# the slowest of the run's last five saves (SAVES: common/rundir.py SaveLine), plus the steps to
# the next point where the trainer reads a stop request (SYNC_STEPS), plus a margin; before the
# first save, CHECKPOINT_BYTES at the write speed the preflight measured (WRITE_BPS, the nodes' sum,
# as they write their shares at once); with neither, LEAD_DEFAULT. Within LEAD_MIN and LEAD_MAX.
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

# job_end_time: this job's EndTime in seconds since the epoch; fails unknown.
job_end_time() {
  local end
  end=$(squeue -h -j "$SLURM_JOB_ID" -o %e 2>/dev/null) || return 1
  [[ $end =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}$ ]] || return 1
  date -d "$end" +%s
}

# warning_timer (in the background): USR1 to this script once the time left is the warning lead,
# recomputed every WARNING_POLL s (the job's end every tenth time: an administrator may move it),
# said when it changes. `--signal` is fixed at sbatch time: this gives each requeue the latest lead.
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

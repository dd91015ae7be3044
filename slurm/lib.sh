# shellcheck shell=bash
# Shared by slurm/*.sbatch (sourced, not run). Nothing to edit here.
#
# fedmpi_launcher PYTHON
#   Prints the command that starts the ranks: $LAUNCHER if set, else what
#   `PYTHON -m fedmpi info --launcher` chooses for the MPI of PYTHON's mpi4py
#   (MPICH: srun --mpi=pmi2; Open MPI with PMIx: srun --mpi=pmix; else mpirun).
#
# fedmpi_resumable OUT_DIR COMMAND...
#   Runs COMMAND (a launcher line such as `srun python -m fedmpi run CFG --out OUT_DIR`).
#   Resume: --resume is appended only when this job wrote OUT_DIR's checkpoint, i.e.
#   this start is a restart of the job (SLURM_RESTART_COUNT > 0) and OUT_DIR/.slurm-job
#   names this cluster and job id; never because some checkpoint.pt happens to exist
#   (pass --resume yourself to continue another job's run on purpose). A restart of
#   this job that finds only its own log (stopped before the first checkpoint) runs
#   again from round 0 with --overwrite. fedmpi itself refuses a fresh run into a
#   directory holding another run unless --overwrite is given.
#   Stop and requeue: SIGUSR1 to this batch shell (`#SBATCH --signal=B:USR1@T` before
#   the time limit, preemption where Slurm sends the user signal (preempt_send_user_signal), or
#   `scancel --signal=USR1 --batch JOBID`) or SIGUSR1 to the job's steps (`scancel
#   --signal=USR1 JOBID`) makes fedmpi finish the current round, write the checkpoint
#   and exit 75; the job then requeues itself (`scontrol requeue`, at most
#   MAX_REQUEUES times) and its next start resumes -- but only when this start wrote a
#   checkpoint newer than the one it found (OUT_DIR/checkpoint.pt changed: inode,
#   size or mtime). Exit 75 without a new checkpoint (the stop came before a round
#   ended) returns 1 with one line saying why, and a restart that finds no newer
#   checkpoint than the previous start of this job counts as a restart without
#   progress: after MAX_RESTARTS_WITHOUT_PROGRESS (default 2) such restarts in a row
#   the job stops (1, one line) instead of running again (OUT_DIR/.slurm-progress
#   keeps the count). SIGTERM (a plain `scancel`, or Slurm's own requeue/preemption)
#   is forwarded too, so the checkpoint is written, but the job never requeues itself
#   after it: a plain `scancel` stops for good, and a job Slurm requeues (scontrol
#   requeue, PreemptMode=REQUEUE, a failed node) resumes anyway.
#   Time limit: before starting COMMAND the job's end (SLURM_JOB_END_TIME, else
#   `squeue -o %e`) is compared with the lead of the time-limit signal
#   (FEDMPI_SIGNAL_LEAD, else the `#SBATCH --signal=[B:]SIG@LEAD` line of the batch
#   script) and the longest round of OUT_DIR/log.h5 (a restart) -- see
#   fedmpi_check_time_limit. Returns COMMAND's exit status (1 as above).
#
# fedmpi_sweep_size FILE / fedmpi_sweep_task FILE ID
#   A sweep file has one line per config key, `key: value value ...` ('#' comments,
#   blank lines ignored); the tasks are the Cartesian product of the lines (the last
#   line varies fastest). fedmpi_sweep_task prints task ID's overrides, one
#   `key=value` per line.

FEDMPI_EXIT_INTERRUPTED=75
MAX_REQUEUES=${MAX_REQUEUES:-20}
MAX_RESTARTS_WITHOUT_PROGRESS=${MAX_RESTARTS_WITHOUT_PROGRESS:-2}

# Slurm may send the time-limit signal the moment the job starts (a --signal lead as
# long as the time limit): from here on SIGUSR1/SIGTERM are noted, not fatal, and
# fedmpi_resumable acts on them once it runs.
FEDMPI_EARLY_SIGNAL=
trap 'FEDMPI_EARLY_SIGNAL=${FEDMPI_EARLY_SIGNAL:-USR1}' USR1
trap 'FEDMPI_EARLY_SIGNAL=TERM' TERM

fedmpi_launcher() {
    if [[ -n "${LAUNCHER:-}" ]]; then
        echo "$LAUNCHER"
        return 0
    fi
    "$1" -m fedmpi info --launcher || {
        echo "fedmpi-slurm: \`$1 -m fedmpi info --launcher\` failed: is fedmpi installed for" \
             "that Python? Set FEDMPI_PYTHON, or LAUNCHER to e.g. \"srun --mpi=pmi2\"" >&2
        return 2
    }
}

fedmpi_forward() {
    if [[ $1 == USR1 ]] && (( FEDMPI_HOLD_USR1 )) && (( SECONDS < FEDMPI_HOLD_UNTIL )); then
        FEDMPI_HOLD_USR1=0     # the early time-limit signal, once (fedmpi_check_time_limit)
        echo "fedmpi-slurm: got SIGUSR1 ${SECONDS} s into the job, before the adapted stop" \
             "time; stopping at $FEDMPI_HOLD_UNTIL s instead (a second SIGUSR1 stops now)" >&2
        return 0
    fi
    FEDMPI_GOT_SIGNAL=${FEDMPI_GOT_SIGNAL:-$1}
    [[ $1 == TERM ]] && FEDMPI_GOT_SIGNAL=TERM   # a cancel wins over an earlier USR1
    if [[ -n "${FEDMPI_CHILD:-}" ]]; then
        echo "fedmpi-slurm: got SIG$1; asking fedmpi (pid $FEDMPI_CHILD) to checkpoint and stop" >&2
        kill -USR1 "$FEDMPI_CHILD" 2>/dev/null || true
    fi
}

fedmpi_requeue() {
    local msg
    if msg=$(scontrol requeue "${SLURM_JOB_ID:?}" 2>&1); then
        echo "fedmpi-slurm: job $SLURM_JOB_ID requeued; it resumes from the checkpoint" >&2
    elif [[ $msg == *"pending"* || $msg == *"already"* ]]; then
        echo "fedmpi-slurm: job $SLURM_JOB_ID is requeued already ($msg)" >&2
    else
        echo "fedmpi-slurm: requeue of job $SLURM_JOB_ID failed: $msg" >&2
        return 1
    fi
}

_fedmpi_job_tag() {
    echo "${SLURM_CLUSTER_NAME:-cluster}:${SLURM_JOB_ID:-}"
}

_fedmpi_ckpt_id() {   # FILE: what changes whenever the checkpoint is (atomically) rewritten
    if [[ -f $1 ]]; then stat -c '%i:%s:%.9Y' "$1"; else echo none; fi
}

_fedmpi_seconds_left() {   # until the job's time limit; nothing if unknown or unlimited
    local end=${SLURM_JOB_END_TIME:-}
    if [[ -z $end && -n ${SLURM_JOB_ID:-} ]]; then
        end=$(squeue --noheader --jobs="$SLURM_JOB_ID" --format=%e 2>/dev/null | head -n 1)
        [[ $end =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}T ]] || return 0
        end=$(date -d "$end" +%s 2>/dev/null) || return 0
    fi
    [[ $end =~ ^[0-9]+$ ]] && echo $(( end - $(date +%s) ))
}

_fedmpi_signal_lead() {   # "LEAD BATCH": seconds before the limit, 1 if sent to the batch shell
    local line
    if [[ -n ${FEDMPI_SIGNAL_LEAD:-} ]]; then
        echo "$FEDMPI_SIGNAL_LEAD 1"
        return 0
    fi
    line=$(grep -m 1 -oE '^#SBATCH[[:space:]]+--signal=[^[:space:]]+' "$0" 2>/dev/null) || return 0
    line=${line#*--signal=}
    local batch=0
    [[ $line == B:* || $line == R:B:* || $line == B:R:* ]] && batch=1
    if [[ $line == *@* ]]; then echo "${line##*@} $batch"; else echo "60 $batch"; fi
}

_fedmpi_round_seconds() {   # OUT_DIR: longest logged round (whole seconds, rounded up)
    [[ -f $1/log.h5 ]] || return 0
    "${PYTHON:-python}" -c 'import math, sys, h5py
with h5py.File(sys.argv[1], "r") as f:
    w = f["rounds/wall_seconds"][:] if "rounds/wall_seconds" in f else []
    print(math.ceil(max(w)) if len(w) else "")' "$1/log.h5" 2>/dev/null || true
}

# fedmpi_check_time_limit OUT_DIR
#   Warns when the time-limit signal would arrive before one round ends: LEAD >= the
#   seconds LEFT in this allocation, or LEFT - LEAD < ROUND (the longest round logged
#   so far in OUT_DIR). When the signal goes to the batch shell (B:), the lead is
#   adapted: the wrapper stops fedmpi itself (a timer sends the batch shell SIGALRM)
#   NEW seconds before the end,
#   NEW = max(LEFT/4, 1.5 ROUND), and ignores the one early time-limit SIGUSR1
#   (FEDMPI_HOLD_*); if even that leaves less than one round, it only warns and the
#   progress rule above ends the job.
fedmpi_check_time_limit() {
    local left lead batch round new
    left=$(_fedmpi_seconds_left)
    read -r lead batch <<< "$(_fedmpi_signal_lead)"
    [[ $left =~ ^-?[0-9]+$ && $lead =~ ^[0-9]+$ ]] || return 0
    round=$(_fedmpi_round_seconds "$1")
    [[ $round =~ ^[0-9]+$ ]] || round=0
    (( lead < left - round )) && return 0
    new=$(( left / 4 ))
    (( new < round * 3 / 2 )) && new=$(( round * 3 / 2 ))
    local why="the time-limit signal (${lead} s before the end) would arrive $(( left > lead ? left - lead : 0 )) s into this allocation's ${left} s"
    (( round > 0 )) && why+=", before one round (${round} s) ends"
    if (( batch )) && (( left - new > round && new > 0 )); then
        FEDMPI_HOLD_USR1=1
        FEDMPI_HOLD_UNTIL=$(( SECONDS + left - new ))
        (sleep "$(( left - new ))" && kill -ALRM $$ 2>/dev/null) &
        FEDMPI_TIMER=$!
        echo "fedmpi-slurm: warning: $why; stopping ${new} s before the end instead" \
             "(give --time more than one round plus the --signal lead)" >&2
    else
        echo "fedmpi-slurm: warning: $why; the run may stop before writing a checkpoint" \
             "(give --time more than one round plus the --signal lead)" >&2
    fi
}

_fedmpi_stop_timer() {
    [[ -n ${FEDMPI_TIMER:-} ]] || return 0
    pkill -P "$FEDMPI_TIMER" sleep 2>/dev/null || true
    kill "$FEDMPI_TIMER" 2>/dev/null || true
    FEDMPI_TIMER=
}

# _fedmpi_count_progress OUT_DIR CKPT_ID: restarts of this job in a row that found no
# checkpoint newer than the previous start's; records CKPT_ID for the next start.
_fedmpi_count_progress() {
    local file=$1/.slurm-progress tag ckpt stalls=0
    if (( ${SLURM_RESTART_COUNT:-0} > 0 )) && [[ -f $file ]]; then
        read -r tag ckpt stalls < "$file"
        if [[ $tag == "$(_fedmpi_job_tag)" && $ckpt == "$2" ]]; then
            stalls=$(( ${stalls:-0} + 1 ))
        else
            stalls=0
        fi
    fi
    [[ -n ${SLURM_JOB_ID:-} ]] && echo "$(_fedmpi_job_tag) $2 $stalls" >"$file"
    echo "$stalls"
}

fedmpi_resumable() {
    local out=$1
    shift
    local cmd=("$@") arg explicit=0 marker="$out/.slurm-job"
    for arg in "${cmd[@]}"; do [[ $arg == --resume ]] && explicit=1; done
    mkdir -p "$out"
    if (( explicit )); then
        echo "fedmpi-slurm: --resume given: continuing the run in $out" >&2
    elif (( ${SLURM_RESTART_COUNT:-0} > 0 )) && [[ -f "$out/checkpoint.pt" && -f "$marker" ]] \
            && [[ "$(cat "$marker")" == "$(_fedmpi_job_tag)" ]]; then
        cmd+=(--resume)
        echo "fedmpi-slurm: resuming this job's checkpoint $out/checkpoint.pt" \
             "(restart ${SLURM_RESTART_COUNT})" >&2
    elif (( ${SLURM_RESTART_COUNT:-0} > 0 )) && [[ ! -f "$out/checkpoint.pt" && -f "$out/log.h5" \
            && -f "$marker" ]] && [[ "$(cat "$marker")" == "$(_fedmpi_job_tag)" ]]; then
        # this job's earlier start stopped before its first checkpoint: start it again
        cmd+=(--overwrite)
        echo "fedmpi-slurm: no checkpoint of this job in $out; restarting the run" \
             "(restart ${SLURM_RESTART_COUNT})" >&2
    elif [[ -f "$out/checkpoint.pt" ]]; then
        echo "fedmpi-slurm: $out/checkpoint.pt is not this job's; not resuming it (add" \
             "--resume to continue it on purpose)" >&2
    fi
    [[ -n "${SLURM_JOB_ID:-}" ]] && _fedmpi_job_tag >"$marker"
    local ckpt_before stalls
    ckpt_before=$(_fedmpi_ckpt_id "$out/checkpoint.pt")
    stalls=$(_fedmpi_count_progress "$out" "$ckpt_before")
    if (( stalls > MAX_RESTARTS_WITHOUT_PROGRESS )); then
        echo "fedmpi-slurm: stopping job ${SLURM_JOB_ID:-?}: $stalls restarts in a row found no" \
             "new checkpoint in $out (MAX_RESTARTS_WITHOUT_PROGRESS=$MAX_RESTARTS_WITHOUT_PROGRESS);" \
             "not running again" >&2
        return 1
    fi
    FEDMPI_GOT_SIGNAL= FEDMPI_HOLD_USR1=0 FEDMPI_HOLD_UNTIL=0 FEDMPI_TIMER=
    trap 'fedmpi_forward USR1' USR1
    trap 'fedmpi_forward TERM' TERM
    trap 'FEDMPI_HOLD_USR1=0; fedmpi_forward USR1' ALRM   # the adapted stop time
    fedmpi_check_time_limit "$out"
    if [[ -n $FEDMPI_EARLY_SIGNAL ]]; then   # arrived while the script prepared the launch
        fedmpi_forward "$FEDMPI_EARLY_SIGNAL"
        FEDMPI_EARLY_SIGNAL=
        if [[ -n $FEDMPI_GOT_SIGNAL ]]; then
            trap - USR1 TERM ALRM
            _fedmpi_stop_timer
            echo "fedmpi-slurm: got SIG$FEDMPI_GOT_SIGNAL before fedmpi started; not starting" \
                 "it, not requeueing job ${SLURM_JOB_ID:-?}" >&2
            return 1
        fi
    fi
    echo "fedmpi-slurm: ${cmd[*]}" >&2
    "${cmd[@]}" &
    FEDMPI_CHILD=$!
    # `wait` returns early when a trapped signal arrives; keep waiting for the child.
    while kill -0 "$FEDMPI_CHILD" 2>/dev/null; do
        wait "$FEDMPI_CHILD"
    done
    wait "$FEDMPI_CHILD"
    local rc=$?
    trap - USR1 TERM ALRM
    _fedmpi_stop_timer
    if [[ $rc -eq $FEDMPI_EXIT_INTERRUPTED ]]; then
        local wrote="after writing a new checkpoint"
        [[ $(_fedmpi_ckpt_id "$out/checkpoint.pt") == "$ckpt_before" ]] \
            && wrote="without a new checkpoint"
        if [[ $FEDMPI_GOT_SIGNAL == TERM ]]; then
            echo "fedmpi-slurm: stopped by SIGTERM (scancel, or Slurm ending/requeueing the" \
                 "job) $wrote; not requeueing" >&2
        elif [[ $wrote == without* ]]; then
            echo "fedmpi-slurm: stopped without writing a new checkpoint (the stop came before" \
                 "a round ended); not requeueing job ${SLURM_JOB_ID:-?}: give --time more than" \
                 "one round plus the --signal lead" >&2
            return 1
        elif (( ${SLURM_RESTART_COUNT:-0} < MAX_REQUEUES )); then
            echo "fedmpi-slurm: interrupted $wrote; requeueing job ${SLURM_JOB_ID:-?}" >&2
            fedmpi_requeue
        else
            echo "fedmpi-slurm: interrupted $wrote; MAX_REQUEUES=$MAX_REQUEUES reached," \
                 "not requeueing" >&2
        fi
    fi
    return $rc
}

_fedmpi_sweep_lines() {  # key<TAB>values of every non-comment line
    sed -e 's/#.*//' "$1" | awk -F: 'NF >= 2 && $1 ~ /[^ \t]/ {
        key = $1; sub(/^[ \t]+/, "", key); sub(/[ \t]+$/, "", key)
        rest = substr($0, index($0, ":") + 1); print key "\t" rest }'
}

fedmpi_sweep_size() {
    local total=1 key values n
    [[ -f "$1" ]] || { echo "fedmpi-slurm: no sweep file $1" >&2; return 2; }
    while IFS=$'\t' read -r key values; do
        n=$(wc -w <<< "$values")
        (( n > 0 )) || { echo "fedmpi-slurm: $1: key $key has no values" >&2; return 2; }
        total=$(( total * n ))
    done < <(_fedmpi_sweep_lines "$1")
    echo "$total"
}

fedmpi_sweep_task() {
    local file=$1 id=$2 size key values
    size=$(fedmpi_sweep_size "$file") || return 2
    if (( id < 0 || id >= size )); then
        echo "fedmpi-slurm: task $id out of range 0..$((size - 1)) for $file" >&2
        return 2
    fi
    local keys=() vals=()
    while IFS=$'\t' read -r key values; do
        keys+=("$key")
        vals+=("$values")
    done < <(_fedmpi_sweep_lines "$file")
    local out=() i arr
    for (( i = ${#keys[@]} - 1; i >= 0; i-- )); do
        read -r -a arr <<< "${vals[i]}"
        out[i]="${keys[i]}=${arr[id % ${#arr[@]}]}"
        id=$(( id / ${#arr[@]} ))
    done
    printf '%s\n' "${out[@]}"
}

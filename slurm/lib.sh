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
#   MAX_REQUEUES times) and its next start resumes. SIGTERM (a plain `scancel`, or
#   Slurm's own requeue/preemption) is forwarded too, so the checkpoint is written,
#   but the job never requeues itself after it: a plain `scancel` stops for good,
#   and a job Slurm requeues (scontrol requeue, PreemptMode=REQUEUE) resumes anyway.
#   Returns COMMAND's exit status.
#
# fedmpi_sweep_size FILE / fedmpi_sweep_task FILE ID
#   A sweep file has one line per config key, `key: value value ...` ('#' comments,
#   blank lines ignored); the tasks are the Cartesian product of the lines (the last
#   line varies fastest). fedmpi_sweep_task prints task ID's overrides, one
#   `key=value` per line.

FEDMPI_EXIT_INTERRUPTED=75
MAX_REQUEUES=${MAX_REQUEUES:-20}

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
    FEDMPI_GOT_SIGNAL=${FEDMPI_GOT_SIGNAL:-$1}
    [[ $1 == TERM ]] && FEDMPI_GOT_SIGNAL=TERM   # a cancel wins over an earlier USR1
    echo "fedmpi-slurm: got SIG$1; asking fedmpi (pid ${FEDMPI_CHILD:-?}) to checkpoint and stop" >&2
    if [[ -n "${FEDMPI_CHILD:-}" ]]; then
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
    echo "fedmpi-slurm: ${cmd[*]}" >&2
    FEDMPI_GOT_SIGNAL=
    trap 'fedmpi_forward USR1' USR1
    trap 'fedmpi_forward TERM' TERM
    "${cmd[@]}" &
    FEDMPI_CHILD=$!
    # `wait` returns early when a trapped signal arrives; keep waiting for the child.
    while kill -0 "$FEDMPI_CHILD" 2>/dev/null; do
        wait "$FEDMPI_CHILD"
    done
    wait "$FEDMPI_CHILD"
    local rc=$?
    trap - USR1 TERM
    if [[ $rc -eq $FEDMPI_EXIT_INTERRUPTED ]]; then
        if [[ $FEDMPI_GOT_SIGNAL == TERM ]]; then
            echo "fedmpi-slurm: stopped by SIGTERM (scancel, or Slurm ending/requeueing the" \
                 "job) after a checkpoint; not requeueing" >&2
        elif (( ${SLURM_RESTART_COUNT:-0} < MAX_REQUEUES )); then
            echo "fedmpi-slurm: interrupted after a checkpoint; requeueing job ${SLURM_JOB_ID:-?}" >&2
            fedmpi_requeue
        else
            echo "fedmpi-slurm: interrupted; MAX_REQUEUES=$MAX_REQUEUES reached, not requeueing" >&2
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

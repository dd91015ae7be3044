# shellcheck shell=bash
# Shared by slurm/*.sbatch (sourced, not run). Nothing to edit here.
#
# fedmpi_resumable OUT_DIR COMMAND...
#   Runs COMMAND (a launcher line such as `srun python -m fedmpi run CFG --out OUT_DIR`),
#   appending --resume when OUT_DIR/checkpoint.pt exists, and --overwrite when a requeued
#   job finds only the log of its own earlier start (stopped before the first checkpoint). While it runs, SIGUSR1 or
#   SIGTERM sent to this batch shell (`#SBATCH --signal=B:USR1@T`, scancel, preemption)
#   is forwarded to the launcher as SIGUSR1, which srun/mpirun pass to every rank:
#   fedmpi finishes the current round, writes the checkpoint and exits with status 75.
#   On 75 the job requeues itself (`scontrol requeue`, at most MAX_REQUEUES times) and
#   the next start of this script resumes. Returns COMMAND's exit status.
#
# fedmpi_sweep_size FILE / fedmpi_sweep_task FILE ID
#   A sweep file has one line per config key, `key: value value ...` ('#' comments,
#   blank lines ignored); the tasks are the Cartesian product of the lines (the last
#   line varies fastest). fedmpi_sweep_task prints task ID's overrides, one
#   `key=value` per line.

FEDMPI_EXIT_INTERRUPTED=75
MAX_REQUEUES=${MAX_REQUEUES:-20}

fedmpi_forward() {
    echo "fedmpi-slurm: got SIG$1; asking fedmpi (pid ${FEDMPI_CHILD:-?}) to checkpoint and stop" >&2
    if [[ -n "${FEDMPI_CHILD:-}" ]]; then
        kill -USR1 "$FEDMPI_CHILD" 2>/dev/null || true
    fi
}

fedmpi_resumable() {
    local out=$1
    shift
    local cmd=("$@")
    mkdir -p "$out"
    if [[ -f "$out/checkpoint.pt" ]]; then
        cmd+=(--resume)
        echo "fedmpi-slurm: resuming from $out/checkpoint.pt (restart ${SLURM_RESTART_COUNT:-0})" >&2
    elif [[ -f "$out/log.h5" && ${SLURM_RESTART_COUNT:-0} -gt 0 ]]; then
        # this job's earlier start stopped before its first checkpoint: start it again
        cmd+=(--overwrite)
        echo "fedmpi-slurm: no checkpoint in $out; restarting the run (restart ${SLURM_RESTART_COUNT})" >&2
    fi
    echo "fedmpi-slurm: ${cmd[*]}" >&2
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
        if (( ${SLURM_RESTART_COUNT:-0} < MAX_REQUEUES )); then
            echo "fedmpi-slurm: interrupted after a checkpoint; requeueing job ${SLURM_JOB_ID:-?}" >&2
            scontrol requeue "${SLURM_JOB_ID:?}" || echo "fedmpi-slurm: requeue failed" >&2
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

#!/bin/bash
# Submit slurm/sweep.sbatch as a job array sized from the sweep file.
#
#   slurm/submit-sweep.sh SWEEP_FILE CONFIG [fedmpi run options]
#
# MAX_PARALLEL (default 8) caps the tasks running at once; SBATCH_ARGS adds sbatch
# options, e.g. SBATCH_ARGS="--partition=gpu --time=01:00:00". The tasks' Slurm
# output goes to LOG_DIR (default logs/, created here): logs/<job name>-<array id>_<task>.out.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=slurm/lib.sh
source "$HERE/lib.sh"
SWEEP=${1:?usage: slurm/submit-sweep.sh SWEEP_FILE CONFIG [fedmpi run options]}
CONFIG=${2:?usage: slurm/submit-sweep.sh SWEEP_FILE CONFIG [fedmpi run options]}
shift 2
N=$(fedmpi_sweep_size "$SWEEP")
LOG_DIR=${LOG_DIR:-logs}
mkdir -p "$LOG_DIR"
# shellcheck disable=SC2086
exec sbatch --output="$LOG_DIR/%x-%A_%a.out" ${SBATCH_ARGS:-} --array="0-$((N - 1))%${MAX_PARALLEL:-8}" \
    "$HERE/sweep.sbatch" "$SWEEP" "$CONFIG" "$@"

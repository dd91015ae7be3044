# Source on a GPU machine without internet: installs carried wheels from .whl/
# (mpich under /tmp/mpi, mpi4py and anything else under /tmp/site) and puts the repo
# on PYTHONPATH. Used by the device runs behind the README's GPU numbers; on a
# normal machine `pip install -e .[mpich]` instead.
if ls .whl/mpich-*.whl >/dev/null 2>&1; then
  # --prefix, not --target: --target drops the wheel's data lib/ (libmpi.so.12)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --prefix /tmp/mpi .whl/mpich-*.whl || return 1
  export PATH=/tmp/mpi/bin:$PATH LD_LIBRARY_PATH=/tmp/mpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # mpi4py's wheel otherwise binds the first libmpi it finds (a system Open MPI)
  export MPI4PY_MPIABI=mpich
fi
others=$(ls .whl/*.whl 2>/dev/null | grep -v '/mpich-')
if [ -n "$others" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $others || return 1
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

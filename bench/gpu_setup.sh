# Source on a GPU machine without internet: installs carried wheels (mpich, mpi4py)
# from .whl/ into /tmp/site and puts the repo on PYTHONPATH. Used by the device runs
# behind the README's GPU numbers; on a normal machine `pip install -e .[mpich]` instead.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# mpi4py's wheel loads the first libmpi it finds; point it at the carried MPICH so it
# matches the carried mpiexec (a system Open MPI would otherwise win).
if [ -e /tmp/site/lib/libmpi.so.12 ]; then
  export MPI4PY_MPIABI=mpich MPI4PY_LIBMPI=/tmp/site/lib/libmpi.so.12
  export LD_LIBRARY_PATH=/tmp/site/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

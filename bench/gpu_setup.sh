# Source on a GPU machine without internet: installs carried wheels (mpich, mpi4py)
# from .whl/ into /tmp/site and puts the repo on PYTHONPATH. Used by the device runs
# behind the README's GPU numbers; on a normal machine `pip install -e .[mpich]` instead.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1

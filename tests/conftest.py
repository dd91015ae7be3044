"""Shared fixtures: MPI launches of the CLI and small configs on digits."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# In-process tests build their Federation on this device. CI has no GPU; on a GPU
# machine ``FEDMPI_TEST_DEVICE=cuda`` runs them on CUDA (the CLI tests use
# runtime.device=auto, which picks the GPU by itself).
TEST_DEVICE = os.environ.get("FEDMPI_TEST_DEVICE", "cpu")
if TEST_DEVICE.startswith("cuda"):
    from fedmpi.training.accel import set_deterministic

    set_deterministic(True)   # in-process equality checks: no TF32, deterministic kernels


@pytest.fixture(autouse=True)
def _no_stop_request_leaks():
    """A stop request recorded by one test (signal tests, interrupted runs in this
    process) must not stop the rounds of the next one."""
    yield
    from fedmpi.job import signals

    signals.clear()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run only with FEDMPI_SLOW=1 (CI skips them)."""
    if os.environ.get("FEDMPI_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow experiment; set FEDMPI_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


QUICK = os.environ.get("FEDMPI_QUICK") == "1"


def mpiexec_path() -> str | None:
    """``mpiexec`` of this environment; a quick local run (``FEDMPI_QUICK=1``)
    skips every test that launches one (CI runs them all)."""
    if QUICK:
        pytest.skip("FEDMPI_QUICK=1: MPI launches skipped (quick local run)")
    for cand in (BIN / "mpiexec", shutil.which("mpiexec")):
        if cand and Path(cand).exists():
            return str(cand)
    return None


def fedmpi_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedmpi", *args]


def run_fedmpi(args: list[str], n: int = 1, timeout: float = 300, env: dict | None = None,
               check: bool = True) -> subprocess.CompletedProcess:
    """Run ``fedmpi ARGS`` alone (n=0) or under ``mpiexec -n n``."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if TEST_DEVICE.startswith("cuda") and args and args[0] == "run":
        # equality tests need bit-reproducible kernels on GPU (no TF32, no atomics)
        args = [*args, "--set", "runtime.deterministic=true"]
    if n >= 1:
        mpi = mpiexec_path()
        if mpi is None:
            pytest.skip("mpiexec not found (pip install -e .[mpich])")
        cmd = [mpi, "-n", str(n), *fedmpi_cmd(*args)]
    else:
        cmd = fedmpi_cmd(*args)
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\n"
                             f"stderr:\n{proc.stderr[-4000:]}")
    return proc


def run_mpi_script(code: str, n: int = 3, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run ``python -c CODE`` under ``mpiexec -n n`` from the repo root; must exit 0."""
    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found (pip install -e .[mpich])")
    proc = subprocess.run([mpi, "-n", str(n), sys.executable, "-c", code], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


#: The start of a script run under mpiexec (``script root config out``): every rank records
#: the files it opens under ``root`` in ``opened`` (relative paths), through an audit hook.
OPEN_AUDIT = r'''
import json, os, sys
from mpi4py import MPI
root, config, out = sys.argv[1:4]
rank = MPI.COMM_WORLD.Get_rank()
opened = set()

def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.path.abspath(os.fsdecode(args[0]))
        if path.startswith(root):
            opened.add(os.path.relpath(path, root))

sys.addaudithook(hook)
'''


def set_dotted(d: dict, over: dict) -> dict:
    """Apply ``{"train.lr": 0.1, ...}`` overrides to a nested config dict (in place)."""
    for key, value in over.items():
        node = d
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return d


def run_at_world_sizes(args: list[str], tmp_path, sizes=(1, 3)) -> tuple[dict, dict]:
    """Run ``fedmpi ARGS --out tmp_path/n<N>`` under each ``mpiexec -n N``.

    Returns ``(logs, models)`` keyed by N: the :class:`fedmpi.log.RunLog` and the
    final global ``state_dict`` (the world-size invariance tests compare them).
    """
    import torch

    from fedmpi.log.reader import read

    logs, models = {}, {}
    for n in sizes:
        out = tmp_path / f"n{n}"
        run_fedmpi([*args, "--out", str(out)], n=n)
        logs[n] = read(out / "log.h5")
        models[n] = torch.load(out / "model.pt", weights_only=True)
    return logs, models


SMALL = [
    "--set", "data.num_clients=6", "--set", "train.clients_per_round=4",
    "--set", "train.rounds=3", "--set", "model.name=cnn", "--set", "train.local_epochs=1",
    "--set", "train.batch_size=64", "--set", "runtime.progress=false",
    "--set", "runtime.round_timeout=120",
]


def build_fed(base: dict, **over):
    """The one in-process :class:`~fedmpi.runtime.Federation` factory of the tests:
    ``base`` (a nested config dict, not modified) with dotted overrides, world size 1."""
    import copy

    from fedmpi.comm import Comm
    from fedmpi.config.schema import config_from_dict
    from fedmpi.runtime.federation import Federation

    return Federation(config_from_dict(set_dotted(copy.deepcopy(base), over)), Comm())


def bare_context(cfg, flat, num_samples, role: str = "server", hosted: tuple = (), **fields):
    """A :class:`~fedmpi.context.Context` without data, communicator or log file, for
    tests of methods and of the server step outside a run (rank 0, world size 1)."""
    import numpy as np
    import torch

    from fedmpi.training.accel import Accel
    from fedmpi.context import Context

    ns = np.asarray(num_samples, dtype=np.int64)
    return Context(cfg=cfg, device=torch.device("cpu"), role=role, rank=0, world_size=1,
                   num_samples=ns, hosted=tuple(hosted), flat=flat, forward=flat.model,
                   accel=Accel("cpu"), data=fields.pop("data", None),
                   partition=fields.pop("partition", None), **fields)


def server_parts(algo, weighting, num_samples, rule=None, stats=None, stages=()):
    """The :class:`~fedmpi.runtime.server.ServerParts` of a server step outside a run:
    the method's own uplink statistics unless ``stats``, the plain ``mean`` rule unless
    ``rule``, no stages unless given."""
    import numpy as np

    from fedmpi.aggregation.rules import ServerRule
    from fedmpi.runtime.server import ServerParts
    from fedmpi.transforms.base import TransformChain

    stats = tuple(algo.exchange().uplink if stats is None else stats)
    return ServerParts(algo, weighting, rule if rule is not None else ServerRule(algo.cfg),
                       TransformChain(list(stages)), stats, np.asarray(num_samples))


# ------------------------------------------------- the shared checkpoint fake
class Comm1:
    """World-size-1 stand-in for fedmpi.comm.Comm (its size-1 code paths)."""

    rank, size = 0, 1
    chunk_elements = 1 << 30   # what Comm.chunk gives without runtime.max_message_bytes

    def chunk(self, dtype) -> int:
        return self.chunk_elements

    def reduce_sum(self, send, recv, what=""):
        import numpy as np

        np.copyto(recv, send)

    def broadcast(self, buf, what=""):
        pass

    def gatherv_rows(self, send, recv, rows, what=""):
        import numpy as np

        np.copyto(recv[: rows[0]], send)

    def scatterv_rows(self, send, recv, rows, what=""):
        import numpy as np

        np.copyto(recv, send[: rows[0]])

    def max_int(self, v, what=""):
        return v


class DictClients:
    """Per-client states kept in a dict (the method's client_state / load_client_state)."""

    def __init__(self, states=None):
        self.states = dict(states or {})

    def client_state(self, k):
        return self.states.get(k, {})

    def load_client_state(self, k, st):
        self.states[k] = st


def fake_run_state(cfg=None, num_clients: int = 4, size: int = 8, components=None, clients=None,
                   out_dir=None):
    """The one fake of what fedmpi.job.checkpoint saves and restores (a RunState at world size 1):
    θ = arange(size)/7, the given named components, per-client states in a dict."""
    import numpy as np
    import torch

    from fedmpi.job.checkpoint import RunState
    from fedmpi.config.schema import config_from_dict

    cfg = cfg if cfg is not None else config_from_dict({"data": {"num_clients": num_clients}})
    return RunState(cfg=cfg, comm=Comm1(), num_clients=num_clients,
                    host=np.zeros(num_clients, dtype=int), hosted=list(range(num_clients)),
                    device=torch.device("cpu"), global_state=torch.arange(size, dtype=torch.float32) / 7,
                    components=dict(components or {}), clients=clients or DictClients(),
                    out_dir=out_dir)

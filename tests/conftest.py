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


def pytest_runtest_setup(item):
    """A quick local run skips the tests marked ``mpi`` before their fixtures run (an
    in-process reference run would be wasted)."""
    if QUICK and item.get_closest_marker("mpi") is not None:
        pytest.skip("FEDMPI_QUICK=1: MPI launches skipped (quick local run)")


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


def run_here(args: list[str], env: dict | None = None, check: bool = True) -> int:
    """``fedmpi ARGS`` in this process: world size 1, what ``mpiexec -n 1 fedmpi ARGS``
    runs, without the launch. The environment is :func:`run_fedmpi`'s
    (``OMP_NUM_THREADS=1`` and ``env``; the repository and a ``PYTHONPATH`` in ``env``
    go on ``sys.path``) and directory (the repository) for the call. Returns the exit
    status (0 asserted unless ``check=False``)."""
    from fedmpi.cli import main

    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    if TEST_DEVICE.startswith("cuda") and args and args[0] == "run":
        args = [*args, "--set", "runtime.deterministic=true"]
    # `python -m fedmpi` in the repository: it and PYTHONPATH come first on sys.path
    paths = [p for p in [str(ROOT), *env.pop("PYTHONPATH", "").split(os.pathsep)]
             if p and p not in sys.path]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.path[:0] = paths
    cwd = os.getcwd()
    os.chdir(ROOT)                     # where run_fedmpi's launches start
    try:
        code = main(list(args))
    finally:
        os.chdir(cwd)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for p in paths:
            sys.path.remove(p)
    if check:
        assert code == 0, f"fedmpi {' '.join(args)} exited {code}"
    return code


#: one MPI job running several ``fedmpi`` commands in turn (:func:`run_fedmpi_many`)
MANY_SCRIPT = r"""
import json, sys
from fedmpi.cli import main
for argv in json.loads(sys.argv[1]):
    code = main(argv)
    if code != 0:
        print(f"fedmpi {' '.join(argv)} exited {code}", file=sys.stderr, flush=True)
        sys.exit(code)
"""


def run_fedmpi_many(argvs: list[list[str]], n: int = 3, timeout: float = 600,
                    env: dict | None = None, before: str = "",
                    after: str = "") -> subprocess.CompletedProcess:
    """Run several ``fedmpi`` commands one after the other in ONE ``mpiexec -n n`` job
    (each rank calls :func:`fedmpi.cli.main` per command, as the ``fedmpi`` process
    does): one launch instead of one per command; every command must exit 0.
    ``before``/``after``: Python code every rank runs before the first command (e.g. a
    spy on a method) and after the last (e.g. printing what the spy saw)."""
    import json

    mpi = mpiexec_path()
    if mpi is None:
        pytest.skip("mpiexec not found (pip install -e .[mpich])")
    if TEST_DEVICE.startswith("cuda"):
        argvs = [[*a, "--set", "runtime.deterministic=true"] if a[0] == "run" else a
                 for a in argvs]
    code = "\n".join([before, MANY_SCRIPT, after])
    proc = subprocess.run([mpi, "-n", str(n), sys.executable, "-c", code,
                           json.dumps(argvs)], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


def wait_for(ready, what: str, timeout: float = 180, proc: subprocess.Popen | None = None,
             poll: float = 0.05):
    """Readiness handshake: poll ``ready()`` until it returns something true (returned),
    for at most ``timeout`` seconds; fails at once, with its stderr, if ``proc`` (the
    child being waited on) exits first. Never a fixed sleep."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = ready()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read()[-3000:] if proc.stderr else ""
            raise AssertionError(f"exited {proc.returncode} before {what}\n{err}")
        time.sleep(poll)
    raise AssertionError(f"not within {timeout} s: {what}")


def logged_rounds(out: Path) -> int:
    """Rounds in ``out``/log.h5 so far (0 while it does not exist or is being created)."""
    from fedmpi.log.reader import read

    try:
        return read(out / "log.h5").num_rounds
    except Exception:  # noqa: BLE001 - not created yet, or created but not yet readable
        return 0


def wait_rounds(out: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> int:
    """Until the run writing ``out`` has logged ``n`` rounds (it is then mid-run)."""
    def logged() -> int:
        rounds = logged_rounds(out)
        return rounds if rounds >= n else 0

    return wait_for(logged, f"{n} rounds logged in {out}", timeout, proc, poll=0.1)


def wait_caught(pid: int, sig: int, timeout: float = 120) -> None:
    """Until process ``pid`` catches ``sig`` (its handler is installed: the kernel's
    ``SigCgt`` mask in /proc/PID/status)."""
    bit = 1 << (sig - 1)

    def caught() -> bool:
        with open(f"/proc/{pid}/status") as f:
            line = next(ln for ln in f if ln.startswith("SigCgt:"))
        return bool(int(line.split()[1], 16) & bit)

    wait_for(caught, f"pid {pid} catching signal {sig}", timeout, poll=0.001)


def assert_same_bits(a: Path, b: Path) -> None:
    """Two run directories hold the same run bit for bit: the same ``model.pt`` bytes and
    the same log rows in every column and array but the timings, the rank table and the
    bytes handed to MPI (``bytes_up``/``bytes_down``: the messages of a world size; the
    per-participant ``bytes_*_encoded`` are compared)."""
    import numpy as np

    from fedmpi.log.reader import read

    assert (a / "model.pt").read_bytes() == (b / "model.pt").read_bytes()
    la, lb = read(a / "log.h5"), read(b / "log.h5")
    for group in ("rounds", "clients", "arrays"):
        ga, gb = getattr(la, group), getattr(lb, group)
        assert ga.keys() == gb.keys(), group
        for name, v in ga.items():
            # timings and where each rank ran (/ranks: host, device per rank) may differ
            if (not name.endswith("seconds") and not name.startswith("ranks/")
                    and name not in ("bytes_up", "bytes_down")):
                same = (np.array_equal(v, gb[name]) if v.dtype == object
                        else np.array_equal(v, gb[name], equal_nan=True))
                assert same, f"{group}/{name}"
    assert la.attrs["status"] == lb.attrs["status"] == "completed"


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
    """Run ``fedmpi ARGS --out tmp_path/n<N>`` under each ``mpiexec -n N`` (N = 1 in this
    process, :func:`run_here`).

    Returns ``(logs, models)`` keyed by N: the :class:`fedmpi.log.RunLog` and the
    final global ``state_dict`` (the world-size invariance tests compare them).
    """
    import torch

    from fedmpi.log.reader import read

    if any(n > 1 for n in sizes) and mpiexec_path() is None:
        pytest.skip("mpiexec not found (pip install -e .[mpich])")
    logs, models = {}, {}
    for n in sizes:
        out = tmp_path / f"n{n}"
        if n == 1:    # world size 1 in this process: what `mpiexec -n 1` runs, no launch
            run_here([*args, "--out", str(out)])
        else:
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

    from fedmpi.comm.world import Comm
    from fedmpi.config.schema import config_from_dict
    from fedmpi.runtime.federation import Federation

    return Federation(config_from_dict(set_dotted(copy.deepcopy(base), over)), Comm())


class ClientRig:
    """The client side of one rank without a :class:`~fedmpi.runtime.Federation`: the
    built parts (:func:`fedmpi.runtime.build.build` at world size 1: data, model, method,
    weighting, transforms), the local trainer and the :class:`~fedmpi.runtime.worker.Worker`
    that runs the client template. For tests of a client rule: what one client uploads
    (no channel, evaluation, server step or log)."""

    def __init__(self, cfg) -> None:
        import torch

        from fedmpi.comm.world import Comm
        from fedmpi.runtime.build import build, participants
        from fedmpi.runtime.worker import Worker
        from fedmpi.training.loop import LocalTrainer

        K, m = cfg.data.num_clients, cfg.train.clients_per_round or cfg.data.num_clients
        self.cfg = cfg
        self.built = b = build(cfg, Comm(), plan=lambda t: participants(cfg.seed, K, m, t))
        self.device, self.data, self.flat = b.device, b.data, b.flat
        self.accel, self.forward = b.accel, b.forward
        self.algo, self.transforms, self.stats = b.algo, b.transforms, b.stats
        self.D = b.flat.size
        self.theta0 = b.flat.vector.detach().clone()   # θ⁰ (the trainer loads over the model)
        self.trainer = LocalTrainer(b.flat, b.data, b.accel, b.forward)
        self.client_idx = {k: torch.as_tensor(b.partition.client_indices[k], device=b.device)
                           for k in b.hosted}
        self.worker = Worker(cfg, 0, b.algo, b.weighting, b.transforms, self.trainer,
                             self.client_idx, {}, b.reports)

    def task(self, k: int, t: int = 0):
        return self.worker.task(k, t)

    def train(self, k: int = 0, t: int = 0, state=None, extras=None):
        """Client ``k``'s update in round ``t`` from ``state`` (θ⁰) with the downlink
        ``extras`` (zeros): ``(uploaded statistics by name, TrainResult)``."""
        import torch

        state = self.theta0.clone() if state is None else state
        if extras is None:
            extras = torch.zeros(self.algo.exchange().downlink, device=self.device)
        out = {s.name: torch.zeros(s.size, device=self.device) for s in self.stats}
        result = self.worker.train(self.task(k, t), state, extras, out)
        return out, result


def client_rig(base: dict, **over) -> ClientRig:
    """A :class:`ClientRig` of ``base`` (a nested config dict, not modified) with dotted
    overrides -- :func:`build_fed`'s arguments, for tests of a client rule."""
    import copy

    from fedmpi.config.schema import config_from_dict

    return ClientRig(config_from_dict(set_dotted(copy.deepcopy(base), over)))


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
    """World-size-1 stand-in for fedmpi.comm.world.Comm (its size-1 code paths)."""

    rank, size, world_size = 0, 1, 1
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

"""Checkpoints and resume (operations, issue 5).

A checkpoint is taken *between* rounds, so everything in it belongs to the
same point of the run: "rounds 0 … r−1 are done". It holds

* ``round`` r, the next round to run (sampling is seeded by (seed, round) and
  client RNG streams by (seed, client, round), so r *is* the RNG state of the
  protocol; the process RNG states of rank 0 are stored anyway),
* ``global_state``: θ on rank 0 (parameters and float buffers, [D] float32),
* ``components``: ``{name: component.state_dict()}`` for every named component
  of the run (:class:`RunState`: ``algorithm`` — optimizer moments, c, h …,
  ``weighting``, ``transform/<name>``, the server ``rule``, ``privacy`` — the
  privacy accountant's counts (:mod:`fedmpi.privacy.budget`), only when
  ``privacy.dp.level`` is not ``none`` — and ``rng``, the torch / numpy /
  ``random`` states of rank 0, :class:`RngStreams`),
* ``clients``: ``{client id: Algorithm.client_state(id)}`` for every client
  with a non-empty state (SCAFFOLD c_k, FedDyn h_k, FedGPS last Δ_k, the client
  optimizer's state under ``train.optimizer_state: keep``, …),
* identification (``format``, ``version``, ``algorithm``, ``num_clients``,
  ``state_size``, ``world_size``, ``config_yaml``).

Nothing here sees the :class:`~fedmpi.runtime.Federation`: the runtime hands
:func:`save` and :func:`load_server_side` a :class:`RunState` — θ, the named
components, the per-client states and the rank layout.

The file format (write/read/validate, checksum) is :mod:`fedmpi.job.checkpoint_file`;
moving the client states between ranks without pickle is :mod:`fedmpi.job.client_states`.
This module assembles a checkpoint from a run and restores a run from one; the names of
both are re-exported here.
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

from fedmpi.job.checkpoint_file import (FORMAT, VERSION, checkpoint_path, digest,
    read_checkpoint)
from fedmpi.job.client_states import (gather_client_states,
    scatter_client_states)
from fedmpi.config.core import Config
from fedmpi.errors import ReportedElsewhere
from fedmpi.job.outputs import save_atomic  # noqa: F401 - the checkpoint writer (re-exported)
from fedmpi.job.rundir import check_same_run, fingerprint
from fedmpi.job.state_check import CheckpointError, check_checkpoint

__all__ = ["ClientStates", "Restored", "RngStreams", "RunState", "StateOwner", "load_server_side",
           "resume", "save"]


# ---------------------------------------------------------------- the run
class StateOwner(Protocol):
    """A named component of a checkpoint: methods, weightings, transforms, server rules."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class ClientStates(Protocol):
    """Per-client state on the hosting rank (the method's ``client_state``)."""

    def client_state(self, client: int) -> dict[str, torch.Tensor]: ...

    def load_client_state(self, client: int, state: dict[str, torch.Tensor]) -> None: ...


class RngStreams:
    """The process RNG states of rank 0 (torch, CUDA, numpy, ``random``) as a component.

    Client streams are seeded by (seed, client, round), so the round is the
    protocol's RNG state; these are stored so that user code drawing from the
    global generators resumes where it stopped."""

    def state_dict(self) -> dict[str, Any]:
        np_state: Any = np.random.get_state()
        py_version, py_state, py_gauss = random.getstate()
        out: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "numpy_pos": int(np_state[2]), "numpy_has_gauss": int(np_state[3]),
            "numpy_cached_gaussian": float(np_state[4]),
            "python": torch.tensor(py_state, dtype=torch.int64), "python_version": int(py_version),
            "python_gauss": None if py_gauss is None else float(py_gauss),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def load_state_dict(self, rng: dict[str, Any]) -> None:
        rng = _to_device(rng, torch.device("cpu"))
        torch.set_rng_state(rng["torch"])
        np.random.set_state(("MT19937", rng["numpy_keys"].numpy().astype(np.uint32),
                             rng["numpy_pos"], rng["numpy_has_gauss"],
                             rng["numpy_cached_gaussian"]))
        random.setstate((rng["python_version"], tuple(int(x) for x in rng["python"].tolist()),
                         rng["python_gauss"]))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"][: torch.cuda.device_count()])


@dataclass
class RunState:
    """What a checkpoint saves and restores of one rank's run.

    ``components`` are the named stateful parts (rank 0 saves and restores
    their ``state_dict``); ``clients`` holds the per-client states of the
    clients this rank hosts (``hosted``; ``host[k]`` is the rank of client k);
    ``global_state`` is θ on rank 0, restored in place; ``after_resume(round)``
    runs collectively on every rank after a restore."""

    cfg: Config
    comm: Any
    num_clients: int
    host: np.ndarray
    hosted: list[int]
    device: torch.device
    global_state: torch.Tensor
    components: dict[str, StateOwner]
    clients: ClientStates
    after_resume: Callable[[int], None] = lambda round: None
    out_dir: Any = None   # the run directory (for messages); None in tests
    #: SHA-256 of the model's frozen parameters (``requires_grad=False``), "" without any:
    #: they are rebuilt from the config, never stored, and a resume checks them
    frozen_digest: str = ""
    preprocessing: dict[str, Any] = field(default_factory=dict)   # the inputs' (fedmpi.data.preprocessing)

    @property
    def rank(self) -> int:
        return int(self.comm.rank)

    @property
    def size(self) -> int:
        return int(self.comm.size)

    @property
    def is_server(self) -> bool:
        return self.rank == 0


# -------------------------------------------------------------- save / load
def _to_cpu(value: Any) -> Any:
    """A detached CPU copy of a tensor (nested dicts/lists too); numbers unchanged."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def save(run: RunState, round: int, path: Path) -> Optional[Path]:
    """Collective: checkpoint "rounds < ``round`` are done" to ``path`` (rank 0 writes)."""
    clients = gather_client_states(run)
    if not run.is_server:
        return None
    ckpt = {
        "format": FORMAT, "version": VERSION, "round": int(round),
        "algorithm": str(run.cfg.algorithm.name), "num_clients": int(run.num_clients),
        "state_size": int(run.global_state.numel()), "world_size": int(run.size),
        "config_yaml": run.cfg.to_yaml(), "fingerprint": fingerprint(run.cfg),
        # no copy on the CPU (a model may be most of the memory): the file holds θ's
        # buffer, which also has the round's downlink extras after θ
        "global_state": run.global_state.detach().cpu(),
        "components": {name: _to_cpu(dict(c.state_dict())) for name, c in run.components.items()},
        "clients": clients,
    }
    if run.frozen_digest:
        ckpt["frozen_sha256"] = run.frozen_digest
    if run.preprocessing:   # what a site applies to its inputs (fedmpi.data.preprocessing)
        ckpt["preprocessing"] = dict(run.preprocessing)
    ckpt["checksum"] = digest(ckpt)
    save_atomic(ckpt, path)
    return path


@dataclass
class Restored:
    """What rank 0 read from a checkpoint and still has to hand to the workers."""

    round: int
    path: Path
    clients: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


def load_server_side(run: RunState, path: Path) -> Restored:
    """Rank 0, not collective: read ``path``, check it fits this run, restore θ and
    every named component's state. Raises :class:`CheckpointError`."""
    ckpt = read_checkpoint(path)
    check_same_run(run.cfg, ckpt["fingerprint"], ckpt["config_yaml"], Path(path))
    D, K = int(run.global_state.numel()), int(run.num_clients)
    checks = (("algorithm", str(run.cfg.algorithm.name), "algorithm.name"),
              ("num_clients", K, "data.num_clients"),
              ("state_size", D, "model.name/model.norm"))
    for key, mine, cfg_key in checks:
        if ckpt[key] != mine:
            raise CheckpointError(f"{path}: checkpoint has {key}={ckpt[key]!r} but this run has "
                                  f"{mine!r} (config key {cfg_key!r} differs from the checkpointed run)")
    if ckpt.get("frozen_sha256", "") != run.frozen_digest:
        raise CheckpointError(f"{path}: the model's frozen parameters (requires_grad=False) "
                              "differ from those of the checkpointed run; they are rebuilt "
                              "from the config, not stored: build them identically (the same "
                              "seed, the same weight files)")
    g = ckpt["global_state"]
    if g.shape != (D,) or g.dtype != torch.float32:
        raise CheckpointError(f"{path}: global_state has shape {tuple(g.shape)} {g.dtype}, "
                              f"expected ({D},) float32")
    bad = [k for k in ckpt["clients"] if not isinstance(k, int) or not 0 <= k < K]
    if bad:
        raise CheckpointError(f"{path}: client ids {bad[:5]} out of range 0..{K - 1}")
    if ckpt["round"] < 0:
        raise CheckpointError(f"{path}: negative round {ckpt['round']}")
    stored = ckpt["components"]
    extra = sorted(set(stored) - set(run.components))
    if extra:
        raise CheckpointError(f"{path}: checkpoint holds state of components {extra} that this "
                              "run does not have")
    check_checkpoint(ckpt, run.components, run.clients, D, Path(path))   # shape, finite, range
    run.global_state.copy_(g.to(run.device))
    for name, component in run.components.items():
        try:
            component.load_state_dict(_to_device(stored.get(name, {}), run.device))
        except Exception as exc:  # noqa: BLE001 - a state that does not fit this run
            raise CheckpointError(f"{path}: cannot restore the state of {name} "
                                  f"({type(exc).__name__}: {exc})") from None
    return Restored(int(ckpt["round"]), Path(path), ckpt["clients"])


def resume(run: RunState, restored: Optional[Restored]) -> int:
    """Collective after :func:`load_server_side`: client states to their hosts;
    every rank returns the round to continue from. Any rank failing to load a
    client state stops every rank (exit 2 with the message on that rank)."""
    head = np.array([restored.round if restored else 0], dtype=np.int64)
    run.comm.broadcast(head, what="resume round Bcast")
    error: Optional[BaseException] = None
    try:
        scatter_client_states(run, restored.clients if restored else None)
    except Exception as exc:  # noqa: BLE001 - reported below, then every rank stops
        where = restored.path if restored else checkpoint_path(run.out_dir or Path("."))
        error = CheckpointError(f"{where}: cannot restore client state on rank {run.rank} "
                                f"({type(exc).__name__}: {exc})")
    code = run.comm.max_int(2 if error else 0, what="resume agreement")
    if error is not None and run.rank != 0:   # the CLI prints rank 0's errors only
        print(f"fedmpi: error: {error}", file=sys.stderr, flush=True)
        raise ReportedElsewhere(str(error))
    if error is not None:
        raise error
    if code:
        raise ReportedElsewhere("restoring a client state failed on another rank (its error "
                                "line says why)")
    if head[0] > 0:   # the same test on every rank: after_resume is collective
        run.after_resume(int(head[0]))
    return int(head[0])

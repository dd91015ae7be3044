"""Checkpoints and resume (operations, issue 5; DESIGN.md §3 step 6).

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

Client states live on the worker that hosts the client. :func:`save` brings
them to rank 0 without pickle: each state dict is serialised to bytes in the
safetensors layout (8-byte little-endian header length, a JSON header with
dtype, shape and byte offsets per tensor, then the raw data; see
:func:`encode_state`), a ``Reduce`` of the per-client byte counts and a
``Bcast`` of them tell every rank the sizes, and ``Gatherv`` of ``uint8``
blocks moves the bytes (in blocks of at most ``comm.chunk(uint8)/size`` bytes per
rank, so MPI counts stay below 2^31 and messages within ``runtime.max_message_bytes``). :func:`resume` does the reverse with
``Scatterv`` to the clients' hosts under the *current* rank layout, so a run
checkpointed under ``-n 5`` resumes under ``-n 2`` or alone.

The file is written by rank 0 with :func:`fedmpi.outputs.save_atomic`
(temporary file, ``fsync``, rename: a failed write leaves the previous
checkpoint intact and exits 1 naming the path), and read with
``torch.load(weights_only=True)`` — tensors, numbers, strings and containers
only, no code runs when a checkpoint is read. Version 3 stores the named
components (version 2 had ``server_state`` and ``rng``; it is refused with one
line saying so). Version 2 added ``checksum``, the
SHA-256 of every other entry (:func:`digest`: tensor bytes included, so a
flipped bit is found) and ``fingerprint``, the run-defining config's hash
(:mod:`fedmpi.rundir`). A truncated, foreign or corrupt file (checksum
mismatch, non-finite ``global_state``), a checkpoint of another run (naming
the first differing config key) or one whose round lies beyond the log raises
:class:`~fedmpi.errors.UserError` naming it (exit status 2).

Longer than ~350 lines: the file format, the pickle-free byte layout and the collective save/restore must change together.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

from .errors import ReportedElsewhere
from .outputs import save_atomic  # noqa: F401 - the checkpoint writer (re-exported)
from .rundir import check_same_run, fingerprint
from .state_check import CheckpointError, check_checkpoint

FORMAT = "fedmpi-checkpoint"
VERSION = 3   # 2: ``checksum`` and ``fingerprint`` (issue 18); 3: named ``components`` (issue 23)
CHECKPOINT_NAME = "checkpoint.pt"

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


# --------------------------------------------------------------------- bytes
def encode_state(state: dict[str, torch.Tensor]) -> np.ndarray:
    """Serialise a dict of tensors to ``uint8`` bytes (safetensors layout, no pickle).

    ``[u64 little-endian N][N bytes JSON {name: {dtype, shape, offsets: [a, b]}}][data]``
    """
    header: dict[str, Any] = {}
    parts: list[np.ndarray] = []
    offset = 0
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"client state {name!r} is {type(t).__name__}, expected a tensor")
        if t.dtype not in _DTYPE_NAMES:
            raise TypeError(f"client state {name!r} has unsupported dtype {t.dtype}")
        raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "offsets": [offset, offset + raw.size]}
        parts.append(raw)
        offset += raw.size
    text = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    size = np.frombuffer(np.array([text.size], dtype="<u8").tobytes(), dtype=np.uint8)
    return np.concatenate([size, text, *parts]) if parts else np.concatenate([size, text])


def decode_state(buf: np.ndarray) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_state` (tensors on the CPU, owning their memory)."""
    raw = np.ascontiguousarray(buf, dtype=np.uint8)
    n = int(raw[:8].view("<u8")[0])
    header = json.loads(bytes(raw[8:8 + n]).decode())
    data = raw[8 + n:]
    out: dict[str, torch.Tensor] = {}
    for name, spec in header.items():
        a, b = spec["offsets"]
        dtype = _DTYPES[spec["dtype"]]
        if a == b:
            out[name] = torch.empty(spec["shape"], dtype=dtype)
            continue
        out[name] = torch.from_numpy(data[a:b].copy()).view(dtype).reshape(spec["shape"])
    return out


# ----------------------------------------------------------------- the file
def checkpoint_path(out_dir: Path) -> Path:
    return Path(out_dir) / CHECKPOINT_NAME


def read_checkpoint(path: Path) -> dict[str, Any]:
    """Load and check the container of a checkpoint file (no code execution)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no checkpoint to resume from (run without --resume, "
                              "or set runtime.checkpoint_every)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any load failure is a bad file
        raise CheckpointError(f"{path}: truncated or corrupt checkpoint "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                              ) from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a fedmpi checkpoint")
    if ckpt.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {ckpt.get('version')!r} was "
                              f"written by another fedmpi; this one reads version {VERSION} "
                              "(start the run again without --resume, with --overwrite)")
    need = {"round": int, "algorithm": str, "num_clients": int, "state_size": int,
            "global_state": torch.Tensor, "components": dict, "clients": dict,
            "checksum": str, "fingerprint": str, "config_yaml": str}
    for key, tp in need.items():
        if not isinstance(ckpt.get(key), tp):
            raise CheckpointError(f"{path}: checkpoint entry {key!r} is missing or not "
                                  f"{tp.__name__}")
    stored = ckpt.pop("checksum")
    if digest(ckpt) != stored:
        raise CheckpointError(f"{path}: corrupt checkpoint (SHA-256 of its contents differs "
                              "from the stored checksum)")
    if not bool(torch.isfinite(ckpt["global_state"]).all()):
        raise CheckpointError(f"{path}: corrupt checkpoint (global_state has non-finite values)")
    return ckpt


def digest(obj: Any) -> str:
    """SHA-256 (hex) over a checkpoint's contents: dict keys in sorted order, every
    tensor's dtype, shape and raw bytes, and the repr of every other leaf."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                walk(v)
            h.update(b"]")
        else:
            h.update(f"{type(x).__name__}:{x!r}".encode())

    walk(obj)
    return h.hexdigest()


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

    cfg: Any
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

    @property
    def rank(self) -> int:
        return int(self.comm.rank)

    @property
    def size(self) -> int:
        return int(self.comm.size)

    @property
    def is_server(self) -> bool:
        return self.rank == 0


# --------------------------------------------------------------- transport
def _block(comm) -> int:
    """Bytes per rank per Gatherv/Scatterv call (total per call ≤ ``comm.chunk``)."""
    return max(1, comm.chunk(np.uint8) // max(1, comm.size))


def _streams_layout(run: RunState, lengths: np.ndarray) -> tuple[list[int], int]:
    """Per-rank stream lengths (clients in id order) and the number of blocks."""
    per_rank = [int(lengths[run.host == r].sum()) for r in range(run.size)]
    block = _block(run.comm)
    return per_rank, -(-max(per_rank) // block) if max(per_rank) else 0


def _split(stream: np.ndarray, clients: list[int], lengths: np.ndarray) -> dict[int, np.ndarray]:
    out, pos = {}, 0
    for k in clients:
        n = int(lengths[k])
        if n:
            out[k] = stream[pos:pos + n]
        pos += n
    return out


def gather_client_states(run: RunState) -> dict[int, dict[str, torch.Tensor]]:
    """Collective: every client's :meth:`Algorithm.client_state` on rank 0, by id."""
    comm, K = run.comm, run.num_clients
    blobs: dict[int, np.ndarray] = {}
    lengths = np.zeros(K, dtype=np.int64)
    for k in run.hosted:
        state = run.clients.client_state(k)
        if state:
            blobs[k] = encode_state(state)
            lengths[k] = blobs[k].size
    total = np.zeros(K, dtype=np.int64)
    comm.reduce_sum(lengths, total if run.is_server else None, what="checkpoint sizes Reduce")
    comm.broadcast(total, what="checkpoint sizes Bcast")
    per_rank, blocks = _streams_layout(run, total)
    mine = [blobs[k] for k in run.hosted if k in blobs]
    stream = np.concatenate(mine) if mine else np.zeros(0, dtype=np.uint8)
    parts: list[list[np.ndarray]] = [[] for _ in range(run.size)]
    block = _block(run.comm)
    for j in range(blocks):
        rows = [max(0, min(block, n - j * block)) for n in per_rank]
        send = stream[j * block: j * block + rows[run.rank]].reshape(-1, 1)
        recv = np.empty((sum(rows), 1), dtype=np.uint8) if run.is_server else None
        comm.gatherv_rows(send, recv, rows, what="checkpoint client-state Gatherv")
        if run.is_server:
            pos = 0
            for r, n in enumerate(rows):
                parts[r].append(recv[pos:pos + n, 0])
                pos += n
    if not run.is_server:
        return {}
    out: dict[int, dict[str, torch.Tensor]] = {}
    for r in range(run.size):
        full = np.concatenate(parts[r]) if parts[r] else np.zeros(0, dtype=np.uint8)
        hosted = [k for k in range(K) if run.host[k] == r]
        for k, blob in _split(full, hosted, total).items():
            out[k] = decode_state(blob)
    return out


def scatter_client_states(run: RunState, states: Optional[dict[int, dict[str, torch.Tensor]]]) -> int:
    """Collective: rank 0's ``states`` to the clients' current hosts, loaded with
    :meth:`Algorithm.load_client_state`; returns how many this rank loaded."""
    comm, K = run.comm, run.num_clients
    lengths = np.zeros(K, dtype=np.int64)
    blobs: dict[int, np.ndarray] = {}
    if run.is_server:
        for k, state in (states or {}).items():
            if state:
                blobs[int(k)] = encode_state(state)
                lengths[int(k)] = blobs[int(k)].size
    comm.broadcast(lengths, what="resume sizes Bcast")
    per_rank, blocks = _streams_layout(run, lengths)
    block = _block(run.comm)
    send_streams: list[np.ndarray] = []
    if run.is_server:
        for r in range(run.size):
            hosted = [blobs[k] for k in range(K) if run.host[k] == r and k in blobs]
            send_streams.append(np.concatenate(hosted) if hosted else np.zeros(0, dtype=np.uint8))
    received: list[np.ndarray] = []
    for j in range(blocks):
        rows = [max(0, min(block, n - j * block)) for n in per_rank]
        send = None
        if run.is_server:
            send = np.concatenate([s[j * block: j * block + rows[r]]
                                   for r, s in enumerate(send_streams)]).reshape(-1, 1)
        recv = np.empty((rows[run.rank], 1), dtype=np.uint8)
        comm.scatterv_rows(send, recv, rows, what="resume client-state Scatterv")
        received.append(recv[:, 0])
    stream = np.concatenate(received) if received else np.zeros(0, dtype=np.uint8)
    loaded = 0
    for k, blob in _split(stream, run.hosted, lengths).items():
        state = {n: t.to(run.device) for n, t in decode_state(blob).items()}
        run.clients.load_client_state(k, state)
        loaded += 1
    return loaded


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
        "global_state": run.global_state.detach().to("cpu", copy=True),
        "components": {name: _to_cpu(dict(c.state_dict())) for name, c in run.components.items()},
        "clients": clients,
    }
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

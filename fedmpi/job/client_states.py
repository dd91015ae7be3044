"""Per-client states between ranks, without pickle: the byte layout and the collectives
that move it (operations, issue 5).

Client states live on the worker that hosts the client. :func:`fedmpi.job.checkpoint.save`
brings them to rank 0 without pickle: each state dict is serialised to bytes in the
safetensors layout (8-byte little-endian header length, a JSON header with dtype, shape
and byte offsets per tensor, then the raw data; see :func:`encode_state`), a ``Reduce``
of the per-client byte counts and a ``Bcast`` of them tell every rank the sizes, and
``Gatherv`` of ``uint8`` blocks moves the bytes (in blocks of at most
``comm.chunk(uint8)/size`` bytes per rank, so MPI counts stay below 2^31 and messages
within ``runtime.max_message_bytes``). :func:`fedmpi.job.checkpoint.resume` does the reverse
with ``Scatterv`` to the clients' hosts under the *current* rank layout, so a run
checkpointed under ``-n 5`` resumes under ``-n 2`` or alone.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from fedmpi.job.checkpoint import RunState

__all__ = ["decode_state", "encode_state", "gather_client_states", "scatter_client_states"]

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

"""The checkpoint file: its format, version, checksum and the checks of reading it
(operations, issue 5; issue 18).

The file is written by rank 0 with :func:`fedmpi.job.outputs.save_atomic`
(temporary file, ``fsync``, rename: a failed write leaves the previous
checkpoint intact and exits 1 naming the path), and read with
``torch.load(weights_only=True)`` — tensors, numbers, strings and containers
only, no code runs when a checkpoint is read. Version 3 stores the named
components (version 2 had ``server_state`` and ``rng``; it is refused with one
line saying so). Version 2 added ``checksum``, the
SHA-256 of every other entry (:func:`digest`: tensor bytes included, so a
flipped bit is found) and ``fingerprint``, the run-defining config's hash
(:mod:`fedmpi.job.rundir`). A truncated, foreign or corrupt file (checksum
mismatch, non-finite ``global_state``), a checkpoint of another run (naming
the first differing config key) or one whose round lies beyond the log raises
:class:`~fedmpi.errors.UserError` naming it (exit status 2).

What a checkpoint holds, and how the run saves and restores it, is :mod:`fedmpi.job.checkpoint`.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from fedmpi.job.state_check import CheckpointError

__all__ = ["CHECKPOINT_NAME", "FORMAT", "VERSION", "checkpoint_path", "digest",
           "read_checkpoint"]

FORMAT = "fedmpi-checkpoint"
VERSION = 3   # 2: ``checksum`` and ``fingerprint`` (issue 18); 3: named ``components`` (issue 23)
CHECKPOINT_NAME = "checkpoint.pt"


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
            if t.numel():   # the buffer itself, not a copy of it (a model may be huge)
                h.update(t.reshape(-1).view(torch.uint8).numpy().data)
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

"""Every tensor of a checkpoint is checked before a run resumes from it (issues 30, 31).

The checksum of a checkpoint (:mod:`fedmpi.job.checkpoint`) only proves that the file was
not altered after it was written; it says nothing about whether what was written can
be trained from. A checkpoint is untrusted input, so at load every tensor must be

* **finite** — a NaN SCAFFOLD control variate c_k poisons client k's every update
  (it is excluded every round: a run that makes no progress);
* **in range** — ``|x| < 2^64`` (:data:`MAX_ABS`): the square of every value is finite
  in float32 (2^128 overflows), so norms, weight decay and the server's squared
  distances stay finite; a global state of 1e30 makes every update non-finite;
* **of the shape this run uses** — θ has D entries; a per-client vector of a
  :meth:`~fedmpi.methods.base.Algorithm.client_store` has the store's size; a
  server-state tensor has the shape of the method's own (a short c_k would crash
  local training rounds later).

:func:`check_checkpoint` raises :class:`CheckpointError` naming the first bad entry
(``clients[3].c``, ``algorithm.c``, ``global_state``), which the CLI prints as one
line with exit status 2.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from fedmpi.errors import UserError

#: Largest magnitude a checkpointed value may have (module docstring).
MAX_ABS = 2.0 ** 64


class CheckpointError(UserError):
    """A checkpoint file is missing, truncated, corrupt or from another run."""


def _tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts/lists, with a dotted/indexed name."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _tensors(v, f"{name}[{k}]" if isinstance(k, int) else f"{name}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{name}[{i}]")


def check_values(name: str, t: torch.Tensor, path: Path) -> None:
    """``t`` finite and within ±:data:`MAX_ABS` (floating tensors only)."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    x = t.detach()   # in its own dtype: every float dtype that can exceed 2^64 holds it exactly
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise CheckpointError(f"{path}: checkpoint entry {name} has {bad} non-finite value(s); "
                              "refusing to resume from it")
    peak = float(x.abs().max())
    if peak >= MAX_ABS:
        raise CheckpointError(f"{path}: checkpoint entry {name} has a value of magnitude "
                              f"{peak:.3g}, beyond the 2^64 a trainable state can hold; "
                              "refusing to resume from it")


def _check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], path: Path) -> None:
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"{path}: checkpoint entry {name} has shape {tuple(t.shape)}, "
                              f"this run expects {tuple(shape)}")


def check_checkpoint(ckpt: Mapping[str, Any], components: Mapping[str, Any], clients: Any,
                     state_size: int, path: Path) -> None:
    """Rank 0 at load: validate θ, every named component's state and every client state of
    ``ckpt`` against this run's ``components`` (their current ``state_dict()`` gives the
    shapes) and its per-client stores (``clients``: the method, whose
    :meth:`~fedmpi.methods.base.Algorithm.client_store` vectors have fixed sizes)."""
    path = Path(path)
    _check_shape("global_state", ckpt["global_state"], (state_size,), path)
    stored = ckpt["components"]
    for cname, component in components.items():
        template = dict(_tensors(component.state_dict(), cname))
        for name, t in _tensors(stored.get(cname, {}), cname):
            if name in template:
                _check_shape(name, t, tuple(template[name].shape), path)
    stores = {st.name: st.size for st in getattr(clients, "_client_stores", ())}
    for k, state in ckpt["clients"].items():
        if not isinstance(state, Mapping):
            raise CheckpointError(f"{path}: checkpoint entry clients[{k}] is not a mapping")
        for entry, t in state.items():
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{path}: checkpoint entry clients[{k}].{entry} is not a "
                                      "tensor")
            if entry in stores:
                _check_shape(f"clients[{k}].{entry}", t, (stores[entry],), path)
    for name, t in (("global_state", ckpt["global_state"]),
                    *((n, x) for c in components for n, x in _tensors(stored.get(c, {}), c)),
                    *_tensors(ckpt["clients"], "clients")):
        check_values(name, t, path)

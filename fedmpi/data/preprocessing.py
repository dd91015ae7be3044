r"""The preprocessing a model was trained under, saved with every model file (issue 48).

Every input the federation's models see is ``Dataset.prepare``'s per-channel affine map
of the raw value :math:`x` (channel axis 1; a tabular feature is a channel):

.. math::  z_{c} = (s\,x_{c} - \mu_c) / \sigma_c

with the scale :math:`s` (1 for tabular features, 1/255 for ``uint8`` images) and the
federation's per-channel mean :math:`\mu_c` and population standard deviation
:math:`\sigma_c` (silo data: over the union of the silos and the server's validation set,
from the per-silo sums :mod:`fedmpi.data.silos` exchanges). Training augmentation is not
part of it (evaluation never augments).

The record (:func:`describe`) is a JSON-able dict. It travels

* in ``model.pt``, ``best.pt`` and ``local_models/<site>.pt``: the file is still the
  model's ``state_dict`` (``torch.load(path, weights_only=True)`` then
  ``model.load_state_dict``), with the record in the dict's ``_metadata`` under
  :data:`KEY` — ``torch.load`` restores ``_metadata`` and ``load_state_dict`` only reads
  the entries named after the model's modules, so the file loads as before;
* in the checkpoint under ``"preprocessing"``, and in the log's ``run_info`` (JSON) under
  ``"preprocessing"``.

A site applies it to its raw rows with :func:`apply` (or the formula above by hand).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping, Optional

import numpy as np
import torch

if TYPE_CHECKING:
    from fedmpi.data.base import Dataset

#: the entry of a model file's ``state_dict._metadata`` that holds the record
KEY = "fedmpi.preprocessing"
#: the attribute of a trained ``nn.Module`` that holds the record (set once at build time)
ATTR = "_fedmpi_preprocessing"


def describe(data: Dataset) -> dict[str, Any]:
    """The record of ``data``'s preprocessing (module docstring)."""
    return {"kind": "standardise", "formula": "(scale * x - mean[c]) / std[c], c on axis 1",
            "scale": float(data.scale), "mean": [float(m) for m in data.mean],
            "std": [float(s) for s in data.std],
            "input_shape": [int(d) for d in data.input_shape],
            "num_classes": int(data.num_classes)}


def attach(model: torch.nn.Module, record: Mapping[str, Any]) -> None:
    """Remember ``record`` on ``model``, so every file written from it carries it."""
    setattr(model, ATTR, dict(record))


def of(model: torch.nn.Module) -> Optional[dict[str, Any]]:
    """The record attached to ``model`` (None: none)."""
    return getattr(model, ATTR, None)


def with_record(state: Mapping[str, torch.Tensor],
                record: Optional[Mapping[str, Any]]) -> "OrderedDict[str, torch.Tensor]":
    """``state`` as a ``state_dict`` whose ``_metadata`` holds ``record`` (module doc)."""
    out: OrderedDict[str, torch.Tensor] = OrderedDict(state)
    meta = OrderedDict(getattr(state, "_metadata", None) or {})
    if record is not None:
        meta[KEY] = dict(record)
    out._metadata = meta   # type: ignore[attr-defined]
    return out


def read(path: str | os.PathLike) -> dict[str, Any]:
    """The record saved in the model file ``path`` (loaded without pickle's code path:
    ``weights_only=True``). Raises ``KeyError`` for a file written without one."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    meta = getattr(state, "_metadata", None) or {}
    if KEY not in meta:
        raise KeyError(f"{os.fspath(path)}: no preprocessing record (written before fedmpi "
                       "saved one, or not a fedmpi model file)")
    return dict(meta[KEY])


def apply(record: Mapping[str, Any], x: "np.ndarray | torch.Tensor") -> torch.Tensor:
    """Raw inputs ``x [N, C, ...]`` as the model's inputs: (s·x − μ_c)/σ_c, float32 —
    the same float64 gain and offset :meth:`Dataset.prepare` rounds to float32."""
    t = torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x)
    mean = torch.tensor(record["mean"], dtype=torch.float64)
    std = torch.tensor(record["std"], dtype=torch.float64)
    shape = (1, -1) + (1,) * (t.dim() - 2)
    gain = (float(record["scale"]) / std).to(torch.float32).view(shape)
    offset = (-mean / std).to(torch.float32).view(shape)
    return torch.addcmul(offset, t.to(torch.float32), gain)

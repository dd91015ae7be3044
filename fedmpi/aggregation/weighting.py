"""Aggregation weights s_k (``aggregation.weighting``).

``samples``  s_k = n_k / Σ_{j∈S} n_j           (FedAvg)
``uniform``  s_k = 1 / |S|

Both are *reducible*: s_k ∝ w̃_k with w̃_k known on the worker, so the worker
sends Σ_k w̃_k x_k and rank 0 divides by Σ_k w̃_k over the accepted clients.
Weightings that must see every client model on rank 0 (FedVG) set
``per_client = True`` and implement :meth:`Weighting.weights`.
"""
from __future__ import annotations

from typing import ClassVar, Mapping, Optional

import numpy as np
import torch

from fedmpi.component import Component, Registry

#: A per-client statistic by name: ``[n, size]`` rows (one per client) or one ``[size]`` row.
Rows = Mapping[str, torch.Tensor]


class Weighting(Component):
    """``samples`` (s_k = n_k/Σn); the base of every weighting.

    Lifecycle as for methods: constructed with n_k of every client, then
    :func:`~fedmpi.component.start` sets ``ctx``/``device``/``cfg`` and
    calls :meth:`setup`. Parameter blocks are ``aggregation.<block>.*``
    (FedVG: ``aggregation.fedvg.*``).
    """

    name: ClassVar[str] = "samples"
    prefix: ClassVar[str] = "aggregation"
    per_client: ClassVar[bool] = False

    def __init__(self, num_samples: np.ndarray) -> None:
        # Normalising by the pool size keeps Σ w̃_k Δ_k at the scale of Δ in float32.
        self.num_samples = np.asarray(num_samples, dtype=np.float64)
        self._scale = 1.0 / max(1.0, float(self.num_samples.sum()))

    @classmethod
    def per_client_reason(cls, cfg) -> Optional[tuple[str, str]]:
        if cls.per_client:
            return "aggregation.weighting", f"{cls.name!r} scores every client's update on rank 0"
        return None

    def raw(self, client: int) -> float:
        """Unnormalised weight w̃_k."""
        return float(self.num_samples[client]) * self._scale

    def on_arrival(self, state: torch.Tensor, client: int, row: Rows) -> None:
        """Rank 0, world size > 1: client ``client``'s statistics ``row`` (name → [size])
        have just arrived (the others may still be training); ``state`` is the
        round's global θ. Per-client weightings can start on it here."""

    def weights(self, state: torch.Tensor, clients: np.ndarray, rows: Rows) -> np.ndarray:
        """Per-client weighting only: s_k for ``clients`` from their statistics
        (name → [n, size], rows in the order of ``clients``) at the global θ ``state``."""
        raise TypeError(f"weighting {self.name!r} is reducible; it has no per-client weights")

    def combine(self, s: "np.ndarray", rows: "torch.Tensor") -> "torch.Tensor":
        """Per-client weighting only: Σ_k s_k x_k of one gathered statistic.

        ``rows`` is ``[n, size]`` (one row per client of ``s``). Weightings
        with a weight per layer/block (FedVG ``layer``/``block``) override
        this to apply their per-segment weights; every weighted statistic of
        every method goes through here.
        """
        return torch.as_tensor(s, dtype=rows.dtype, device=rows.device) @ rows


class Uniform(Weighting):
    name = "uniform"

    def raw(self, client: int) -> float:
        return 1.0


#: ``aggregation.weighting`` names → classes (built-ins registered in :mod:`fedmpi.aggregation`)
WEIGHTINGS: Registry = Registry(Weighting, "aggregation.weighting")


def register_weighting(cls: type[Weighting]) -> type[Weighting]:
    """Make ``cls`` available as ``aggregation.weighting: <cls.name>``."""
    return WEIGHTINGS.register(cls)


def build_weighting(name: str, num_samples: np.ndarray) -> Weighting:
    """The weighting ``name`` (registered, or ``pkg.module:Class``) for clients of sizes n_k."""
    return WEIGHTINGS.lookup(name)(num_samples)

"""Aggregation weights s_k (``aggregation.weighting``).

``samples``  s_k = n_k / Σ_{j∈S} n_j           (FedAvg)
``uniform``  s_k = 1 / |S|

Both are *reducible*: s_k ∝ w̃_k with w̃_k known on the worker, so the worker
sends Σ_k w̃_k x_k and rank 0 divides by Σ_k w̃_k over the accepted clients.
Weightings that must see every client model on rank 0 (FedVG) set
``per_client = True`` and implement :meth:`Weighting.weights`.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError


class Weighting:
    name = "samples"
    per_client = False

    def __init__(self, num_samples: np.ndarray) -> None:
        # Normalising by the pool size keeps Σ w̃_k Δ_k at the scale of Δ in float32.
        self.num_samples = np.asarray(num_samples, dtype=np.float64)
        self._scale = 1.0 / max(1.0, float(self.num_samples.sum()))

    def raw(self, client: int) -> float:
        """Unnormalised weight w̃_k."""
        return float(self.num_samples[client]) * self._scale

    def bind(self, fed) -> None:
        """Called once with the :class:`~fedmpi.runtime.Federation` (rank 0 holds
        the validation set FedVG scores on)."""

    def on_arrival(self, fed, client: int, row: "torch.Tensor") -> None:
        """Rank 0, world size > 1: client ``client``'s row has just arrived (the others
        may still be training). Per-client weightings can start on it here."""

    def weights(self, fed, clients: "np.ndarray", rows) -> "np.ndarray":
        """Per-client weighting only: s_k for ``clients`` from their gathered rows."""
        raise TypeError(f"weighting {self.name!r} is reducible; it has no per-client weights")

    def combine(self, s: "np.ndarray", rows: "torch.Tensor") -> "torch.Tensor":
        """Per-client weighting only: Σ_k s_k x_k of one gathered statistic.

        ``rows`` is ``[n, size]`` (one row per client of ``s``). Weightings
        with a weight per layer/block (FedVG ``layer``/``block``) override
        this to apply their per-segment weights; every weighted statistic of
        every method goes through here.
        """
        import torch

        return torch.as_tensor(s, dtype=rows.dtype, device=rows.device) @ rows

    def log_arrays(self) -> dict[str, "np.ndarray"]:
        """Per-round arrays for the HDF5 log (e.g. ``fedvg/grad_norm``)."""
        return {}


class Uniform(Weighting):
    name = "uniform"

    def raw(self, client: int) -> float:
        return 1.0


WEIGHTINGS: dict[str, type[Weighting]] = {"samples": Weighting, "uniform": Uniform}

from .fedvg import FedVG, FedVGAvg  # noqa: E402  (subclasses of Weighting, defined above)

WEIGHTINGS.update({"fedvg": FedVG, "fedvg_avg": FedVGAvg})


def build_weighting(name: str, num_samples: np.ndarray) -> Weighting:
    if ":" in name:   # pkg.module:Class, a user weighting (fedmpi.imports)
        from ..imports import weighting_class

        return weighting_class(name)(num_samples)
    try:
        cls = WEIGHTINGS[name]
    except KeyError:
        raise ConfigError(f"config key 'aggregation.weighting': {name!r} is not implemented in this "
                          f"version; available: {', '.join(sorted(WEIGHTINGS))}") from None
    return cls(num_samples)

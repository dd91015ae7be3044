"""The shared math of the DP stages: clipping, Gaussian noise and its seeded streams.

The stages that use it are :mod:`fedmpi.privacy.client_dp` (DP-FedAvg) and
:mod:`fedmpi.privacy.record_dp` (DP-SGD). Noise is drawn from generators keyed by
(seed, round) on rank 0 and (seed, client, round) on a client, so it does not depend on
the rank layout and a resumed run draws the same noise.
"""
from __future__ import annotations

import torch


#: stream tags (SeedSequence entropy) of the DP noise
CENTRAL_TAG, SHARE_TAG = 0xD9_0001, 0xD9_0002


def noise_generator(device: torch.device, *keys: int) -> torch.Generator:
    """A generator on ``device`` seeded from integer ``keys`` (seed, round, ...)."""
    from fedmpi.training.loop import stream_seed   # the one seed rule of every RNG stream

    return torch.Generator(device=device).manual_seed(stream_seed(*keys))


def clip_(vector: torch.Tensor, clip: float) -> float:
    """Scale ``vector`` in place to l2 norm at most ``clip``; returns its norm before.

    Computed in float64 so the clipped norm is ≤ C up to one float32 rounding."""
    norm = float(torch.linalg.vector_norm(vector, dtype=torch.float64))
    if norm > clip:
        vector.mul_(clip / norm)
    return norm


def gaussian_(out: torch.Tensor, std: float, gen: torch.Generator) -> torch.Tensor:
    """``out += N(0, std²)`` per entry, drawn from ``gen``."""
    if std > 0:
        out.add_(torch.randn(out.shape, generator=gen, device=out.device, dtype=out.dtype),
                 alpha=std)
    return out

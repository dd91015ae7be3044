r"""Client-level differential privacy: DP-FedAvg (McMahan, Ramage, Talwar, Zhang 2018).

Per round t with the m sampled clients S_t (fixed size, without replacement):

1. **clip on the client** (:class:`fedmpi.transforms.dp_clip.ClientClip`, an
   update transform, the last
   one to touch the upload): Δ̄_k = Δ_k · min(1, C / ‖Δ_k‖₂) over the whole
   uploaded state (parameters and float buffers; Alg. 1 ``ClipFn``);
2. **noise on the sum**, std σC per coordinate, added either by rank 0
   (``privacy.dp.noise: central``, :meth:`ServerNoise.apply`) or in m equal
   shares N(0, σ²C²/m) by the participants themselves (``distributed``), so the
   sum carries N(0, σ²C²) and no single party adds it;
3. **fixed-denominator mean** (the paper's estimator f̃_f with uniform weights
   w_k = 1 and qW = m): Δ̃ = (Σ_{k accepted} Δ̄_k + z) / m. ``aggregation.weighting``
   must be ``uniform`` (config check); the denominator is m even when a
   participant is excluded, so it never depends on anyone's data.

A participant whose upload is excluded (non-finite) takes its noise share with
it. Rank 0 then adds the missing shares, N(0, σ²C²·e/m) for e excluded
participants, so the released aggregate still carries std σC and the
accountant's σ holds for everyone who sees the models; that top-up is known to
rank 0 itself, so against rank 0 the noise it did not add has std
σC·√((m−e)/m) in such a round (logged as an event; docs/privacy.md).

Noise is drawn from streams keyed by (seed, round) on rank 0 and
(seed, client, round) on a client, so it does not depend on the rank layout
and a resumed run draws the same noise.
"""
from __future__ import annotations

import math
from typing import Optional

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


class ServerNoise:
    """Rank 0's part of DP-FedAvg: noise (central, or the top-up of excluded shares)
    and the fixed denominator m (module docstring)."""

    def __init__(self, cfg) -> None:
        d = cfg.privacy.dp
        self.clip, self.sigma, self.seed = float(d.clip), float(d.noise_multiplier), int(cfg.seed)
        self.distributed = d.noise == "distributed"

    def noise_std(self, selected: int, accepted: int) -> float:
        """Std rank 0 adds to the sum: σC (central), or σC·√(e/m) for e = m − accepted
        excluded shares (distributed)."""
        if not self.distributed:
            return self.sigma * self.clip
        return self.sigma * self.clip * math.sqrt(max(0, selected - accepted) / max(1, selected))

    def apply(self, mean: torch.Tensor, round: int, selected: int, accepted: int) -> Optional[str]:
        """``mean`` = (1/accepted) Σ Δ̄_k in place → (Σ Δ̄_k + z)/selected. Returns an event
        text when rank 0 topped up missing shares (distributed noise), else None."""
        mean.mul_(accepted / selected)
        std = self.noise_std(selected, accepted)
        gen = noise_generator(mean.device, self.seed, CENTRAL_TAG, round)
        gaussian_(mean, std / selected, gen)
        if self.distributed and accepted < selected and std > 0:
            return (f"distributed DP noise: {selected - accepted} participant share(s) excluded; "
                    f"rank 0 added N(0, (sigma*C)^2*{selected - accepted}/{selected}) so the "
                    "model carries std sigma*C")
        return None

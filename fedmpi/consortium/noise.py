r"""Differentially private site summaries: the Gaussian mechanism on a site's row
(:mod:`fedmpi.consortium.summaries`), calibrated by Google's ``dp-accounting``.

**What is protected.** One record (sample) of one site, under add-or-remove-one
neighbouring datasets. Each site noises its own row before it leaves the site, so
rank 0 (and anyone reading ``stats.json``) sees only noisy sums; sites hold disjoint
records, so the release as a whole is (ε, δ)-DP for every record (parallel
composition).

**Assumptions the sensitivities rest on** (what a consortium must accept):

* every value is clipped to the declared range ``[lo, hi]`` (``--clip LO HI``) before
  it is summed, and centred at :math:`a = (lo + hi)/2`, so :math:`|v - a| \le r`,
  :math:`r = (hi - lo)/2`; the mean and standard deviation are then those of the
  clipped values;
* the input shape, the number of classes C (the largest label + 1) and the feature
  names are public: they are agreed in the clear before the noisy release;
* the smallest and largest values are **withheld** (their sensitivity is the whole
  range): the tables show the declared range instead.

Rank 0 post-processes the noisy rows (which costs no privacy): each site's counts are
rounded to whole numbers ≥ 0 (:func:`fedmpi.consortium.summaries.round_counts`; the
all-sites counts are then the sum of the sites' rows as shown), means are clamped into
``[lo, hi]`` and standard deviations into ``[0, hi − lo]``
(:func:`fedmpi.consortium.summaries.describe`). A site's sample count and its class
counts are noised apart, so its class counts need not add up to its samples.

With H channels of P values per sample (tabular: P = 1, H features), one record moves
the blocks of the row by at most (L2 norm)

==============  =============================================
block           sensitivity :math:`\Delta_b`
==============  =============================================
``count``       1
``classes``     1 (one label's count, by one)
``missing``     :math:`P\sqrt H` (every value of the record missing)
``sum``         :math:`P r \sqrt H`
``sum_sq``      :math:`P r^2 \sqrt H`
==============  =============================================

Block b gets Gaussian noise of standard deviation :math:`\sigma \Delta_b`. Divided by
its :math:`\Delta_b`, every block moves by at most 1, so the whole row is one Gaussian
mechanism of L2 sensitivity :math:`\sqrt B` (B = 5 blocks) and noise σ: its (ε, δ) is
``dp_accounting.get_epsilon_gaussian(σ/√B, δ)``, the analytic Gaussian mechanism of
Balle & Wang (2018), and for a stated ε, :math:`\sigma = \sqrt B\,`
``get_sigma_gaussian(ε, δ)``. No accounting is written here.

The noise is drawn from the operating system's entropy, never from the config's seed:
an aggregator that knows the seed could otherwise subtract it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from fedmpi.errors import UserError

from fedmpi.consortium.summaries import RowLayout

__all__ = ["NOISED", "StatsPrivacy", "calibrate", "epsilon_of"]

#: The blocks that carry noise; ``min`` and ``max`` are withheld.
NOISED = ("count", "classes", "missing", "sum", "sum_sq")


def _dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError:
        raise UserError("fedmpi stats --epsilon needs the dp-accounting package "
                        "(pip install 'fedmpi[privacy]')") from None
    return dp_accounting


@dataclass(frozen=True)
class StatsPrivacy:
    """The Gaussian mechanism of one ``fedmpi stats`` release (module docstring)."""

    epsilon: float
    delta: float
    clip: tuple[float, float]
    noise_multiplier: float       # σ, relative to each block's sensitivity

    @property
    def center(self) -> float:
        return (self.clip[0] + self.clip[1]) / 2

    @property
    def radius(self) -> float:
        return (self.clip[1] - self.clip[0]) / 2

    def sensitivities(self, channels: int, per_sample: int) -> dict[str, float]:
        """:math:`\\Delta_b` of every noised block (module docstring)."""
        root = math.sqrt(channels)
        return {"count": 1.0, "classes": 1.0, "missing": per_sample * root,
                "sum": per_sample * self.radius * root,
                "sum_sq": per_sample * self.radius ** 2 * root}

    def add_noise(self, row: np.ndarray, layout: RowLayout, per_sample: int,
                  rng: Optional[np.random.Generator] = None) -> np.ndarray:
        """``row`` with Gaussian noise of std σΔ_b on each noised block and the extremes
        withheld (NaN); ``rng`` for tests only (default: fresh OS entropy)."""
        rng = rng if rng is not None else np.random.default_rng()
        out = row.copy()
        for block, delta in self.sensitivities(layout.channels, per_sample).items():
            span = layout.span(block)
            out[span] += rng.normal(0.0, self.noise_multiplier * delta, size=span.stop - span.start)
        out[layout.span("min")] = np.nan
        out[layout.span("max")] = np.nan
        return out

    def record(self, channels: int, per_sample: int) -> dict[str, Any]:
        """What ``stats.json`` says about the mechanism."""
        return {"mechanism": "Gaussian, one per site, on its clipped and centred sums",
                "neighbouring": "add or remove one record of one site",
                "epsilon": epsilon_of(self.noise_multiplier, self.delta),
                "epsilon_stated": self.epsilon, "delta": self.delta,
                "clip": list(self.clip), "noise_multiplier": self.noise_multiplier,
                "sensitivities": self.sensitivities(channels, per_sample),
                "noise_std": {b: self.noise_multiplier * d
                              for b, d in self.sensitivities(channels, per_sample).items()},
                "withheld": ["min", "max"],
                "accountant": "dp_accounting.get_epsilon_gaussian (analytic Gaussian mechanism)"}


def calibrate(epsilon: float, delta: float, clip: tuple[float, float]) -> StatsPrivacy:
    """The mechanism with (ε, δ) as stated: σ = √B · ``get_sigma_gaussian(ε, δ)``.

    Raises
    ------
    UserError
        ε ≤ 0, δ outside (0, 1), or a clip range that is not ``lo < hi`` (finite).
    """
    if not (math.isfinite(epsilon) and epsilon > 0):
        raise UserError(f"fedmpi stats --epsilon expects a positive number, got {epsilon}")
    if not 0.0 < delta < 1.0:
        raise UserError(f"fedmpi stats --delta expects a number in (0, 1), got {delta}")
    lo, hi = (float(v) for v in clip)
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise UserError(f"fedmpi stats --clip expects LO < HI (finite), got {lo} {hi}")
    sigma = math.sqrt(len(NOISED)) * float(_dp_accounting().get_sigma_gaussian(epsilon, delta))
    return StatsPrivacy(float(epsilon), float(delta), (lo, hi), sigma)


def epsilon_of(noise_multiplier: float, delta: float) -> float:
    """ε at δ of the release with noise multiplier σ on each of the B blocks."""
    return float(_dp_accounting().get_epsilon_gaussian(noise_multiplier / math.sqrt(len(NOISED)),
                                                       delta))

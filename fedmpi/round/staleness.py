"""Staleness weights of asynchronous aggregation.

An update computed from model version ``v`` and applied at server version ``u`` has
staleness τ = u − v ≥ 0. Its contribution to the aggregate is scaled by s(τ):

* ``constant``: s(τ) = 1 — FedBuff as published (Nguyen et al., AISTATS 2022, Alg. 1);
* ``polynomial``: s(τ) = (τ + 1)^(−a) — Xie et al. 2019 (FedAsync), §5.2;
* ``hinge``: s(τ) = 1 for τ ≤ b, else 1 / (a (τ − b) + 1) — Xie et al. 2019, §5.2.

An update with τ > ``round.max_staleness`` is dropped before any of these apply.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("constant", "polynomial", "hinge")


@dataclass(frozen=True)
class Staleness:
    """s(τ) of one kind with its parameters ``a`` (exponent or slope) and ``b`` (the
    hinge's knee); ``max_staleness`` (None: no limit) marks the updates to drop."""

    kind: str = "constant"
    a: float = 0.5
    b: int = 4
    max_staleness: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"staleness kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.a < 0 or self.b < 0:
            raise ValueError("staleness parameters a and b must be >= 0")

    def keeps(self, tau: int) -> bool:
        """Whether an update of staleness ``tau`` is aggregated at all."""
        return self.max_staleness is None or tau <= self.max_staleness

    def weight(self, tau: int) -> float:
        """s(τ) for τ ≥ 0."""
        if tau < 0:
            raise ValueError(f"staleness must be >= 0, got {tau}")
        if self.kind == "polynomial":
            return float((tau + 1.0) ** (-self.a))
        if self.kind == "hinge":
            return 1.0 if tau <= self.b else 1.0 / (self.a * (tau - self.b) + 1.0)
        return 1.0

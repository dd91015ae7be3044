r"""Server-side aggregation rules (``aggregation.rule``): the seam on rank 0.

A round's server step (:func:`fedmpi.runtime.server.server_step`) combines the
accepted clients' *weighted* uplink statistics x_k (the model update Δ_k, and
e.g. SCAFFOLD's new control variates) into one aggregate that the method's
server rule then applies. By default (``aggregation.rule: mean``) that
aggregate is the weighted mean

.. math:: \bar x = \sum_{k \in A_t} s_k x_k

with s_k from ``aggregation.weighting``, pre-reduced on the workers. A rule
that needs every accepted client's statistic on rank 0 — a robust aggregator
(median, trimmed mean, Krum, ...), per-client clipping — sets
``per_client = True``; the uplink plan then sends those statistics as one row
per client (as it does for FedVG's weighting), and :meth:`ServerRule.aggregate`
receives the rows of the accepted clients (non-finite and failed clients never
reach a rule) together with their weights s_k and returns the aggregate.

Composition: the weighting computes s_k first (so FedVG × a robust rule works),
then the rule; ``sum`` and ``client`` statistics are untouched. A method whose
model update is not a weighted statistic (the submodel family, whose coverage
averaging sums masked updates) cannot take a per-client rule: ``fedmpi check``
exits 2 naming ``aggregation.rule`` and ``algorithm.name``.

A rule is one class and one :func:`register_rule` line, or a class given by
import path (``aggregation.rule: pkg.module:Class``) whose parameters come from
``aggregation.params`` — the same conventions as methods (:mod:`fedmpi.config.params`):
a built-in rule names its frozen parameter dataclasses by config block,
``params = {"trimmed_mean": TrimmedMeanParams}`` → ``aggregation.trimmed_mean.*``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

import numpy as np
import torch

from fedmpi.component import Component, Registry
from fedmpi.config.core import Config

__all__ = ["RuleInfo", "ServerRule", "RULES", "register_rule", "rule_class_for", "build_rule"]


@dataclass(frozen=True)
class RuleInfo:
    """What a rule knows about the round it aggregates."""

    round: int
    clients: np.ndarray        # accepted client ids, ascending (the rows' order)
    weights: np.ndarray        # s_k of those clients from aggregation.weighting (sum 1)
    num_samples: np.ndarray    # n_k of those clients
    num_clients: int           # K, all clients of the federation
    state: torch.Tensor        # θ before this round's update (read only)


class ServerRule(Component):
    """``mean``: Σ_k s_k x_k, today's aggregation; the base of every rule.

    Lifecycle as for methods and weightings: constructed with the run's config,
    then :func:`~fedmpi.component.start` sets ``ctx``/``device`` and calls
    :meth:`setup` (on every rank, after the method and the weighting).
    """

    name: ClassVar[str] = "mean"
    prefix: ClassVar[str] = "aggregation"
    #: config blocks of the rule: ``{"trimmed_mean": TrimmedMeanParams}`` gives the keys
    #: ``aggregation.trimmed_mean.*``; a rule given by import path uses ``"params"``
    #: (``aggregation.params``)
    params: ClassVar[dict[str, type]] = {}
    #: True: the weighted statistics of every participant reach rank 0 as rows and
    #: :meth:`aggregate` combines them; False: the workers pre-reduce the weighted mean
    per_client: ClassVar[bool] = False

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @classmethod
    def per_client_reason(cls, cfg: Config) -> Optional[tuple[str, str]]:
        if cls.per_client:
            return "aggregation.rule", f"{cfg.aggregation.rule!r} needs every client's update on rank 0"
        return None

    def begin_round(self, state: torch.Tensor, round: int) -> None:
        """Rank 0 with world size > 1, right after round ``round``'s state ``Bcast``,
        while the workers train: work on θ^t (``state``, read only) alone, done there off
        the round's critical path (FLTrust's server update). Default: nothing."""

    def aggregate(self, rows: Mapping[str, torch.Tensor], info: RuleInfo) -> dict[str, torch.Tensor]:
        """The aggregate of every weighted statistic from the accepted clients' rows.

        ``rows``: name → ``[n, size]`` float32, row i belonging to ``info.clients[i]``.
        Returns name → ``[size]`` float32, in place of Σ_k s_k x_k. Only called when
        :attr:`per_client` is True.
        """
        return {name: torch.as_tensor(info.weights, dtype=x.dtype, device=x.device) @ x
                for name, x in rows.items()}


#: ``aggregation.rule`` names → classes
RULES: Registry = Registry(ServerRule, "aggregation.rule")


def register_rule(cls: type[ServerRule]) -> type[ServerRule]:
    """Make ``cls`` available as ``aggregation.rule: <cls.name>``."""
    return RULES.register(cls)


register_rule(ServerRule)


def rule_class_for(name: str) -> type[ServerRule]:
    """The class of ``aggregation.rule``: a registered name or ``pkg.module:Class``."""
    return RULES.lookup(name)


def build_rule(cfg: Config, cls: Optional[type] = None) -> ServerRule:
    """The run's rule (``cls`` given to :func:`fedmpi.run` replaces the config's name)."""
    rule_cls = cls if cls is not None else rule_class_for(cfg.aggregation.rule)
    return rule_cls(cfg)

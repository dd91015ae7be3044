"""FedAvg (McMahan et al., 2017): the weighted average of client models.

The rule lives in :class:`~fedmpi.methods.base.Algorithm`, which every other
method extends; this module only names it.
"""
from __future__ import annotations

from fedmpi.methods.base import Algorithm, MethodSpec


class FedAvg(Algorithm):
    name = "fedavg"
    spec = MethodSpec(record_dp=True, asynchronous=True)   # plain SGD local step (docs/privacy.md)

"""How the server combines client updates: weightings (the s_k of the average:
:mod:`~fedmpi.aggregation.weighting`, FedVG's validation-gradient scores in
:mod:`~fedmpi.aggregation.fedvg`) and server rules (``aggregation.rule``:
:mod:`~fedmpi.aggregation.rules`, the robust ones in :mod:`~fedmpi.aggregation.robust`
with their math in :mod:`~fedmpi.aggregation.robust_math`).

Importing the package registers the built-in weightings and rules.
"""
from __future__ import annotations

from fedmpi.aggregation import fedvg, robust, weighting

for _w in (weighting.Weighting, weighting.Uniform, fedvg.FedVG, fedvg.FedVGAvg):
    weighting.register_weighting(_w)
del robust   # imported for its registrations (the robust rules)

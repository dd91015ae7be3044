"""FIARSE (Wu et al., NeurIPS 2024): importance-aware submodels, one global threshold.

The ``global`` rule of :mod:`fedmpi.algorithms.submodel`: the top (⌊r·d⌋ − d̃)
magnitudes over all prunable entries form the submodel, θ̃ = the smallest kept
|θ|. During local training the forward pass uses θ ⊙ 1[|θ| ≥ θ̃] recomputed
after every step (the mask is recomputed each forward), and the gradient is the
straight-through estimate ∇ ⊙ M_sent ⊙ (1 + 2|θ|θ̃/(|θ|+θ̃)²) on every entry of
the sent submodel, so an entry that dropped below θ̃ can recover. The client
uploads its full (un-re-masked) values on the sent submodel; aggregation is
overlap-aware and unweighted.

Deviation (recorded): the always-kept critical set (input/output layers,
normalisation layers, biases) is the same as FedLAGC's, so FIARSE and FedLAGC
here differ only in how the budget is spread over layers.
"""
from __future__ import annotations

from .submodel import SubmodelMethod


class FIARSE(SubmodelMethod):
    name = "fiarse"
    rule = "global"
    use_ste = True
    dynamic_mask = True

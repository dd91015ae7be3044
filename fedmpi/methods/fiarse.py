"""FIARSE (Wu et al., NeurIPS 2024): importance-aware submodels, one global threshold.

The ``global`` rule of :mod:`fedmpi.methods.submodel`: the top (⌊r·d⌋ − d̃)
magnitudes over all prunable entries form the submodel, θ̃ = the smallest kept
|θ|. During local training the forward pass uses θ ⊙ 1[|θ| ≥ θ̃] recomputed
after every step (the mask is recomputed each forward). The client uploads its
full (un-re-masked) values on the sent submodel; aggregation is overlap-aware
and unweighted.

Gradient (``algorithm.fiarse.below_threshold``):

* ``frozen`` (default; FIARSE's code, ``Bern.backward``): d(θ·1[|θ|≥θ̃])/dθ =
  1[|θ| ≥ θ̃]·(1 + 2|θ|θ̃/(|θ|+θ̃)²), so the gradient is
  ∇ ⊙ 1[|θ| ≥ θ̃] ⊙ STE with the *current* |θ|: an entry that falls below θ̃
  during local training gets zero gradient from then on (weight decay and
  momentum still act on it, as in the code's torch SGD);
* ``recover``: straight-through on every entry of the sent submodel,
  ∇ ⊙ M_sent ⊙ STE, so an entry that dropped below θ̃ can come back.

Always kept (``algorithm.fiarse.always_keep``): ``norm`` (default; FIARSE's
code masks every conv/linear weight and bias, including the input layer and the
classifier, and keeps only the normalisation layers) or ``critical``
(FedLAGC's set: input/output layers, normalisation layers, biases).
``algorithm.submodel.ste: false`` drops the STE factor (the 1[·] stays).

Budget (``algorithm.fiarse.budget``): ``model`` (default) keeps ⌊r·d⌋ − d̃
prunable entries, so the submodel holds ⌊r·d⌋ parameters as for every other
method here (the comparison of FedLAGC's tables is at equal size); ``maskable``
is FIARSE's code (``generate_mask``: ``topk(|θ|, int(numel·model_size))`` over
the maskable entries), ⌊r·(d − d̃)⌋ — r·d̃ fewer, d̃ the always-kept entries.
"""
from __future__ import annotations

from dataclasses import dataclass

from fedmpi.config.params import param
from fedmpi.methods.submodel import SubmodelMethod, SubmodelParams
from fedmpi.config.core import Config


@dataclass(frozen=True)
class FIARSEParams:
    """``algorithm.fiarse.*`` (:mod:`fedmpi.config.params`)."""

    below_threshold: str = param('frozen', "FIARSE entries whose |theta| falls below the "
                                           "threshold in local training: frozen = zero gradient"
                                           " (FIARSE Bern.backward) or recover = straight-"
                                           "through on the whole sent submodel",
                                           choices=('frozen', 'recover'))
    budget: str = param('model', "FIARSE budget: model = floor(r*d) parameters in all (every "
                                 "method's budget) or maskable = floor(r * maskable entries) "
                                 "(FIARSE code: topk over the maskable entries)",
                        choices=('model', 'maskable'))
    always_keep: str = param('norm', "FIARSE always-kept set: norm layers only (FIARSE code) or"
                                     " critical = FedLAGC's (input/output layers, norm layers, "
                                     "biases)", choices=('norm', 'critical'))


class FIARSE(SubmodelMethod):
    name = "fiarse"
    params = {"submodel": SubmodelParams, "fiarse": FIARSEParams}
    rule = "global"
    use_ste = True
    dynamic_mask = True

    def __init__(self, cfg: Config, layout, num_clients: int) -> None:
        self.cfg = cfg   # hparams before the base sets up the extractor with self.keep
        f = self.hparams("fiarse")
        self.keep = f.always_keep
        self.frozen_below = f.below_threshold == "frozen"
        self.budget_rule = f.budget
        super().__init__(cfg, layout, num_clients)

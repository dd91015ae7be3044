"""FedLAGC (Hu et al., AAAI 2026): layer-adaptive submodels + gradient correction.

Submodels: the ``layer_adaptive`` rule of :mod:`fedmpi.methods.submodel`
(layer importance S_l = mean|θ_l|, log normalisation, per-layer keep ratios
r_l = S̃_l (d_n − d̃)/Σ_j S̃_j d_j with the critical set always kept, top-k
magnitude masks, thresholds θ̃_l). Clients train θ ⊙ M with the STE gradient
g = ∇F(θ⊙M) ⊙ M ⊙ (1 + 2|θ|θ̃/(|θ|+θ̃)²) (footnote 2) and the correction

    g̃ = (g − h(t) λ_n) ⊙ M,   h(t) = 1 for t < ⌊T/4⌋ else 0          (Eq. "g̃")
    λ_n ← λ_n + β (θ_n^{t+1} − θ^t ⊙ M) ⊙ M,   β = 0.1               (Eq. "λ")

λ_n lives on the worker hosting client n (``client_state``), created as 0 at
its first participation. Aggregation is overlap-aware (see
:class:`~fedmpi.methods.submodel.SubmodelMethod`).

Switches (paper ablations): ``algorithm.fedlagc.correction: false`` = "FedLAGC
w/o GC" (Table 2); ``algorithm.submodel.ste: false`` = "w/o STE";
``algorithm.fedlagc.importance`` mean|max|equal and
``algorithm.fedlagc.log_normalize`` (Fig. 3(a)); ``algorithm.fedlagc.beta`` β
(Fig. 3(b)); ``algorithm.fedlagc.correction_fraction`` (1/4: h(t) switches off
at round ⌊fraction·T⌋, T = ``train.rounds``).

Deviations / choices (the paper is silent): keep ratios above 1 are clipped and
the surplus redistributed in proportion to S̃_l d_l (water-filling, see the
submodel module); the STE factor uses the current local |θ| and the round's
threshold θ̃_l, and is 1 on the always-kept critical entries (θ̃ = 0 there); the
overlap-aware average is unweighted (as FIARSE); λ is stored densely (P floats
per client that has participated on its hosting worker).
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from fedmpi.component import ClientTask
from fedmpi.methods.submodel import FedLAGCParams, SubmodelMethod, SubmodelParams
from fedmpi.config.core import Config


class FedLAGC(SubmodelMethod):
    name = "fedlagc"
    params = {"submodel": SubmodelParams, "fedlagc": FedLAGCParams}
    rule = "layer_adaptive"
    use_ste = True

    def __init__(self, cfg: Config, layout, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        a = self.hparams("fedlagc")
        self.use_correction = bool(a.correction)
        self.beta = float(a.beta)
        self.switch_round = int(math.floor(a.correction_fraction * cfg.train.rounds))
        self._lam = self.client_store("lambda", self.num_params)   # λ_k of hosted clients (worker)

    def extractor_options(self) -> dict[str, Any]:
        """Layer importance S_l and its normalisation (``algorithm.fedlagc.*``)."""
        a = self.hparams("fedlagc")
        return {"importance": a.importance, "log_normalize": a.log_normalize}

    def h(self, t: int) -> float:
        """h(t) = 1 for t < ⌊fraction·T⌋ (fraction 1/4), else 0."""
        return 1.0 if t < self.switch_round else 0.0

    def correction(self, task: ClientTask) -> tuple[Optional[torch.Tensor], float]:
        if not self.use_correction:
            return None, 0.0
        return self._lam.vector(task.client, self._flat.device), self.h(task.round)

    def finish_client(self, task, state, extras, out, result) -> None:
        super().finish_client(task, state, extras, out, result)
        if self.use_correction:   # out["delta"] is already (θ_n − θ⊙M) ⊙ M
            self._lam.vector(task.client, out["delta"].device).add_(out["delta"][: self.P],
                                                                alpha=self.beta)


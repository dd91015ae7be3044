"""HeteroFL (Diao et al., ICLR 2021): nested width slices.

The ``nested`` rule of :mod:`fedmpi.methods.submodel`: a level-r client
trains the first ⌈√r·c⌉ channels of every layer (width √r ⇒ ≈ r of the
parameters); plain masked gradients (no STE); overlap-aware averaging, so each
coordinate is averaged over the clients whose slice contains it.

``algorithm.heterofl.masked_ce`` (HeteroFL code's ``cfg['mask']`` /
``label_split``): during local training the logits of classes absent from the
client's data are set to 0 (``masked_fill(·, 0)``, not −∞) before the
cross-entropy; evaluation uses all logits. Off by default (the paper does not
describe it).

``algorithm.heterofl.scaler`` (default true, the paper's Scaler module, §3):
in local training the input of every normalisation layer is divided by the
client's width rate w = √r (identity in evaluation) — for batch-statistics norms
the same function as the norm with ε·w² (:class:`~fedmpi.methods.submodel.Scaler`).

Deviations (recorded): models must be channel-sliceable (``cnn``, ResNets).
"""
from __future__ import annotations

from dataclasses import dataclass

from fedmpi.config.params import param
from fedmpi.methods.submodel import SubmodelMethod, SubmodelParams
from fedmpi.config.core import Config


@dataclass(frozen=True)
class HeteroFLParams:
    """``algorithm.heterofl.*`` (:mod:`fedmpi.config.params`)."""

    masked_ce: bool = param(False, "HeteroFL masked cross-entropy: logits of classes absent "
                                   "from the client's data set to 0 (HeteroFL code option)")
    scaler: bool = param(True, "HeteroFL Scaler: in local training the input of every norm "
                               "layer is divided by the width rate sqrt(r) (paper Sec. 3; "
                               "= BN eps * r for batch statistics)")


class HeteroFL(SubmodelMethod):
    name = "heterofl"
    params = {"submodel": SubmodelParams, "heterofl": HeteroFLParams}
    rule = "nested"

    def __init__(self, cfg: Config, layout, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        p = self.hparams("heterofl")
        self.masked_ce = bool(p.masked_ce)
        self.scaler = bool(p.scaler)

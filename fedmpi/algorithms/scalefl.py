"""ScaleFL (Ilhan, Su & Liu, CVPR 2023): width *and* depth scaled submodels.

The third baseline of FedLAGC Tables 1–3, on the shared mask machinery: the
``scaled`` rule of :mod:`fedmpi.algorithms.submodel`. A level-r client trains
a submodel that is both shallower and narrower than the global model: depth
fraction δ = r^s (s = ``algorithm.scalefl.depth_share``, 0.5: the budget is
split evenly between depth and width in log scale), the deepest residual
blocks skipped, and nested width slices w = √(r·d/d_rest) on the rest, so the
submodel holds ≈ r·d parameters. Masked gradients, no STE, overlap-aware
averaging (as HeteroFL; ScaleFL aggregates each parameter over the clients
that hold it).

Deviations (recorded; what the mask module cannot express):

* **No early exits, no self-distillation.** ScaleFL attaches an exit
  classifier after the last kept block of each level and trains every exit
  with cross-entropy plus KL self-distillation from the deepest exit. Here a
  model has one classifier; a shallow level skips its deepest *identity*
  residual blocks (zero weights and norm affine ⇒ the block passes its input
  through) and uses the shared head. Blocks with a shortcut projection
  (stage transitions) are never skipped, so the depth reduction is capped.
* Depth/width split: the paper picks per-level (width, exit) pairs from a
  table; here one exponent s gives both from r.
* Models without residual blocks (``cnn``, ``lenet``) are scaled in width only
  (w = √r, i.e. HeteroFL's masks); the run's event log says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..params import param
from .submodel import SubmodelMethod, SubmodelParams


@dataclass(frozen=True)
class ScaleFLParams:
    """``algorithm.scalefl.*`` (:mod:`fedmpi.params`)."""

    depth_share: float = param(0.5, "ScaleFL: share of log(r) spent on depth: depth fraction "
                                    "r^share, width sqrt(r^(1-share))", ge=0, le=1)


class ScaleFL(SubmodelMethod):
    name = "scalefl"
    params = {"submodel": SubmodelParams, "scalefl": ScaleFLParams}
    rule = "scaled"

    def extractor_options(self) -> dict[str, Any]:
        """Depth share s of the ``scaled`` rule (``algorithm.scalefl.depth_share``)."""
        return {"depth_share": self.hparams("scalefl").depth_share}

    def setup(self, ctx) -> None:
        """Also records when the model allows no depth scaling."""
        super().setup(ctx)
        if not self.extractor.skippable:
            ctx.log.event(0, -1, f"scalefl: model {ctx.cfg.model.name!r} has no identity "
                          "residual blocks; depth scaling off, width only")

"""ScaleFL (Ilhan, Su & Liu, CVPR 2023): width *and* depth scaled submodels.

The third baseline of FedLAGC Tables 1–3, on the shared mask machinery: the
``scaled`` rule of :mod:`fedmpi.methods.submodel`. A level-r client trains
a submodel that is both shallower and narrower than the global model, and
trains r·d of the d parameters (within one channel step; ≤ 0.5 % on
ResNet-18/34 at FedLAGC's levels). ScaleFL's split of the budget: a depth
share and a width share (the code's per-level exit index and width scale).
Depth: fraction δ = r^s of the residual blocks (s =
``algorithm.scalefl.depth_share``, 0.5: the budget split evenly between depth
and width in log scale), the deepest ⌊(1 − δ)·B + ½⌋ blocks skipped — fewer
when the blocks left cannot hold r·d parameters even at full width (a
ResNet's deepest blocks hold most of its parameters). Width: the nested
channel fraction w whose exact parameter count over the kept blocks is
nearest r·d (ScaleFL's width scale is what makes a level's model fit its
budget). Masked gradients, no STE, overlap-aware averaging (as HeteroFL;
ScaleFL aggregates each parameter over the clients that hold it).

Deviations (recorded; what the mask module cannot express):

* **No early exits, no self-distillation.** ScaleFL attaches an exit
  classifier after the last kept block of each level and trains every exit
  with cross-entropy plus KL self-distillation from the deepest exit. Here a
  model has one classifier; a shallow level skips its deepest *identity*
  residual blocks (zero weights and norm affine ⇒ the block passes its input
  through) and uses the shared head. Blocks with a shortcut projection
  (stage transitions) are never skipped, so the depth reduction is capped.
* Depth/width split: the code takes per-level (width scale, exit) pairs
  from its arguments (``--vertical_scale_ratios``, ``--horizontal_scale_ratios``);
  here the exponent s gives the depth from r and the width is solved so that
  the level's parameter count is r·d.
* Models without residual blocks (``cnn``, ``lenet``) are scaled in width only
  (HeteroFL's nested masks at the width that meets the budget); the run's
  event log says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedmpi.config.params import param
from fedmpi.methods.submodel import SubmodelMethod, SubmodelParams


@dataclass(frozen=True)
class ScaleFLParams:
    """``algorithm.scalefl.*`` (:mod:`fedmpi.config.params`)."""

    depth_share: float = param(0.5, "ScaleFL: share of log(r) spent on depth: depth fraction "
                                    "r^share of the residual blocks; the width then meets the "
                                    "r*d parameter budget", ge=0, le=1)


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
            self.report.event(f"scalefl: model {ctx.cfg.model.name!r} has no identity "
                          "residual blocks; depth scaling off, width only")

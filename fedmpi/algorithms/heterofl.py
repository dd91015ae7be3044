"""HeteroFL (Diao et al., ICLR 2021): nested width slices.

The ``nested`` rule of :mod:`fedmpi.algorithms.submodel`: a level-r client
trains the first ⌈√r·c⌉ channels of every layer (width √r ⇒ ≈ r of the
parameters); plain masked gradients (no STE); overlap-aware averaging, so each
coordinate is averaged over the clients whose slice contains it.

Deviations (recorded): no "scaler" module (HeteroFL divides activations by the
width rate in training); models must be channel-sliceable (``cnn``, ResNets).
"""
from __future__ import annotations

from .submodel import SubmodelMethod


class HeteroFL(SubmodelMethod):
    name = "heterofl"
    rule = "nested"

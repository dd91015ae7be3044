"""FedRolex (Alam et al., NeurIPS 2022): rolling sub-model extraction.

The ``rolling`` rule of :mod:`fedmpi.methods.submodel`: in round t a level-r
client trains the ⌈√r·c⌉ channels starting at index (t mod c), wrapping around,
of every dimension of size c, so the window advances one channel per round and
every channel is trained by small clients over time. Masked gradients, no STE,
overlap-aware averaging. Evaluation of a level uses the window of round t+1
(what the next clients would receive).
"""
from __future__ import annotations

from fedmpi.methods.submodel import SubmodelMethod


class FedRolex(SubmodelMethod):
    name = "fedrolex"
    rule = "rolling"

"""Update transforms: stages composed around any method, with a client half on the worker
and a server half on rank 0 (:mod:`~fedmpi.transforms.base`): ECGR
(:mod:`~fedmpi.transforms.ecgr`) and the simulated adversary
(:mod:`~fedmpi.transforms.adversary`); the privacy stages live in :mod:`fedmpi.privacy`.

Importing the package registers them, in the order they apply: ECGR first, so an
adversary corrupts the real upload.
"""
from __future__ import annotations

from fedmpi.transforms import adversary, base, ecgr

for _t in (ecgr.EcgrTransform, adversary.Adversary):
    base.register_transform(_t)

"""Update transforms: client-side rewrites composed around any method
(:mod:`~fedmpi.transforms.base`): ECGR (:mod:`~fedmpi.transforms.ecgr`), the simulated
adversary (:mod:`~fedmpi.transforms.adversary`) and client-level DP's clip
(:mod:`~fedmpi.transforms.dp_clip`).

Importing the package registers them, in the order they apply: ECGR first (an adversary
corrupts the real upload), client-level DP's clip last.
"""
from __future__ import annotations

from fedmpi.transforms import adversary, base, dp_clip, ecgr

for _t in (ecgr.EcgrTransform, adversary.Adversary, dp_clip.ClientClip):
    base.register_transform(_t)

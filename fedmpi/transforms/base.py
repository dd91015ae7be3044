"""Update transforms: client-side rewrites composed around any method.

A transform sees a client's work at four points of the one local-training path
(:meth:`~fedmpi.methods.base.Algorithm.client_update`), in this order:

1. :meth:`UpdateTransform.before_training` — the task may be changed (label
   flipping) or refused (a simulated crash raises);
2. :meth:`UpdateTransform.wrap_hooks` — hooks inside the local loop
   (ECGR records every step);
3. :meth:`UpdateTransform.on_delta` — right after Δ_k = θ_k − θ is formed,
   before the method's ``finish_client`` (ECGR's herding selection);
4. :meth:`UpdateTransform.on_upload` — on the final upload, after the method
   wrote every statistic (ECGR's re-aggregated update; an adversary's
   corruption).

Each transform declares its own uplink statistics (:meth:`stats`, e.g. ECGR's
``ecgr/selected`` row) and log output (:meth:`log_arrays`, and static
attributes through ``ctx.log`` in :meth:`setup`), its config block (a top-level
section named after it: ``ecgr.*``, ``adversary.*``) and whether a config turns
it on (:meth:`UpdateTransform.enabled`). A transform is one class registered in
:data:`TRANSFORMS`; the runtime builds the enabled ones in registration order
(ECGR before the adversary, so an attack corrupts what would really be
uploaded), then those listed by import path in ``transforms``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Optional, Sequence

import numpy as np
import torch

from fedmpi.training.loop import StepHooks
from fedmpi.component import Component, Registry

if TYPE_CHECKING:
    from fedmpi.context import Context
    from fedmpi.component import ClientTask, Stat


class UpdateTransform(Component):
    """Base of a client-side update transform (every hook is optional).

    Built with the run's config, ``cls(cfg)``. Its block ``<name>`` gives the
    top-level keys ``<name>.*``.
    """

    name: ClassVar[str] = "transform"
    prefix: ClassVar[str] = ""
    #: True: the transform rewrites the whole update after the method's ``finish_client``
    #: (ECGR), so it cannot run with a method whose upload is masked (the submodel family)
    rewrites_update: ClassVar[bool] = False
    #: the key that turns it on (named in errors about combinations)
    enable_key: ClassVar[str] = "transforms"

    def __init__(self, cfg) -> None:
        self.cfg = cfg

    @classmethod
    def enabled(cls, cfg) -> bool:
        """Whether ``cfg`` turns this registered transform on (ECGR: ``ecgr.enabled``)."""
        return False

    @classmethod
    def build(cls, cfg) -> UpdateTransform:
        """The transform of this run (default ``cls(cfg)``)."""
        return cls(cfg)

    def setup(self, ctx: Context) -> None:
        """Called once on every rank with the run's context, before the uplink is planned."""

    def stats(self) -> list[Stat]:
        """Uplink statistics this transform adds (after the method's own)."""
        return []

    def before_training(self, task: ClientTask) -> ClientTask:
        return task

    def wrap_hooks(self, hooks: StepHooks, task: ClientTask) -> StepHooks:
        return hooks

    def on_delta(self, task: ClientTask, out: dict[str, torch.Tensor]) -> None:
        """``out["delta"]`` holds θ_k − θ; the method's own statistics are not written yet."""

    def on_upload(self, task: ClientTask, out: dict[str, torch.Tensor]) -> None:
        """Every statistic of ``out`` is final; rewrite what is uploaded."""

    def log_outputs(self) -> list[str]:
        """What this component writes to the HDF5 log, as paths: per-round arrays and
        static datasets (``"submodel/levels"``) and group attributes (``"ecgr@storage"``).
        The composition test checks every run's log holds what its parts declare."""
        return []

    def log_arrays(self) -> dict[str, np.ndarray]:
        """Per-round arrays for the HDF5 log (rank 0)."""
        return {}


class TransformChain:
    """The enabled transforms of a run, applied in order at each point."""

    def __init__(self, transforms: Sequence[UpdateTransform] = ()) -> None:
        self.transforms = list(transforms)

    def __iter__(self):
        return iter(self.transforms)

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def setup(self, ctx: Context) -> None:
        for tr in self.transforms:
            tr.setup(ctx)

    def stats(self) -> list[Stat]:
        return [s for tr in self.transforms for s in tr.stats()]

    def before_training(self, task: ClientTask) -> ClientTask:
        for tr in self.transforms:
            task = tr.before_training(task)
        return task

    def wrap_hooks(self, hooks: StepHooks, task: ClientTask) -> StepHooks:
        for tr in self.transforms:
            hooks = tr.wrap_hooks(hooks, task)
        return hooks

    def on_delta(self, task: ClientTask, out: dict[str, torch.Tensor]) -> None:
        for tr in self.transforms:
            tr.on_delta(task, out)

    def on_upload(self, task: ClientTask, out: dict[str, torch.Tensor]) -> None:
        for tr in self.transforms:
            tr.on_upload(task, out)

    def log_outputs(self) -> list[str]:
        return [p for tr in self.transforms for p in tr.log_outputs()]

    def log_arrays(self) -> dict[str, np.ndarray]:
        return {k: v for tr in self.transforms for k, v in tr.log_arrays().items()}

    def get(self, name: str) -> Optional[UpdateTransform]:
        return next((tr for tr in self.transforms if tr.name == name), None)


#: name → class; a new transform is one module defining an :class:`UpdateTransform`
#: plus one ``register_transform`` line (built-ins: :mod:`fedmpi.transforms`).
TRANSFORMS: Registry = Registry(UpdateTransform, "transforms")


def register_transform(cls: type[UpdateTransform]) -> type[UpdateTransform]:
    """Register a transform class; it is built when ``cls.enabled(cfg)``, as ``cls(cfg)``."""
    return TRANSFORMS.register(cls)


def enabled_transforms(cfg) -> list[type[UpdateTransform]]:
    """The classes of the transforms ``cfg`` enables, in order: registered ones whose
    :meth:`~UpdateTransform.enabled` is true, then the ``transforms`` import paths."""
    chain = [cls for cls in TRANSFORMS.values() if cls.enabled(cfg)]
    return chain + [TRANSFORMS.lookup(path, f"transforms[{i}]")
                    for i, path in enumerate(cfg.transforms)]


def build_transforms(cfg) -> TransformChain:
    """The transforms ``cfg`` enables, built with the config (:func:`enabled_transforms`)."""
    return TransformChain([cls.build(cfg) for cls in enabled_transforms(cfg)])

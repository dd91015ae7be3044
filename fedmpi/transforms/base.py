"""Update transforms: stages composed around any method, with a client and a server half.

A transform sees a client's work at four points of the worker's client template
(:class:`fedmpi.runtime.worker.Worker`), in this order:

1. :meth:`UpdateTransform.before_training` — the task may be changed (label
   flipping) or refused (a simulated crash raises);
2. :meth:`UpdateTransform.wrap_hooks` — hooks inside the local loop (ECGR records
   every step; record-level DP replaces the batch sampler and the gradient);
3. :meth:`UpdateTransform.on_delta` — right after Δ_k = θ_k − θ is formed, before the
   method's ``finish_client`` (ECGR's herding selection);
4. :meth:`UpdateTransform.on_upload` — on the final upload, after the method wrote
   every statistic (ECGR's re-aggregated update; an adversary's corruption;
   client-level DP's clip).

Its server half runs on rank 0, in the *reverse* order of the client halves (the stage
that touched the upload last sees the aggregate first, as pfl-research's
postprocessors do):

5. :meth:`UpdateTransform.plan_round` — before a round is started: a reason to end the
   run instead (a privacy budget that the round would exceed);
6. :meth:`UpdateTransform.on_rows` — the per-client half, on the accepted clients' rows
   before the weighting and the server rule see them (the omniscient ALIE attack);
   a transform that needs it declares :meth:`UpdateTransform.needs_rows`;
7. :meth:`UpdateTransform.on_aggregate` — on the combined aggregate, before the
   method's server rule (DP-FedAvg's noise and fixed denominator);
8. :meth:`UpdateTransform.after_round` — after the server step, every round a client
   trained in (privacy accounting).

A transform may also encode the uplink sum (:meth:`UpdateTransform.codec`: secure
aggregation's masked ring elements), hand that codec the integer code its sums are
formed in (:meth:`UpdateTransform.sum_code`: the int8 uplink's shared-scale codes), send
each participant's upload to rank 0 as its own encoded message instead of summing it on the
worker (:meth:`UpdateTransform.payload_code`: bf16, top-k), declare that rank 0 may hold only sums
(:attr:`UpdateTransform.sums_only`), and refuse what it cannot be combined with
(:meth:`UpdateTransform.validate`, given the run's built parts).

Each transform declares its own uplink statistics (:meth:`stats`, e.g. ECGR's
``ecgr/selected`` row), reports what it logs through ``self.report``, owns its config
block (a top-level section named after it: ``ecgr.*``, ``adversary.*``; the privacy
stages read ``privacy.*``) and says whether a config turns it on
(:meth:`UpdateTransform.enabled`). A transform is one class registered in
:data:`TRANSFORMS`; the runtime builds the enabled ones in registration order (ECGR
before the adversary, so an attack corrupts what would really be uploaded; the privacy
stages last), then those listed by import path in ``transforms``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Protocol, Sequence

import numpy as np
import torch

from fedmpi.component import ClientTask, Component, Registry, RoundInfo, Stat
from fedmpi.training.loop import StepHooks

if TYPE_CHECKING:
    from fedmpi.config.core import Config


class SumCode(Protocol):
    """Integer codes of the clients' contributions, summed exactly in a ring 2^``bits``
    under an :class:`UplinkCodec` (the int8 uplink with secure aggregation,
    :class:`~fedmpi.transforms.ring.SharedScaleInt8`).

    Per round on every rank: ``begin``; ``take(client, x, weight)`` for each accepted
    client it hosts (the contribution is ``weight·x``); ``local_bound(size)`` → what the
    rank contributes to one ``MAX`` ``Allreduce``; ``agree(maximum)``; ``encode(out)`` →
    Σ of its clients' codes mod 2^bits into ``out``; rank 0: ``decode(centred, start)``
    → the float64 sum of the entries from ``start`` on.
    """

    bits: int

    def begin(self) -> None: ...

    def take(self, client: int, x: torch.Tensor, weight: float) -> None: ...

    def local_bound(self, size: int) -> np.ndarray: ...

    def agree(self, maximum: np.ndarray) -> None: ...

    def encode(self, out: np.ndarray) -> None: ...

    def decode(self, centred: torch.Tensor, start: int) -> torch.Tensor: ...


class UplinkCodec(Protocol):
    """How the summed uplink statistics travel when a transform encodes them (secure
    aggregation; the int8 uplink's ring): each rank seals its float64 partial sum into a ring buffer of
    ``wire_dtype`` (int64), the buffers are summed by one ``Reduce``, rank 0 opens the
    total.

    ``take(client, parts)``: True when the codec keeps a client's contribution itself
    (a :class:`SumCode`; the channel then adds nothing to the float64 partial sum);
    ``agreement(size)``: None, or an array every rank contributes to one ``MAX``
    ``Allreduce`` after the metadata ``Allreduce`` and before sealing
    (``on_agreement``); ``open(total, start)``: the entries from ``start`` on.

    ``handshake``/``on_handshake``: one ``Allreduce`` of an int64 array before the first
    round (secure aggregation's public keys; None: none). ``sums_exactly``: the opened sum
    is the same at any world size and rank layout (integer codes of each client, as the
    int8 uplink's), so ``runtime.reduction: exact`` keeps the codec's statistics reduced. ``begin(participants)``: a new round with
    that many participants; ``accepts(x, weight)``: whether a client's contribution
    ``weight·x`` decodes without wrapping (refused clients are excluded, never wrapped, and
    logged with ``refused_because``). With fewer than ``min_accepted`` accepted clients no
    rank seals anything: the clients' updates are withheld (``withheld_because``) and the
    round leaves the model unchanged.
    """

    refused_because: str
    min_accepted: int
    withheld_because: str
    wire_dtype: np.dtype
    sums_exactly: bool

    def handshake(self) -> Optional[np.ndarray]: ...

    def on_handshake(self, words: np.ndarray) -> None: ...

    def begin(self, participants: int) -> None: ...

    def accepts(self, x: torch.Tensor, weight: float) -> bool: ...

    def take(self, client: int, parts: Sequence[tuple[torch.Tensor, float]]) -> bool: ...

    def agreement(self, size: int) -> Optional[np.ndarray]: ...

    def on_agreement(self, agreed: np.ndarray) -> None: ...

    def seal(self, partial: torch.Tensor, t: int, mine: Sequence[int], accepted: Sequence[int],
             out: np.ndarray) -> None: ...

    def open(self, total: np.ndarray, start: int = 0) -> torch.Tensor: ...


class PayloadCode(Protocol):
    """Each accepted participant's encoded statistic travels to rank 0 as its own message
    of :attr:`nbytes` bytes (the bf16 and top-k uplinks,
    :class:`~fedmpi.transforms.compression.EncodedPayloads`), decoded there.

    A worker: ``begin`` per round; ``take(client, x)`` keeps client k's encoded x_k (one
    buffer per client it trains in the round); ``payload(client)`` is that message.
    Rank 0: ``buffer()`` is its one receive buffer; ``add(acc, payload, weight)`` adds
    weight·decode(payload) to the float64 ``acc`` (on the CPU), client after client in
    id order: the same bits at any world size.
    """

    nbytes: int

    def begin(self) -> None: ...

    def take(self, client: int, x: torch.Tensor) -> None: ...

    def payload(self, client: int) -> np.ndarray: ...

    def buffer(self) -> np.ndarray: ...

    def add(self, acc: torch.Tensor, payload: np.ndarray, weight: float) -> None: ...


@dataclass(frozen=True)
class RunParts:
    """The run's built parts, for the rules that span them (:meth:`UpdateTransform.validate`)."""

    cfg: Config
    algorithm: Any               # the method (fedmpi.methods.base.Algorithm)
    weighting: Any               # fedmpi.aggregation.weighting.Weighting
    rule: Any                    # fedmpi.aggregation.rules.ServerRule
    transforms: tuple[Any, ...]  # the enabled UpdateTransforms, in order
    stats: tuple[Stat, ...]      # every uplink statistic (the method's, then the transforms')
    model: torch.nn.Module
    world_size: int


class UpdateTransform(Component):
    """Base of an update transform (every hook is optional; see the module docstring).

    Built with the run's config, ``cls(cfg)``. Its block ``<name>`` gives the
    top-level keys ``<name>.*``.
    """

    name: ClassVar[str] = "transform"
    prefix: ClassVar[str] = ""
    #: True: the transform rewrites the whole update after the method's ``finish_client``
    #: (ECGR), so it cannot run with a method whose upload is masked (the submodel family)
    rewrites_update: ClassVar[bool] = False
    #: True: rank 0 may hold only sums over the accepted clients (secure aggregation);
    #: every part that needs one client's statistics on rank 0 is refused
    sums_only: ClassVar[bool] = False
    #: the key that turns it on (named in errors about combinations)
    enable_key: ClassVar[str] = "transforms"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @classmethod
    def enabled(cls, cfg: Config) -> bool:
        """Whether ``cfg`` turns this registered transform on (ECGR: ``ecgr.enabled``)."""
        return False

    @classmethod
    def build(cls, cfg: Config) -> UpdateTransform:
        """The transform of this run (default ``cls(cfg)``)."""
        return cls(cfg)

    @property
    def needs_rows(self) -> bool:
        """Whether rank 0 must hold every accepted client's weighted statistics as rows
        (:meth:`on_rows` rewrites them). Default: no."""
        return False

    def validate(self, parts: RunParts) -> None:
        """Refuse (:class:`~fedmpi.errors.ConfigError` naming the keys) a combination of
        the run's built parts this transform cannot work with. Default: none."""

    def codec(self, hosted: Sequence[int], num_clients: int,
              code: Optional[SumCode] = None) -> Optional[UplinkCodec]:
        """The encoding of the uplink sums this transform imposes (None: plain float64),
        summing ``code``'s integers when another stage hands one (:meth:`sum_code`)."""
        return None

    def sum_code(self) -> Optional[SumCode]:
        """The integer code in which this stage's encoded uploads are summed under another
        stage's :meth:`codec` (None: none; the codec's own fixed point)."""
        return None

    def payload_code(self) -> Optional[PayloadCode]:
        """The encoding in which each participant's summed upload travels to rank 0 as its
        own message, decoded there (None: summed on the workers)."""
        return None

    def stats(self) -> list[Stat]:
        """Uplink statistics this transform adds (after the method's own)."""
        return []

    def client_stores(self, make: Callable[[str, int], Any]) -> None:
        """Make the per-client vectors this stage keeps on the worker with ``make(name,
        size)`` (the method's :meth:`~fedmpi.methods.base.Algorithm.client_store`, so
        checkpoints carry them by client id). Default: none."""

    def traffic(self, up: int, down: int) -> tuple[int, int]:
        """(uplink, downlink) bytes one participant moves once this stage encoded its
        upload, from those before it (default: unchanged)."""
        return up, down

    def received(self, state: torch.Tensor) -> torch.Tensor:
        """On a rank with participants, once per round: θ as its clients receive it (a
        lossy downlink decodes it; default: ``state`` itself, never modified in place)."""
        return state

    # ------------------------------------------------------------- client half
    def before_training(self, task: ClientTask) -> ClientTask:
        return task

    def wrap_hooks(self, hooks: StepHooks, task: ClientTask) -> StepHooks:
        return hooks

    def on_delta(self, task: ClientTask, out: dict[str, torch.Tensor]) -> None:
        """``out["delta"]`` holds θ_k − θ; the method's own statistics are not written yet."""

    def on_upload(self, task: ClientTask, out: dict[str, torch.Tensor]) -> None:
        """Every statistic of ``out`` is final; rewrite what is uploaded."""

    # ------------------------------------------------------------- server half
    def plan_round(self, round: int, participants: np.ndarray) -> Optional[str]:
        """Rank 0, before round ``round`` with these participants: a reason to end the run
        (completed) instead of starting it, or None."""
        return None

    def on_rows(self, state: torch.Tensor, rows: dict[str, torch.Tensor],
                info: RoundInfo) -> list[int]:
        """Rank 0, when :attr:`needs_rows`: rewrite the accepted clients' weighted rows
        (name → ``[n, size]``, row i of ``info.clients[i]``) in place before the weighting
        and the server rule see them; returns the clients whose rows changed."""
        return []

    def on_aggregate(self, agg: dict[str, torch.Tensor], info: RoundInfo) -> None:
        """Rank 0: the round's combined aggregate (name → ``[size]``), in place, before the
        method's server rule applies it."""

    def after_round(self, info: RoundInfo) -> None:
        """Rank 0, after the server step of a round in which clients trained (accepted or
        not: ``info.participants``)."""


class TransformChain:
    """The enabled transforms of a run: client halves in order, server halves reversed."""

    def __init__(self, transforms: Sequence[UpdateTransform] = ()) -> None:
        self.transforms = list(transforms)

    def __iter__(self):
        return iter(self.transforms)

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def stats(self) -> list[Stat]:
        return [s for tr in self.transforms for s in tr.stats()]

    def client_stores(self, make: Callable[[str, int], Any]) -> None:
        for tr in self.transforms:
            tr.client_stores(make)

    def traffic(self, up: int, down: int) -> tuple[int, int]:
        for tr in self.transforms:
            up, down = tr.traffic(up, down)
        return up, down

    def received(self, state: torch.Tensor) -> torch.Tensor:
        for tr in self.transforms:
            state = tr.received(state)
        return state

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

    @property
    def needs_rows(self) -> bool:
        return any(tr.needs_rows for tr in self.transforms)

    def codec(self, hosted: Sequence[int], num_clients: int) -> Optional[UplinkCodec]:
        codes = [c for c in (tr.sum_code() for tr in self.transforms) if c is not None]
        assert len(codes) <= 1, "one transform codes the uplink sums"
        code = codes[0] if codes else None
        codecs = [c for c in (tr.codec(hosted, num_clients, code) for tr in self.transforms)
                  if c is not None]
        assert len(codecs) <= 1, "one transform encodes the uplink sums"
        return codecs[0] if codecs else None

    def payload_code(self) -> Optional[PayloadCode]:
        codes = [c for c in (tr.payload_code() for tr in self.transforms) if c is not None]
        assert len(codes) <= 1, "one transform encodes the uplink messages"
        return codes[0] if codes else None

    def plan_round(self, round: int, participants: np.ndarray) -> Optional[str]:
        for tr in reversed(self.transforms):
            reason = tr.plan_round(round, participants)
            if reason:
                return reason
        return None

    def on_rows(self, state: torch.Tensor, rows: dict[str, torch.Tensor],
                info: RoundInfo) -> list[int]:
        changed: list[int] = []
        for tr in reversed(self.transforms):
            if tr.needs_rows:
                changed += [k for k in tr.on_rows(state, rows, info) if k not in changed]
        return changed

    def on_aggregate(self, agg: dict[str, torch.Tensor], info: RoundInfo) -> None:
        for tr in reversed(self.transforms):
            tr.on_aggregate(agg, info)

    def after_round(self, info: RoundInfo) -> None:
        for tr in reversed(self.transforms):
            tr.after_round(info)

    def get(self, name: str) -> Optional[UpdateTransform]:
        return next((tr for tr in self.transforms if tr.name == name), None)


#: name → class; a new transform is one module defining an :class:`UpdateTransform`
#: plus one ``register_transform`` line (built-ins: :mod:`fedmpi.transforms`).
TRANSFORMS: Registry = Registry(UpdateTransform, "transforms")


def register_transform(cls: type[UpdateTransform]) -> type[UpdateTransform]:
    """Register a transform class; it is built when ``cls.enabled(cfg)``, as ``cls(cfg)``."""
    return TRANSFORMS.register(cls)


def enabled_transforms(cfg: Config) -> list[type[UpdateTransform]]:
    """The classes of the transforms ``cfg`` enables, in order: registered ones whose
    :meth:`~UpdateTransform.enabled` is true, then the ``transforms`` import paths."""
    chain = [cls for cls in TRANSFORMS.values() if cls.enabled(cfg)]
    return chain + [TRANSFORMS.lookup(path, f"transforms[{i}]")
                    for i, path in enumerate(cfg.transforms)]


def build_transforms(cfg: Config) -> TransformChain:
    """The transforms ``cfg`` enables, built with the config (:func:`enabled_transforms`)."""
    return TransformChain([cls.build(cfg) for cls in enabled_transforms(cfg)])

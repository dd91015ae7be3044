"""Personal parameters: trained at their site, never exchanged (docs/personalisation.md).

Which parameters and float buffers are personal is the union of what the method declares
(:meth:`fedmpi.methods.base.Algorithm.personal_names`: FedBN's normalisation layers,
FedPer's and FedRep's head) and the name patterns of ``personal.params``
(:func:`fnmatch.fnmatchcase`, e.g. ``"fc2.*"``). :class:`~fedmpi.training.flat.FlatModel`
keeps them outside the exchanged vector, exactly as it keeps frozen parameters, so no
message, aggregate, checkpointed global state or logged byte count contains them; the
local loop trains them with the rest (:attr:`FlatModel.train_params`).

Each client's personal part lives on the worker hosting it, in the method's per-client
store ``personal`` (:class:`PersonalParts`), which checkpoints gather and resumes scatter
by client id under the current rank layout (:mod:`fedmpi.job.client_states`). A client
starts from the initial model's personal part (the same on every rank: the seed builds
it). Between client trainings the rank's model holds that initial part, so the global
model that rank 0 evaluates and writes is the shared part with the *initial* personal
part, whatever the world size.
"""
from __future__ import annotations

from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Callable, Iterable, Optional

import torch
from torch import nn

from fedmpi.errors import ConfigError

if TYPE_CHECKING:
    from fedmpi.config.core import Config
    from fedmpi.methods.base import Algorithm, ClientVectors
    from fedmpi.training.flat import FlatModel

#: module types whose parameters and running statistics FedBN keeps local
NORM_LAYERS: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase, nn.GroupNorm,
                                            nn.LayerNorm)


def named_state(model: nn.Module) -> list[str]:
    """The names a personal declaration may pick: trainable parameters and float buffers."""
    return [n for n, p in model.named_parameters() if p.requires_grad] + \
        [n for n, b in model.named_buffers() if b.is_floating_point()]


def matching(model: nn.Module, patterns: Iterable[str], key: str = "personal.params") -> set[str]:
    """The trainable parameters and float buffers whose names match a pattern; a pattern
    that matches none is bad input (ConfigError naming ``key``)."""
    names = named_state(model)
    out: set[str] = set()
    for pat in patterns:
        hit = {n for n in names if fnmatchcase(n, pat)}
        if not hit:
            raise ConfigError(f"config key {key!r}: {pat!r} matches no trainable parameter or "
                              f"float buffer of the model (names such as "
                              f"{', '.join(names[-3:])})")
        out |= hit
    return out


def norm_layer_names(model: nn.Module) -> set[str]:
    """Every parameter and float buffer of the model's normalisation layers (FedBN)."""
    out: set[str] = set()
    for prefix, module in model.named_modules():
        if isinstance(module, NORM_LAYERS):
            for n, t in [*module.named_parameters(recurse=False),
                         *module.named_buffers(recurse=False)]:
                if t.is_floating_point():
                    out.add(f"{prefix}.{n}" if prefix else n)
    return out


def head_names(model: nn.Module, layers: int) -> set[str]:
    """The parameters of the last ``layers`` modules that hold parameters of their own
    (FedPer/FedRep's "head": for an MLP or CNN the final linear layer(s))."""
    owners = [(prefix, m) for prefix, m in model.named_modules()
              if any(True for _ in m.parameters(recurse=False))]
    out: set[str] = set()
    for prefix, m in owners[-layers:]:
        for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]:
            if t.is_floating_point():
                out.add(f"{prefix}.{n}" if prefix else n)
    return out


class PersonalParts:
    """The personal parts of the clients hosted by this rank, and the swap in and out of
    the rank's model around each client's training (on the worker)."""

    def __init__(self, flat: FlatModel,
                 store: Callable[[str, int], ClientVectors]) -> None:
        self.size = flat.personal_size
        self.initial = flat.personal_state()     # every client starts here
        self.parts = store("personal", self.size)

    def of(self, client: int) -> torch.Tensor:
        """Client ``client``'s personal part (the initial one before its first training)."""
        part = self.parts.get(client)
        return self.initial if part is None else part

    def enter(self, client: int, flat: FlatModel) -> None:
        """Load client ``client``'s personal part into the model, before it trains."""
        flat.load_personal(self.of(client).to(flat.device))

    def leave(self, client: int, flat: FlatModel) -> None:
        """Keep the trained personal part (unless NaN/±inf: the client keeps its previous
        one, as its update is excluded) and put the initial one back."""
        part = flat.personal_state()
        if bool(torch.isfinite(part).all()):
            self.parts[client] = part
        flat.load_personal(self.initial.to(flat.device))


class ClientModels:
    """Each hosted client's own model, as the worker and the per-site evaluation use it:
    the method's one personalisation seam (:meth:`~fedmpi.methods.base.Algorithm.client_models`).

    By default it serves personal parameters (``parts``; None: nothing is personal, every
    call is a no-op and :meth:`load` says False). A method with a personal *model* of its
    own (Ditto's v_k, APFL's mixture) passes ``load``, which puts client k's model, given
    the global state, into ``flat`` for its evaluation."""

    def __init__(self, parts: Optional[PersonalParts],
                 load: Optional[Callable[[int, torch.Tensor, FlatModel], None]] = None) -> None:
        self.parts, self._load = parts, load

    def enter(self, client: int, flat: FlatModel) -> None:
        """Worker, before ``client`` trains on ``flat``: load its personal part."""
        if self.parts is not None:
            self.parts.enter(client, flat)

    def leave(self, client: int, flat: FlatModel) -> None:
        """Worker, after ``client`` trained: keep its personal part, reset the model's."""
        if self.parts is not None:
            self.parts.leave(client, flat)

    def load(self, client: int, state: torch.Tensor, flat: FlatModel) -> bool:
        """Hosted client ``client``'s personal model, given the global ``state``, into
        ``flat`` for its evaluation; False when the method gives clients none. Default:
        the global state with the client's personal parameters; :meth:`reset` puts the
        initial ones back."""
        if self._load is not None:
            self._load(client, state, flat)
            return True
        if self.parts is None:
            return False
        flat.load(state)
        self.parts.enter(client, flat)
        return True

    def reset(self, flat: FlatModel) -> None:
        """After :meth:`load`'s evaluation: the model's personal part back to the initial
        one."""
        if self.parts is not None:
            flat.load_personal(self.parts.initial.to(flat.device))


def check(cfg: Config, method: type[Algorithm]) -> None:
    """What personal parameters and personal models do not compose with, refused with one
    line naming both keys (docs/personalisation.md, "Composition"). Secure aggregation,
    client-level DP, robust rules and compression compose: they see only the exchanged
    vector, which holds no personal entry."""
    spec = method.spec_for(cfg)
    declared = list(cfg.personal.params)
    if not (spec.personal or declared):
        return
    name = cfg.algorithm.name
    key = "'algorithm.name'" if spec.personal else "'personal.params'"
    if declared and spec.personal and spec.own_loss:   # Ditto, APFL
        raise ConfigError(f"config keys 'personal.params' and 'algorithm.name': {name!r} keeps "
                          "a whole personal model per client; personal parameters do not apply")
    if cfg.privacy.dp.level == "record":
        raise ConfigError(f"config keys 'privacy.dp.level' and {key}: DP-SGD clips and noises "
                          "the exchanged parameters' per-sample gradients only; personal "
                          "parameters would train outside it (use privacy.dp.level: client)")
    if cfg.runtime.ranks_per_silo > 1:
        raise ConfigError(f"config keys 'runtime.ranks_per_silo' and {key}: a personal part is "
                          "kept by the rank hosting the client, not shared among a silo's "
                          "ranks; use runtime.ranks_per_silo: 1")

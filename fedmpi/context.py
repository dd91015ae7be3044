"""What a method, a weighting or an update transform may see of the run.

The runtime builds one frozen :class:`Context` per rank and hands it to
``setup(ctx)`` of the method (:class:`~fedmpi.methods.base.Algorithm`), the
weighting and every update transform, and to the few later calls that need
the run (a method's own evaluation, ``after_resume``). Nothing else of the
runtime is visible to them: no communicator, no buffers, no round driver.

A method that needs a collective after a resume gets exactly one:
:attr:`Context.broadcast` (rank 0's buffer to every rank, in place).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal, Mapping, Optional

import numpy as np
import torch

from fedmpi.log.row import Reports

if TYPE_CHECKING:  # imported for annotations only: no import cycle at run time
    from fedmpi.training.accel import Accel
    from fedmpi.config.core import Config
    from fedmpi.data.base import Dataset
    from fedmpi.data.partition import Partition
    from fedmpi.training.flat import FlatModel


@dataclass(frozen=True)
class Context:
    """One rank's view of the run, for methods, weightings and transforms.

    Attributes:
        cfg: the validated run configuration.
        device: the training device of this rank.
        role: ``"server"`` on rank 0 (aggregates, evaluates, writes the log),
            ``"worker"`` elsewhere; with world size 1 rank 0 is both, and
            :attr:`hosted` says which clients it trains.
        rank, world_size: this rank and the number of ranks.
        num_samples: n_k of every client (read-only), known on every rank.
        hosted: the clients this rank trains (fixed for the run).
        flat: the rank's model as one flat vector (:class:`~fedmpi.training.flat.FlatModel`).
        forward: the model's forward (compiled when ``runtime.compile``).
        accel: the autocast/channels-last switches of the forward.
        data, partition: the rank's data and the client partition.
        reports: where this rank's components report what they log
            (:class:`~fedmpi.log.row.Reports`; each component reports through its own
            ``component.report``, set by :func:`fedmpi.component.start`).
        broadcast: the one collective a method may use (rank 0 → all, in place);
            every rank must call it the same number of times.
        participants: round t's participant mask (the same on every rank).
        test: ``test(state, part=slice(None), collect=None)`` — (Σ loss, #correct,
            n) of a flat state vector on the test set (or the slice ``part`` of it),
            through the run's forward, evaluation batch size and evaluated logits;
            ``collect`` (a :class:`fedmpi.metrics.Collector`) sees each batch.
        client_weight: w̃_k, the weighting's unnormalised weight of client k
            (None for weightings that score clients on rank 0).
        model_delta_scale: the method's c_k with θ_k − θ = c_k·u_k on the parameters,
            from client k's statistics (1 for most methods; FedNova: a_k), so a
            per-client weighting can score the client model θ_k (FedVG Eq. 4).
    """

    cfg: Config
    device: torch.device
    role: Literal["server", "worker"]
    rank: int
    world_size: int
    num_samples: np.ndarray
    hosted: tuple[int, ...]
    flat: FlatModel
    forward: Callable[[torch.Tensor], torch.Tensor]
    accel: Accel
    data: Dataset
    partition: Partition
    reports: Reports = field(default_factory=Reports)
    broadcast: Callable[[np.ndarray, str], None] = field(default=lambda buf, what="": None)
    participants: Callable[[int], np.ndarray] = field(
        default=lambda t: np.zeros(0, dtype=bool))
    test: Callable[..., tuple[float, float, float]] = field(
        default=lambda state, part=slice(None), collect=None: (float("nan"), float("nan"), 0.0))
    client_weight: Optional[Callable[[int], float]] = None
    model_delta_scale: Callable[[Mapping[str, torch.Tensor]], float] = field(
        default=lambda stats: 1.0)

    @property
    def is_server(self) -> bool:
        return self.role == "server"

    @property
    def num_clients(self) -> int:
        return int(self.num_samples.shape[0])

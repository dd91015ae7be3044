r"""Privacy accounting of a run by Google's ``dp-accounting`` (the ``.[privacy]`` extra).

No accounting is written here: this module only says *which* DP event one
round is and asks the library for ε at the configured δ.

**Client level** (DP-FedAvg, McMahan et al. 2018). A round samples a fixed
number m = ``train.clients_per_round`` of the K = ``data.num_clients`` clients
uniformly *without replacement* (:func:`fedmpi.runtime.build.participants`),
each sampled client's update is clipped to norm C and the sum carries Gaussian
noise of std σC. Fixed-size sampling is accounted as such, not as Poisson
sampling: one round is

    ``SampledWithoutReplacementDpEvent(K, m, GaussianDpEvent(σ/2))``

under the *replace-one* neighbouring relation (Wang, Balle, Kasiviswanathan
2019, Thm. 27; the relation that fixed-size sampling needs, K public). Replacing
one client moves the clipped sum by up to 2C, so the noise multiplier relative
to that sensitivity is σC / 2C = σ/2. With m = K (everyone, every round) the
round is ``GaussianDpEvent(σ/2)`` under the same relation. R rounds compose R
times. Only the RDP accountant implements sampling without replacement;
``pld`` is accepted for m = K only (config check).

**Record level** (DP-SGD, Abadi et al. 2016, inside each silo). Silo k draws
Poisson batches: every sample of its n_k joins a step's batch with probability
q_k = min(1, B/n_k), B = ``train.batch_size``, and the clipped per-sample sum
carries noise σC. One step is ``PoissonSampledDpEvent(q_k, GaussianDpEvent(σ))``
under add-or-remove-one; a silo composes τ_k steps in every round it trains
(its actual step count from the round's metadata). ε is per silo; the run's ε
is the largest over silos.

ε is recomputed each round from the *counts* (rounds, or steps per silo) by a
fresh accountant composing the round's event ``count`` times: ε is a function of
the counts alone, so the counts are the whole checkpointed state and a resumed
run reports the very ε of an uninterrupted one.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from fedmpi.errors import ConfigError
from fedmpi.privacy import absl_quiet
from fedmpi.privacy.dpsgd import poisson_rate   # the sampler's own rate: accounted = sampled

if TYPE_CHECKING:
    from fedmpi.config.core import Config

EXTRA_HINT = "pip install 'fedmpi[privacy]'"


def dp_accounting() -> Any:
    """The ``dp_accounting`` package, or a one-line ConfigError naming the extra."""
    try:
        import dp_accounting as dpa
    except ImportError:
        raise ConfigError(f"config key 'privacy.dp.level' needs the dp-accounting package "
                          f"({EXTRA_HINT})") from None
    absl_quiet.install()   # its harmless RDP non-convergence warning only
    return dpa


def client_round_event(num_clients: int, per_round: int, noise_multiplier: float) -> Any:
    """One DP-FedAvg round: fixed-size sampling of ``per_round`` of ``num_clients``, the
    Gaussian sum with sensitivity 2C under replace-one (see module docstring)."""
    dpa = dp_accounting()
    gauss = dpa.GaussianDpEvent(noise_multiplier / 2.0)
    if per_round >= num_clients:
        return gauss
    return dpa.SampledWithoutReplacementDpEvent(num_clients, per_round, gauss)


def record_step_event(sampling_probability: float, noise_multiplier: float) -> Any:
    """One DP-SGD step of a silo: Poisson sampling with probability q, Gaussian noise σ."""
    dpa = dp_accounting()
    return dpa.PoissonSampledDpEvent(sampling_probability, dpa.GaussianDpEvent(noise_multiplier))


class Accountant:
    """ε of the run so far (rank 0): counts of composed events, ε from dp-accounting.

    Args:
        level: ``client`` or ``record``.
        kind: ``rdp`` or ``pld``.
        noise_multiplier: σ; 0 gives ε = ∞ once anything is composed.
        delta: δ at which ε is reported.
        num_clients: K.
        per_round: m, participants per round.
        rates: record level: q_k of every silo (:func:`poisson_rate`).
    """

    def __init__(self, level: str, kind: str, noise_multiplier: float, delta: float,
                 num_clients: int, per_round: int, rates: Optional[np.ndarray] = None) -> None:
        dp_accounting()   # fail at set-up, not in round 1, when the extra is missing
        self.level, self.kind = level, kind
        self.sigma, self.delta = float(noise_multiplier), float(delta)
        self.K, self.m = int(num_clients), int(per_round)
        self.rates = np.asarray(rates if rates is not None else np.ones(self.K), dtype=np.float64)
        self.rounds = 0                                   # client level: rounds composed
        self.steps = np.zeros(self.K, dtype=np.int64)     # record level: steps per silo
        self._cache: dict[tuple[int, int], float] = {}
        self._curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}   # RDP of one event

    @classmethod
    def from_config(cls, cfg: Config, num_samples: np.ndarray) -> "Accountant":
        d = cfg.privacy.dp
        K = cfg.data.num_clients
        rates = np.array([poisson_rate(int(n), cfg.train.batch_size) for n in num_samples])
        return cls(d.level, d.accountant, d.noise_multiplier, d.delta, K,
                   cfg.train.clients_per_round or K, rates)

    # ----------------------------------------------------------------- ε
    def _epsilon(self, event: Any, count: int) -> float:
        if count == 0:
            return 0.0
        if self.sigma == 0.0:
            return math.inf
        dpa = dp_accounting()
        if self.kind == "pld":
            from dp_accounting import pld

            acc: Any = pld.PLDAccountant(self._relation(dpa))
            acc.compose(event, count)
            return float(acc.get_epsilon(self.delta))
        from dp_accounting import rdp

        # RDP composes additively: ``RdpAccountant.compose(event, count)`` adds count × the
        # event's RDP curve. The curve (the costly part: fractional orders of a subsampled
        # Gaussian) is computed once per event and scaled here by the library's own
        # conversion (``compute_epsilon``), which gives the very bits of composing anew.
        key = repr(event)
        curve = self._curves.get(key)
        if curve is None:
            acc = rdp.RdpAccountant(neighboring_relation=self._relation(dpa))
            acc.compose(event, 1)
            orders, one = getattr(acc, "_orders", None), getattr(acc, "_rdp", None)
            if orders is None or one is None:   # a dp-accounting without them: compose anew
                acc = rdp.RdpAccountant(neighboring_relation=self._relation(dpa))
                acc.compose(event, count)
                return float(acc.get_epsilon(self.delta))
            curve = self._curves[key] = (np.asarray(orders), np.asarray(one, dtype=np.float64))
        orders, one = curve
        eps, _ = rdp.rdp_privacy_accountant.compute_epsilon(orders, count * one, self.delta)
        return float(eps)

    def _relation(self, dpa: Any) -> Any:
        rel = dpa.NeighboringRelation
        return rel.REPLACE_ONE if self.level == "client" else rel.ADD_OR_REMOVE_ONE

    def client_epsilon(self, client: int, steps: int) -> float:
        """ε of silo ``client`` after ``steps`` DP-SGD steps (record level)."""
        key = (client, int(steps))
        if key not in self._cache:
            self._cache[key] = self._epsilon(
                record_step_event(float(self.rates[client]), self.sigma), int(steps))
        return self._cache[key]

    def epsilon_after(self, rounds: int = 0, steps: Optional[np.ndarray] = None) -> float:
        """ε if ``rounds`` more rounds (client) or ``steps`` more steps per silo (record)
        were composed now; with no argument, ε so far."""
        if self.level == "client":
            return self._epsilon(client_round_event(self.K, self.m, self.sigma),
                                 self.rounds + int(rounds))
        total = self.steps + (steps if steps is not None else 0)
        return max((self.client_epsilon(k, int(total[k])) for k in range(self.K)), default=0.0)

    @property
    def epsilon(self) -> float:
        """ε of the run so far (record level: the largest over silos)."""
        return self.epsilon_after()

    def per_client(self) -> np.ndarray:
        """[K] ε of every silo so far (record level; NaN at client level)."""
        if self.level == "client":
            return np.full(self.K, np.nan)
        return np.array([self.client_epsilon(k, int(self.steps[k])) for k in range(self.K)])

    # ------------------------------------------------------------ update
    def record_round(self, trained: np.ndarray, steps: np.ndarray) -> None:
        """Compose one round: ``trained`` [K] bool (participants that ran local training),
        ``steps`` [K] their local step counts τ_k (record level)."""
        if self.level == "client":
            self.rounds += 1
        else:
            self.steps += np.where(trained, np.asarray(steps, dtype=np.int64), 0)

    # ------------------------------------------------------------- state
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The counts; ε is a function of them (module docstring)."""
        return {"rounds": torch.tensor(self.rounds, dtype=torch.int64),
                "steps": torch.from_numpy(self.steps.copy())}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        steps = state["steps"].cpu().numpy().astype(np.int64)
        if steps.shape != (self.K,):
            raise ValueError(f"privacy accountant: {steps.shape[0]} silos in the checkpoint, "
                             f"{self.K} in this run")
        if int(state["rounds"]) < 0 or (steps < 0).any():
            raise ValueError("privacy accountant: negative counts")
        self.rounds = int(state["rounds"])
        self.steps = steps

"""The run's privacy budget on rank 0: ε per round into the log, the stop before the target.

Each round composes what it spent (:class:`~fedmpi.privacy.accountant.Accountant`)
and logs ε at δ as ``/rounds/epsilon`` (record level: the largest over silos,
and every silo's as ``/clients/epsilon``). Before a round starts,
:meth:`Budget.exceeded_by` asks what ε *would be* after it (its participants are
known: sampling is seeded by (seed, round)); if that exceeds
``privacy.target_epsilon`` the run stops there, status ``completed``, with the
reason in the log (root attribute ``stop_reason`` and an event): the budget is
never exceeded.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from fedmpi.privacy.accountant import Accountant


class Budget:
    """Accountant + target of one run (rank 0).

    Args:
        accountant: counts and ε.
        target: ``privacy.target_epsilon`` or None.
        steps_of: record level: τ_k of client k in a round (to foresee the next round).
    """

    def __init__(self, accountant: Accountant, target: Optional[float],
                 steps_of: Callable[[int], int]) -> None:
        self.accountant, self.target, self.steps_of = accountant, target, steps_of

    @classmethod
    def from_config(cls, cfg, num_samples: np.ndarray) -> "Budget":
        from fedmpi.training.loop import sgd_config
        from fedmpi.training.loop import num_local_steps

        sgd = sgd_config(cfg)
        return cls(Accountant.from_config(cfg, num_samples), cfg.privacy.target_epsilon,
                   lambda k: num_local_steps(int(num_samples[k]), sgd))

    def exceeded_by(self, mask: np.ndarray) -> Optional[str]:
        """Why the round with participants ``mask`` must not run (ε would pass the
        target), or None."""
        if self.target is None:
            return None
        acc = self.accountant
        if acc.level == "client":
            eps = acc.epsilon_after(rounds=1)
        else:
            eps = acc.epsilon_after(steps=np.array([self.steps_of(k) if mask[k] else 0
                                                    for k in range(acc.K)], dtype=np.int64))
        if eps <= self.target:
            return None
        return (f"privacy budget: the next round would take epsilon to {eps:.4g} > "
                f"privacy.target_epsilon {self.target:g} (delta {acc.delta:g}); stopped at "
                f"epsilon {acc.epsilon:.4g}")

    def record_round(self, trained: np.ndarray, steps: np.ndarray) -> tuple[dict, dict]:
        """Compose the round; returns its log scalars and per-client arrays."""
        acc = self.accountant
        acc.record_round(trained, steps)
        per_client = {} if acc.level == "client" else {"epsilon": acc.per_client()}
        return {"epsilon": acc.epsilon}, per_client

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.accountant.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.accountant.load_state_dict(state)

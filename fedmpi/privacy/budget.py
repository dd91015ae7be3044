"""The accountant and the budget of a differentially private run, as a server stage.

:class:`AccountedStage` is the server half both DP levels share (client level:
:class:`~fedmpi.privacy.client_dp.ClientDP`, record level:
:class:`~fedmpi.privacy.record_dp.RecordDP`). After every round in which clients trained
it composes what they spent (:class:`~fedmpi.privacy.accountant.Accountant`) and reports
ε at δ as ``/rounds/epsilon`` (record level: the largest over silos, and every silo's as
``/clients/epsilon``). Before a round starts, :meth:`AccountedStage.plan_round` asks what
ε *would be* after it (its participants are known: sampling is seeded by (seed, round));
if that exceeds ``privacy.target_epsilon`` the run stops there, status ``completed``,
with the reason in the log (root attribute ``stop_reason`` and an event): the budget is
never exceeded. The accountant's counts are the stage's checkpointed state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Optional

import numpy as np
import torch

from fedmpi.component import RoundInfo
from fedmpi.errors import ConfigError
from fedmpi.privacy.accountant import Accountant
from fedmpi.training.loop import num_local_steps, sgd_config
from fedmpi.transforms.base import UpdateTransform

if TYPE_CHECKING:
    from fedmpi.config.core import Config


class AccountedStage(UpdateTransform):
    """Rank 0's accountant and ``privacy.target_epsilon`` (module docstring)."""

    enable_key: ClassVar[str] = "privacy.dp.level"
    final_scalars: ClassVar[tuple[str, ...]] = ("epsilon",)
    level: ClassVar[str] = ""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        d = cfg.privacy.dp
        self.clip, self.sigma = float(d.clip), float(d.noise_multiplier)   # C and σ

    @classmethod
    def enabled(cls, cfg: Config) -> bool:
        return bool(cfg.privacy.dp.level == cls.level)

    def setup(self, ctx) -> None:
        """Rank 0 keeps the accountant; every rank refuses a budget that cannot afford the
        run's first round (it would end at once with an untrained model)."""
        sgd = sgd_config(ctx.cfg)
        num_samples = ctx.num_samples
        self.target = ctx.cfg.privacy.target_epsilon
        self.steps_of = lambda k: num_local_steps(int(num_samples[k]), sgd)
        self.participants = ctx.participants
        self.accountant: Optional[Accountant] = Accountant.from_config(ctx.cfg, num_samples)
        if self.target is not None:
            first = self.plan_round(0, ctx.participants(0))
            if first is not None:
                d = ctx.cfg.privacy.dp
                why = ("privacy.dp.noise_multiplier 0 gives no privacy (epsilon is infinite)"
                       if d.noise_multiplier == 0 else first.split("; stopped")[0])
                raise ConfigError(f"config key 'privacy.target_epsilon' ({self.target:g}) cannot "
                                  f"afford the first round: {why}")
        if not ctx.is_server:
            self.accountant = None

    def plan_round(self, round: int, participants: np.ndarray) -> Optional[str]:
        """Why the round with ``participants`` must not run (ε would pass the target)."""
        acc = self.accountant
        if acc is None or self.target is None:
            return None
        if acc.level == "client":
            eps = acc.epsilon_after(rounds=1)
        else:
            eps = acc.epsilon_after(steps=np.array([self.steps_of(k) if participants[k] else 0
                                                    for k in range(acc.K)], dtype=np.int64))
        if eps <= self.target:
            return None
        return (f"privacy budget: the next round would take epsilon to {eps:.4g} > "
                f"privacy.target_epsilon {self.target:g} (delta {acc.delta:g}); stopped at "
                f"epsilon {acc.epsilon:.4g}")

    def after_round(self, info: RoundInfo) -> None:
        """Every participant trained, accepted or not: all of them spent privacy."""
        acc = self.accountant
        assert acc is not None, "rank 0 accounts"
        acc.record_round(info.participants, info.participant_steps)
        self.report.scalar("epsilon", acc.epsilon)
        if acc.level != "client":
            self.report.clients("epsilon", acc.per_client())

    def check_restored(self, round: int, history: list[dict]) -> Optional[str]:
        """The restored counts are those of rounds < ``round`` (client level: ``round``
        rounds; record level: τ_k for every round client k took part in), and their ε is the
        one the log holds for the last of those rounds."""
        acc = self.accountant
        if acc is None:
            return None
        if acc.level == "client":
            if acc.rounds != round:
                return (f"the privacy accountant counts {acc.rounds} rounds but the checkpoint "
                        f"covers {round}")
        else:
            steps = np.zeros(acc.K, dtype=np.int64)
            for r in range(round):
                mask = self.participants(r)
                steps += np.array([self.steps_of(k) if mask[k] else 0 for k in range(acc.K)])
            if not np.array_equal(acc.steps, steps):
                bad = int(np.flatnonzero(acc.steps != steps)[0])
                return (f"the privacy accountant counts {int(acc.steps[bad])} DP-SGD steps for "
                        f"client {bad} but rounds < {round} took {int(steps[bad])}")
        logged = [row.get("epsilon") for row in history if row.get("epsilon") is not None]
        if logged and round > 0 and float(logged[-1]) != acc.epsilon:
            return (f"the privacy accountant gives epsilon {acc.epsilon:.6g} but the log holds "
                    f"{float(logged[-1]):.6g} for round {round - 1}")
        return None

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.accountant.state_dict() if self.accountant is not None else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if self.accountant is not None:
            self.accountant.load_state_dict(state)

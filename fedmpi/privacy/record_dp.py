r"""Record-level differential privacy: DP-SGD (Abadi et al. 2016, Alg. 1) inside every
silo, as one stage — the client half replaces the local loop's batch sampler and
gradient (:mod:`fedmpi.privacy.dpsgd`), the server half is the accountant and the budget
(:class:`~fedmpi.privacy.budget.AccountedStage`).

One local step on a Poisson batch L (every sample of the silo joins with probability
q_k = B/n_k)::

    g̃ = (Σ_{i∈L} g_i · min(1, C/‖g_i‖₂) + N(0, σ²C² I)) / B

with B = ``train.batch_size`` the *expected* batch size; g̃ then enters the ordinary local
step (weight decay, momentum) as the gradient. The noise of client k in round t comes
from its own stream of (seed, client, round), separate from the batch order.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Iterator

import torch

from fedmpi.component import ClientTask
from fedmpi.errors import ConfigError
from fedmpi.privacy.budget import AccountedStage
from fedmpi.privacy.dpsgd import check_model, clipped_grad_sum, poisson_batch, poisson_rate
from fedmpi.training.flat import FlatModel
from fedmpi.training.loop import StepHooks, SummedGradient
from fedmpi.transforms.base import RunParts

if TYPE_CHECKING:
    from fedmpi.config.core import Config

#: separates the DP-SGD noise stream from the batch order of the same (seed, client, round)
NOISE_TAG = 0x0D95_6D1A


class RecordDP(AccountedStage):
    """``privacy.dp.level: record`` (module docstring)."""

    name = "record_dp"
    level = "record"

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        self.batch_size = int(cfg.train.batch_size)

    def validate(self, parts: RunParts) -> None:
        """DP-SGD replaces the local gradient: the method's local step must be plain SGD on
        the cross-entropy, and every sample's forward pass independent of the batch."""
        if not parts.algorithm.spec_for(parts.cfg).record_dp:
            raise ConfigError(f"config key 'privacy.dp.level': 'record' (DP-SGD) needs a method "
                              f"whose local step is plain SGD; algorithm.name "
                              f"{parts.cfg.algorithm.name!r} is not one (see docs/privacy.md)")
        check_model(parts.model)

    def wrap_hooks(self, hooks: StepHooks, task: ClientTask) -> StepHooks:
        """Poisson batches and the clipped, noised gradient of this client-round."""
        if hooks.loss_fn is not None:
            raise RuntimeError("record-level DP computes the plain cross-entropy per sample; "
                               "this method replaces the loss (StepHooks.loss_fn)")
        B, clip, sigma = self.batch_size, self.clip, self.sigma
        noise = torch.Generator(device=task.indices.device).manual_seed(task.seed ^ NOISE_TAG)

        def sampler(indices: torch.Tensor, steps: int,
                    gen: torch.Generator) -> Iterator[torch.Tensor]:
            q = poisson_rate(indices.numel(), B)
            for _ in range(steps):
                yield poisson_batch(indices, q, gen)

        def clipped_sum(flat: FlatModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            segments = flat.param_segments
            loss = torch.zeros((), device=flat.device)
            if y.numel():
                loss = clipped_grad_sum(flat.model, [s.name for s in segments], x, y, clip,
                                        [flat.grad[s.slice] for s in segments])
            return loss

        def noise_and_scale(flat: FlatModel) -> None:
            with torch.no_grad():
                if sigma > 0:
                    flat.grad.add_(torch.randn(flat.grad.shape, generator=noise,
                                               device=flat.device), alpha=sigma * clip)
                flat.grad.div_(B)

        # a sum over samples and a completion: the ranks of a silo sum their shares'
        # clipped sums and add the noise once (fedmpi.training.dataparallel)
        return replace(hooks, sampler=sampler,
                       gradient=SummedGradient(clipped_sum, noise_and_scale))

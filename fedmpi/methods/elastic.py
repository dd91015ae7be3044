"""Elastic aggregation (Chen et al. 2023), as in FedVG's code base (FL-bench).

Client k keeps a sensitivity s_{k,l} per parameter tensor l (zero at the
start, kept on the worker that hosts k across rounds). Each round, before
local training, at the received global model θ, on a random
``algorithm.elastic.sample`` share (0.3) of its data, batch by batch:

    s_{k,l} ← μ s_{k,l} + (1 − μ) ‖∇_l ℓ_k‖²          (μ = ``algorithm.elastic.mu`` = 0.95)

then trains as FedAvg. The server, with weights s_k of
``aggregation.weighting`` over the accepted clients,

    s̄_l = Σ_k s_k s_{k,l},      s^max_l = max_k s_{k,l},
    ζ_l = 1 + τ − s̄_l / s^max_l                         (τ = ``algorithm.elastic.tau`` = 0.5)
    θ_l ← θ_l + η_g ζ_l Σ_k s_k (θ_{k,l} − θ_l)           (= θ_l − ζ_l Σ_k s_k (θ_l − θ_{k,l}))

so sensitive tensors move less (ζ → τ) and insensitive ones more (ζ → 1 + τ).
With ``weighting: fedvg`` both the sensitivity average and the update use
FedVG's weights (FedVG Table A.8).

Traffic: the max over clients needs every client's L sensitivities on rank
0. They travel as a "sum" statistic of N·L floats in which client k fills
only its own slot, so the one ``Reduce`` of the round brings the per-client
values (L is the number of tensors, tiny next to the model).

Deviations: the share is a fresh random subsample of the client's training
data each round that is *also* used for training (FL-bench's
``sample_ratio``), not a split removed from training. Inputs are prepared
without augmentation; BN runs in train mode during the measurement as in
FL-bench, but its running statistics are restored before training (FL-bench
lets the measurement pass nudge them). ζ_l uses s̄_l/s^max_l = 0 when every
client's sensitivity of tensor l is zero (FL-bench would divide by zero). Float
buffers take the plain weighted average (ζ = 1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedmpi.config.params import param
from fedmpi.training.loop import StepHooks, TrainResult
from fedmpi.methods.base import Algorithm, Exchange
from fedmpi.component import ClientTask, RoundInfo, Stat
from fedmpi.config.core import Config

SENSITIVITY_STREAM = 0xE1A57C


@dataclass(frozen=True)
class ElasticParams:
    mu: float = param(0.95, "Elastic sensitivity EMA decay mu", ge=0, lt=1)
    tau: float = param(0.5, "Elastic zeta = 1 + tau - s_agg/s_max", ge=0)
    sample: float = param(0.3, "Elastic share of client data measured per round", gt=0, le=1)


class Elastic(Algorithm):
    name = "elastic"
    params = {"elastic": ElasticParams}

    def __init__(self, cfg: Config, layout, num_clients: int) -> None:
        super().__init__(cfg, layout, num_clients)
        a = self.hparams("elastic")
        self.mu, self.tau, self.sample = float(a.mu), float(a.tau), float(a.sample)
        self.segments = layout.param_segments
        self.L = len(self.segments)
        self.sens_local = self.client_store("sensitivity", self.L)   # s_k of hosted clients (worker)
        self.last_zeta: np.ndarray = np.ones(self.L)
        self.device = torch.device("cpu")

    def exchange(self) -> Exchange:
        return Exchange((Stat("delta", self.state_size, "weighted"),
                         Stat("sensitivity", self.num_clients * self.L, "sum")))

    # ----------------------------------------------------------------- client
    def measure(self, task: ClientTask, state: torch.Tensor) -> torch.Tensor:
        """Update and return s_k: the EMA of per-tensor ‖∇ℓ‖² over sampled batches at θ."""
        assert self.ctx is not None, "started"
        flat, data = self.ctx.flat, self.ctx.data
        s_k = self.sens_local.vector(task.client, state.device)
        n = task.indices.numel()
        m = min(n, max(2, int(n * self.sample)))
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence(
            [task.seed, SENSITIVITY_STREAM]).generate_state(1, np.uint64)[0] >> 1))
        idx = task.indices[torch.randperm(n, generator=gen)[:m].to(task.indices.device)]
        bs = self.sgd.batch_size
        starts = list(range(0, m, bs))
        if len(starts) > 1 and m - starts[-1] == 1:   # a 1-sample batch breaks BatchNorm
            starts.pop()
        ends = starts[1:] + [m]
        flat.load(state)
        model = flat.model
        model.train()
        for a, b in zip(starts, ends):
            batch = idx[a:b]
            x = data.prepare(data.x_train[batch], train=False)
            y = data.y_train[batch]
            if task.flip_labels:
                y = data.num_classes - 1 - y
            flat.zero_grad()
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                sq = torch.stack([flat.grad[s.slice].square().sum() for s in self.segments])
                s_k.mul_(self.mu).add_(sq, alpha=1.0 - self.mu)
        flat.zero_grad()
        return s_k

    def hooks(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor) -> StepHooks:
        """s_k is measured at θ before local training; the model is left at θ."""
        self.measure(task, state)
        assert self.ctx is not None, "started"
        self.ctx.flat.load(state)   # measuring moved BatchNorm's running statistics
        return StepHooks()

    def finish_client(self, task: ClientTask, state: torch.Tensor, extras: torch.Tensor,
                      out: dict[str, torch.Tensor], result: TrainResult) -> None:
        """Client k's sensitivities into its slots of the summed ``sensitivity`` vector."""
        slots = out["sensitivity"]
        slots.zero_()
        slots[task.client * self.L:(task.client + 1) * self.L].copy_(
            self.sens_local.vector(task.client, state.device))

    # ----------------------------------------------------------------- server
    def zeta(self, sens: torch.Tensor, weights: np.ndarray) -> torch.Tensor:
        """ζ_l = 1 + τ − (Σ_k s_k s_{k,l}) / max_k s_{k,l} for sens [|S|, L]."""
        sens = sens.to(torch.float64)
        w = torch.as_tensor(np.asarray(weights, dtype=np.float64), device=sens.device)
        avg = w @ sens
        mx = sens.max(dim=0).values
        ratio = torch.where(mx > 0, avg / torch.where(mx > 0, mx, torch.ones_like(mx)),
                            torch.zeros_like(mx))
        return 1.0 + self.tau - ratio

    def server_update(self, state: torch.Tensor, agg: dict[str, torch.Tensor],
                      info: RoundInfo) -> None:
        sens = agg["sensitivity"].view(self.num_clients, self.L)[torch.as_tensor(
            np.asarray(info.clients, dtype=np.int64), device=state.device)]
        zeta = self.zeta(sens, info.weights)
        self.last_zeta = zeta.cpu().numpy()
        self.report.array("elastic/zeta", self.last_zeta.astype(np.float64))
        delta = agg["delta"]
        for s, z in zip(self.segments, self.last_zeta):
            state[s.slice].add_(delta[s.slice], alpha=self.server_lr * float(z))
        P = self.num_params
        state[P:].add_(delta[P:], alpha=self.server_lr)

    def log_outputs(self) -> list[str]:
        return ["elastic/zeta"]

"""Server optimizers on the pseudo-gradient (rank 0 only).

Every "adaptive/momentum server" method treats the aggregated client update
as a gradient. With aggregation weights s_k (``aggregation.weighting``; FedVG
weights included) and Δ_k = θ_k − θ,

    Δ_t = Σ_k s_k Δ_k            g_t = −Δ_t   (the pseudo-gradient)

and one optimizer step is applied to the global parameters θ:

* :class:`ServerSGD` — SGD with momentum m and optional Nesterov, exactly
  ``torch.optim.SGD`` (dampening 0; Hsu et al. 2019, FedAvgM)::

      b_t = m·b_{t−1} + g_t            (b_0 = g_0)
      d_t = g_t + m·b_t  (Nesterov)    or   d_t = b_t
      θ  ← θ − η·d_t

  m = 0 (any Nesterov flag) gives θ − η g_t = θ + η Δ_t, FedAvg with server lr η.
* :class:`ServerAdam` — Reddi et al. 2021, "Adaptive Federated Optimization",
  Algorithm 2 (FedAdam, and FedYogi with ``yogi=True``)::

      m_t = β1·m_{t−1} + (1 − β1)·Δ_t
      v_t = β2·v_{t−1} + (1 − β2)·Δ_t²                     (Adam)
      v_t = v_{t−1} − (1 − β2)·Δ_t²·sign(v_{t−1} − Δ_t²)    (Yogi)
      θ  ← θ + η·m_t / (√v_t + τ)

  with m_{−1} = 0 and v_{−1} = τ² (the paper requires v_{−1} ≥ τ²), no bias
  correction (as in the paper).

The optimizers act on a vector of any length; callers pass the parameter part
of the state (float buffers such as BN running statistics are averaged, not
optimized: see the methods using this module). One implementation serves
FedAvgM, FedAdam, FedYogi and FedVG × FedAvgM.
"""
from __future__ import annotations

import abc

import torch

from fedmpi.methods.base import Algorithm, MethodSpec
from fedmpi.component import RoundInfo


class ServerOptimizer(abc.ABC):
    """Base: ``step(params, delta)`` updates ``params`` in place from Δ_t = ``delta``."""

    def __init__(self, lr: float) -> None:
        self.lr = float(lr)

    @abc.abstractmethod
    def step(self, params: torch.Tensor, delta: torch.Tensor) -> None:
        """One server step on ``params`` (in place)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            getattr(self, name).copy_(value)


class ServerSGD(ServerOptimizer):
    """SGD with (Nesterov) momentum on g_t = −Δ_t (see module docstring)."""

    def __init__(self, size: int, device: torch.device, lr: float = 1.0, momentum: float = 0.0,
                 nesterov: bool = False) -> None:
        super().__init__(lr)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.buf = torch.zeros(size, device=device)
        self.started = torch.zeros((), device=device)   # 0 until the first step (checkpointed)
        self._g = torch.empty(size, device=device)

    def step(self, params: torch.Tensor, delta: torch.Tensor) -> None:
        g = torch.neg(delta, out=self._g)
        if self.momentum:
            if not bool(self.started):
                self.buf.copy_(g)
            else:
                self.buf.mul_(self.momentum).add_(g)
            d = g.add_(self.buf, alpha=self.momentum) if self.nesterov else self.buf
        else:
            d = g
        params.add_(d, alpha=-self.lr)
        self.started.fill_(1.0)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"buf": self.buf, "started": self.started}


class ServerAdam(ServerOptimizer):
    """FedAdam / FedYogi server step (Reddi et al. 2021, Algorithm 2)."""

    def __init__(self, size: int, device: torch.device, lr: float = 0.1, beta1: float = 0.9,
                 beta2: float = 0.99, tau: float = 1e-3, yogi: bool = False) -> None:
        super().__init__(lr)
        self.beta1, self.beta2, self.tau, self.yogi = float(beta1), float(beta2), float(tau), yogi
        self.m = torch.zeros(size, device=device)
        self.v = torch.full((size,), self.tau ** 2, device=device)
        self._sq = torch.empty(size, device=device)

    def step(self, params: torch.Tensor, delta: torch.Tensor) -> None:
        self.m.mul_(self.beta1).add_(delta, alpha=1.0 - self.beta1)
        sq = torch.mul(delta, delta, out=self._sq)
        if self.yogi:
            sign = torch.sign(self.v - sq)
            self.v.addcmul_(sq, sign, value=-(1.0 - self.beta2))
        else:
            self.v.mul_(self.beta2).add_(sq, alpha=1.0 - self.beta2)
        denom = self.v.sqrt().add_(self.tau)
        params.addcdiv_(self.m, denom, value=self.lr)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"m": self.m, "v": self.v}


class ServerOptAlgorithm(Algorithm, abc.ABC):
    """FedAvg clients + a :class:`ServerOptimizer` on rank 0.

    Server rule: ``opt.step(θ[:P], Σ_k s_k Δ_k[:P])`` on the P parameters; the
    float buffers (BN running statistics) take the plain weighted average
    ``θ[P:] += Σ_k s_k Δ_k[P:]`` — momentum or Adam moments on running
    statistics have no meaning (FedML/FL-bench optimize ``parameters()`` only).
    Subclasses implement :meth:`make_optimizer`.
    """

    spec = MethodSpec(record_dp=True, asynchronous=True)   # FedAvg clients: plain SGD local step (docs/privacy.md)

    @abc.abstractmethod
    def make_optimizer(self, size: int, device: torch.device) -> ServerOptimizer:
        """The server optimizer over the ``size`` parameters on ``device``."""

    def setup(self, ctx) -> None:
        self.opt: ServerOptimizer | None = (self.make_optimizer(self.num_params, ctx.device)
                                            if ctx.is_server else None)

    def server_update(self, state: torch.Tensor, agg: dict[str, torch.Tensor],
                      info: RoundInfo) -> None:
        P = self.num_params
        self.opt.step(state[:P], agg["delta"][:P])
        state[P:].add_(agg["delta"][P:])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"opt.{k}": v for k, v in self.opt.state_dict().items()} if self.opt else {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.opt.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("opt.")})

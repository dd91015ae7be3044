r"""Compressed uplink (``compression.*``), an update transform.

Each participant's upload Δ_k (``delta``, the method's weighted update over the exchanged
state) is encoded as a real client would send it and decoded as the server would; the
federation sums the decoded updates. Encodings of x ∈ ℝ^D (``compression.uplink``):

``bf16``   x̂ = bfloat16(x) (round to nearest even): 2 bytes per entry;
``int8``   blocks of B = 256 entries (the last one shorter), one float32 scale per block
           s_b = max_i |x_i| / 127 and codes q_i = round(x_i / s_b) ∈ [−127, 127];
           x̂_i = s_b · q_i: D + 4·⌈D/B⌉ bytes (QSGD-style absmax quantization with a
           per-block scale, Alistarh et al. 2017, deterministic rounding);
``topk``   the k = ⌈f·D⌉ entries of largest |x_i| (f = ``compression.topk_fraction``),
           sent as (int32 index, float32 value) pairs: 8k bytes; x̂ is zero elsewhere
           (Aji & Heafield 2017; Stich et al. 2018).

**Error feedback** (``compression.error_feedback``, default on; Seide et al. 2014, Karimireddy
et al. 2019 "EF-SGD", Alg. 2): client k keeps e_k (zero at first) on the worker that hosts it,
uploads x̂ = C(Δ_k + e_k) and keeps e_k ← (Δ_k + e_k) − x̂, so what one round drops is sent
later. e_k is a per-client vector of the method's store (checkpointed by client id with the
other per-client state). A non-finite upload is passed on untouched (the server excludes it)
and leaves e_k as it was.

**With client-level DP** the stage runs after the clip and the participant's noise share (it
is registered after the privacy stages): the encoding is post-processing of what DP already
protects, and the accountant is unchanged. Error feedback is refused there: e_k is a
data-dependent residual that would be added after the clip, beyond the sensitivity C the
accountant assumes. **With secure aggregation** the masked sum needs fixed-point ring
elements whose scale every party knows beforehand; a compressed uplink is refused with
both keys named.

**Downlink** (``compression.downlink: bf16``): the clients of a worker train from
θ̂ = bfloat16(θ), decoded once per round (:meth:`Compression.received`), and upload
θ_k − θ̂; the server applies the aggregate to its float32 θ. Method extras (SCAFFOLD's c)
stay float32.

The logged ``/rounds/bytes_up`` counts each participant's ``delta`` at its encoded size and
``/rounds/bytes_down`` θ at its (:meth:`Compression.traffic`); other statistics stay float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from fedmpi.component import ClientTask
from fedmpi.config.params import load_group, param
from fedmpi.errors import ConfigError
from fedmpi.transforms.base import UpdateTransform
from fedmpi.training.vecops import all_finite

if TYPE_CHECKING:
    from fedmpi.config.core import Config

#: entries per int8 block (one float32 scale each)
INT8_BLOCK = 256
ENCODINGS = ("none", "bf16", "int8", "topk")


@dataclass(frozen=True)
class CompressionParams:
    """``compression.*`` (:mod:`fedmpi.config.params`)."""

    uplink: str = param("none", "encoding of each client's update (docs/large-models.md): "
                                "none (float32), bf16, int8 (per-256-entry absmax scale), "
                                "topk (the largest entries with their indices)",
                        choices=ENCODINGS)
    topk_fraction: float = param(0.01, "topk: the fraction of entries sent", gt=0, le=1)
    error_feedback: bool = param(True, "keep each client's encoding error on its worker and "
                                       "add it to its next update (lossy encodings)")
    downlink: str = param("none", "encoding of the global model the clients receive: none "
                                  "(float32) or bf16", choices=("none", "bf16"))


def encoded_bytes(kind: str, size: int, topk_fraction: float = 1.0) -> int:
    """Bytes of one encoded vector of ``size`` float32 entries (module docstring)."""
    if kind == "bf16":
        return 2 * size
    if kind == "int8":
        return size + 4 * math.ceil(size / INT8_BLOCK)
    if kind == "topk":
        return 8 * topk_count(size, topk_fraction)
    return 4 * size


def topk_count(size: int, fraction: float) -> int:
    """k = ⌈f·D⌉, at least 1 and at most D."""
    return min(size, max(1, math.ceil(fraction * size)))


def decode_encode(kind: str, x: torch.Tensor, topk_fraction: float = 1.0) -> torch.Tensor:
    """x̂ = decode(encode(x)): what the server reads of ``x`` (a new float32 tensor)."""
    if kind == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    if kind == "int8":
        n = x.numel()
        pad = (-n) % INT8_BLOCK
        blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, INT8_BLOCK)
        scale = blocks.abs().amax(dim=1, keepdim=True) / 127.0
        codes = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1.0)),
                            torch.zeros_like(blocks)).clamp_(-127, 127).to(torch.int8)
        return (codes.to(x.dtype) * scale).view(-1)[:n]
    if kind == "topk":
        k = topk_count(x.numel(), topk_fraction)
        idx = torch.topk(x.abs(), k, sorted=False).indices
        out = torch.zeros_like(x)
        out[idx] = x[idx]
        return out
    return x.clone()


class Compression(UpdateTransform):
    """``compression.uplink`` or ``compression.downlink`` other than ``none`` (module
    docstring)."""

    name = "compression"
    params = {"compression": CompressionParams}
    enable_key = "compression.uplink"
    rewrites_update = True   # a masked submodel upload would be densified

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)
        p = load_group(cfg, "compression", CompressionParams)
        self.kind, self.fraction = p.uplink, float(p.topk_fraction)
        self.feedback = bool(p.error_feedback) and p.uplink != "none"
        self.errors: Any = None   # client → e_k: the method's per-client store (ClientVectors)
        self.D = 0
        self.down = p.downlink
        self._received: Optional[torch.Tensor] = None   # θ̂, one buffer per worker

    @classmethod
    def enabled(cls, cfg: Config) -> bool:
        return (cfg.get("compression.uplink", "none") != "none"
                or cfg.get("compression.downlink", "none") != "none")

    @classmethod
    def check(cls, cfg: Config) -> None:
        p = load_group(cfg, "compression", CompressionParams)
        if cfg.privacy.secure_aggregation and p.uplink != "none":
            raise ConfigError(f"config keys 'compression.uplink' and "
                              f"'privacy.secure_aggregation': the masked sum needs fixed-point "
                              f"ring elements of a scale known beforehand; "
                              f"{p.uplink!r} updates cannot be summed under the masks")
        if p.error_feedback and p.uplink != "none" and cfg.privacy.dp.level == "client":
            raise ConfigError("config keys 'compression.error_feedback' and 'privacy.dp.level': "
                              "error feedback adds a data-dependent residual after the DP clip "
                              "(beyond the sensitivity the accountant assumes); set "
                              "compression.error_feedback: false with client-level DP")

    def setup(self, ctx) -> None:
        self.D = ctx.flat.size
        self.report.attr("compression", "uplink", self.kind)
        self.report.attr("compression", "downlink", self.down)
        self.report.attr("compression", "error_feedback", int(self.feedback))
        if self.kind == "topk":
            self.report.attr("compression", "topk_fraction", self.fraction)

    def client_stores(self, make: Callable[[str, int], Any]) -> None:
        if self.feedback:
            self.errors = make("compression/error", self.D)

    # ------------------------------------------------------------- client half
    def received(self, state: torch.Tensor) -> torch.Tensor:
        """θ̂ = bfloat16(θ) under ``compression.downlink: bf16`` (the same bits on every
        rank); the clients train from θ̂ and upload θ_k − θ̂, applied to the server's θ."""
        if self.down == "none":
            return state
        if self._received is None or self._received.shape != state.shape:
            self._received = torch.empty_like(state)
        self._received.copy_(decode_encode(self.down, state))
        return self._received

    def on_upload(self, task: ClientTask, out: dict[str, torch.Tensor]) -> None:
        if self.kind == "none":
            return
        delta = out["delta"]
        if not all_finite(delta):
            return   # excluded by the server; e_k unchanged
        if self.errors is not None:
            e = self.errors.vector(task.client, delta.device)
            delta.add_(e)
            sent = decode_encode(self.kind, delta, self.fraction)
            torch.sub(delta, sent, out=e)
            delta.copy_(sent)
        else:
            delta.copy_(decode_encode(self.kind, delta, self.fraction))

    # ------------------------------------------------------------- server half
    def traffic(self, up: int, down: int) -> tuple[int, int]:
        return (up - 4 * self.D + encoded_bytes(self.kind, self.D, self.fraction),
                down - 4 * self.D + encoded_bytes(self.down, self.D))


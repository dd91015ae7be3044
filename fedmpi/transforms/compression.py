r"""Compressed uplink (``compression.*``), an update transform.

Each participant's upload Δ_k (``delta``, the method's weighted update over the exchanged
state) is encoded as a real client would send it. Encodings of x ∈ ℝ^D
(``compression.uplink``):

``bf16``   x̂ = bfloat16(x) (round to nearest even): 2 bytes per entry;
``int8``   integer codes on a per-block scale shared by the round's participants, summed
           exactly in a ring of b-bit words (below, :class:`SharedScaleInt8`): 2 bytes per
           entry (b = 16, m ≤ 258 participants) plus 8 per block of 256 for the scale;
``topk``   the k = ⌈f·D⌉ entries of largest |x_i| (f = ``compression.topk_fraction``),
           sent as (int32 index, float32 value) pairs: 8k bytes; x̂ is zero elsewhere
           (Aji & Heafield 2017; Stich et al. 2018).

``bf16`` and ``topk`` codes travel to rank 0 as one message per participant
(:class:`EncodedPayloads`: D uint16 words; k int32 indices then k float32 values), which
rank 0 receives one at a time in client-id order, decodes and adds as w̃_k x̂_k to its
float64 sum: the same bits at any world size, one message held at a time. Where the codes
cannot travel alone (a method uploading another statistic or needing ``delta`` per client,
``round.mode`` other than ``sync``) each is decoded on its worker, which adds w̃_k x̂_k to
its float64 partial sum, as int8's per-client code below.

**int8: shared-scale codes in an integer ring** (QSGD-style absmax quantization with a
per-block scale, Alistarh et al. 2017, deterministic rounding). The codes are summed as
integers, so their scale must be the same for every participant and known before the sum:
each participant's weighted contribution y_k = w̃_k x_k (x_k = Δ_k + e_k) is coded with the
round's common per-block scale

.. math:: s_b = \max_{k \in A_t} \max_{i \in b} |y_{k,i}| \,/\, L, \qquad
          q_{k,i} = \mathrm{round}(y_{k,i} / s_b) \in [-L, L],

agreed by one ``MAX`` ``Allreduce`` of each rank's per-block maxima (every rank learns
max_k |y_k| per block of 256 entries, one float64 per block, beyond the sum). Each worker
sums its clients' codes exactly and sends Σ_k q_k mod 2^b as uint16 (uint32) words, b = 16
(32 when 127·m ≥ 2^15; m = ``train.clients_per_round``); the ``Reduce`` adds them with
unsigned wrap-around (:class:`RingSum`). Since a participant's share of the wire is a b-bit
ring element whatever its code, the codes use the ring's whole range:
L = ⌊(2^{b−1} − 1)/m⌋ levels per side (6,553 at m = 5), so that Σ_k q_k never wraps, where
a per-client int8 code has 127 — the shared scale, set by the largest weighted
contribution, would otherwise leave a client of small weight only a few levels. Rank 0
decodes s_b · Σ_k q_{k,i}, the same integers at any world size (so
``runtime.reduction: exact`` keeps this sum instead of sending rows). Error feedback keeps
e_k ← x_k − s_b q_k / w̃_k (the update space: the next round's weight may differ).
**With secure aggregation** the same ring elements are pairwise-masked
(:class:`~fedmpi.privacy.secagg.SecureAggregator` adds its masks to :class:`RingSum`'s
words): the same codes, the same sum, the same model bit for bit.

Where the ring cannot carry the upload, int8 is the per-client code decoded on the worker:
per block one float32 scale s_b = max_i |x_i| / 127 and codes q_i = round(x_i / s_b) ∈
[−127, 127], x̂_i = s_b q_i (D + 4·⌈D/B⌉ bytes as a client would send them; the worker's
float64 sum travels). That is the case for a method that uploads another statistic besides
``delta`` or needs ``delta`` per client (SCAFFOLD's c, FedDyn's h, a per-client weighting or
rule: the ring carries one sum), client-level DP (the shared scale couples every client's
rounding to the others' updates, beyond the sensitivity the accountant assumes; the
per-client code is post-processing), and ``round.mode`` other than ``sync``. Under secure
aggregation these are refused instead (exit 2, both keys named), as are ``bf16`` (not a
fixed-point code) and ``topk`` (indices differ per client).

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
accountant assumes.

**Downlink** (``compression.downlink: bf16``): the clients of a worker train from
θ̂ = bfloat16(θ), decoded once per round (:meth:`Compression.received`), and upload
θ_k − θ̂; the server applies the aggregate to its float32 θ. Method extras (SCAFFOLD's c)
stay float32.

The logged ``/rounds/bytes_up_encoded`` counts each participant's ``delta`` at its encoded size
and ``/rounds/bytes_down_encoded`` θ at its (:meth:`Compression.traffic`); other statistics stay
float32. In the int8 ring a participant's ``delta`` is its ring element, 2 (or 4) bytes per
entry, plus its 8-byte block maxima; the agreed maxima come back in ``bytes_down_encoded``.
``/rounds/bytes_up``/``bytes_down`` are what the ranks handed MPI: the ring words and the
maxima for int8, the messages for bf16 and top-k, the float64 sums for the codes decoded on
the worker (docs/large-models.md, "What travels on the wire"). The ``compression``
attribute ``wire`` says which of these a run took (``ring``, ``messages``, ``decoded sum``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np
import torch

from fedmpi.component import ClientTask
from fedmpi.config.params import load_group, param
from fedmpi.errors import ConfigError
from fedmpi.transforms.base import RunParts, SumCode, UpdateTransform, UplinkCodec
from fedmpi.transforms.ring import (INT8_BLOCK, RingSum, SharedScaleInt8, blocks, code_levels,
                                    ring_bits)
from fedmpi.training.vecops import add_scaled, all_finite

if TYPE_CHECKING:
    from fedmpi.config.core import Config

ENCODINGS = ("none", "bf16", "int8", "topk")


@dataclass(frozen=True)
class CompressionParams:
    """``compression.*`` (:mod:`fedmpi.config.params`)."""

    uplink: str = param("none", "encoding of each client's update (docs/large-models.md): "
                                "none (float32), bf16, int8 (codes on a per-256-entry scale "
                                "shared by the round, summed in a 16-bit ring), topk (the "
                                "largest entries with their indices)",
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
        xb = blocks(x)
        scale = xb.abs().amax(dim=1, keepdim=True) / 127.0
        codes = torch.where(scale > 0, torch.round(xb / torch.where(scale > 0, scale, 1.0)),
                            torch.zeros_like(xb)).clamp_(-127, 127).to(torch.int8)
        return (codes.to(x.dtype) * scale).view(-1)[:n]
    if kind == "topk":
        k = topk_count(x.numel(), topk_fraction)
        idx = torch.topk(x.abs(), k, sorted=False).indices
        out = torch.zeros_like(x)
        out[idx] = x[idx]
        return out
    return x.clone()


class EncodedPayloads:
    """The bf16 and top-k codes as messages (a :class:`~fedmpi.transforms.base.PayloadCode`):
    bf16 as D uint16 words (2·D bytes), top-k as k int32 indices followed by their k float32
    values (8k bytes, k = :func:`topk_count`).

    The uploads reach :meth:`take` already decoded (x̂ = decode(encode(x)), error feedback
    formed on the worker), so encoding them again is exact: bf16(x̂) = x̂, and x̂ has at most
    k non-zero entries, all among the k kept. A worker keeps one message per client it trains
    in the round; rank 0 one receive buffer and one float32 decode buffer (top-k).
    """

    def __init__(self, kind: str, size: int, fraction: float = 1.0) -> None:
        self.kind, self.size = kind, size
        self.k = topk_count(size, fraction) if kind == "topk" else 0
        self.nbytes = encoded_bytes(kind, size, fraction)
        self._kept: dict[int, np.ndarray] = {}
        self._free: list[np.ndarray] = []     # messages kept between rounds
        self._recv = np.zeros(0, dtype=np.uint8)
        self._dense = torch.zeros(0)

    def begin(self) -> None:
        self._free += self._kept.values()
        self._kept = {}

    def take(self, client: int, x: torch.Tensor) -> None:
        out = self._free.pop() if self._free else np.empty(self.nbytes, dtype=np.uint8)
        x = x.detach()
        if self.kind == "bf16":
            words = x.to(torch.bfloat16).view(torch.int16).cpu().numpy()
            out.view(np.int16)[:] = words
        else:
            idx = torch.topk(x.abs(), self.k, sorted=False).indices
            out[: 4 * self.k].view(np.int32)[:] = idx.to(torch.int32).cpu().numpy()
            out[4 * self.k:].view(np.float32)[:] = x[idx].to(torch.float32).cpu().numpy()
        self._kept[client] = out

    def payload(self, client: int) -> np.ndarray:
        return self._kept[client]

    def buffer(self) -> np.ndarray:
        if self._recv.size != self.nbytes:
            self._recv = np.empty(self.nbytes, dtype=np.uint8)
        return self._recv

    def add(self, acc: torch.Tensor, payload: np.ndarray, weight: float) -> None:
        """acc += weight · x̂ (``add_scaled``, as a worker adds x̂ to its partial sum)."""
        if self.kind == "bf16":
            x = torch.from_numpy(payload.view(np.int16)).view(torch.bfloat16).to(torch.float32)
            add_scaled(acc, x, weight)
            return
        if self._dense.numel() != self.size:
            self._dense = torch.zeros(self.size)
        idx = torch.from_numpy(payload[: 4 * self.k].view(np.int32)).to(torch.long)
        self._dense[idx] = torch.from_numpy(payload[4 * self.k:].view(np.float32))
        add_scaled(acc, self._dense, weight)
        self._dense[idx] = 0.0


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
        # int8 codes are formed once the round's scale is agreed and summed in a ring;
        # without secure aggregation only where the ring can carry the upload (else each
        # client's code is decoded on its worker: ``validate``, module docstring)
        m = cfg.train.clients_per_round or cfg.data.num_clients
        self.secure = bool(cfg.privacy.secure_aggregation)
        ringed = p.uplink == "int8" and (self.secure or (cfg.privacy.dp.level != "client"
                                                         and cfg.round.mode == "sync"))
        self.ring = ring_bits(m) if ringed else 0
        self.levels = code_levels(self.ring, m) if self.ring else 0
        # bf16 and top-k codes travel to rank 0 as messages where they can (``validate``)
        self.direct = p.uplink in ("bf16", "topk") and not self.secure and cfg.round.mode == "sync"

    @classmethod
    def enabled(cls, cfg: Config) -> bool:
        return (cfg.get("compression.uplink", "none") != "none"
                or cfg.get("compression.downlink", "none") != "none")

    @classmethod
    def check(cls, cfg: Config) -> None:
        p = load_group(cfg, "compression", CompressionParams)
        if cfg.privacy.secure_aggregation and p.uplink not in ("none", "int8"):
            raise ConfigError(f"config keys 'compression.uplink' and "
                              f"'privacy.secure_aggregation': {p.uplink!r} updates cannot be "
                              f"summed in the masked ring (bf16 is not a fixed-point code, topk "
                              f"indices differ per client); int8 is the uplink encoding that "
                              f"combines with secure aggregation")
        if (cfg.privacy.secure_aggregation and p.uplink == "int8"
                and cfg.privacy.dp.level == "client"):
            raise ConfigError("config keys 'compression.uplink' and 'privacy.dp.level': with "
                              "secure aggregation the int8 scale is shared by the round's "
                              "participants, so one client's update changes every client's "
                              "rounding (beyond the sensitivity the accountant assumes)")
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

    def validate(self, parts: RunParts) -> None:
        """The int8 ring carries ``delta`` alone, as one sum: another summed statistic
        (SCAFFOLD's c, FedDyn's h, …) would have to share its codes' ring, and a per-client
        weighting or rule needs ``delta`` as rows. Under secure aggregation such a method
        is refused; without it each client's int8 code is decoded on its worker instead
        (per-client scale, module docstring)."""
        other = [s.name for s in parts.stats if s.name != "delta"]
        per_client = (parts.weighting.per_client or parts.rule.per_client
                      or any(tr.needs_rows for tr in parts.transforms))
        if not self.secure and (other or per_client):
            self.ring = self.levels = 0   # decoded on the worker
            self.direct = False
        wire = "ring" if self.ring else "messages" if self.direct else "decoded sum"
        if self.kind != "none":
            self.report.attr("compression", "wire", wire)
        if not self.ring:
            return
        self.report.attr("compression", "ring_bits", self.ring)
        self.report.attr("compression", "code_levels", self.levels)
        if other:
            raise ConfigError(f"config keys 'compression.uplink' and 'algorithm.name': with "
                              f"'privacy.secure_aggregation' the int8 ring carries only 'delta', "
                              f"but {parts.cfg.algorithm.name!r} also uploads {other[0]!r}")

    def sum_code(self) -> Optional[SharedScaleInt8]:
        """The shared-scale int8 codes the ring sums (masked under secure aggregation)."""
        return (SharedScaleInt8(self.ring, self.levels, self.sent if self.feedback else None)
                if self.ring else None)

    def codec(self, hosted: Sequence[int], num_clients: int,
              code: Optional[SumCode] = None) -> Optional[UplinkCodec]:
        """Without secure aggregation the int8 codes travel in their ring, unmasked."""
        return RingSum(code) if code is not None and not self.secure else None

    def payload_code(self) -> Optional[EncodedPayloads]:
        """bf16 and top-k: each participant's code travels to rank 0 as its own message."""
        return EncodedPayloads(self.kind, self.D, self.fraction) if self.direct else None

    def sent(self, client: int, sent: torch.Tensor) -> None:
        """x̂_k, what the ring sum carries of client k's x_k: e_k ← x_k − x̂_k
        (:meth:`on_upload` left e_k = x_k)."""
        e = self.errors.vector(client, sent.device)
        e.sub_(sent.to(e.dtype))

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
        if self.ring:   # coded once the round's scale is agreed (SharedScaleInt8, sent)
            if self.errors is not None:
                e = self.errors.vector(task.client, delta.device)
                delta.add_(e)
                e.copy_(delta)
            return
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
        down = down - 4 * self.D + encoded_bytes(self.down, self.D)
        if self.ring:   # a ring element per entry + its block maxima; the agreed maxima back
            maxima = 8 * math.ceil(self.D / INT8_BLOCK)
            return up - 4 * self.D + self.ring // 8 * self.D + maxima, down + maxima
        return up - 4 * self.D + encoded_bytes(self.kind, self.D, self.fraction), down


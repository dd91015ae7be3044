r"""The int8 ring: integer codes on a per-block scale shared by a round's participants,
summed exactly modulo 2^b (the math is :mod:`fedmpi.transforms.compression`'s module
docstring, "With secure aggregation" and "int8"). :class:`SharedScaleInt8` forms the codes
(a :class:`~fedmpi.transforms.base.SumCode`), :class:`RingSum` is the unmasked
:class:`~fedmpi.transforms.base.UplinkCodec` that sums them (``compression.uplink: int8``);
secure aggregation adds its masks to the same ring elements
(:class:`~fedmpi.privacy.secagg.SecureAggregator`).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from fedmpi.transforms.base import SumCode

#: entries per int8 block (one float32 scale each)
INT8_BLOCK = 256
#: blocks one piece of :meth:`SharedScaleInt8.encode` codes at a time (1 Mi entries)
ENCODE_BLOCKS = 4096


def ring_bits(participants: int) -> int:
    """The ring 2^b that sums ``participants`` int8 codes without wrapping: b = 16 while
    127·m < 2^15 (the centred sum fits), else 32."""
    return 16 if 127 * participants < 1 << 15 else 32


def code_levels(bits: int, participants: int) -> int:
    """L = ⌊(2^{b−1} − 1)/m⌋: the largest |code| of each of m participants whose sum the
    centred ring 2^b holds."""
    return ((1 << (bits - 1)) - 1) // participants


def blocks(y: torch.Tensor) -> torch.Tensor:
    """``y`` zero-padded to whole blocks, as [⌈n/B⌉, B]."""
    return torch.nn.functional.pad(y, (0, (-y.numel()) % INT8_BLOCK)).view(-1, INT8_BLOCK)


class SharedScaleInt8:
    """Integer codes in [−``levels``, ``levels``] on a per-block scale shared by the
    round's participants, summed in the ring 2^``bits`` (a
    :class:`~fedmpi.transforms.base.SumCode`; module docstring).

    One rank's side: ``take`` keeps each accepted client's x_k (float32, on its device)
    and weight until the scale is agreed — up to the rank's participants of a round, each
    the size of the uplink — ``local_bound`` is max_k |w̃_k x_k| per block over them,
    ``encode`` forms q_k = round(y_k / s_b) in float64 (y_k = w̃_k x_k), sums them as
    integers and hands each client's x̂_k = s_b q_k / w̃_k to ``sent`` (error feedback).

    Args:
        bits: 16 or 32 (:func:`ring_bits`).
        levels: L (:func:`code_levels`).
        sent: ``sent(client, x̂_k)`` once client k's code is formed, or None.
    """

    def __init__(self, bits: int, levels: int,
                 sent: Optional[Callable[[int, torch.Tensor], None]] = None) -> None:
        self.bits, self.levels = bits, levels
        self.sent = sent
        self._rows: list[torch.Tensor] = []     # kept between rounds, one per client slot
        self._kept: list[tuple[int, float]] = []
        self._scale = torch.zeros(0, dtype=torch.float64)       # s_b, on the clients' device
        self._scale_cpu = torch.zeros(0, dtype=torch.float64)   # s_b, for decoding on rank 0

    def begin(self) -> None:
        self._kept.clear()

    def take(self, client: int, x: torch.Tensor, weight: float) -> None:
        i = len(self._kept)
        if i == len(self._rows) or self._rows[i].shape != x.shape or self._rows[i].device != x.device:
            row = torch.empty_like(x, dtype=torch.float32)
            if i == len(self._rows):
                self._rows.append(row)
            else:
                self._rows[i] = row
        self._rows[i].copy_(x)
        self._kept.append((client, float(weight)))

    def local_bound(self, size: int) -> np.ndarray:
        """max_{k kept} max_{i∈b} |y_{k,i}| per block (zeros where none is kept)."""
        out = torch.zeros(math.ceil(size / INT8_BLOCK), dtype=torch.float64)
        for row, (_, weight) in zip(self._rows, self._kept):
            # max_i |w x_i| = |w| max_i |x_i| in float64: rounding is monotone, so the same
            # bits without a float64 copy of the row
            block_max = blocks(row).abs().amax(dim=1).cpu().to(torch.float64)
            torch.maximum(out, block_max.mul_(abs(weight)), out=out)
        return out.numpy()

    def agree(self, maximum: np.ndarray) -> None:
        """s_b = max_k max_i |y_{k,i}| / L from the round's ``MAX`` ``Allreduce``."""
        self._scale_cpu = torch.from_numpy(maximum / float(self.levels))
        device = self._rows[0].device if self._kept else torch.device("cpu")
        self._scale = self._scale_cpu.to(device)

    def encode(self, out: np.ndarray) -> None:
        """Σ_k q_k mod 2^b (q_k = round(y_k / s_b), s_b = 0: q = 0) into ``out``, in
        pieces of :data:`ENCODE_BLOCKS` blocks (each entry's arithmetic is the same; the
        float64 temporaries stay a piece, not the uplink, in size)."""
        n = out.size
        nblocks = self._scale.shape[0]
        mask = (1 << self.bits) - 1
        sent = ([torch.empty_like(self._rows[i]) for i in range(len(self._kept))]
                if self.sent is not None else [])
        for b0 in range(0, nblocks, ENCODE_BLOCKS):
            b1 = min(b0 + ENCODE_BLOCKS, nblocks)
            lo, hi = b0 * INT8_BLOCK, min(b1 * INT8_BLOCK, n)
            s = self._scale[b0:b1].unsqueeze(1)
            nonzero = s > 0
            safe = torch.where(nonzero, s, 1.0)
            total = torch.zeros(b1 - b0, INT8_BLOCK, dtype=torch.int64, device=s.device)
            for i, (client, weight) in enumerate(self._kept):
                y = blocks(self._rows[i][lo:hi].to(torch.float64) * weight)
                q = torch.where(nonzero, torch.round(y / safe), 0.0).clamp_(-self.levels,
                                                                           self.levels)
                total += q.to(torch.int64)
                if self.sent is not None:
                    piece = (q * s).view(-1)[: hi - lo]
                    sent[i][lo:hi].copy_(piece.div_(weight) if weight else piece.zero_())
            total.bitwise_and_(mask)
            out[lo:hi] = total.view(-1)[: hi - lo].cpu().numpy()
        if self.sent is not None:
            for (client, _), x_hat in zip(self._kept, sent):
                self.sent(client, x_hat)

    def decode(self, centred: torch.Tensor, start: int) -> torch.Tensor:
        """s_b · Σ_k q_{k,i} (float64) for the entries i = start, start + 1, …"""
        b0, end = start // INT8_BLOCK, start + centred.numel()
        scale = self._scale_cpu[b0: -(-end // INT8_BLOCK)].repeat_interleave(INT8_BLOCK)
        off = start - b0 * INT8_BLOCK
        return centred.to(torch.float64) * scale[off: off + centred.numel()]


def ring_wire(bits: int) -> np.dtype:
    """The wire type of the ring 2^``bits`` (16 or 32): unsigned words that wrap exactly
    modulo 2^bits in MPI's sum."""
    return np.dtype(f"uint{bits}")


class RingSum:
    """The :class:`~fedmpi.transforms.base.UplinkCodec` that sums a
    :class:`~fedmpi.transforms.base.SumCode`'s integers in its ring 2^b, unmasked (the
    ``int8`` uplink without secure aggregation; secure aggregation adds its pairwise masks
    to the same ring elements, :class:`~fedmpi.privacy.secagg.SecureAggregator`).

    Every accepted client's contribution is kept by the code (``take``), the ranks agree
    on its scale with one ``MAX`` ``Allreduce`` (``agreement``), each rank seals the sum of
    its clients' codes mod 2^b (``seal``: ``partial`` is not read) and rank 0 decodes the
    centred representative of the ring total (``open``). The codes are bounded by
    construction, so no client is refused; the opened sum is an integer sum, the same at
    any world size and rank layout (``sums_exactly``).
    """

    refused_because = "outside the int8 ring"   # never: codes are bounded by construction
    min_accepted = 1
    withheld_because = ""
    sums_exactly = True

    def __init__(self, code: SumCode) -> None:
        self.code = code
        self.mod = 1 << int(code.bits)
        self.wire_dtype = ring_wire(int(code.bits))

    def handshake(self) -> Optional[np.ndarray]:
        return None   # nothing to exchange before the first round

    def on_handshake(self, words: np.ndarray) -> None:
        pass

    def begin(self, participants: int) -> None:
        self.code.begin()

    def accepts(self, x: torch.Tensor, weight: float) -> bool:
        return True   # finite (the channel's check): its codes are bounded by construction

    def take(self, client: int, parts: Sequence[tuple[torch.Tensor, float]]) -> bool:
        assert len(parts) == 1, "a sum code encodes one statistic (Compression.validate)"
        x, weight = parts[0]
        self.code.take(client, x, weight)
        return True

    def agreement(self, size: int) -> Optional[np.ndarray]:
        return self.code.local_bound(size)

    def on_agreement(self, agreed: np.ndarray) -> None:
        self.code.agree(agreed)

    def seal(self, partial: torch.Tensor, t: int, mine: Sequence[int], accepted: Sequence[int],
             out: np.ndarray) -> None:
        """Σ_{k∈mine} q_k mod 2^b into ``out`` (``partial`` is not read)."""
        self.code.encode(out)

    def open(self, total: np.ndarray, start: int = 0) -> torch.Tensor:
        """s_b · Σ_k q_k (float64) from the ring total of the entries from ``start`` on:
        the code decodes its centred representative."""
        c = torch.from_numpy(total.astype(np.int64))
        c.sub_(torch.where(c >= self.mod // 2, self.mod, 0))
        return self.code.decode(c, start)

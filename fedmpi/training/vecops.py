"""Model-sized vector operations done in pieces, so that none allocates a model-sized
temporary.

PyTorch materialises a converted copy of the whole input for a mixed-dtype operation:
``acc64.add_(x32, alpha=w)`` and ``x32.sum(dtype=torch.float64)`` each allocate 8 bytes per
element before computing (measured: +763 MiB for 10^8 elements). Done on pieces of
:data:`PIECE` elements the results are the same bits (every operation here is elementwise,
or a finiteness test whose answer does not depend on the grouping) and the temporary is one
piece.
"""
from __future__ import annotations

from typing import Iterator

import torch

PIECE = 1 << 20   # elements per piece: an 8 MiB float64 temporary at most


def pieces(n: int, piece: int = PIECE) -> Iterator[slice]:
    """Consecutive slices of at most ``piece`` elements covering ``range(n)``."""
    for a in range(0, n, piece):
        yield slice(a, min(n, a + piece))


def all_finite(v: torch.Tensor) -> bool:
    """Whether every entry of ``v`` is finite: a float64 sum per piece (a float32 entry
    cannot overflow it), non-finite iff some entry is — no [n] bool temporary."""
    flat = v.reshape(-1)
    return all(bool(torch.isfinite(flat[s].sum(dtype=torch.float64))) for s in pieces(flat.numel()))


def add_scaled(acc: torch.Tensor, x: torch.Tensor, alpha: float = 1.0) -> None:
    """``acc += alpha · x`` in place (``acc`` float64, ``x`` float32: exactly
    ``acc.add_(x, alpha=alpha)``, piece by piece)."""
    for s in pieces(acc.numel()):
        acc[s].add_(x[s], alpha=alpha)


def divide_into_float32(v: torch.Tensor, divisor: float) -> torch.Tensor:
    """``v / divisor`` rounded to float32 (``torch.div(v, divisor, out=float32)``), written
    over the first half of the bytes of the contiguous float64 ``v`` itself: the float64
    accumulator becomes the float32 aggregate, and no second model-sized buffer exists.

    Piece by piece in ascending order: the float32 result of piece [a, b) occupies bytes
    [4a, 4b), which hold only float64 entries of pieces already read (< 8b), so nothing is
    overwritten before it is read. ``v`` is destroyed.
    """
    assert v.dtype == torch.float64 and v.is_contiguous(), "a contiguous float64 accumulator"
    n = v.numel()
    out = v.view(torch.float32)[:n]
    tmp = torch.empty(min(n, PIECE), dtype=torch.float32, device=v.device)
    for s in pieces(n):
        m = s.stop - s.start
        torch.div(v[s], divisor, out=tmp[:m])
        out[s].copy_(tmp[:m])
    return out

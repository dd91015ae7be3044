"""Batched, on-device image augmentation.

The classic CIFAR recipe (``RandomCrop(32, padding=4)`` followed by
``RandomHorizontalFlip()``) applied to a whole batch at once on the batch's
device, with no Python loop over samples.
"""
from __future__ import annotations

import torch

__all__ = ["random_crop_flip"]


def random_crop_flip(
    x: torch.Tensor,
    padding: int = 4,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    r"""Random crop with zero padding plus random horizontal flip, per sample.

    For every sample :math:`b` of ``x`` (shape ``[B, C, H, W]``) draw offsets
    :math:`i_b, j_b \sim \mathcal{U}\{0, \dots, 2p\}` and a flip bit
    :math:`f_b \sim \mathrm{Bernoulli}(1/2)`; with :math:`\tilde x` the input
    zero-padded by :math:`p` pixels on each side,

    .. math::

        y_{b,c,h,w} = \tilde x_{b,\,c,\,i_b + h,\,j_b + w'}, \qquad
        w' = \begin{cases} W - 1 - w & f_b = 1 \\ w & f_b = 0 \end{cases}

    which is the distribution of ``RandomCrop(H, padding=p)`` followed by
    ``RandomHorizontalFlip()``. The padding value is 0 in the units of ``x``,
    so applied to raw pixels it pads with black, exactly as torchvision does
    before ``ToTensor``/``Normalize``.

    Parameters
    ----------
    x:
        Batch ``[B, C, H, W]`` of any dtype, on any device.
    padding:
        Pad width :math:`p` in pixels (the crop size is the input size).
    generator:
        Random generator on ``x.device``; ``None`` uses torch's global RNG.
        Three draws are made per call (row offsets, column offsets, flips),
        so a generator in a given state always yields the same batch.

    Returns
    -------
    torch.Tensor
        A new tensor with the shape, dtype and device of ``x``.
    """
    if x.dim() != 4:
        raise ValueError(f"expected a batch [B, C, H, W], got shape {tuple(x.shape)}")
    b, _, h, w = x.shape
    device = x.device
    span = 2 * padding + 1
    rows0 = torch.randint(0, span, (b,), device=device, generator=generator)
    cols0 = torch.randint(0, span, (b,), device=device, generator=generator)
    flip = torch.randint(0, 2, (b,), device=device, generator=generator).bool()

    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    ar_h = torch.arange(h, device=device)
    ar_w = torch.arange(w, device=device)
    rows = rows0[:, None] + ar_h                               # [B, H]
    # Flip by reading the window's columns right to left.
    cols = torch.where(flip[:, None], ar_w.flip(0), ar_w) + cols0[:, None]  # [B, W]
    batch = torch.arange(b, device=device)[:, None, None]
    # Advanced indices separated by a slice put the broadcast dims first:
    # padded[B, :, H, W] -> [B, H, W, C].
    out = padded[batch, :, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()

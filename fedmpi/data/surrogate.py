"""FedGPS surrogate dataset D^s (Definition 4.1 of the FedGPS paper).

One class-specific Gaussian per class, generated from the run seed, identical
on every rank and fixed for the whole run (no files). Code lineage: VHL's
"Gaussian_Noise" generator, as described in ``shared/ALGORITHMS.md``:

1. class means ``m_c ~ N(0, I)`` on a 3×8×8 latent, c = 0..C−1;
2. samples ``z = m_c + σ·ε``, ``ε ~ N(0, I)``, σ = 0.5 (``surrogate_std``);
3. bilinear upsampling of the latent to the input size H×W
   (``align_corners=False``);
4. clamp to [0, 1] (image units);
5. the dataset's normalisation ``(x − μ_ch)/σ_ch`` (the same affine map
   :meth:`~fedmpi.data.base.Dataset.prepare` applies to real images).

Channels: the latent has 3 channels. For 3-channel inputs it is used as is;
for 1-channel inputs (digits, MNIST) it is converted with the ITU-R 601 luma
weights (0.299, 0.587, 0.114), as ``torchvision.transforms.Grayscale`` does —
VHL's "grayscale" variant. Other channel counts are rejected.

Randomness: a NumPy ``PCG64`` stream seeded by ``SeedSequence([seed, TAG])``
and float64 arithmetic up to the final cast, so the tensor is bit-identical on
every rank and every run with the same seed; the interpolation runs on the CPU
before the tensor is moved to the training device.

Deviation: the authors' code (VHL lineage) reads pre-generated images from
disk; here nothing is read. Its per-draw augmentation (RandomCrop with padding
4 + horizontal flip) is applied by FedGPS with
``algorithm.fedgps.surrogate_augment: crop_flip``
(:func:`~fedmpi.data.augment.random_crop_flip`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["SurrogateData", "make_surrogate", "LATENT_SHAPE"]

LATENT_SHAPE = (3, 8, 8)
_TAG = 0x5A88 << 8          # RNG domain separation from the other (seed, ...) streams
_LUMA = (0.299, 0.587, 0.114)


@dataclass(frozen=True)
class SurrogateData:
    """Normalised surrogate images ``x`` [N, C_in, H, W] (float32) and class labels
    ``y`` [N] in [0, C) (class-major order: ``y = repeat(0..C−1, per_class)``)."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int

    def __len__(self) -> int:
        return int(self.y.numel())

    def to(self, device: torch.device | str) -> "SurrogateData":
        return SurrogateData(self.x.to(device), self.y.to(device), self.num_classes)


def make_surrogate(seed: int, num_classes: int, input_shape: tuple[int, int, int],
                   mean: tuple[float, ...], std: tuple[float, ...], per_class: int = 200,
                   noise_std: float = 0.5) -> SurrogateData:
    """Generate D^s (see the module docstring for the recipe).

    Args:
        seed: the run seed (``seed``); same seed → bit-identical data.
        num_classes: C, number of surrogate classes (= real classes).
        input_shape: (C_in, H, W) of the real inputs; C_in must be 1 or 3.
        mean, std: the dataset's per-channel normalisation (image units in [0, 1]).
        per_class: samples per class (FedGPS default 200, VHL's script).
        noise_std: σ of the class Gaussians in the latent.
    """
    if len(input_shape) != 3:
        raise ValueError(f"surrogate data is image-like: it needs inputs [C, H, W], got "
                         f"{tuple(input_shape)}")
    c_in, h, w = (int(v) for v in input_shape)
    if c_in not in (1, 3):
        raise ValueError(f"surrogate data supports 1- or 3-channel inputs, got {c_in}")
    if num_classes < 1 or per_class < 1:
        raise ValueError("num_classes and per_class must be >= 1")
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), _TAG])))
    means = rng.standard_normal((num_classes, *LATENT_SHAPE))
    y = np.repeat(np.arange(num_classes), per_class)
    z = means[y] + noise_std * rng.standard_normal((y.size, *LATENT_SHAPE))
    x = F.interpolate(torch.from_numpy(z), size=(h, w), mode="bilinear", align_corners=False)
    x = x.clamp_(0.0, 1.0)
    if c_in == 1:
        x = (_LUMA[0] * x[:, 0:1] + _LUMA[1] * x[:, 1:2] + _LUMA[2] * x[:, 2:3])
    m = torch.tensor(mean, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(1, -1, 1, 1)
    x = ((x - m) / s).to(torch.float32).contiguous()
    return SurrogateData(x, torch.from_numpy(y.astype(np.int64)), num_classes)

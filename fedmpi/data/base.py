"""The in-memory :class:`Dataset` container and its batch preprocessing.

A dataset is held as four tensors (training pool and test set, inputs and
labels) in their *raw* storage type: ``uint8`` pixels for image datasets,
``float32`` for ``digits``, the synthetic blobs and tabular features. Inputs
are ``[N, C, ...]``: images ``[N, C, H, W]``, feature vectors ``[N, F]`` (each
feature is a "channel" of the normalisation). Conversion to the
network's input happens per batch, on the batch's device, in
:meth:`Dataset.prepare`; this keeps the resident copy 4x smaller than a
float copy and lets the whole pool sit on the GPU next to the model.
"""
from __future__ import annotations

import dataclasses
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from fedmpi.data.augment import random_crop_flip
from fedmpi.errors import DataError

if TYPE_CHECKING:
    import h5py

__all__ = ["Dataset", "channel_stats", "channel_sums", "check_finite", "first_non_finite",
           "read_h5_array", "stats_from_sums"]


@dataclass(eq=False)
class Dataset:
    r"""A classification dataset as resident tensors.

    Attributes
    ----------
    name:
        Dataset name as given to :func:`~fedmpi.data.load_dataset`.
    x_train, y_train:
        Training pool: raw images ``[N, C, H, W]`` and ``int64`` labels ``[N]``.
        Partitioning (clients and the server hold-out) indexes into this pool.
    x_test, y_test:
        Test set, same layout.
    num_classes:
        Number of classes :math:`C`; labels lie in ``[0, C)``.
    mean, std:
        Per-channel mean :math:`\mu_c` and standard deviation
        :math:`\sigma_c` of the training images in units *after* scaling to
        :math:`[0, 1]`.
    scale:
        Factor :math:`s` mapping a raw value to :math:`[0, 1]`
        (``1/255`` for ``uint8`` images, ``1/16`` for ``digits``).
    augment:
        Apply random crop (4-px zero padding) and horizontal flip to training
        batches in :meth:`prepare`. Meant for natural 32x32 RGB images.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: float
    augment: bool = False
    #: the institution of every training-pool sample, for data sets whose sites are real
    #: institutions (:mod:`fedmpi.data.institutions`; ``data.partition.method:
    #: institutions``), and the institutions' names; None / () otherwise
    groups: Optional[np.ndarray] = None
    group_names: tuple[str, ...] = ()
    # Per-device (gain, offset) of the affine normalisation; not part of the value.
    _affine: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        channels = self.x_train.shape[1] if self.x_train.dim() >= 2 else -1
        if not (len(self.mean) == len(self.std) == channels):
            raise ValueError(
                f"dataset {self.name!r}: x_train must be [N, C, ...] (images [N, C, H, W], "
                f"features [N, F]) with C = len(mean) = len(std), got shape "
                f"{tuple(self.x_train.shape)}, {len(self.mean)} means, {len(self.std)} stds"
            )
        if self.augment and self.x_train.dim() != 4:
            raise DataError(f"data.augment: random crop + flip needs images [N, C, H, W]; dataset "
                            f"{self.name!r} has inputs of shape {tuple(self.x_train.shape[1:])}")

    # ------------------------------------------------------------------ shape
    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input: ``(C, H, W)`` for images, ``(F,)`` for feature vectors."""
        return tuple(int(d) for d in self.x_train.shape[1:])

    @property
    def num_train(self) -> int:
        """Size :math:`N` of the training pool."""
        return int(self.y_train.shape[0])

    @property
    def num_test(self) -> int:
        """Size of the test set."""
        return int(self.y_test.shape[0])

    # ---------------------------------------------------------------- devices
    def to(self, device: torch.device | str) -> Dataset:
        """Return a copy whose four tensors live on ``device`` (no copy if already there)."""
        return dataclasses.replace(
            self,
            x_train=self.x_train.to(device),
            y_train=self.y_train.to(device),
            x_test=self.x_test.to(device),
            y_test=self.y_test.to(device),
        )

    # ---------------------------------------------------------- preprocessing
    def _gain_offset(self, device: torch.device, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Cached ``[1, C, 1, ...]`` tensors :math:`a_c = s/\sigma_c`, :math:`b_c = -\mu_c/\sigma_c`
        for batches of ``dim`` dimensions (channel axis 1)."""
        cached = self._affine.get((device, dim))
        if cached is None:
            mean = torch.tensor(self.mean, dtype=torch.float64)
            std = torch.tensor(self.std, dtype=torch.float64)
            shape = (1, -1) + (1,) * (dim - 2)
            gain = (self.scale / std).to(torch.float32).view(shape).to(device)
            offset = (-mean / std).to(torch.float32).view(shape).to(device)
            cached = (gain, offset)
            self._affine[(device, dim)] = cached
        return cached

    def prepare(
        self,
        x: torch.Tensor,
        train: bool,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        r"""Turn a raw batch into network input.

        .. math::

            y_{b,c,h,w} = \frac{s\,x_{b,c,h,w} - \mu_c}{\sigma_c}

        (per feature :math:`c` for feature vectors ``[B, F]``) computed in ``float32``
        on ``x.device``. When ``train`` and
        :attr:`augment` are both true the raw batch first goes through
        :func:`~fedmpi.data.augment.random_crop_flip` (4-px padding with raw 0,
        i.e. black, as torchvision pads before normalising).

        Parameters
        ----------
        x:
            Raw batch ``[B, C, ...]`` (a slice of :attr:`x_train` or :attr:`x_test`).
        train:
            Whether this is a training batch (enables augmentation).
        generator:
            Generator on ``x.device`` driving the augmentation; ``None`` uses
            torch's global RNG. Unused without augmentation.
        """
        if train and self.augment:
            x = random_crop_flip(x, padding=4, generator=generator)
        gain, offset = self._gain_offset(x.device, x.dim())
        return torch.addcmul(offset, x.to(torch.float32), gain)


def channel_stats(
    x: torch.Tensor, scale: float, chunk: int = 8192
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    r"""Per-channel mean and (population) standard deviation of ``s * x``.

    .. math::

        \mu_c = \frac{1}{NHW}\sum_{n,h,w} s\,x_{n,c,h,w}, \qquad
        \sigma_c = \Big(\frac{1}{NHW}\sum_{n,h,w} (s\,x_{n,c,h,w})^2 - \mu_c^2\Big)^{1/2}

    over every axis but the channel axis 1 (for feature vectors ``[N, F]``: per
    feature), accumulated in ``float64`` over chunks of ``chunk`` samples, so a
    large ``uint8`` pool is never expanded to floating point all at once.
    A constant channel gets :math:`\sigma_c = 1` to keep normalisation finite.
    """
    if x.dim() < 2 or x.shape[0] == 0:
        raise ValueError(f"expected a non-empty [N, C, ...] tensor, got shape {tuple(x.shape)}")
    total, total_sq, count = channel_sums(x, scale, chunk)
    return stats_from_sums(total, total_sq, count)


def channel_sums(x: torch.Tensor, scale: float = 1.0,
                 chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(Σ s·x, Σ (s·x)², count)`` per channel (float64 ``[C]``, count per channel)."""
    c = x.shape[1]
    axes = (0, *range(2, x.dim()))
    total = torch.zeros(c, dtype=torch.float64)
    total_sq = torch.zeros(c, dtype=torch.float64)
    for start in range(0, x.shape[0], chunk):
        part = x[start : start + chunk].to(torch.float64) * scale
        total += part.sum(dim=axes).cpu()
        total_sq += part.square().sum(dim=axes).cpu()
    return total, total_sq, x.numel() // max(c, 1)


def stats_from_sums(total: torch.Tensor, total_sq: torch.Tensor,
                    count: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
    r"""Mean and population std from per-channel sums: :math:`\mu = S/n`,
    :math:`\sigma = (Q/n - \mu^2)^{1/2}` (1 for a constant channel)."""
    mean = total / count
    var = (total_sq / count - mean.square()).clamp_min(0.0)
    std = torch.where(var > 0, var.sqrt(), torch.ones_like(var))
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def npz_member(npz: "np.lib.npyio.NpzFile", key: str, path: str) -> np.ndarray:
    """Array ``key`` of an open ``.npz`` (loaded with ``allow_pickle=False``); an object
    array (which only pickle could load) or a damaged member is a DataError naming both."""
    from fedmpi.errors import DataError

    if npz.files.count(key) > 1:   # a zip may hold one name twice; numpy reads only one
        raise DataError(f"{path}: array {key!r} appears {npz.files.count(key)} times in the "
                        ".npz (an archive with duplicate members is ambiguous); write it once")
    try:
        return npz[key]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        if "allow_pickle" in str(exc):
            raise DataError(f"{path}: array {key!r} is an object array (needs pickle, which "
                            "fedmpi never loads); store numeric arrays") from None
        raise DataError(f"{path}: array {key!r} is unreadable ({exc})") from None


#: Class ids must lie below this (2^20): per-client class histograms are dense [K, C]
#: arrays, so a stray label of 2^40 would ask for terabytes.
MAX_CLASSES = 1 << 20


def check_class_ids(y: np.ndarray, where: str) -> None:
    """Labels ``y`` (integers >= 0) are class ids below :data:`MAX_CLASSES`, else a
    DataError naming ``where`` and the label."""
    if len(y) and int(y.max()) >= MAX_CLASSES:
        raise DataError(f"{where}: label {int(y.max())} is not a class id below 2^20 "
                        f"({MAX_CLASSES}); labels must be 0 .. C-1 for C classes")


def first_non_finite(x: "np.ndarray | torch.Tensor") -> "tuple[int, ...] | None":
    """Index of the first element of ``x`` that is NaN or ±inf (row-major), or None.
    Integer arrays are finite."""
    if isinstance(x, torch.Tensor):
        if not x.is_floating_point():
            return None
        bad = ~torch.isfinite(x)
        if not bool(bad.any()):
            return None
        flat = int(torch.nonzero(bad.reshape(-1))[0, 0])
        return tuple(int(i) for i in np.unravel_index(flat, tuple(x.shape)))
    x = np.asarray(x)
    if x.dtype.kind not in "fc":
        return None
    bad = ~np.isfinite(x)
    if not bad.any():
        return None
    return tuple(int(i) for i in np.unravel_index(int(np.flatnonzero(bad.reshape(-1))[0]),
                                                  x.shape))


def check_finite(x: "np.ndarray | torch.Tensor", where: str) -> None:
    """DataError naming ``where``, the sample and the position of the first NaN or
    ±inf input: one would enter the standardisation statistics (every update becomes
    non-finite); fedmpi does not impute."""
    at = first_non_finite(x)
    if at is not None:
        value = float(x[at])
        rest = f" at position {at[1:]}" if len(at) > 1 else ""
        raise DataError(f"{where}: sample {at[0]} holds {value}{rest}; inputs must be finite "
                        "numbers (fill or drop such samples first: fedmpi does not impute)")


def read_h5_array(f: "h5py.File", key: str, path: str) -> np.ndarray:
    """Dataset ``key`` of an open data file: refused (DataError naming both) if it is a
    group, or keeps its bytes outside the file (HDF5 external storage, a virtual
    dataset: reading would pull in other files this rank may read)."""
    import h5py

    ds = f[key]
    if not isinstance(ds, h5py.Dataset):
        raise DataError(f"{path}: {key!r} is a group, expected a dataset")
    if ds.external or ds.is_virtual:
        kind = "external storage (other files)" if ds.external else "a virtual dataset"
        raise DataError(f"{path}: dataset {key!r} uses {kind}; a data file must hold its own "
                        "data")
    return np.asarray(ds[()])

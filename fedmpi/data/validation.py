r"""The server-held validation set :math:`D_{val}` that FedVG scores client models on.

Options (``data.validation.*``; FedVG paper appendix A.5 and A.7.1):

``source: holdout`` (default)
    The stratified hold-out of ``data.validation.fraction`` of the training
    pool that :func:`~fedmpi.data.make_partition` already removed from client
    data (``Partition.validation_indices``).
``source: <dataset>``
    An external labelled dataset (Section 6 of the paper: STL-10 or CIFAR-100
    as the validation set of a CIFAR-10 federation). Its training and test
    splits are pooled, its labels are mapped to the federation's classes with
    :data:`CLASS_MAPS` (Tables A.6 and A.7; identity when both have the same
    classes and no map is listed), and ``data.validation.per_class`` samples are
    drawn uniformly at random per *target* class (balanced sampling). Images
    are scaled to [0, 1], resized (bilinear, antialiased) to the federation's
    input size and normalised with the *federation's* channel mean/std, i.e.
    exactly what the model sees at test time.
``size_fraction`` :math:`f \in (0, 1]`
    Keep a class-stratified fraction :math:`f` of :math:`D_{val}` (A.7.1,
    "size of the global validation set").
``rho`` :math:`\rho \in (0, 1]` (null = off)
    Class-imbalanced subset (Eqs. E.8–E.9): :math:`N' = \lfloor |D_{val}|/2
    \rfloor`, :math:`p_i = \rho^i / \sum_j \rho^j` and :math:`s_i = \lfloor p_i
    N' \rfloor` samples of class :math:`i` (classes in index order).

Deviations from the paper (recorded here as the brief asks):

* Imbalance: when class :math:`i` holds fewer than :math:`s_i` samples, all of
  them are kept (the paper's Fig. A.6 counts exceed a 10 % hold-out's class
  sizes for small :math:`\rho`; it does not say how it filled them). The
  counts actually used are in :attr:`ValidationSet.class_counts`.
* CIFAR-100 → CIFAR-10: Table A.7 lists per-*source*-class counts of 514–531
  (3,650 samples). We draw a balanced ``per_class`` per *target* class from the
  union of its source classes; the default 1,200 is the largest balanced count
  (bus+motorcycle and wolf+fox offer 2 × 600 each) — 3,600 samples in all.
  STL-10 → CIFAR-10 uses the paper's 550 per class (4,950 samples; train+test
  pool of STL-10 has 1,300 per class).

The set is built once on rank 0 and kept **resident on the scoring device** as
network-ready ``float32`` (``x``) and ``int64`` labels (``y``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedmpi.data.base import Dataset
from fedmpi.data.partition import stratified_holdout
from fedmpi.errors import ConfigError, DataError
from fedmpi.config.core import Config

__all__ = [
    "CIFAR10_CLASSES", "CIFAR100_CLASSES", "STL10_CLASSES", "CLASS_MAPS", "DEFAULT_PER_CLASS",
    "ValidationSet", "build_validation", "class_map", "imbalanced_counts", "imbalanced_subset",
]

CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck")
STL10_CLASSES = ("airplane", "bird", "car", "cat", "deer", "dog", "horse", "monkey", "ship",
                 "truck")
#: torchvision's CIFAR-100 fine labels (alphabetical; index = label).
CIFAR100_CLASSES = (
    "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle",
    "bottle", "bowl", "boy", "bridge", "bus", "butterfly", "camel", "can", "castle",
    "caterpillar", "cattle", "chair", "chimpanzee", "clock", "cloud", "cockroach", "couch",
    "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish", "forest", "fox",
    "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion",
    "lizard", "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse", "mushroom",
    "oak_tree", "orange", "orchid", "otter", "palm_tree", "pear", "pickup_truck", "pine_tree",
    "plain", "plate", "poppy", "porcupine", "possum", "rabbit", "raccoon", "ray", "road",
    "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk", "skyscraper", "snail", "snake",
    "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank",
    "telephone", "television", "tiger", "tractor", "train", "trout", "tulip", "turtle",
    "wardrobe", "whale", "willow_tree", "wolf", "woman", "worm",
)

_NAMED_MAPS: dict[tuple[str, str], dict[str, str]] = {
    # Table A.6: STL-10 -> CIFAR-10 (monkey dropped, no frog).
    ("stl10", "cifar10"): {"airplane": "airplane", "car": "automobile", "bird": "bird",
                           "cat": "cat", "deer": "deer", "dog": "dog", "horse": "horse",
                           "ship": "ship", "truck": "truck"},
    # Table A.7: CIFAR-100 -> CIFAR-10.
    ("cifar100", "cifar10"): {"bus": "automobile", "motorcycle": "automobile",
                              "leopard": "cat", "lion": "cat", "tiger": "cat",
                              "wolf": "dog", "fox": "dog"},
}
_CLASS_NAMES = {"cifar10": CIFAR10_CLASSES, "stl10": STL10_CLASSES, "cifar100": CIFAR100_CLASSES}

#: source label -> federation label, per (source, federation) dataset pair.
CLASS_MAPS: dict[tuple[str, str], dict[int, int]] = {
    (src, dst): {_CLASS_NAMES[src].index(a): _CLASS_NAMES[dst].index(b) for a, b in m.items()}
    for (src, dst), m in _NAMED_MAPS.items()
}
#: Samples per target class when ``data.validation.per_class`` is null.
DEFAULT_PER_CLASS = {"stl10": 550, "cifar100": 1200}


@dataclass(eq=False)
class ValidationSet:
    """:math:`D_{val}` resident on the scoring device."""

    x: torch.Tensor               # [N, C, H, W] float32, network-ready (normalised)
    y: torch.Tensor               # [N] int64 federation labels
    source: str                   # "holdout" or the external dataset's name
    class_counts: np.ndarray      # [num_classes] int64

    def __len__(self) -> int:
        return int(self.y.numel())

    def batches(self, batch_size: int):
        """Yield ``(x, y)`` slices of at most ``batch_size`` samples, in order."""
        for start in range(0, len(self), batch_size):
            yield self.x[start:start + batch_size], self.y[start:start + batch_size]


def class_map(source: str, target: str, source_classes: int, target_classes: int) -> dict[int, int]:
    """Label map from ``source`` to ``target`` (Tables A.6/A.7, else identity)."""
    key = (source.lower(), target.lower())
    if key in CLASS_MAPS:
        return dict(CLASS_MAPS[key])
    if source_classes == target_classes:
        return {c: c for c in range(source_classes)}
    raise ConfigError(
        f"config key 'data.validation.source': no class map from {source!r} "
        f"({source_classes} classes) to {target!r} ({target_classes} classes); available maps: "
        f"{', '.join(f'{a}->{b}' for a, b in CLASS_MAPS)} or two datasets with the same classes")


def imbalanced_counts(class_sizes: np.ndarray, rho: float, total: int) -> np.ndarray:
    r"""Eqs. E.8–E.9: :math:`s_i = \lfloor \rho^i / \sum_j \rho^j \cdot N' \rfloor`, clipped to
    the available ``class_sizes`` (see module docstring), with :math:`N'` = ``total``."""
    c = len(class_sizes)
    p = rho ** np.arange(c, dtype=np.float64)
    p /= p.sum()
    want = np.floor(p * total).astype(np.int64)
    return np.minimum(want, np.asarray(class_sizes, dtype=np.int64))


def imbalanced_subset(labels: np.ndarray, rho: float, num_classes: int,
                      rng: np.random.Generator) -> np.ndarray:
    """Positions (sorted) of a ρ-imbalanced subset of ``labels`` with N' = ⌊len/2⌋."""
    labels = np.asarray(labels)
    sizes = np.bincount(labels, minlength=num_classes)
    counts = imbalanced_counts(sizes, rho, len(labels) // 2)
    keep = [rng.choice(np.flatnonzero(labels == c), size=int(n), replace=False)
            for c, n in enumerate(counts) if n > 0]
    return np.sort(np.concatenate(keep)) if keep else np.zeros(0, dtype=np.int64)


def _prepare_chunks(data: Dataset, x: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    return torch.cat([data.prepare(x[i:i + chunk], train=False) for i in range(0, len(x), chunk)]
                     or [torch.zeros(0, *data.input_shape, device=x.device)])


def _external(source: str, data: Dataset, per_class: Optional[int], rng: np.random.Generator,
              loader: Callable[..., Dataset], root: str, download: bool,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    ext = loader(source, root, download)
    mapping = class_map(source, data.name, ext.num_classes, data.num_classes)
    x_pool = torch.cat([ext.x_train, ext.x_test])
    y_pool = torch.cat([ext.y_train, ext.y_test]).cpu().numpy()
    targets = np.full(ext.num_classes, -1, dtype=np.int64)
    for s, t in mapping.items():
        targets[s] = t
    mapped = targets[y_pool]
    present = np.unique(mapped[mapped >= 0])
    available = {int(t): np.flatnonzero(mapped == t) for t in present}
    n = per_class if per_class is not None else DEFAULT_PER_CLASS.get(
        source.lower(), min(len(v) for v in available.values()))
    short = {t: len(v) for t, v in available.items() if len(v) < n}
    if short:
        raise DataError(f"config key 'data.validation.per_class' = {n} exceeds the samples of "
                        f"{source!r} available for target classes {short}")
    pick = np.sort(np.concatenate([rng.choice(available[t], size=n, replace=False)
                                   for t in sorted(available)]))
    idx = torch.as_tensor(pick)
    c, h, w = data.input_shape
    x = x_pool[idx].to(device=device, dtype=torch.float32) * ext.scale
    if x.shape[1] != c:
        if x.shape[1] == 1 and c == 3:
            x = x.expand(-1, 3, -1, -1)
        elif x.shape[1] == 3 and c == 1:
            x = x.mean(1, keepdim=True)
        else:
            raise DataError(f"data.validation.source {source!r} has {x.shape[1]} channels, the "
                            f"federation's data {c}")
    if tuple(x.shape[2:]) != (h, w):
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
    mean = torch.tensor(data.mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    std = torch.tensor(data.std, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    x = (x - mean) / std
    y = torch.as_tensor(mapped[pick], dtype=torch.int64, device=device)
    return x.contiguous(), y


def build_validation(cfg: Config, data: Dataset, validation_indices: np.ndarray, device: torch.device,
                     loader: Optional[Callable[..., Dataset]] = None) -> ValidationSet:
    """Build :math:`D_{val}` from ``cfg.data.validation`` (see module docstring).

    ``validation_indices`` is the partition's server hold-out (training-pool
    indices); ``loader(name, root, download)`` loads an external dataset
    (default :func:`~fedmpi.data.load_dataset`). Randomness comes from
    ``(seed, 0xFED7)``, so every run with the same config builds the same set.
    """
    v = cfg.data.validation
    rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0xFED7]))
    source = v.source
    if source == "holdout":
        idx = torch.as_tensor(np.asarray(validation_indices, dtype=np.int64),
                              device=data.x_train.device)
        x = _prepare_chunks(data, data.x_train[idx]).to(device)
        y = data.y_train[idx].to(device)
    else:
        if source.lower() == str(cfg.data.dataset).lower():
            raise ConfigError(f"config key 'data.validation.source' is the federation's own dataset "
                              f"{source!r}; use 'holdout' (its test split must stay unseen)")
        if loader is None:
            from fedmpi.data.datasets import load_dataset
            loader = load_dataset
        x, y = _external(source, data, v.per_class, rng, loader, cfg.data.root,
                         cfg.data.download, device)
    labels = y.cpu().numpy()
    if v.size_fraction < 1.0:
        held, _ = stratified_holdout(labels, v.size_fraction, rng)
        sel = torch.as_tensor(held, device=x.device)
        x, y, labels = x[sel], y[sel], labels[held]
    if v.rho is not None:
        keep = imbalanced_subset(labels, v.rho, data.num_classes, rng)
        sel = torch.as_tensor(keep, device=x.device)
        x, y, labels = x[sel], y[sel], labels[keep]
    if len(labels) == 0:
        raise DataError(f"the server validation set (data.validation.source={source!r}) is empty; "
                        "raise data.validation.fraction / size_fraction or choose another source")
    counts = np.bincount(labels, minlength=data.num_classes).astype(np.int64)
    return ValidationSet(x.contiguous(), y.contiguous(), source, counts)

"""The partition of a run, computed from its config: the one code path shared by
:class:`fedmpi.runtime.Federation` and ``fedmpi partition`` (so the preview is
exactly the partition a run with the same config trains on)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from fedmpi.data.base import Dataset
from fedmpi.data.partition import Partition, make_partition
from fedmpi.errors import DataError
from fedmpi.config.core import Config

__all__ = ["DataNeeds", "build_partition", "load_pool"]


@dataclass(frozen=True)
class DataNeeds:
    """What the run's components ask of the data. :mod:`fedmpi.data` names no method,
    weighting or transform: the layer above works this out from what the components
    declare (:meth:`fedmpi.usercode.UserCode.data_needs`) and passes it in, so a run,
    ``fedmpi partition`` and ``fedmpi check`` build the same data."""

    #: every client has at least this many local batches of ``train.batch_size``
    #: (:func:`~fedmpi.data.partition.local_batches`); 0: no floor
    min_batches: int = 0
    #: the config key of the component that asks for them (named in the error)
    min_batches_key: str = ""
    #: rank 0 reads ``data.silos.validation`` even when only the clients evaluate
    server_validation: bool = False


def load_pool(cfg: Config, data: Optional[Any] = None) -> Dataset:
    """The pooled dataset of ``cfg``: ``data`` when given (a :class:`Dataset`, a
    ``(train, test)`` pair or a zero-argument callable, from :func:`fedmpi.run`),
    else ``data.dataset``: an import path, ``tabular`` (``data.tabular.*`` files),
    an embedded tabular set, or a built-in name (:func:`~fedmpi.data.load_dataset`)."""
    import dataclasses

    from fedmpi import imports
    from fedmpi.data import tabular
    from fedmpi.data.custom import dataset_factory

    d = cfg.data
    if data is not None or imports.is_import_path(d.dataset) or d.dataset == "tabular" \
            or d.dataset in tabular.EMBEDDED:
        if data is not None or imports.is_import_path(d.dataset):
            pool = dataset_factory(data if data is not None else d.dataset)()
        elif d.dataset == "tabular":
            pool = tabular.load_tabular(d.tabular.train, d.tabular.test, d.tabular.label)
        else:
            pool = tabular.load_embedded(d.dataset)
        # data.augment applies to these too (and refuses inputs that are not images)
        return dataclasses.replace(pool, augment=True) if d.augment else pool
    from fedmpi.data.institutions import INSTITUTION_SETS, load_institutions

    if d.dataset in INSTITUTION_SETS:
        return load_institutions(d.dataset)
    from fedmpi.data.datasets import load_dataset

    return load_dataset(d.dataset, d.root, d.download, augment=d.augment,
                        image_size=d.image_size)


def build_partition(cfg: Config, dataset: Dataset, needs: DataNeeds) -> Partition:
    """:func:`~fedmpi.data.partition.make_partition` of ``dataset``'s training pool
    with the ``data.partition.*`` and ``data.validation.fraction`` keys of ``cfg``
    (``data.partition.seed``, or the top-level ``seed`` when it is null) and the
    components' floor of local batches per client (``needs``)."""
    p = cfg.data.partition
    part = make_partition(
        dataset.y_train.cpu().numpy(), cfg.data.num_clients, p.method,
        seed=cfg.seed if p.seed is None else p.seed, alpha=p.alpha,
        classes_per_client=p.classes_per_client, min_size=p.min_size, file=p.file,
        validation_fraction=cfg.data.validation.fraction, num_classes=dataset.num_classes,
        min_batches=needs.min_batches, min_batches_key=needs.min_batches_key,
        batch_size=cfg.train.batch_size, groups=dataset.groups)
    _check_batchnorm_sizes(cfg, part)
    return part


#: Models whose ``model.norm`` layers are BatchNorm when norm is bn/static_bn (lenet has
#: no normalisation, the ViTs use LayerNorm).
_BN_MODELS = ("cnn", "resnet18", "resnet34", "resnet50")


def _check_batchnorm_sizes(cfg: Config, part: Partition) -> None:
    """BatchNorm cannot normalise a training batch of one sample, so a one-sample
    client would fail in local training; refuse it here, naming the client."""
    if cfg.model.norm not in ("bn", "static_bn") or cfg.model.name not in _BN_MODELS:
        return
    for k, ix in enumerate(part.client_indices):
        if len(ix) < 2:
            raise DataError(
                f"data.num_clients={cfg.data.num_clients}: client {k} gets {len(ix)} training "
                f"sample(s); BatchNorm (model.norm={cfg.model.norm}) needs >= 2 per batch: use "
                "fewer data.num_clients, data.partition.method=dirichlet with min_size >= 2, "
                "or model.norm=gn")
